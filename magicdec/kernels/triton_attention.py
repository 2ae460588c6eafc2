"""Attention over the KV cache in Triton, for CUDA: split-KV ("flash-decoding") for decode and verification.

Queries come GQA-packed as `magicdec.model.attend` passes them: [B, KV, M, hd] with M = G*q, the G query heads of a
KV head times q new tokens, rows ordered head then token. One program of `_split_kernel` takes one row b, one KV head
h and one split of `SPLIT` consecutive positions, and reads each K/V element of its split once for all M query rows
(a verification of q = gamma + 1 tokens reads the cache as a decode step does). It writes the split's running
maximum, sum and unnormalised output; `_merge_kernel` combines a (row, head)'s splits in split order.

On request (`shares`, for `magicdec.drafters.vegas`) the split kernel also stores one new token's raw scores (its G
query heads', as the softmax takes them), the merge each row's final maximum and sum, and `_shares_kernel` turns
the scores into each position's share of that token's attention: no K is read twice, and the output keeps its bits.

K/V are read in place, either

- paged: pools [NB, KV, BS, hd] (vLLM's "HND" layout, any strides but a contiguous last dim) through a block table
  [B, nblk] int32, position (or sparse slot) l of row b being pool[table[b, l // BS], :, l % BS] (`magicdec.kv.paged`,
  and the sparse draft caches of `magicdec.kv.sparse`), or
- dense: [B, KV, L, hd] per row (the window rings of sliding layers).

K/V are fp16, bf16 or fp32, or int8 rows carrying their scale (`magicdec.kv.quant`: hd int8 values, then the fp32
scale in the row's last 4 bytes; the 4-bit rows of `magicdec.kv.lowbit` too), converted to fp32 in the kernel as
they are read: an int8 cache is read at half the bytes of a 16-bit one, the queries and products in fp32.

Which positions a query row sees comes from the device, never the host, so a CUDA graph can capture a call:

- `bias` [B, 1, R, L] (0 / -inf, R divides M, query row m takes bias row m % R): the mask every cache builds today
  (`magicdec.model.attention_bias`), and the only form that serves caches whose slots are not positions (rings,
  sparse caches). `magicdec.model.attend` passes it. It costs one bias element per position and bias row.
- `lens` [B] int32, the positions row b held before this forward's q tokens: token t = m % q sits at position
  lens[b] + t and sees positions (lens[b] + t - window, lens[b] + t] (causal; `window` 0 for none). This is the
  paged cache's mask (`PagedKVCache.attn_mask`) without a [B, q, L] tensor to build and read: the form for a
  runner with static length buffers.

Exactness. The split size and the tile sizes are constants (`SPLIT`, `TILE`, and `ROWS` query rows per program for
up to `ROWS` rows), so a query row's arithmetic depends only on its own positions: not on the batch, the other rows,
their lengths, the padding of L, nor (for M <= ROWS) on how many query rows share its program. Splits that see none
of a row's positions are skipped exactly in the merge. Hence a row's output is bit-identical whatever the batch, and a
verification row equals the one-token step's over the same cache where the dot products of a row do not depend on
the other rows of the tile (true of Triton's interpreter; on a GPU, the same compiled kernel and tile shapes).

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported) on CPU
tensors; `tests/test_triton_attention.py` checks them there against a torch reference. The interpreter multiplies
bf16 operands of `tl.dot` as their raw 16-bit patterns, so under it bf16 operands are widened to fp32 first (exact;
the products then sum in fp32 as a GPU's do). MAGICDEC_TRITON=0 turns the kernels off (torch's SDPA runs instead).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from magicdec.dtypes import INT8_SCALE_BYTES

triton = None
# Only where a kernel can run (a CUDA or ROCm build of torch, or Triton's interpreter): a CPU-only process would
# spend 0.2 s importing triton for nothing.
if torch.version.cuda or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # no triton: the torch path runs
        triton = None

#: Query rows (M = G*q) per program, at most: one tile shape for a decode step and a verification of up to
#: ROWS // G tokens, so their rows take the same arithmetic. More rows (a prefill chunk) are declined (`takes`).
ROWS = 64
#: Positions per split: fixed, so a row's splits, and with them its arithmetic, depend on its positions only.
SPLIT = 512
#: Positions per tile within a split (two 32-position blocks).
TILE = 64
#: K/V dtypes the kernels read (int8: rows carrying their scale, `magicdec.kv.quant`).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
#: "No sliding window" as a window size larger than any position.
NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634


@functools.cache
def switched_on() -> bool:
    """Whether the Triton kernels may run in this process: triton is importable and MAGICDEC_TRITON is not 0. Decided
    once, as the native kernels' path is: every forward must take the same kernels."""
    return triton is not None and os.environ.get("MAGICDEC_TRITON", "1") != "0"


