"""A standalone draft model (same vocabulary as the target) with a dense or sparse KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.errors import UnsupportedModelError
from magicdec.kv import KVCache
from magicdec.kv.blocks import BLOCK_SIZE, KVManager
from magicdec.kv.hybrid import paged_part
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.sparse import SnapKVObserver, SparseKVCache, compress_into, prefix_size
from magicdec.model import Transformer
from magicdec.prefill import prefill_upto

CACHE_KINDS = ("dense", "streaming", "snapkv")


class ModelDrafter(Drafter):
    """Drafts with a small model. Its K/V of a request lie in the request's own KV blocks (the draft model's share of
    each block, `KVManager.draft_storage`), read through the target's block tables: a prefix hit maps them with the
    target's, no K/V copied, where the draft model prefilled those blocks before. It prefills each prompt densely in
    the chunks the target prefills, in the same steps; a dense draft decodes over those blocks, a sparse cache is cut
    from them at the final chunk."""

    def __init__(self, model: Transformer, cache_kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        if model.cfg.hybrid:
            raise UnsupportedModelError("a draft model with sliding-window layers is not supported as a standalone "
                                        "drafter; draft with the target itself (--draft streaming or snapkv)")
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown draft cache {cache_kind!r}; choose from {CACHE_KINDS}")
        self.cache_kind, self.budget, self.reindex = cache_kind, budget, reindex
        self.name = f"model-{cache_kind}"
        self.prefills = True
        self.dense: PagedKVCache | None = None  # the draft K/V in the blocks, every slot's prompt and (dense) more

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, kv: KVManager | None = None) -> None:
        if kv is None or target is None:
            raise ValueError("a draft model keeps its K/V in the target's KV blocks: pass the target's cache and its "
                             "KV manager")
        k, v = kv.draft_storage(self.model)
        self.dense = paged_part(target).over(self.model.cfg, k, v)
        if self.cache_kind == "dense":
            self.cache = self.dense
        else:  # in the draft share of blocks the scheduler takes for each request at admission
            self.cache = SparseKVCache(self.model.cfg, k, v, slots, self.budget,
                                       prefix_size(self.cache_kind, self.budget), self.slack, self.reindex,
                                       self.model.inv_freq)

    @property
    def blocks_per_request(self) -> int:
        return 0 if self.cache_kind == "dense" else SparseKVCache.blocks_per_row(self.budget, self.slack)

    def free(self) -> None:
        super().free()
        self.dense = None

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """A sparse cache's per-slot state: the K/V are the KV blocks' draft share (`KVManager.draft_storage`)."""
        return 0 if self.cache_kind == "dense" else SparseKVCache.state_bytes(slots, self.budget, self.slack)

    def assign(self, slot: int, drafted: int, blocks: list[int]) -> None:
        super().assign(slot, drafted, blocks)
        row = self.dense.row(slot)
        row.clear()
        row.commit(drafted * BLOCK_SIZE)

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        """Prefill what the draft's blocks lack of prompt[:end] (the scheduler started the chunks where the draft
        model's hit ends, so that is at most a chunk); at the final chunk a sparse cache is cut from them, SnapKV
        observing the draft's own final forward."""
        row, final = self.dense.row(slot), end == len(prompt)
        own = SnapKVObserver(self.model.cfg.n_layers) if final and self.cache_kind == "snapkv" else None
        prefill_upto(self.model, row, prompt, end, own)
        if final and self.cache_kind != "dense":
            compress_into(self.cache.row(slot), row, self.cache_kind, own)

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        if self.cache is not self.dense:
            self.dense.copy_row(src, dst)

    def release(self, slot: int) -> None:
        super().release(slot)
        if self.cache is not self.dense:
            self.dense.row(slot).clear()
