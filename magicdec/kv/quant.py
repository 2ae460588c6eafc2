"""8-bit KV caches: int8 rows that carry their own scale, and fp8 (e4m3).

int8 stores each cached K or V row (one position of one KV head, head_dim values x) as head_dim signed bytes
round(x / s), followed by the row's scale s = max|x| / 127 as the four bytes of an fp32: a row is head_dim + 4 int8.
Keeping the scale inside the row means every copy of K/V (a block of the pool, a gather, a row moved to another
slot, a sparse draft cache loaded from the target's) moves values and scales together, and a row's bytes depend on
that row alone, so a verification forward stores what the one-token steps store and speculation stays exact against
the int8-cache target. llama.cpp's q8_0 cache keeps a scale per 32 values; one per row (64-256 values) is what lets
the native kernel take a row's dot product in integers (`magicdec.kernels`, VNNI).

fp8 stores x as float8_e4m3fn with scale 1 (vLLM's default for `--kv-cache-dtype fp8`), saturated at +-448, its bits
held in a uint8 tensor (`storage_dtype`: torch's CPU build has no index_put_, index_copy_ or scatter_ for float8, and
a cache only moves the bytes); torch's operators attend over it converted back (no native CPU kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec import dtypes
from magicdec.dtypes import INT8_SCALE_BYTES as SCALE_BYTES

INT8 = torch.int8
#: The largest level an int8 row stores (its scale is max|x| / LEVELS); a row at 4-bit levels stores at most 7.
INT8_LEVELS = 127
INT4_LEVELS = 7
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: What an fp8 cache's tensors hold: the values' bits.
FP8_BITS = torch.uint8


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors a cache of `dtype` allocates."""
    return FP8_BITS if dtype == FP8 else dtype


def quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype (or storage dtype) stores 8-bit values that `load` converts back."""
    return dtype in (INT8, FP8, FP8_BITS)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one cached row (the last dim of a cache of this dtype)."""
    return head_dim + SCALE_BYTES if dtype == INT8 else head_dim


def element_bytes(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes a cache of this dtype (or storage dtype) takes per K or V value, scales included (`dtypes.kv_nbytes`)."""
    return dtypes.kv_nbytes(FP8 if dtype == FP8_BITS else dtype, head_dim)


def store(x: Tensor, dtype: torch.dtype, levels: int | Tensor = INT8_LEVELS) -> Tensor:
    """Rows x [..., head_dim] as a cache of `dtype` stores them ([..., row_width]); an int8 cache rounds each row to
    `levels` steps either side of zero (INT4_LEVELS: the 4-bit rows of `magicdec.kv.lowbit`; a tensor [..., 1]: per
    row)."""
    if dtype == INT8:
        amax = x.abs().amax(-1, keepdim=True).float()
        scale = amax / levels
        values = (x.float() * (levels / amax.clamp_min(torch.finfo(torch.float32).tiny))).round_().to(INT8)
        return torch.cat((values, scale.view(INT8)), -1)
    if dtype in (FP8, FP8_BITS):
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).view(FP8_BITS)
    return x.to(dtype)


def load(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Cached rows [..., row_width] as values [..., head_dim] of `dtype` (`store` undone, up to its rounding)."""
    if rows.dtype == INT8:
        values, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
        if scale.stride(-2) % SCALE_BYTES or scale.storage_offset() % SCALE_BYTES:
            scale = scale.contiguous()
        return (values.float() * scale.view(torch.float32)).to(dtype)
    if rows.dtype == FP8_BITS:
        return rows.view(FP8).to(dtype)
    return rows.to(dtype)


def attention_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention over a cache of `kv_dtype` computes in (its additive bias's): the cache's own, or the
    model's where the cache holds 8-bit values."""
    return model_dtype if quantized(kv_dtype) else kv_dtype
