"""Dtype names: the short names the CLI, profiles and presets use, and bytes per element.

Torch-free, so that the planner's callers can use it without importing torch.
"""

from __future__ import annotations

from typing import Any

#: Short name -> bytes per element.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Torch's names (and `str(torch.dtype)` without "torch.") -> short name.
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: Short name -> attribute of the torch module.
TORCH_NAMES = {short: long for long, short in ALIASES.items()}
#: KV-cache-only dtypes (magicdec.kv.quant), short name -> attribute of the torch module, and back.
KV_ONLY = {"int8": "int8", "fp8": "float8_e4m3fn"}
KV_ONLY_NAMES = {long: short for short, long in KV_ONLY.items()}
#: Bytes of an int8 cache row's scale, after its head_dim values.
INT8_SCALE_BYTES = 4


def short_name(dtype: Any) -> str | None:
    """fp32, bf16 or fp16 for a torch dtype or a name of one; None for anything else."""
    key = str(dtype).lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    return key if key in BYTES else None


def kv_short_name(dtype: Any) -> str | None:
    """`short_name`, or int8 / fp8 for the 8-bit KV cache dtypes; None for anything else."""
    key = str(dtype).lower().removeprefix("torch.")
    return KV_ONLY_NAMES.get(key, key if key in KV_ONLY else short_name(dtype))


def kv_nbytes(dtype: Any, head_dim: int) -> float:
    """Bytes per K or V value of a cache of this dtype (a name, a torch dtype or a number of bytes), an int8 row's
    scale included."""
    name = kv_short_name(dtype)
    if name == "int8":
        return 1 + INT8_SCALE_BYTES / head_dim
    return 1.0 if name == "fp8" else nbytes(dtype)


def nbytes(dtype: Any) -> float:
    """Bytes per element of a torch dtype, a dtype name, or a number of bytes (returned as is)."""
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        return float(dtype)
    name = short_name(dtype)
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(BYTES)}")
    return float(BYTES[name])
