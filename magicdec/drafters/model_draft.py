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
from magicdec.prefill import prefill_row

CACHE_KINDS = ("dense", "streaming", "snapkv")
#: Prompt tokens per forward when the draft model prefills a prompt.
DRAFT_PREFILL_CHUNK = 512


class ModelDrafter(Drafter):
    """Drafts with a small model. It prefills each prompt densely (from its own prefix cache, which holds as many
    tokens as its slots, where prefix caching is on); a sparse cache is then cut from that."""

    def __init__(self, model: Transformer, cache_kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        if model.cfg.hybrid:
            raise UnsupportedModelError("a draft model with sliding-window layers is not supported as a standalone "
                                        "drafter; draft with the target itself (--draft streaming or snapkv)")
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown draft cache {cache_kind!r}; choose from {CACHE_KINDS}")
        self.cache_kind, self.budget, self.reindex = cache_kind, budget, reindex
        self.name = f"model-{cache_kind}"
        self.prefix_cache: PrefixCache | None = None

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

    def free(self) -> None:
        super().free()
        self.prefix_cache = None

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """The draft cache and, where prefix caching is on, its prefix cache (counted either way)."""
        return KVCache.nbytes(self.model.cfg, slots, self._capacity(capacity) + capacity, dtype)

    def admit(self, slot: int, prompt: Tensor, target: KVCache, observer: SnapKVObserver | None) -> None:
        if self.cache_kind == "dense":
            prefill_row(self.model, self.cache.row(slot), prompt, DRAFT_PREFILL_CHUNK, prefix_cache=self.prefix_cache)
            return
        dense = KVCache(self.model.cfg, 1, len(prompt), self.cache.dtype, self.cache.device)
        own = SnapKVObserver(self.model.cfg.n_layers) if self.cache_kind == "snapkv" else None
        prefill_row(self.model, dense, prompt, DRAFT_PREFILL_CHUNK, own, self.prefix_cache)
        compress_into(self.cache.row(slot), dense, self.cache_kind, own)
