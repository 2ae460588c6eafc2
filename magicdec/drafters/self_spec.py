"""Self-speculation: the target's own weights over a fixed-budget sparse KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.kv import KVCache
from magicdec.kv.hybrid import HybridCache, global_config, global_observer
from magicdec.kv.sparse import SnapKVObserver, SparseKVCache, compress_into, prefix_size
from magicdec.model import Transformer


class SelfSpecDrafter(Drafter):
    """Drafts with the target model reading only `budget` cached tokens (StreamingLLM or SnapKV).

    A slot's sparse cache is cut from the target's dense cache after prefill, so drafting costs no extra prefill;
    SnapKV's selection uses the attention of the prompt's last tokens, observed during the target's own prefill.
    Catching up works the same way: the entries of tokens decoded since the draft last ran are copied from the
    target's cache, so each round's first draft forward reads one token and a switch from plain decoding back to
    drafting costs no forward over the tokens decoded meanwhile."""

    def __init__(self, model: Transformer, kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        self.kind, self.budget, self.reindex = kind, budget, reindex
        self.name = f"self-{kind}"
        self.needs_target_attention = kind == "snapkv"

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, prefix_caching: bool = False) -> None:
        # a slot's entries are cut from the target's cache, which the target's prefix cache fills
        cfg = self.model.cfg
        sparse = SparseKVCache(global_config(cfg), slots, self.budget, prefix_size(self.kind, self.budget),
                               self.slack, dtype, device, self.reindex, self.model.inv_freq)
        if cfg.hybrid and not isinstance(target, HybridCache):
            raise ValueError("a self-speculative draft of a hybrid model shares the target's sliding-window ring: "
                             "pass the target's cache")
        # hybrid: only the global layers read a sparse cache; the sliding layers read the target's own ring
        self.cache = target.sharing_window(sparse) if cfg.hybrid else sparse

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        return KVCache.nbytes(global_config(self.model.cfg), slots, self.budget + self.slack, dtype)

    def catch_up(self, cache: KVCache, seq: Tensor, n_tokens: Tensor, live: Tensor, target: KVCache,
                 gamma: int) -> None:
        cache.append_from(target, n_tokens - 1, live)

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        if end < len(prompt):  # the entries are cut from the target's row once it holds the whole prompt
            return
        row = self.cache.row(slot)
        if isinstance(row, HybridCache):
            row, target, observer = row.full, target.full, global_observer(self.model.cfg, observer)
        compress_into(row, target, self.kind, observer)
