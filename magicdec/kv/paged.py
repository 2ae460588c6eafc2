"""The target's dense K/V as the model reads them: the `KVManager`'s block pool through per-slot block tables.

Row (slot) b's position t lives in block `tables[b, t // BLOCK_SIZE]` at offset t % BLOCK_SIZE of the pool
[layers, blocks, KV, BLOCK_SIZE, hd]. The scheduler decides which blocks a slot holds; the runner writes them into
`tables` (`set_blocks`) before the forward that needs them. Per-row state is as `KVCache`'s (`lens`, `next_pos`; new
tokens written at lens.., kept by `commit`), and `head(n)` / `row(i)` are views sharing storage, tables and state.

A forward's attention reads K/V through the table: the native kernels directly, torch's operators over a gathered
contiguous copy (`gather`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec import kernels
from magicdec.config import ModelConfig
from magicdec.kv import quant
from magicdec.kv.base import KVCache
from magicdec.kv.blocks import BLOCK_SIZE, NULL_BLOCK


def gather(pool: Tensor, table: Tensor, length: int) -> Tensor:
    """One layer's K or V [blocks, KV, BS, hd] read through table [B, n] as [B, KV, length, hd] (a copy); BS is the
    pool's block size (BLOCK_SIZE, or 1 for a `kernels.token_view`)."""
    B, n = table.shape
    rows = pool.index_select(0, table.reshape(-1).long()).view(B, n, *pool.shape[1:])  # [B, n, KV, BS, hd]
    return rows.transpose(1, 2).reshape(B, pool.shape[1], n * pool.shape[2], pool.shape[-1])[:, :, :length]


class PagedKVCache(KVCache):
    """Rows of up to `max_blocks` blocks each over the pool `k`, `v` [layers, blocks, KV, BLOCK_SIZE, hd] (through
    `tables` [rows, max_blocks], new where not given); per-row state, commit and rollback as `KVCache`'s. `clear`
    empties rows and leaves their blocks mapped: the runner maps and unmaps them (`set_blocks`, `unmap`) as the
    scheduler says."""

    PER_ROW: tuple[str, ...] = KVCache.PER_ROW + ("tables",)
    ROWS_IN_STORAGE = False

    def __init__(self, cfg: ModelConfig, k: Tensor, v: Tensor, rows: int, max_blocks: int,  # noqa: super: no storage
                 tables: Tensor | None = None):
        self.cfg, self.k, self.v = cfg, k, v
        device = k.device
        if tables is None:
            tables = torch.full((rows, max_blocks), NULL_BLOCK, dtype=torch.int32, device=device)
        self.tables = tables
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.max_len = 0  # host-side upper bound of lens
        self.capacity = max_blocks * BLOCK_SIZE
        self._write: tuple[Tensor, Tensor] | None = None  # (blocks, offsets) [B, q] the current forward writes
        self._table: Tensor | None = None  # [B, blocks] the current forward reads

    # --- what the model calls, once per forward -------------------------------------------------
    def attn_mask(self, q: int) -> Tensor:
        """[B, 1, q, L] causal visibility over the L positions the forward attends (per-row lengths)."""
        if self.max_len + q > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.max_len + q} positions > capacity {self.capacity}")
        L = self.capacity if self.static else self.max_len + q
        slots = self.lens[:, None] + self._arange(q)  # [B, q]
        self._write = (self.tables.gather(1, slots // BLOCK_SIZE).long(), slots % BLOCK_SIZE)
        self._table = self.tables[:, : -(-L // BLOCK_SIZE)]
        return self._arange(L)[None, None, None, :] <= slots[:, None, :, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write new k, v [B, KV, q, hd] at each row's next positions; return the layer's pool K, V [blocks, KV,
        BLOCK_SIZE, hd] and the table [B, n] to read them through."""
        kc, vc = self.k[layer], self.v[layer]
        self._store(kc, vc, k, v)
        return kc, vc, self._table

    def _store(self, kc: Tensor, vc: Tensor, k: Tensor, v: Tensor) -> None:
        """Write new k, v [B, KV, q, hd] into a layer's pools kc, vc at the forward's (block, offset) `_write`."""
        if kc.dtype == k.dtype and kernels.fuses(k):  # the rows as they are, one copy each
            kernels.store_kv(kc, vc, k, v, *self._write)
        else:  # index_put_ on the [blocks, BLOCK_SIZE, KV, hd] view with [B, q] indices, values [B, q, KV, hd]
            kc.transpose(1, 2).index_put_(self._write, quant.store(k.transpose(1, 2), kc.dtype))
            vc.transpose(1, 2).index_put_(self._write, quant.store(v.transpose(1, 2), vc.dtype))

    def locate(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Where positions of rows (broadcast together) live: (block, offset), indexing dims 1 and 3 of `k`."""
        return self.tables[rows, positions // BLOCK_SIZE].long(), positions % BLOCK_SIZE

    # --- what the engine calls -------------------------------------------------------------------
    def set_blocks(self, row: int, first: int, blocks: list[int]) -> None:
        """Row `row`'s table entries [first, first + len(blocks)) name `blocks`."""
        if blocks:
            self.tables[row, first : first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def unmap(self, row: int) -> None:
        """Point row `row`'s whole table at the null block (its blocks went back to the pool: an idle row riding along
        in a forward must not write into them)."""
        self.tables[row].fill_(NULL_BLOCK)

    def over(self, cfg: ModelConfig, k: Tensor, v: Tensor) -> "PagedKVCache":
        """A cache of other K/V storage for the same blocks (a draft model's, `KVManager.draft_storage`), reading
        through this one's block tables (the same tensor: what the runner maps here maps there), with lengths of its
        own."""
        return PagedKVCache(cfg, k, v, self.batch, self.tables.shape[1], self.tables)

    def _filled_slots(self, row: int) -> int:
        return 0  # a moved row takes the blocks its table names: no K/V moves
