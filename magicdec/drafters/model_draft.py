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
    cache prefills into a dense staging row for the prompt, cut into the sparse cache at the final chunk."""

    def __init__(self, model: Transformer, cache_kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        if model.cfg.hybrid:
            raise UnsupportedModelError("a draft model with sliding-window layers is not supported as a standalone "
                                        "drafter; draft with the target itself (--draft streaming or snapkv)")
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown draft cache {cache_kind!r}; choose from {CACHE_KINDS}")
        self.cache_kind, self.budget, self.reindex = cache_kind, budget, reindex
        self.name = f"model-{cache_kind}"
        self.hits: dict[int, list[bytes]] = {}  # by slot: prefix-cache keys matched at admission, pinned until loaded
        self.staging: dict[int, KVCache] = {}  # by slot: a sparse cache's dense rows of the prompts being prefilled

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
        self.hits, self.staging = {}, {}

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """The draft cache and, where prefix caching is on, its prefix cache (counted either way). Not a sparse cache's
        staging rows, which live from a prompt's first prefill chunk to its last: the scheduler prefills the prompts in
        turn, so one or two exist at a time (a prefill's activations are not counted either)."""
        return KVCache.nbytes(self.model.cfg, slots, self._capacity(capacity) + capacity, dtype)

    def _dense_row(self, slot: int) -> KVCache:
        """The dense row a prompt is prefilled into: the slot's own, or its staging row."""
        return self.cache.row(slot) if self.cache_kind == "dense" else self.staging[slot]

    def assign(self, slot: int, cached: list[bytes]) -> None:
        self.hits[slot] = cached  # loaded at the prompt's first chunk (the blocks stay pinned until then)

    def _start(self, slot: int, prompt_len: int) -> None:
        """The prompt's first chunk: a sparse cache's staging row is made, and the row starts from the prefix hit."""
        if self.cache_kind != "dense":
            self.staging[slot] = KVCache(self.model.cfg, 1, prompt_len, self.cache.dtype, self.cache.device)
        row = self._dense_row(slot)
        row.clear()
        cached = self.hits.pop(slot)
        if cached:
            self.prefix_cache.load(cached, row)

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        """Prefill what the draft row lacks of prompt[:end] (the scheduler started the chunks where the shorter of
        the target's and this drafter's prefix hits ends, so that is at most a chunk); at the final chunk, store the
        prompt's blocks and cut a sparse cache from the dense row, SnapKV observing the draft's own final forward."""
        if slot in self.hits:
            self._start(slot, len(prompt))
        row, final = self._dense_row(slot), end == len(prompt)
        own = SnapKVObserver(self.model.cfg.n_layers) if final and self.cache_kind == "snapkv" else None
        prefill_upto(self.model, row, prompt, end, own)
        if not final:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt.tolist(), row)
        if self.cache_kind != "dense":
            compress_into(self.cache.row(slot), row, self.cache_kind, own)
            del self.staging[slot]

    def release(self, slot: int) -> None:
        """Also drop what a request gone before its prefill finished left: its pinned hit, its staging row."""
        super().release(slot)
        self.staging.pop(slot, None)
        hit = self.hits.pop(slot, [])
        if hit:
            self.prefix_cache.unpin(hit)