def interpreted() -> bool:
    """Whether this module's kernels run under Triton's interpreter (TRITON_INTERPRET=1 when it was imported)."""
    return triton is not None and not isinstance(_split_kernel, triton.runtime.JITFunction)


def supported(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether decode and verification attention over a cache of this dtype on this device run these kernels."""
    return device.type == "cuda" and kv_dtype in DTYPES and switched_on()


def takes(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor | None = None) -> bool:
    """Whether `attend` takes these operands (those of `magicdec.model.attend`) on this device: at most `ROWS` query
    rows per KV head, a power-of-two head size from 16 to 256, contiguous last dimensions, a bias [B, 1, R, L], and
    dense K/V of at least L positions or an int32 [B, nblk] `table` covering them."""
    hd, M = head_dim(keys), xq.shape[2]
    if not (supported(keys.device, keys.dtype) and values.dtype == keys.dtype and values.shape == keys.shape
            and hd == xq.shape[-1]):
        return False
    if not (16 <= hd <= 256 and hd & (hd - 1) == 0 and M <= ROWS and bias.dim() == 4
            and bias.shape[:2] == (xq.shape[0], 1) and M % bias.shape[2] == 0):
        return False
    B, L = xq.shape[0], bias.shape[-1]
    if table is None:
        covered = keys.shape[0] == B and keys.shape[2] >= L
    else:
        covered = (table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == B
                   and table.shape[1] * keys.shape[2] >= L)
    return covered and all(t.stride(-1) == 1 for t in (xq, keys, values, bias))  # rows read element by element


def head_dim(keys: Tensor) -> int:
    """The head size of cached K or V rows: their last dim, less an int8 row's scale."""
    return keys.shape[-1] - (INT8_SCALE_BYTES if keys.dtype == torch.int8 else 0)


def attend(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor | None = None,
           shares: Tensor | None = None, share_row: int = 0) -> Tensor:
    """`magicdec.model.attend` on these kernels (call where `takes` is True): the bias read on the device."""
    return attention(xq, keys, values, table, bias=bias, shares=shares, share_row=share_row)


def attention(xq: Tensor, keys: Tensor, values: Tensor, table: Tensor | None = None, *, bias: Tensor | None = None,
              lens: Tensor | None = None, tokens: int = 1, window: int = 0, length: int | None = None,
              shares: Tensor | None = None, share_row: int = 0) -> Tensor:
    """Softmax attention (scale hd^-0.5) of queries [B, KV, M, hd] over K/V, dense [B, KV, L, hd] or paged pools
    [NB, KV, BS, hd] read through `table` [B, nblk] int32; returns [B, KV, M, hd] in K's dtype (the queries' over
    int8 rows). Visibility: exactly one of `bias` [B, 1, R, L], or `lens` [B] int32 with the q = `tokens` new tokens
    per query head (M = G*q) and an optional sliding `window` (see the module's docstring). `length`: the positions
    L spanned (default: the bias's L; with `lens`, the dense L or the table's nblk * BS), which sizes the grid;
    programs past a row's own positions do nothing. Under Triton's interpreter the tensors are CPU tensors.

    `shares` (fp32, contiguous [B, KV, L]), where given, receives the attention shares of new token `share_row` (in
    [0, R)): shares[b, h, l] = the sum over the query rows m of KV head h with m % R == share_row of their softmax
    probability at l, 0 where it is hidden (as `magicdec.kernels.decode_attention` writes them). The output has the
    same bits with shares as without."""
    if (bias is None) == (lens is None):
        raise ValueError("pass exactly one of bias or lens")
    B, KV, M, hd = xq.shape
    if length is None:
        length = bias.shape[-1] if bias is not None else (table.shape[1] * keys.shape[2] if table is not None
                                                          else keys.shape[2])
    splits = max(1, -(-length // SPLIT))
    acc = torch.empty(B * KV, splits, M, hd, dtype=torch.float32, device=xq.device)
    stats = torch.empty(B * KV, splits, 2, M, dtype=torch.float32, device=xq.device)  # per split: maximum, sum
    period = bias.shape[2] if bias is not None else tokens  # query row m is bias row / token m % period
    mask = bias if bias is not None else lens
    if shares is not None and (shares.shape != (B, KV, length) or not shares.is_contiguous()
                               or not 0 <= share_row < period):
        raise ValueError(f"shares must be contiguous [{B}, {KV}, {length}] for a token row in [0, {period})")
    # one token's raw scores (log2 units) and each row's final maximum and sum, for `_shares_kernel`; a bias's splits
    # write every position, lengths' skip those outside a row's window, which stay -inf
    scores = None
    if shares is not None:
        size = (B * KV, M // period, length)
        scores = torch.empty(size, device=xq.device) if bias is not None else torch.full(size, float("-inf"),
                                                                                          device=xq.device)
    final = None if shares is None else torch.empty(B * KV, 2, M, dtype=torch.float32, device=xq.device)
    quantized = keys.dtype == torch.int8
    _split(xq if quantized else xq.to(keys.dtype), keys, values, table, mask, period, window, length, acc, stats,
           scores, share_row)
    out = torch.empty(B, KV, M, hd, dtype=xq.dtype if quantized else keys.dtype, device=xq.device)
    # the merge is elementwise per row: its tile of rows can fit M without changing a row's bits
    _merge_kernel[(B * KV,)](acc, stats, out, final if final is not None else stats, splits, M,
                             ROWS=triton.next_power_of_2(M), HD=hd, SHARES=shares is not None)
    if shares is not None:
        G = M // period
        _shares_kernel[(B * KV, -(-length // TILE))](scores, final, shares, G, M, length, period, share_row,
                                                     HEADS=triton.next_power_of_2(G), TILE=TILE)
    return out


def _split(xq: Tensor, keys: Tensor, values: Tensor, table: Tensor | None, mask: Tensor, period: int, window: int,
           length: int, acc: Tensor, stats: Tensor, scores: Tensor | None, share_row: int) -> None:
    """Launch `_split_kernel` over (row and KV head, split); `mask`: the bias [B, 1, R, L] or the lengths [B];
    `scores`, where given, receives query rows share_row, share_row + period, ...'s scores."""
    B, KV, M, hd = xq.shape
    paged, use_bias = table is not None, mask.dim() == 4
    # K/V addressed as base + outer * s0 + head * s1 + inner * s2: (block, offset) paged, (row, position) dense
    kv_strides = (*keys.stride()[:3], *values.stride()[:3])
    mask_strides = (mask.stride(0), mask.stride(2)) if use_bias else (0, 0)
    _split_kernel[(B * KV, acc.shape[1])](
        xq, keys, values, table if paged else mask, mask, acc, stats,  # an unused pointer is still a tensor
        scores if scores is not None else stats, share_row,
        KV, M, length, period, window if window > 0 else NO_WINDOW, hd**-0.5 * LOG2E,
        *xq.stride()[:3], *kv_strides, table.stride(0) if paged else 0, *mask_strides,
        PAGE=keys.shape[2] if paged else 1, PAGED=paged, USE_BIAS=use_bias, ROWS=ROWS, TILE=TILE, SPLIT=SPLIT,
        HD=hd, QUANT=keys.dtype == torch.int8, SHARES=scores is not None,
        UPCAST=interpreted() and keys.dtype == torch.bfloat16, IEEE=keys.dtype in (torch.float32, torch.int8),
        num_warps=8 if hd > 128 else 4)  # a [ROWS, 256] fp32 accumulator on 4 warps would spill registers


if triton is not None:

    @triton.jit
    def _split_range(mask_ptr, b, split, L, P, window, USE_BIAS: tl.constexpr, TILE: tl.constexpr,
                     SPLIT: tl.constexpr):
        """The tiles [lo, hi) of `split` that may hold positions row b sees: with lengths, from the first tile of
        the window to the last new token; with a bias, the whole split (the bias decides)."""
        start = split * SPLIT
        hi = tl.minimum(start + SPLIT, L)
        lo = start
        if not USE_BIAS:
            held = tl.load(mask_ptr + b)
            lo = start + tl.maximum(held - window + 1 - start, 0) // TILE * TILE  # tiles stay aligned to `start`
            hi = tl.minimum(hi, held + P)
        return lo, hi

    @triton.jit
    def _tile_bias(mask_ptr, b, rows, pos, M, L, P, window, sm_b, sm_r, USE_BIAS: tl.constexpr):
        """[ROWS, TILE] additive bias in log2 units (0 / -inf) of the query rows over the tile's positions."""
        inside = (rows < M)[:, None] & (pos < L)[None, :]
        if USE_BIAS:
            ptrs = mask_ptr + b * sm_b + (rows % P)[:, None] * sm_r + pos[None, :]
            bias = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        else:
            at = tl.load(mask_ptr + b) + rows % P  # each query's own position
            seen = inside & (pos[None, :] <= at[:, None]) & (pos[None, :] > at[:, None] - window)
            bias = tl.where(seen, 0.0, float("-inf"))
        return bias

    @triton.jit
    def _kv_index(table_ptr, b, pos, seen, st_b, PAGE: tl.constexpr, PAGED: tl.constexpr):
        """(outer, inner) indices [TILE] of the positions' K/V: (block, offset) through the table, else (row,
        position). Positions no query sees read no table entry."""
        if PAGED:
            outer = tl.load(table_ptr + b * st_b + pos // PAGE, mask=seen, other=0).to(tl.int64)
            inner = pos % PAGE
        else:
            outer = tl.zeros_like(pos).to(tl.int64) + b
            inner = pos
        return outer, inner

    @triton.jit
    def _load_rows(row_ptrs, dims, seen, HD: tl.constexpr, QUANT: tl.constexpr):
        """[TILE, HD] K or V rows starting at row_ptrs [TILE] (rows no query sees: zeros, not read); int8 rows times
        the fp32 scale stored after their HD values, in fp32."""
        rows = tl.load(row_ptrs[:, None] + dims[None, :], mask=seen[:, None], other=0.0)
        if QUANT:
            scale = tl.load((row_ptrs + HD).to(tl.pointer_type(tl.float32)), mask=seen, other=0.0)
            rows = rows.to(tl.float32) * scale[:, None]
        return rows

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """a @ b in fp32: fp32 operands in full precision (not TF32); bf16 widened first under the interpreter."""
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, mask_ptr, acc_ptr, stats_ptr, scores_ptr, share_row,
                      KV, M, L, P, window, qk_scale,
                      sq_b, sq_h, sq_m, sk_0, sk_1, sk_2, sv_0, sv_1, sv_2, st_b, sm_b, sm_r,
                      PAGE: tl.constexpr, PAGED: tl.constexpr, USE_BIAS: tl.constexpr, ROWS: tl.constexpr,
                      TILE: tl.constexpr, SPLIT: tl.constexpr, HD: tl.constexpr, QUANT: tl.constexpr,
                      SHARES: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """One (row b, KV head h, split): online softmax over its tiles for all M query rows; writes the split's
        maximum and sum [M] (log2 units) and unnormalised output [M, HD], and with SHARES the scores of query rows
        share_row, share_row + P, ... (one token's G heads) to scores [B * KV, G, L]."""
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = bh // KV, (bh % KV).to(tl.int64)
        rows, dims = tl.arange(0, ROWS), tl.arange(0, HD)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_m + dims[None, :], mask=(rows < M)[:, None],
                    other=0.0)
        if QUANT:
            q = q.to(tl.float32)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HD], tl.float32)
        lo, hi = _split_range(mask_ptr, b, split, L, P, window, USE_BIAS, TILE, SPLIT)
        for start in range(lo, hi, TILE):
            pos = start + tl.arange(0, TILE)
            bias = _tile_bias(mask_ptr, b, rows, pos, M, L, P, window, sm_b, sm_r, USE_BIAS)
            seen = tl.max(bias, 0) > float("-inf")  # positions no row sees are not read (unwritten blocks)
            outer, inner = _kv_index(table_ptr, b, pos, seen, st_b, PAGE, PAGED)
            k = _load_rows(k_ptr + outer * sk_0 + h * sk_1 + inner * sk_2, dims, seen, HD, QUANT)
            s = _dot(q, tl.trans(k), UPCAST, IEEE) * qk_scale + bias
            if SHARES:
                mine = (rows < M) & (rows % P == share_row)
                at = scores_ptr + (bh.to(tl.int64) * (M // P) + rows // P)[:, None] * L + pos[None, :]
                tl.store(at, s, mask=mine[:, None] & (pos < L)[None, :])
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no NaN
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(v_ptr + outer * sv_0 + h * sv_1 + inner * sv_2, dims, seen, HD, QUANT)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
            m_i = m_new
        base = (bh * tl.num_programs(1) + split).to(tl.int64) * M
        ok = rows < M
        tl.store(acc_ptr + (base + rows[:, None]) * HD + dims[None, :], acc, mask=ok[:, None])
        tl.store(stats_ptr + 2 * base + rows, m_i, mask=ok)
        tl.store(stats_ptr + 2 * base + M + rows, l_i, mask=ok)

    @triton.jit
    def _merge_kernel(acc_ptr, stats_ptr, out_ptr, final_ptr, S, M, ROWS: tl.constexpr, HD: tl.constexpr,
                      SHARES: tl.constexpr):
        """One (row, KV head): its S splits combined in split order, splits that saw nothing skipped exactly (a
        row's result does not change with trailing empty splits, i.e. with the batch's longest row). With SHARES,
        each query row's final maximum and sum go to final [B * KV, 2, M]."""
        bh = tl.program_id(0)
        rows, dims = tl.arange(0, ROWS), tl.arange(0, HD)
        ok = rows < M
        first = bh.to(tl.int64) * S
        m_max = tl.full([ROWS], float("-inf"), tl.float32)
        for s in range(S):
            m_max = tl.maximum(m_max, tl.load(stats_ptr + (first + s) * 2 * M + rows, mask=ok, other=float("-inf")))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HD], tl.float32)
        for s in range(S):
            m_s = tl.load(stats_ptr + (first + s) * 2 * M + rows, mask=ok, other=float("-inf"))
            l_s = tl.load(stats_ptr + (first + s) * 2 * M + M + rows, mask=ok, other=0.0)
            part = tl.load(acc_ptr + ((first + s) * M + rows[:, None]) * HD + dims[None, :], mask=ok[:, None],
                           other=0.0)
            w = tl.exp2(m_s - m_safe)
            live = m_s > float("-inf")
            total = tl.where(live, total + l_s * w, total)
            acc = tl.where(live[:, None], acc + part * w[:, None], acc)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees nothing (padding): zeros
        tl.store(out_ptr + (bh.to(tl.int64) * M + rows[:, None]) * HD + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        if SHARES:
            tl.store(final_ptr + bh.to(tl.int64) * 2 * M + rows, m_safe, mask=ok)
            tl.store(final_ptr + bh.to(tl.int64) * 2 * M + M + rows, total, mask=ok)

    @triton.jit
    def _shares_kernel(scores_ptr, final_ptr, shares_ptr, G, M, L, P, share_row, HEADS: tl.constexpr,
                       TILE: tl.constexpr):
        """One (row and KV head, tile of positions): each position's probability under the token's G query rows
        (m = g * P + share_row), from their raw scores and final maxima and sums, summed over the rows."""
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        heads, pos = tl.arange(0, HEADS), tile * TILE + tl.arange(0, TILE)
        ok = heads < G
        m = heads * P + share_row
        top = tl.load(final_ptr + bh * 2 * M + m, mask=ok, other=0.0)
        total = tl.load(final_ptr + bh * 2 * M + M + m, mask=ok, other=0.0)
        raw = tl.load(scores_ptr + (bh * G + heads)[:, None] * L + pos[None, :],
                      mask=ok[:, None] & (pos < L)[None, :], other=float("-inf"))
        p = tl.exp2(raw - top[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(shares_ptr + bh * L + pos, tl.sum(p, 0), mask=pos < L)
