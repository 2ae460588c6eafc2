"""A standalone draft model (same vocabulary as the target) with a dense or sparse KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.errors import UnsupportedModelError
from magicdec.kv import KVCache
from magicdec.kv.prefix_cache import PrefixCache
from magicdec.kv.sparse import SnapKVObserver, SparseKVCache, compress_into, prefix_size
from magicdec.model import Transformer
from magicdec.prefill import prefill_upto

CACHE_KINDS = ("dense", "streaming", "snapkv")


class ModelDrafter(Drafter):
    """Drafts with a small model. It prefills each prompt densely, in the chunks the target prefills in the same
    steps (from its own prefix cache, which holds as many tokens as its slots, where prefix caching is on); a sparse
    cache prefills into a dense staging row of its slot, cut into the sparse cache at the final chunk."""

    def __init__(self, model: Transformer, cache_kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        if model.cfg.hybrid:
            raise UnsupportedModelError("a draft model with sliding-window layers is not supported as a standalone "
                                        "drafter; draft with the target itself (--draft streaming or snapkv)")
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown draft cache {cache_kind!r}; choose from {CACHE_KINDS}")
        self.cache_kind, self.budget, self.reindex = cache_kind, budget, reindex
        self.name = f"model-{cache_kind}"
        self.staging: KVCache | None = None  # a sparse cache's dense rows, which prompts are prefilled into

    def _capacity(self, capacity: int) -> int:
        return capacity + self.slack if self.cache_kind == "dense" else self.budget + self.slack

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, prefix_caching: bool = False) -> None:
        cfg = self.model.cfg
        self.prefix_cache = PrefixCache(cfg, KVCache.nbytes(cfg, slots, capacity, dtype), dtype) if prefix_caching \
            else None
        if self.cache_kind == "dense":
            self.cache = KVCache(cfg, slots, self._capacity(capacity), dtype, device)
        else:
            self.cache = SparseKVCache(cfg, slots, self.budget, prefix_size(self.cache_kind, self.budget), self.slack,
                                       dtype, device, self.reindex, self.model.inv_freq)
            self.staging = KVCache(cfg, slots, capacity, dtype, device)

    def free(self) -> None:
        super().free()
        self.prefix_cache = self.staging = None

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """The draft cache, a sparse cache's staging rows and, where prefix caching is on, the prefix cache (counted
        either way): a staging row per slot, as every slot may be prefilling at once."""
        staging = 0 if self.cache_kind == "dense" else capacity
        return KVCache.nbytes(self.model.cfg, slots, self._capacity(capacity) + capacity + staging, dtype)

    def _dense_row(self, slot: int) -> KVCache:
        """The dense row a prompt is prefilled into: the slot's own, or its staging row."""
        return (self.cache if self.cache_kind == "dense" else self.staging).row(slot)

    def assign(self, slot: int, cached: list[bytes]) -> None:
        row = self._dense_row(slot)
        row.clear()
        if cached:
            self.prefix_cache.load(cached, row)

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        """Prefill what the draft row lacks of prompt[:end] (the scheduler started the chunks where the shorter of
        the target's and this drafter's prefix hits ends, so that is at most a chunk); at the final chunk, store the
        prompt's blocks and cut a sparse cache from the dense row, SnapKV observing the draft's own final forward."""
        row, final = self._dense_row(slot), end == len(prompt)
        own = SnapKVObserver(self.model.cfg.n_layers) if final and self.cache_kind == "snapkv" else None
        prefill_upto(self.model, row, prompt, end, own)
        if not final:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt.tolist(), row)
        if self.cache_kind != "dense":
            compress_into(self.cache.row(slot), row, self.cache_kind, own)
