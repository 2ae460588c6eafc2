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


def short_name(dtype: Any) -> str | None:
    """fp32, bf16 or fp16 for a torch dtype or a name of one; None for anything else."""
    key = str(dtype).lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    return key if key in BYTES else None


def nbytes(dtype: Any) -> float:
    """Bytes per element of a torch dtype, a dtype name, or a number of bytes (returned as is)."""
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        return float(dtype)
    name = short_name(dtype)
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(BYTES)}")
    return float(BYTES[name])
