"""magicdec: fast long-context, large-batch generation with sparse-KV speculative decoding.

The public names are imported lazily so that `magicdec.planner` stays usable without torch.
"""

import os
from typing import TYPE_CHECKING

# torch's CPU allocator backs tensors of 2 MB and more with transparent huge pages where this is set (read at its
# first allocation, so set before torch is imported): a step's largest tensors (logits of a 262k vocabulary, prefill
# activations) are allocated afresh each step, and faulting them in 4 KB pages cost more than computing them (a
# verification forward of Gemma 3 at 32 rows x 32k: 860 -> 740 ms). A value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
