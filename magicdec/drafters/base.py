"""The interface every drafter implements, and the bookkeeping they share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from magicdec.kv import KVCache
from magicdec.kv.sparse import SnapKVObserver
from magicdec.model import Transformer
from magicdec.sampling import SamplingParams, probs_from_logits, sample


class Drafter(ABC):
    """Proposes gamma tokens per sequence from a cheap model/cache, then follows what the target accepted.

    Lifecycle: `prefill` once after the target's prefill; then per round `propose` and `accept`.
    The drafter keeps its own cache; tokens the target has committed but that the draft cache has not
    seen yet ("pending", 1 or 2 per sequence) enter it at the start of the next `propose`.
    """

    name: str = "drafter"
    #: whether `prefill` needs the attention of the prompts' last tokens observed in the target's prefill
    needs_target_attention: bool = False

    def __init__(self, model: Transformer, gamma: int):
        self.model = model
        self.gamma = gamma  # the most tokens it will be asked to draft per round (sizes its cache slack)
        self.cache: KVCache | None = None
        self.pending: Tensor | None = None  # [B, 2] tokens to feed first, left-aligned
        self.n_pending: Tensor | None = None  # [B] 1 or 2
        self.drafted: Tensor | None = None  # [B, gamma] tokens proposed in the current round
        self._lens_before: Tensor | None = None  # draft cache lengths at the start of the round

    def prefill(
        self, tokens: Tensor, lens: Tensor, target_cache: KVCache, observer: SnapKVObserver | None, first: Tensor,
        chunk: int,
    ) -> None:
        """Build the draft cache for prompts tokens [B, T] (lengths lens [B]) whose next token is `first`."""
        self.cache = self.build_cache(tokens, lens, target_cache, observer, chunk)
        self.pending = torch.stack((first, torch.zeros_like(first)), dim=1)
        self.n_pending = torch.ones_like(first)

    @abstractmethod
    def build_cache(
        self, tokens: Tensor, lens: Tensor, target_cache: KVCache, observer: SnapKVObserver | None, chunk: int
    ) -> KVCache:
        """The draft's cache after the prompt, with room for a round's tokens in flight."""

    def propose(
        self, gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor | None]:
        """Draft gamma tokens per sequence: (tokens [B, gamma], their distributions [B, gamma, V] or None)."""
        cache = self.cache
        self._lens_before = cache.lens.clone()
        x = self.model(self.pending, cache, logits_at=(self.n_pending - 1)[:, None])[:, 0]
        cache.commit(self.n_pending)
        tokens, probs = [], []
        for i in range(gamma):
            if params.greedy:
                t = x.argmax(dim=-1)
            else:
                pr = probs_from_logits(x, params)
                t = sample(pr, generator)
                probs.append(pr)
            tokens.append(t)
            if i < gamma - 1:
                x = self.model(t[:, None], cache)[:, 0]
                cache.commit(1)
        self.drafted = torch.stack(tokens, dim=1)
        return self.drafted, (torch.stack(probs, dim=1) if probs else None)

    def accept(self, n_accepted: Tensor, next_token: Tensor, live: Tensor) -> None:
        """The target accepted n_accepted [B] draft tokens and then produced next_token [B].

        Rows with live == 0 (finished sequences) keep nothing of this round.
        """
        gamma = self.drafted.shape[1]
        # the cache holds the pending tokens and the first gamma-1 drafts; keep those that were accepted
        kept = self.n_pending + n_accepted.clamp_max(gamma - 1)
        self.cache.truncate(self._lens_before + kept * live)
        self.evict()
        all_in = n_accepted == gamma
        last_draft = self.drafted[:, -1]
        self.pending = torch.stack(
            (torch.where(all_in, last_draft, next_token), torch.where(all_in, next_token, 0)), dim=1
        )
        self.n_pending = all_in.long() + 1

    def evict(self) -> None:
        """Keep the draft cache within its budget (sparse caches slide their window)."""
        evict = getattr(self.cache, "evict", None)
        if evict is not None:
            evict()

    def select_rows(self, rows: Tensor) -> None:
        self.cache.select_rows(rows)
        self.pending = self.pending.index_select(0, rows)
        self.n_pending = self.n_pending.index_select(0, rows)
