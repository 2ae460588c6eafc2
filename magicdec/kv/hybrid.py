"""KV caches that follow the layer kinds of a hybrid-attention model (Gemma 3: five sliding-window layers to one
global).

A global layer attends over the whole context, so its K/V grow with it; a sliding-window layer's query at position t
sees only positions (t - window, t], so its K/V live in a ring of `window - 1 + max_q` slots per row (the window, plus
the most tokens one forward writes: a prefill chunk, or a verification of gamma + 1 tokens), position t in slot
t mod size. A forward writes all its tokens before attending, and the tokens it overwrites are more than a window
behind its first query, so a rollback (committing fewer tokens) never needs an overwritten entry back.

`HybridCache` pairs the global layers' cache (`full`: the target's dense cache, or a sparse draft cache) with the
sliding layers' ring (`window`); the model asks it for one mask per layer kind. A self-speculative draft makes only
the global layers sparse and shares the target's ring: the draft's own entries in it (the tokens it drafts) are
overwritten by the verification forward before the target reads them, as that forward rewrites every position the
draft wrote.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor

from magicdec.config import GLOBAL, SLIDING, ModelConfig
from magicdec.kv.base import KVCache
from magicdec.kv.blocks import KVManager, blocks_for
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.sparse import SnapKVObserver


def kind_config(cfg: ModelConfig, kind: str) -> ModelConfig:
    """The shape of the K/V of one layer kind: `cfg` with only those layers (a cache's storage is per layer)."""
    return dataclasses.replace(cfg, n_layers=len(cfg.layers_of(kind)), layer_types=())


def ring_size(cfg: ModelConfig, capacity: int, max_q: int) -> int:
    """Slots of a sliding layers' ring for rows of up to `capacity` tokens and forwards of up to max_q tokens."""
    return min(capacity, cfg.sliding_window - 1 + max_q)


class WindowKVCache(KVCache):
    """The K/V of the sliding-window layers: a ring per row (position t in slot t mod capacity), `slot_pos` recording
    the position each slot holds (-1: none)."""

    PER_ROW = KVCache.PER_ROW + ("slot_pos",)

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, window: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(cfg, batch, capacity, dtype, device)
        self.window = window
        self.slot_pos = torch.full((batch, capacity), -1, dtype=torch.long, device=device)

    def attn_mask(self, q: int) -> Tensor:
        """[B, 1, q, capacity]: each query sees the held positions in (its position - window, its position]."""
        if q > self.capacity - self.window + 1 and int(self.next_pos.max()) + q > self.capacity:
            raise RuntimeError(f"window cache overflow: {q} new tokens with a ring of {self.capacity} slots would "
                               f"overwrite entries of a {self.window}-token window still in use")
        qpos = self.next_pos[:, None] + self._arange(q)  # [B, q]
        self._slots = qpos % self.capacity
        self.slot_pos.scatter_(1, self._slots, qpos)
        pos, qp = self.slot_pos[:, None, :], qpos[:, :, None]
        return ((pos >= 0) & (pos <= qp) & (pos > qp - self.window))[:, None]

    def hold(self, pos: Tensor) -> None:
        """Record that every row's ring holds positions `pos` [n] (at most `capacity` of them), each in its slot."""
        self.slot_pos[:, pos % self.capacity] = pos

    def attended_slots(self, q: int) -> int:
        return self.capacity  # the ring spans the whole buffer; the mask picks what is held

    def _filled_slots(self, row: int) -> int:
        return self.capacity

    def clear(self) -> None:
        super().clear()
        self.slot_pos.fill_(-1)


class HybridCache:
    """The cache of a hybrid model: `full` holds the global layers (dense, or a sparse draft cache) and decides the
    rows' lengths and positions; `window` holds the sliding layers and follows `full`'s positions (it shares the
    per-row position tensors, so only `full` is committed or rolled back)."""

    def __init__(self, cfg: ModelConfig, full: KVCache, window: WindowKVCache):
        self.cfg, self.full, self.window = cfg, full, window
        window.lens, window.next_pos = full.lens, full.next_pos
        index = {GLOBAL: 0, SLIDING: 0}
        self._where: list[tuple[KVCache, int]] = []  # per model layer: the cache holding it and its index there
        for kind in cfg.kinds:
            self._where.append((full if kind == GLOBAL else window, index[kind]))
            index[kind] += 1

    # --- what the model calls -----------------------------------------------------------------------
    def rope_positions(self, q: int) -> Tensor:
        return self.full.rope_positions(q)

    def attn_mask(self, q: int) -> dict[str, Tensor]:
        return {GLOBAL: self.full.attn_mask(q), SLIDING: self.window.attn_mask(q)}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        cache, i = self._where[layer]
        return cache.update(i, k, v)

    # --- the per-row state of `full` ------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.full.device

    @property
    def batch(self) -> int:
        return self.full.batch

    @property
    def capacity(self) -> int:
        return self.full.capacity

    @property
    def lens(self) -> Tensor:
        return self.full.lens

    @property
    def next_pos(self) -> Tensor:
        return self.full.next_pos

    @property
    def entries_read(self) -> Tensor:
        return self.full.entries_read

    @property
    def max_len(self) -> int:
        return self.full.max_len

    @property
    def static(self) -> bool:
        return self.full.static

    @static.setter
    def static(self, value: bool) -> None:
        self.full.static = value  # the ring attends over its whole buffer always

    def commit(self, n: Tensor | int) -> None:
        self.full.commit(n)

    def truncate(self, lens: Tensor) -> None:
        self.full.truncate(lens)

    def clear(self) -> None:
        self.full.clear()
        self.window.slot_pos.fill_(-1)

    def copy_row(self, src: int, dst: int) -> None:
        self.full.copy_row(src, dst)
        self.window.copy_row(src, dst)

    def head(self, n: int) -> "HybridCache":
        return HybridCache(self.cfg, self.full.head(n), self.window.head(n))

    def row(self, i: int) -> "HybridCache":
        return HybridCache(self.cfg, self.full.row(i), self.window.row(i))

    def take(self, index: Tensor) -> "HybridCache | None":
        """The rows at `index` alone (`KVCache.take`): the global layers' and the rings' (read in place)."""
        full, window = self.full.take(index), self.window.take(index)
        return None if full is None or window is None else HybridCache(self.cfg, full, window)

    def put(self, index: Tensor, part: "HybridCache") -> None:
        """Take back the per-row state of `part`, the rows `take(index)` gave."""
        self.full.put(index, part.full)
        self.window.put(index, part.window)

    # --- a draft's `full` (a sparse cache, or a 4-bit copy) -------------------------------------------------------
    def evict(self) -> None:
        self.full.evict()

    def append_from(self, src: "HybridCache", end: Tensor, rows: Tensor) -> None:
        """Catch up on src's global-layer entries before `end` (the ring is src's own, see the module)."""
        self.full.append_from(src.full, end, rows)

    def sharing_window(self, full: KVCache) -> "HybridCache":
        """A cache over the same sliding-layer ring with `full` for the global layers (a draft over this cache)."""
        return HybridCache(self.cfg, full, copy.copy(self.window))


def make_cache(cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str,
               max_q: int) -> KVCache | HybridCache:
    """A dense cache for rows of up to `capacity` tokens, written by forwards of up to max_q tokens: a `KVCache`, or
    for a hybrid model a `HybridCache` whose sliding layers keep a ring."""
    if not cfg.hybrid:
        return KVCache(cfg, batch, capacity, dtype, device)
    full = KVCache(kind_config(cfg, GLOBAL), batch, capacity, dtype, device)
    return HybridCache(cfg, full, window_ring(cfg, batch, capacity, max_q, dtype, device))


def window_ring(cfg: ModelConfig, rows: int, capacity: int, max_q: int, dtype: torch.dtype,
                device: torch.device | str) -> WindowKVCache:
    """The sliding layers' ring of `rows` rows of up to `capacity` positions, for forwards of up to max_q tokens."""
    return WindowKVCache(kind_config(cfg, SLIDING), rows, ring_size(cfg, capacity, max_q), cfg.sliding_window, dtype,
                         device)


def cache_bytes(cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, max_q: int) -> int:
    """Bytes `make_cache` allocates (memory is planned before it is allocated)."""
    return KVCache.nbytes(global_config(cfg), batch, capacity, dtype) + ring_bytes(cfg, batch, capacity, dtype, max_q)


def paged_cache(cfg: ModelConfig, kv: KVManager, rows: int, capacity: int,
                max_q: int) -> PagedKVCache | HybridCache:
    """The engine's target cache: `rows` slots of up to `capacity` positions over `kv`'s block pool, for forwards of up
    to max_q tokens; for a hybrid model a `HybridCache` whose sliding layers keep a ring per slot."""
    full = PagedKVCache(global_config(cfg), kv.k, kv.v, rows, blocks_for(capacity))
    if not cfg.hybrid:
        return full
    return HybridCache(cfg, full, window_ring(cfg, rows, capacity, max_q, kv.dtype, kv.k.device))


def paged_part(cache: PagedKVCache | HybridCache) -> PagedKVCache:
    """The part of a `paged_cache` whose rows read the KV blocks (a hybrid model's global layers)."""
    return cache.full if isinstance(cache, HybridCache) else cache


def ring_bytes(cfg: ModelConfig, rows: int, capacity: int, dtype: torch.dtype, max_q: int) -> int:
    """Bytes the sliding layers' rings of `paged_cache` allocate (0 for a model without them)."""
    if not cfg.hybrid:
        return 0
    ring = ring_size(cfg, capacity, max_q)
    return KVCache.nbytes(kind_config(cfg, SLIDING), rows, ring, dtype) + 8 * rows * ring


def global_config(cfg: ModelConfig) -> ModelConfig:
    """The shape of the K/V that grow with the context: every layer's, or a hybrid model's global layers'."""
    return kind_config(cfg, GLOBAL) if cfg.hybrid else cfg


def global_observer(cfg: ModelConfig, observer: SnapKVObserver | None) -> SnapKVObserver | None:
    """The prefill attention `observer` saw in the global layers only (what selects a hybrid draft's sparse
    entries)."""
    if observer is None:
        return None
    layers = cfg.layers_of(GLOBAL)
    selected = SnapKVObserver(len(layers))
    selected.scores = [observer.scores[i] for i in layers]
    return selected
