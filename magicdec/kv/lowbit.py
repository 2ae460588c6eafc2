"""A dense cache of 4-bit K/V rows: what a quantized self-speculative draft reads (QuantSpec, arXiv 2502.10424).

The draft attends over the whole context, as the target does, but through K/V rounded to 4 bits (7 levels either
side of zero, a scale per row): its acceptance does not fall as the context outgrows a budget, as a sparse draft's
does. Rows are kept in the int8 row format of `magicdec.kv.quant` (levels and the row's fp32 scale), so the native
int8 kernel reads them at its own speed; packing two levels a byte would halve the bytes, which pays where attention
is bound by bytes read (a GPU), not on the CPUs' int8 kernel, which is bound by its instructions. The rows are copied
from the target's cache (dequantized and rounded again), the way a sparse draft cache cuts its entries from it, so
the draft never prefills.

- **Keys less their mean.** Keys are stored less their mean over the prompt (per layer and KV head), as SageAttention
  smooths K: a query's scores all shift by the same q.mean, which softmax cancels, while the channels whose keys share
  a large offset no longer set every row's scale, so 4 bits resolve what differs between keys.
- **Recent rows at 8 bits.** The prompt's last RECENT rows and every row after them (tokens generated since, and the
  draft's own) keep 127 levels, as QuantSpec keeps its recent tokens in full precision; here nothing is rounded down
  later (in the int8 row format the bytes are the same). On SmolLM2 at 2k-4k tokens of PG-19 they raised acceptance
  by 3-7 points over 4-bit rows throughout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv import quant
from magicdec.kv.base import KVCache

#: Positions a prompt's rows are copied in at a time (bounds the fp32 copy a long prompt would make).
COPY_CHUNK = 2048
#: The prompt's last rows that keep 8-bit levels.
RECENT = 128


class LowBitKVCache(KVCache):
    """A dense cache (slot == position) of int8 rows: 4-bit levels before a row's `recent_from` [B] position, 8-bit
    from it on; keys less their row's mean (`k_mean` [B, layers, KV, head_dim]). Both are set by a row's first copy
    from the target (its prompt)."""

    PER_ROW = KVCache.PER_ROW + ("k_mean", "recent_from")

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, device: torch.device | str):
        super().__init__(cfg, batch, capacity, quant.INT8, device)
        self.k_mean = torch.zeros(batch, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, device=device)
        self.recent_from = torch.zeros(batch, dtype=torch.long, device=device)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, None]:
        """A draft forward's new tokens (past the prompt: 8-bit levels), keys less the row's mean."""
        return super().update(layer, k.float() - self.k_mean[:, layer, :, None], v)

    def append_from(self, src: KVCache, end: Tensor, rows: Tensor) -> None:
        """Copy src's entries at positions [next_pos, end) into the rows where rows [B] is set; an empty row first
        takes the mean of those keys and its `recent_from`. src holds keys rotated by absolute position (any
        layout)."""
        count = torch.where(rows, end - self.next_pos, 0).clamp_min(0)  # [B]
        first = (self.lens == 0) & (count > 0)
        if first.any():  # a pass over the keys for the mean, which every key of the row is stored less
            sums = torch.zeros_like(self.k_mean)
            for b, p, block, offset in self._chunks(src, count):
                sums.index_add_(0, b, quant.load(src.k[:, block, :, offset], torch.float32))
            self.k_mean[first] = sums[first] / count[first, None, None, None]
            self.recent_from[first] = end[first] - RECENT
        for b, p, block, offset in self._chunks(src, count):
            levels = torch.where(p >= self.recent_from[b], quant.INT8_LEVELS, quant.INT4_LEVELS)
            levels = levels[:, None, None, None].float()  # [n, 1, 1, 1]: per row
            k = quant.load(src.k[:, block, :, offset], torch.float32)  # [n, layers, KV, head_dim]
            self.k[:, b, :, p] = quant.store(k - self.k_mean[b], quant.INT8, levels)
            self.v[:, b, :, p] = quant.store(quant.load(src.v[:, block, :, offset], torch.float32), quant.INT8, levels)
        self.commit(count)

    def _chunks(self, src: KVCache, count: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(rows b [n], positions p [n], and where src holds them: its K/V's dims 1 and 3, `locate`) for the next
        count [B] positions of each row, at most COPY_CHUNK a row at a time (bounding the fp32 copies of a long
        prompt)."""
        for start in range(0, int(count.max()), COPY_CHUNK):
            j = start + self._arange(min(COPY_CHUNK, int(count.max()) - start))
            b, i = (j[None, :] < count[:, None]).nonzero(as_tuple=True)
            p = self.next_pos[b] + j[i]
            yield b, p, *src.locate(b, p)
