"""magicdec: fast long-context, large-batch generation with sparse-KV speculative decoding.

The public names are imported lazily so that `magicdec.planner` stays usable without torch.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig", "__version__"]

_EXPORTS = {
    "LLM": "magicdec.engine",
    "RequestOutput": "magicdec.engine",
    "SamplingParams": "magicdec.sampling",
    "SpeculativeConfig": "magicdec.speculative",
}

if TYPE_CHECKING:
    from magicdec.engine import LLM, RequestOutput
    from magicdec.sampling import SamplingParams
    from magicdec.speculative import SpeculativeConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'magicdec' has no attribute {name!r}")
