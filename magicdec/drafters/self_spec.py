"""Self-speculation: the target's own weights over a fixed-budget sparse KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.drafters.base import SelfDrafter
from magicdec.kv import KVCache
from magicdec.kv.blocks import KVManager
from magicdec.kv.hybrid import HybridCache, global_config, global_observer
from magicdec.kv.sparse import SnapKVObserver, SparseKVCache, compress_into, prefix_size
from magicdec.model import Transformer


class SelfSpecDrafter(SelfDrafter):
    """Drafts with the target model reading only `budget` cached tokens (StreamingLLM or SnapKV).

    A slot's sparse cache is cut from the target's dense cache after prefill, so drafting costs no extra prefill;
    SnapKV's selection uses the attention of the prompt's last tokens, observed during the target's own prefill.
    Catching up copies from the target too (`SelfDrafter`): a switch from plain decoding back to drafting costs no
    forward over the tokens decoded meanwhile."""

    def __init__(self, model: Transformer, kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        self.kind, self.budget, self.reindex = kind, budget, reindex
        self.name = f"self-{kind}"
        self.needs_target_attention = kind == "snapkv"

    @property
    def blocks_per_request(self) -> int:
        return SparseKVCache.blocks_per_row(self.budget, self.slack)

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, kv: KVManager | None = None) -> None:
        # a slot's entries are cut from the target's cache, which the target's prefix cache fills; they lie in blocks
        # of the target's pool, which the scheduler takes for each request at admission
        if kv is None:
            raise ValueError("a sparse draft cache lies in the KV manager's blocks: pass the KV manager")
        sparse = SparseKVCache(global_config(self.model.cfg), kv.k, kv.v, slots, self.budget,
                               prefix_size(self.kind, self.budget), self.slack, self.reindex, self.model.inv_freq)
        self.cache = self._over_target(sparse, target)  # hybrid: only the global layers read a sparse cache

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        return SparseKVCache.state_bytes(slots, self.budget, self.slack)  # the K/V: in the pool's blocks

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        if end < len(prompt):  # the entries are cut from the target's row once it holds the whole prompt
            return
        row = self.cache.row(slot)
        if isinstance(row, HybridCache):
            row, target, observer = row.full, target.full, global_observer(self.model.cfg, observer)
        compress_into(row, target, self.kind, observer)
