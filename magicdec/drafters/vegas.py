"""Self-speculation over the entries the last verification attended to (Vegas), read in place in the target's blocks."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from magicdec.drafters.base import SelfDrafter
from magicdec.errors import InvalidRequestError
from magicdec.kv import KVCache
from magicdec.kv.blocks import KVManager
from magicdec.kv.hybrid import HybridCache, global_config, global_observer, paged_part
from magicdec.kv.sparse import SnapKVObserver
from magicdec.kv.vegas import AttentionShares, VegasKVCache, select, vegas_top, vegas_window
from magicdec.model import Transformer


class VegasDrafter(SelfDrafter):
    """Drafts with the target model reading `budget` cached positions per layer: the sink, the positions of largest
    share in the last verification's attention (from its first token, per layer), and the recent window
    (`magicdec.kv.vegas`). It keeps no K/V of its own: the draft reads and writes the target's blocks, so it needs no
    prefill, no catch-up copies and no memory beyond its selections. A request's first rounds draft over the positions
    its prompt's last tokens attended to (SnapKV's observation, made in the target's last prefill forward)."""

    name = "self-vegas"
    needs_target_attention = True

    def __init__(self, model: Transformer, budget: int, gamma: int):
        super().__init__(model, gamma)
        self.budget = budget
        self.top, self.window = vegas_top(budget), vegas_window(budget)
        if self.top < 1:
            raise InvalidRequestError(f"a Vegas draft's budget ({budget}) must leave room for a selection beside its "
                                      f"sink and window: 8 entries or more")
        self.target: KVCache | HybridCache | None = None
        self.shares = AttentionShares(model.cfg, model.device)  # its `shares`: a verification's not selected from yet

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, kv: KVManager | None = None) -> None:
        if target is None:
            raise ValueError("a Vegas draft reads the target's blocks: pass the target's cache")
        self.target = target
        full = VegasKVCache(global_config(self.model.cfg), paged_part(target), self.top, self.window)
        self.cache = self._over_target(full, target)

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """Each row's selected positions (int64) and its flag, and the verification's attention shares, which
        `AttentionShares` keeps from round to round (fp32 per global layer, KV head and position; at most GROWTH
        times the largest forward's)."""
        cfg = global_config(self.model.cfg)
        shares = cfg.n_layers * cfg.n_kv_heads * capacity * 4 * AttentionShares.GROWTH
        return slots * (cfg.n_layers * self.top * 8 + 1 + math.ceil(shares))

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        """Nothing to copy: the row reads the target's entries. Its first selection, once the prompt is prefilled, is
        SnapKV's: the positions the prompt's last tokens attended to most (`observer`), per layer."""
        if end < len(prompt):
            return
        if self.model.cfg.hybrid:
            observer = global_observer(self.model.cfg, observer)
        scores = torch.stack(observer.scores)  # [layers, 1, KV, L]
        lens = torch.tensor([end], device=scores.device)
        paged_part(self.cache.row(slot)).selected.copy_(select(scores, lens, self.top, self.window))

    def catch_up(self, cache: KVCache, seq: Tensor, n_tokens: Tensor, live: Tensor, target: KVCache,
                 gamma: int) -> None:
        paged_part(cache).follow(n_tokens - 1, live)  # the target holds every known token but the last

    def verification_shares(self) -> AttentionShares:
        """Where the coming verification forward leaves its attention shares (read back by `accept`)."""
        self.shares.start()
        return self.shares

    def accept(self, n: int, n_tokens: Tensor, live: Tensor) -> None:
        """Select each live row's positions for its next rounds from the verification's shares."""
        super().accept(n, n_tokens, live)
        if self.shares.shares is None:
            return
        draft = paged_part(self.cache)
        chosen = select(self.shares.shares, paged_part(self.target).lens[:n], self.top, self.window)
        draft.selected[:n] = torch.where(live[:, None, None], chosen, draft.selected[:n])
        self.shares.start()  # selected from: the next selection waits for the next verification's shares
