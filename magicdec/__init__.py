"""magicdec: fast long-context, large-batch generation with sparse-KV speculative decoding.

The public names are imported lazily so that `magicdec.planner` stays usable without torch.
"""

import ctypes
import os
from typing import TYPE_CHECKING

# torch's CPU allocator backs tensors of 2 MB and more with transparent huge pages where this is set (read at its
# first allocation, so set before torch is imported): a step's largest tensors (logits of a 262k vocabulary, prefill
# activations) are allocated afresh each step, and faulting them in 4 KB pages cost more than computing them (a
# verification forward of Gemma 3 at 32 rows x 32k: 860 -> 740 ms). A value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

#: glibc's mallopt parameters, and the values set: blocks under MMAP_THRESHOLD come from the heap rather than from
#: their own mapping, and freed memory stays in the heap up to TRIM_THRESHOLD at its top.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD, MMAP_THRESHOLD = 1 << 30, 256 << 20


def _keep_freed_memory() -> str:
    """Have glibc's malloc reuse freed memory for a step's large tensors instead of mapping them afresh.

    By default a block over 32 MB gets its own mapping, returned to the system when freed, so a step's logits (Gemma 3:
    134 MB at 32 rows x 4 tokens) are faulted in again every step, and with huge pages the kernel now and then
    compacts memory on the fault (LM head at 128 rows: 50 ms, 200 ms where it compacted, 38 ms from reused memory).
    KV caches (larger than MMAP_THRESHOLD) keep their own mappings. `MAGICDEC_MALLOPT=0` leaves malloc as it is.
    Returns what was done ("kept": set; "default": left alone, or not glibc)."""
    if os.environ.get("MAGICDEC_MALLOPT", "1") == "0":
        return "default"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's C library (glibc on Linux)
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "default"
    return "kept"


#: How malloc treats freed memory in this process (recorded with benchmark results): see `_keep_freed_memory`.
MALLOC = _keep_freed_memory()

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
