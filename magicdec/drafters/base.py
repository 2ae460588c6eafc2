"""The interface every drafter implements, and the drafting loop they share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from magicdec import scopes
from magicdec.drafters.vocab import DraftHead
from magicdec.kv import KVCache
from magicdec.kv.blocks import KVManager
from magicdec.kv.hybrid import HybridCache, paged_part
from magicdec.kv.sparse import SnapKVObserver
from magicdec.model import SharesRecorder, Transformer
from magicdec.sampling import RowParams, exponential_noise, sample_tokens, top_indices


class Drafter(ABC):
    """Proposes gamma tokens per sequence from a cheap model/cache, then follows what the target accepted.

    A drafter keeps one cache row per engine slot. `assign` starts a slot's row for a new request and `prefill`
    follows the target's prefill chunk by chunk (a draft model prefills the same chunks in the same steps, within the
    scheduler's per-step prefill budget); per round, `propose` drafts for the first n slots and `accept` rolls the
    draft cache back to what the target kept. The draft cache trails the sequence: at the start of a round it first
    catches up on the tokens it has not seen (usually 1 or 2; more after rounds of plain decoding, which leave it
    alone), taken from the engine's token buffer (`catch_up`, then the round's first forward)."""

    name: str = "drafter"
    #: whether `prefill` needs the attention of the prompt's last tokens observed in the target's prefill
    needs_target_attention: bool = False

    def __init__(self, model: Transformer, gamma: int):
        self.model = model
        #: the draft model's forward in drafting rounds: the model's own, or replayed from CUDA graphs (the runner
        #: sets it, `magicdec.graphs`)
        self.forward = model
        self.gamma = gamma  # the most tokens it will be asked to draft per round (sizes a sparse cache's slack)
        self.head: DraftHead | None = None  # proposes among part of the vocabulary (None: the model's LM head)
        self.cache: KVCache | None = None
        #: whether it prefills prompts itself (a draft model: the scheduler then tracks which blocks hold its K/V),
        #: rather than taking a prompt's entries from the target's cache
        self.prefills = False

    @property
    def slack(self) -> int:
        """Entries a sparse cache holds beyond its budget: tokens in flight during a round."""
        return self.gamma + 2

    @property
    def blocks_per_request(self) -> int:
        """KV blocks a request's draft cache takes from the pool when it is admitted (a sparse cache's fixed size;
        0 where the draft reads the request's own blocks, or keeps a row per slot)."""
        return 0

    @abstractmethod
    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, kv: KVManager | None = None) -> None:
        """Create the draft cache for `slots` sequences of up to `capacity` tokens; `target` is the target's cache
        over the same slots (a self-speculative draft of a hybrid model shares its sliding-window ring) and `kv` the
        KV manager whose blocks it reads (a draft model keeps its own K/V in the same blocks)."""

    @abstractmethod
    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes `allocate` would take (memory is planned before it is allocated)."""

    def assign(self, slot: int, drafted: int, blocks: list[int]) -> None:
        """A new request takes `slot`, its prefix hit mapped into the target's block table; `drafted`: how many of
        the hit's leading blocks hold a draft model's K/V too (a drafter that does not prefill takes its entries from
        the target, and has nothing to start); `blocks`: the `blocks_per_request` blocks of its sparse cache."""
        if blocks:
            paged_part(self.cache).set_blocks(slot, 0, blocks)

    @abstractmethod
    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        """The target's row `target` (a view) holds prompt[:end] of slot's request after a prefill chunk: follow it.
        At end == len(prompt) (the observation window, whose attention `observer` holds where
        `needs_target_attention`) the slot's draft cache must be complete."""

    def verification_shares(self) -> SharesRecorder | None:
        """Where the coming verification forward should leave its attention shares, for a drafter that selects its
        entries by them (read back in `accept`); None: it does not."""
        return None

    def free(self) -> None:
        """Drop the draft cache: the drafter leaves its engine (and that engine's CUDA graphs)."""
        self.cache = None
        self.forward = self.model

    def move(self, src: int, dst: int) -> None:
        """The request in slot src moves to the free slot dst (src is released after)."""
        self.cache.copy_row(src, dst)

    def release(self, slot: int) -> None:
        """The slot's request is gone: empty its row (a stale long row would widen every forward's writes) and unmap
        its sparse cache's blocks (back in the pool)."""
        self.cache.row(slot).clear()
        if self.blocks_per_request:
            paged_part(self.cache).unmap(slot)

    @staticmethod
    def _feed_limit(cache: KVCache) -> int:
        """Most tokens one forward may write: a sparse ring must not overwrite entries it still shows, and a dense
        cache must hold q more slots in its longest row (every row writes q)."""
        budget = getattr(cache, "budget", None)
        return cache.capacity - cache.max_len if budget is None else cache.capacity - budget

    def _feed(self, cache: KVCache, seq: Tensor, start: Tensor, count: Tensor, live: Tensor) -> Tensor:
        """Run seq[b, start[b] : start[b] + count[b]] through the draft model (count >= 1 for live rows); returns
        each row's logits after its last token, [n, V]."""
        q = int(count.max())
        index = (start[:, None] + torch.arange(q, device=seq.device)).clamp_max(seq.shape[1] - 1)
        at = (count - 1).clamp_min(0)[:, None]
        with scopes.forward("draft", len(seq), q, cache.entries_read):
            logits = self.forward(seq.gather(1, index), cache, logits_at=at, head=self.head)[:, 0]
        cache.commit(count * live)
        return logits

    def propose(self, n: int, gamma: int, seq: Tensor, n_tokens: Tensor, live: Tensor, rows: RowParams,
                target: KVCache, stop: float | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Draft up to gamma tokens for each of the first n slots: (tokens [n, gamma], lengths [n], confidences),
        row b's first lengths[b] tokens its draft (the tokens past a row's length are meaningless). Per-row draft
        lengths: with `stop`, a row stops drafting before the token that would bring the product of its drafted
        tokens' confidences (`confidence`) below it, and confidences [n, gamma] holds those products (None without
        `stop`: every row drafts gamma tokens); the rows that stopped leave the round's later forwards where the cache
        can run some rows alone (`KVCache.take`; each row's logits are the same bits in any batch), and the loop ends
        once every row has stopped.

        seq [n, C]: every slot's tokens (prompt and output); n_tokens [n]: how many are known; live [n]: slots that
        are decoding (others compute garbage and keep nothing); target: the target's cache over the same slots,
        holding every known token but the last. Draft token i of a row is its sample at position n_tokens + i, with
        the row's own sampling parameters and noise."""
        cache = self.cache.head(n)
        self.catch_up(cache, seq, n_tokens, live, target, gamma)
        start = cache.next_pos.clone()
        x = self._feed(cache, seq, start, torch.where(live, n_tokens - start, 1), live)
        tokens = torch.zeros(n, gamma, dtype=torch.long, device=seq.device)
        lengths = torch.full((n,), gamma, dtype=torch.long, device=seq.device)
        # the rows the forwards run over (`index` into the n; all of them until some stop), their cache and parameters
        index, part, part_rows = torch.arange(n, device=seq.device), cache, rows
        sure = torch.ones(n, device=seq.device)  # the product of each drafting row's tokens' confidences
        products = None if stop is None else torch.zeros(n, gamma, device=seq.device)
        ids = None if self.head is None else self.head.ids
        for i in range(gamma):
            with scopes.sampling("draft"):
                position = n_tokens[index] + i
                t = sample_tokens(x[:, None], part_rows, position[:, None], ids)[:, 0]
                tokens[index, i] = t
                if stop is not None:
                    sure = sure * confidence(x, part_rows, position, ids)
                    products[index, i] = sure
                    going = (sure >= stop) & live[index]
                    lengths[index] = torch.where(going, gamma, lengths[index].clamp_max(i))
            if i == gamma - 1:
                break
            if stop is not None and not bool(going.all()):
                if not bool(going.any()):
                    break
                part, index, kept = self._drafting(cache, part, index, going)
                if kept is not None:
                    x, t, sure, part_rows = x[kept], t[kept], sure[kept], rows.select(index)
            with scopes.forward("draft", len(index), 1, part.entries_read):
                x = self.forward(t[:, None], part, head=self.head)[:, 0]
            part.commit(live[index].long())
        if part is not cache:
            cache.put(index, part)
        return tokens, lengths, products

    @staticmethod
    def _drafting(cache: KVCache, part: KVCache, index: Tensor,
                  going: Tensor) -> tuple[KVCache, Tensor, Tensor | None]:
        """The rows that draft on (`going` [len(index)] of the rows at `index` the last forward ran over) as the next
        forward's: (their cache, their index into the round's rows, which of the last forward's rows they are), or
        the same rows as before (None) where the cache cannot run some rows alone."""
        kept = going.nonzero()[:, 0]
        if part is not cache:
            cache.put(index, part)  # what the last forwards left, before the rows are taken again
        taken = cache.take(index[kept])
        return (part, index, None) if taken is None else (taken, index[kept], kept)

    def catch_up(self, cache: KVCache, seq: Tensor, n_tokens: Tensor, live: Tensor, target: KVCache,
                 gamma: int) -> None:
        """Read the tokens the draft cache has not seen (after rounds of plain decoding, which leave it alone) in
        forwards the cache can hold, leaving the last few for the round's first forward and room for its drafts. A
        drafter that can take these entries from `target` instead overrides this."""
        start = cache.next_pos.clone()
        unseen = torch.where(live, n_tokens - start, 1)
        while int(unseen.max()) > (last_limit := self._feed_limit(cache) - gamma + 1):
            count = (unseen - last_limit).clamp(0, self._feed_limit(cache))
            self._feed(cache, seq, start, count.clamp_min(1), live & (count > 0))
            cache.evict()
            start, unseen = start + count, unseen - count

    def accept(self, n: int, n_tokens: Tensor, live: Tensor) -> None:
        """After verification the first n slots know n_tokens [n] tokens; keep the draft entries that match them
        (positions below n_tokens - 1) and drop the rest."""
        cache = self.cache.head(n)
        keep = torch.where(live, torch.minimum(n_tokens - 1, cache.next_pos), cache.next_pos)
        cache.truncate(cache.lens - (cache.next_pos - keep))
        cache.evict()  # a sparse cache slides its window back to its budget


#: Tokens of a draft step `confidence` races: its most probable ones, where the winner and runner-up all but always lie.
CONFIDENCE_CANDIDATES = 16


def confidence(logits: Tensor, rows: RowParams, position: Tensor, ids: Tensor | None = None) -> Tensor:
    """How surely a draft step's token is the target's too, [n] in [0, 1]: 1 - (runner-up / winner) of the race that
    draws it (`magicdec.sampling`: probability over the token's noise, the noise 1 for a greedy row) among the row's
    CONFIDENCE_CANDIDATES most probable tokens. The target draws with the same noise, so a token that wins its race
    by far is kept by a target whose probabilities differ a little, and a near tie is not (a draft's largest
    probability says less: a flat distribution the target shares is drawn alike).

    logits [n, V] at each row's temperature (1 for a greedy row); position [n]: the drafted token's; ids: as
    `sample_tokens` takes them. Top-k and top-p are not applied: this weighs a draw, it draws nothing."""
    index = top_indices(logits, CONFIDENCE_CANDIDATES)  # [n, k], the largest first
    scaled = logits.gather(-1, index) / rows.temperature[:, None]
    race = (scaled - scaled[:, :1]).exp()  # probabilities over the winner's, [n, k]
    token = index if ids is None else ids[index]
    noise = exponential_noise(rows.seed, position[:, None], token[:, None])[:, 0]
    race = torch.where(rows.greedy[:, None], race, race / noise)
    best = race.topk(2, dim=-1).values
    return 1 - best[:, 1] / best[:, 0]


class SelfDrafter(Drafter):
    """A drafter with the target's own weights over a cache cut from the target's: it never prefills, and the tokens
    decoded since it last ran are copied from the target's cache (`catch_up`), so each round's first draft forward
    reads one token. A hybrid model's sliding layers read the target's own ring: only the global layers' cache is the
    draft's."""

    def _over_target(self, full: KVCache, target: KVCache | None) -> KVCache:
        """The draft cache: `full` for the (global) layers, beside a hybrid target's sliding-window ring."""
        if not self.model.cfg.hybrid:
            return full
        if not isinstance(target, HybridCache):
            raise ValueError("a self-speculative draft of a hybrid model shares the target's sliding-window ring: "
                             "pass the target's cache")
        return target.sharing_window(full)

    def catch_up(self, cache: KVCache, seq: Tensor, n_tokens: Tensor, live: Tensor, target: KVCache,
                 gamma: int) -> None:
        cache.append_from(target, n_tokens - 1, live)
