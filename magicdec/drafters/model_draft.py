"""A standalone draft model (same vocabulary as the target) with a dense or sparse KV cache."""

from __future__ import annotations

from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.kv import KVCache
from magicdec.kv.sparse import SnapKVObserver, compress
from magicdec.model import Transformer

CACHE_KINDS = ("dense", "streaming", "snapkv")


class ModelDrafter(Drafter):
    """Drafts with a small model. Its prompt is prefilled densely; a sparse cache is then cut from that."""

    def __init__(self, model: Transformer, cache_kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown draft cache {cache_kind!r}; choose from {CACHE_KINDS}")
        self.cache_kind, self.budget, self.reindex = cache_kind, budget, reindex
        self.name = f"model-{cache_kind}"

    def build_cache(
        self, tokens: Tensor, lens: Tensor, target_cache: KVCache, target_observer: SnapKVObserver | None, chunk: int
    ) -> KVCache:
        from magicdec.decode import prefill  # decode imports drafters; import here to avoid a cycle

        dense = KVCache(self.model.cfg, len(lens), target_cache.capacity + 2, target_cache.k.dtype, target_cache.device)
        observer = SnapKVObserver(self.model.cfg.n_layers) if self.cache_kind == "snapkv" else None
        prefill(self.model, dense, tokens, lens, chunk, observer=observer)
        if self.cache_kind == "dense":
            return dense
        return compress(dense, self.cache_kind, self.budget, self.reindex, self.gamma + 2, self.model.inv_freq, observer)
