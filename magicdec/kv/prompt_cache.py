"""Prefilled prompts kept for reuse across requests, matched on the whole prompt."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv.base import KVCache
from magicdec.kv.hybrid import HybridCache
from magicdec.kv.sparse import SnapKVObserver


@dataclass
class _Prefilled:
    k: Tensor  # [n_layers, KV, T, hd]
    v: Tensor
    logits: Tensor  # [1, V], predicting the token after the prompt
    scores: list[Tensor]  # SnapKV's observation per layer, [1, KV, T]
    ring: tuple[Tensor, ...] = ()  # a hybrid model's sliding-window ring: K, V [n_sliding, KV, R, hd], slot_pos [R]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.logits, *self.scores, *self.ring))


class PromptCache:
    """Prefilled prompts kept for reuse, matched on the whole prompt, least recently used evicted first.

    Benchmarks and `generate --compare-ar` decode the same prompts under several configurations, and `generate --n`
    samples one prompt many times; a hit costs a copy of the prompt's K/V instead of its prefill. Entries hold the
    K/V in the cache dtype, the last logits and SnapKV's observation, so every drafter can start from a hit. A cache
    of 0 bytes is off."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], _Prefilled] = OrderedDict()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @staticmethod
    def bytes_for(cfg: ModelConfig, lengths: Sequence[int], kv_dtype: torch.dtype) -> int:
        """Bytes that hold exactly one entry per prompt of these lengths (tokens): the K/V, the logits and SnapKV's
        observation (fp32)."""
        return sum(KVCache.nbytes(cfg, 1, n, kv_dtype) + 4 * (cfg.vocab_size + cfg.n_layers * cfg.n_kv_heads * n)
                   for n in lengths)

    def resize(self, max_bytes: int) -> None:
        """Hold at most `max_bytes` from now on (0: off), evicting the least recently used entries."""
        self.max_bytes = max_bytes
        self._evict(0)

    def __contains__(self, prompt: Sequence[int]) -> bool:
        return tuple(prompt) in self.entries

    def get(self, prompt: Sequence[int]) -> _Prefilled:
        key = tuple(prompt)
        self.entries.move_to_end(key)
        return self.entries[key]

    def load(self, prompt: Sequence[int], row: KVCache, observer: SnapKVObserver | None) -> Tensor:
        """Fill `row` (one cache row) with the cached prefill of `prompt`; returns its last logits."""
        entry, T = self.get(prompt), len(prompt)
        row.clear()
        full = row.full if isinstance(row, HybridCache) else row
        full.k[:, 0, :, :T] = entry.k
        full.v[:, 0, :, :T] = entry.v
        if entry.ring:
            for stored, into in zip(entry.ring, (row.window.k[:, 0], row.window.v[:, 0], row.window.slot_pos[0])):
                into.copy_(stored)
        row.commit(T)
        if observer is not None:
            observer.scores = list(entry.scores)
        return entry.logits

    def store(self, prompt: Sequence[int], row: KVCache, logits: Tensor, observer: SnapKVObserver) -> None:
        """Keep the prefill of `prompt` that `row` now holds (with its last logits and SnapKV observation)."""
        key, T = tuple(prompt), len(prompt)
        scores = [s[..., :T] for s in observer.scores]  # attention may have spanned the row's unfilled slots
        full = row.full if isinstance(row, HybridCache) else row
        ring = (row.window.k[:, 0], row.window.v[:, 0], row.window.slot_pos[0]) if full is not row else ()
        entry = _Prefilled(full.k[:, 0, :, :T].clone(), full.v[:, 0, :, :T].clone(), logits.clone(), scores,
                           tuple(t.clone() for t in ring))
        if key in self.entries or entry.nbytes > self.max_bytes:
            return
        self._evict(entry.nbytes)
        self.entries[key] = entry
        self.nbytes += entry.nbytes

    def _evict(self, room: int) -> None:
        """Drop least recently used entries until `room` more bytes fit."""
        while self.entries and self.nbytes + room > self.max_bytes:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
