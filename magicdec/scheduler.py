"""The scheduler: which requests run each step, and how (policy; the runner is the mechanism).

Requests wait in arrival order for a free slot (a cap on concurrent requests: slots hold small per-request state) and
for KV blocks (`magicdec.kv.blocks.KVManager`): a request is admitted when the pool has the blocks of its whole prompt
and first decode round beyond its prefix hit, beside those the prompts being prefilled still need, plus a watermark. An
admitted request's prompt is prefilled in chunks, at most `max_prefill_tokens` per step across requests, interleaved
with the decode rounds of the running ones, so a long arrival does not stall the streams already running (a standalone
draft model prefills the same chunks in the same steps). Blocks are taken as requests grow: each prefill chunk's, and
each decode round's lookahead (the longest draft plus the target's token). Where the pool runs dry, the most recently
admitted request is preempted: its blocks go back (its full blocks stay cached, so its resume is mostly a prefix hit),
and it waits at the head of the queue to be prefilled again, prompt and output so far, and to go on exactly where it
stopped.

With prefix caching, an admitted request starts from the longest prefix of its prompt that the pool holds, and a
request whose prompt shares more leading blocks with a prompt being prefilled than the pool holds waits for that
prefill to fill them (n samples of one prompt, or many questions about one document, prefill the shared part once).
Each step decodes the slots below the highest running one, with the draft length the speculation policy picks for the
live batch; when no request waits for a slot, running requests move down into free slots so that the decoded rows
stay few. Every finish (EOS or the token limit, as the runner reports them, a stop string, an abort) is decided here,
and frees the request's slot and blocks at once.
"""

from __future__ import annotations

import enum
import time
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from magicdec.config import EngineConfig
from magicdec.errors import InvalidRequestError
from magicdec.kv.blocks import BLOCK_SIZE, KVManager, block_keys
from magicdec.logprobs import TokenLogprob
from magicdec.prefill import cacheable_prefix, prefill_chunks
from magicdec.sampling import SamplingParams
from magicdec.step import LENGTH, RUNNING, STOPPED, PrefillWork, ScheduledStep, SlotAssignment, SlotOutput, StepResult

class GammaPolicy:
    """Each step's draft length (0: plain decoding) from the live sequences and their mean context, and where rows
    stop drafting on their own; told how every decode round went, so that a policy may learn (`autoplan.Replanner`)."""

    def __call__(self, live: int, context: int) -> int:
        raise NotImplementedError

    def draft_stop(self) -> float | None:
        """The next round's per-row draft lengths: a row stops drafting before the token that would bring the product
        of its draft's confidences below this (`magicdec.drafters.base.confidence`; 0: rows never stop, but their
        confidences are reported); None: every row drafts the round's gamma tokens."""
        return None

    def observe(self, gamma: int, accepted: Sequence[int], seconds: float,
                drafted: Sequence[int] | None = None, confidences: Sequence[Sequence[float]] | None = None) -> None:
        """A decode round that drafted `gamma` tokens per row (0: a plain step) took `seconds` (0: untimed, a round
        under the profiler, whose operators it slows unevenly); `accepted` holds each live row's accepted drafts, and
        where rows stop drafting on their own, `drafted` its draft's length (None: gamma each) and `confidences` the
        products of its drafted tokens' confidences, one per token."""


@dataclass(frozen=True)
class FixedGamma(GammaPolicy):
    """Always `gamma` draft tokens (0: never speculate), each row stopping at `stop` (`GammaPolicy.draft_stop`)."""

    gamma: int
    stop: float | None = None

    def __call__(self, live: int, context: int) -> int:
        return self.gamma

    def draft_stop(self) -> float | None:
        return self.stop


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


FINISH_NAMES = {STOPPED: "stop", LENGTH: "length"}


@dataclass(eq=False)
class Request:
    """One generation request and everything the engine learns about it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    slot: int = -1
    chunks: deque[tuple[int, int]] = field(default_factory=deque)  # prompt tokens [start, end) left to prefill
    computed: int = 0  # leading tokens whose K/V the target's cache holds (or will, after this step's chunks)
    prefilled: int = 0  # leading tokens its prefill computed, or a hit held (a draft model's K/V too)
    cached_tokens: int = 0  # leading prompt tokens found in the prefix cache
    preemptions: int = 0  # times the request gave its blocks back and was prefilled again
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    accepted_hist: list[int] = field(default_factory=list)  # verify rounds by number of drafts accepted
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, where params.logprobs asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first), if asked
    _keys: tuple[int, list[bytes]] | None = field(default=None, repr=False)  # prompt_keys of so many prefill_ids

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether a cached prefix may stand in for prefilling the prompt's first blocks: not where the prompt's
        log-probabilities are asked for (a cached block has no logits, and computing them costs its prefill)."""
        return self.params.prompt_logprobs is None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def context(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens an admission prefills: the prompt, and a preempted request's output so far."""
        return self.prompt_ids + self.output_ids

    @property
    def prompt_keys(self) -> list[bytes]:
        """The prefix cache's keys of the blocks of `prefill_ids` that a hit may cover."""
        ids = self.prefill_ids
        if self._keys is None or self._keys[0] != len(ids):
            self._keys = (len(ids), block_keys(ids[: cacheable_prefix(len(ids))]))
        return self._keys[1]


class Scheduler:
    """Admission, chunked prefill, KV blocks and preemption, the per-step draft length, and retirement of finished
    requests. `kv` is the target's KV manager; `watermark`: the fraction of its blocks an admission leaves free (so
    that the running requests' next rounds do not at once preempt the request just admitted)."""

    def __init__(self, config: EngineConfig, gamma_policy: GammaPolicy, max_gamma: int = 0, *, kv: KVManager,
                 decode: Callable[[list[int]], str] | None = None, row_bucket: Callable[[int], int] = lambda n: n,
                 watermark: float = 0.01):
        self.slots = [None] * config.max_num_seqs  # type: list[Request | None]
        self.prefill_chunk = config.prefill_chunk
        self.max_prefill_tokens = config.max_prefill_tokens or 1 << 62
        self.max_queued = config.max_queued
        self.gamma_policy = gamma_policy
        self.max_gamma = max_gamma  # the drafter's longest draft (0: no drafter)
        self.kv = kv
        self.watermark = int(watermark * kv.num_blocks)
        self.draft_prefills = False  # whether a draft model prefills prompts (its K/V in the same blocks)
        self.draft_blocks = 0  # blocks a request's sparse draft cache takes at admission
        self.decode = decode  # token ids -> text, for stop strings
        self.row_bucket = row_bucket  # decoded rows, rounded up to a shape a captured graph can replay
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # requests holding a slot, in the order they were admitted

    def set_speculation(self, gamma_policy: GammaPolicy, max_gamma: int, draft_prefills: bool = False,
                        draft_blocks: int = 0) -> None:
        """Draft up to `max_gamma` tokens a round (0: never), as `gamma_policy` picks, from the next step on;
        `draft_prefills`: a draft model prefills prompts too, into its share of the same blocks (`Drafter.prefills`),
        so a hit maps its K/V only where it computed them; `draft_blocks`: the blocks each request's sparse draft cache
        takes from the pool when it is admitted (`Drafter.blocks_per_request`)."""
        self.gamma_policy, self.max_gamma, self.draft_prefills = gamma_policy, max_gamma, draft_prefills
        self.draft_blocks = draft_blocks

    @property
    def lookahead(self) -> int:
        """Positions a decode round writes past a request's computed tokens: the longest draft and the target's."""
        return self.max_gamma + 1

    # --- requests in and out --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if self.max_queued is not None and len(self.waiting) >= self.max_queued:
            raise QueueFullError(f"the queue is full ({self.max_queued} requests waiting)")
        self.waiting.append(request)

    def abort(self, request: Request) -> int | None:
        """End a request that has not finished (the client went away); returns the slot it freed, if any."""
        if request.status is Status.WAITING:
            self.waiting.remove(request)
            self._retire(request, "abort")
            return None
        return self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> int:
        """Retire a request that holds a slot; returns the slot, free from now on (its blocks too)."""
        self._retire(request, reason)
        self._store(request)
        return self._vacate(request)

    def _vacate(self, request: Request) -> int:
        """Take the request's slot and blocks back; returns the slot."""
        self.active.remove(request)
        self.kv.free(request.request_id)
        self.slots[request.slot] = None
        return request.slot

    @staticmethod
    def _retire(request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        request.finish_time = time.monotonic()

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None and r.status is Status.RUNNING]

    @property
    def prefilling(self) -> list[Request]:
        return [r for r in self.active if r.status is Status.PREFILLING]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.active)

    # --- one step -------------------------------------------------------------------------------------------
    def _next_admissible(self, in_flight: set[bytes]) -> Request | None:
        """The first waiting request that would not find more of its prompt cached by waiting: one that shares more
        leading blocks with the prompts being prefilled (`in_flight`: their keys) than the cache holds waits for
        those prefills to store them."""
        for request in self.waiting:
            keys = request.prompt_keys if in_flight and request.uses_prefix_cache else []
            shared = next((n for n, key in enumerate(keys) if key not in in_flight), len(keys))
            if not shared or shared <= self.kv.cached_prefix(keys[:shared]):
                return request
        return None

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        caching = self.kv.caching
        in_flight = {key for r in self.prefilling for key in r.prompt_keys} if caching else set()
        for slot, holder in enumerate(self.slots):
            if holder is None and self.waiting:
                request = self._next_admissible(in_flight)
                if request is None or not self._fits(request):
                    break
                self.waiting.remove(request)
                step.assign.append(self._admit(request, slot))
                in_flight.update(request.prompt_keys if caching else ())
        grown = self._grow(step)
        if not self.waiting:
            self._compact(step)
        step.grow = [(r.slot, first, blocks) for r, first, blocks in grown if r.slot >= 0]
        decoding = self.running + [r for r in self.prefilling if not r.chunks and r.params.max_tokens > 1]
        if decoding:
            step.n_rows = self.decode_rows(1 + max(r.slot for r in decoding))
            context = sum(r.context for r in decoding) // len(decoding)
            step.gamma = min(self.max_gamma, self.gamma_policy(len(decoding), context))
            step.draft_stop = self.gamma_policy.draft_stop() if step.gamma else None
        return step

    def decode_rows(self, n: int) -> int:
        """Rows a decode round over the first n slots runs: n rounded up to a row bucket, at most every slot."""
        return min(len(self.slots), self.row_bucket(n))

    def _fits(self, request: Request) -> bool:
        """Whether the pool has the blocks of the request's whole prompt and first decode round beyond its prefix hit
        (and its cached blocks that nobody holds now) and of its sparse draft cache, beside those the prompts being prefilled still need, with the
        watermark left over. Admitting on a first chunk's blocks alone filled the pool with half-prefilled prompts that
        then preempted each other, each preemption throwing away prefill work (benchmarks/README.md, "Capacity at the
        same KV memory")."""
        keys = request.prompt_keys if request.uses_prefix_cache else []
        hit = self.kv.hit_blocks(keys)
        unheld = sum(self.kv.pool.refs[b] == 0 for b in hit)
        need = self._missing(request, len(request.prefill_ids)) - len(hit) + unheld + self.draft_blocks
        promised = sum(self._missing(r, len(r.prefill_ids)) for r in self.active if r.status is Status.PREFILLING)
        watermark = self.watermark if self.active else 0  # alone, a request may take the whole pool
        return need + promised + watermark <= self.kv.num_free

    def _missing(self, request: Request, tokens: int) -> int:
        """Blocks the request lacks for `tokens` prompt tokens and a decode round after them."""
        return self.kv.missing(request.request_id, tokens + self.lookahead)

    def _grow(self, step: ScheduledStep) -> list[tuple[Request, int, list[int]]]:
        """Give each request holding a slot, oldest first, the blocks of its work in this step: its prefill chunks
        (within the step's budget), or its decode round's lookahead; where the pool runs dry, preempt the newest
        until the work fits. Returns (request, first table index, new blocks) of each that grew."""
        budget, grown = self.max_prefill_tokens, []
        for request in list(self.active):
            if request not in self.active:  # preempted for an older request's blocks in this pass
                continue
            chunks = []
            if request.status is Status.PREFILLING:
                while len(chunks) < len(request.chunks) and (budget > 0 or not (step.prefills or chunks)):
                    chunks.append(request.chunks[len(chunks)])
                    budget -= chunks[-1][1] - chunks[-1][0]
                if not chunks:
                    continue
                joins = len(chunks) == len(request.chunks) and request.params.max_tokens > 1
                need = chunks[-1][1] + (self.lookahead if joins else 0)
            else:
                need = request.context - 1 + self.lookahead
            first = len(self.kv.blocks_of(request.request_id))
            while (new := self.kv.grow(request.request_id, need)) is None:
                victim = self.active[-1]
                self._preempt(victim, step)
                if victim is request:
                    break
            if new is None:
                break
            if new:
                grown.append((request, first, new))
            for start, end in chunks:
                request.chunks.popleft()
                request.computed = request.prefilled = end
                step.prefills.append(PrefillWork(request.slot, start, end, final=not request.chunks))
        return grown

    def _preempt(self, request: Request, step: ScheduledStep) -> None:
        """Send a request back to the head of the queue, its blocks to the pool (the keyed ones stay cached): it is
        prefilled again, prompt and output so far, when it is next admitted."""
        assigned = next((a for a in step.assign if a.slot == request.slot), None)
        if assigned is not None:
            step.assign.remove(assigned)
        else:
            step.release.append(request.slot)
        self._store(request)
        self._vacate(request)
        self.kv.preemptions += 1
        request.preemptions += 1
        request.status, request.slot, request.chunks = Status.WAITING, -1, deque()
        self.waiting.appendleft(request)

    def _admit(self, request: Request, slot: int) -> SlotAssignment:
        """Give `slot` to `request`: its longest cached prefix is mapped into its blocks, the rest of its prompt (and
        a preempted request's output so far) prefilled.

        A draft model prefills the same chunks in the same steps, into its share of the same blocks; of the hit's
        blocks, it holds the leading ones that a prefill of its own computed (a chat's next turn finds its history in
        the target's blocks, past outputs included, and the draft model's K/V of the prompts only). The chunks start
        where the draft model's hit ends, the target skipping what it holds, so that no step runs more than its
        budget of either model's prefill."""
        ids = request.prefill_ids
        keys, n = request.prompt_keys, len(ids)
        cached = self.kv.match(request.request_id, keys if request.uses_prefix_cache else [], n)
        drafted = self.kv.drafted_prefix(cached) if self.draft_prefills else len(cached)
        draft_blocks = self.kv.take_draft(request.request_id, self.draft_blocks) if self.draft_blocks else []
        assert draft_blocks is not None, "admitted without the blocks of its draft cache (_fits)"
        request.slot, request.status = slot, Status.PREFILLING
        request.cached_tokens = request.computed = len(cached) * BLOCK_SIZE
        request.prefilled = drafted * BLOCK_SIZE
        request.chunks = deque(prefill_chunks(n, self.prefill_chunk, request.prefilled))
        self.slots[slot] = request
        self.active.append(request)
        params = request.params
        if request.output_ids:  # a resumed request: its tokens so far are its prompt now
            params = dataclasses.replace(params, prompt_logprobs=None)
        return SlotAssignment(slot, ids, params, request.seed, keys[: len(cached)], cached, drafted,
                              generated=len(request.output_ids), draft_blocks=draft_blocks)

    def _compact(self, step: ScheduledStep) -> None:
        """Move running requests from the highest slots into free lower ones. A round decodes every slot below the
        highest running one, and an empty slot still rides through the linear layers at a row's cost; a move copies
        the request's block table, not its K/V. Called when no request waits for a slot."""
        while True:
            free = next((i for i, r in enumerate(self.slots) if r is None), None)
            top = max((r.slot for r in self.running), default=-1)
            if free is None or free > top:
                return
            request = self.slots[top]
            self.slots[free], self.slots[top], request.slot = request, None, free
            step.moves.append((top, free))

    def _store(self, request: Request) -> None:
        """Key the request's blocks that filled (its computed tokens: prefilled, or all but the newest sampled), and
        mark those a draft model's prefill filled too."""
        if not self.kv.caching:
            return
        if request.computed // BLOCK_SIZE > len(self.kv.keys_of(request.request_id)):
            self.kv.store(request.request_id, request.prefill_ids, request.computed)
        if self.draft_prefills:
            self.kv.mark_drafted(request.request_id, request.prefilled)

    def update(self, step: ScheduledStep, result: StepResult, timed: bool = True) -> tuple[list[Request], list[int]]:
        """Apply a step's results and decide which requests finish; returns the requests that gained tokens or
        finished, and the slots their finishing freed. `timed`: whether the gamma policy may learn from the step's
        seconds."""
        now = time.monotonic()
        changed: dict[int, Request] = {}
        freed: list[int] = []
        for slot, entries in result.prompt_logprobs:
            self.slots[slot].prompt_logprobs.extend(entries)
        for out in result.first:
            request = self.slots[out.slot]
            request.status = Status.RUNNING
            if request.first_token_time is None:
                request.first_token_time = now
            changed[out.slot] = request
            freed.extend(self._append(request, out))
        for out in result.decoded:
            request = self.slots[out.slot]
            if request is None:  # its first token, in this step, completed a stop string
                continue
            if step.gamma:
                hist = request.accepted_hist
                hist.extend([0] * (step.gamma + 1 - len(hist)))
                hist[out.accepted] += 1
            changed[out.slot] = request
            freed.extend(self._append(request, out))
        if result.decoded:  # (a round can find every row gone: first tokens that were EOS)
            stopping = step.draft_stop is not None
            self.gamma_policy.observe(step.gamma, [out.accepted for out in result.decoded],
                                      result.decode_s if timed else 0.0,
                                      [out.drafted for out in result.decoded],
                                      [out.confidences for out in result.decoded] if stopping else None)
        for request in self.active:
            self._store(request)
        return list(changed.values()), freed

    def _append(self, request: Request, out: SlotOutput) -> list[int]:
        """Add a slot's new tokens to its request and finish it at EOS, its token limit or a stop string; returns the
        slot when that freed it."""
        request.output_ids.extend(out.tokens)
        request.computed = request.context - 1  # the newest token's K/V are written by the next round
        if out.logprobs is not None:
            request.logprobs.extend(out.logprobs)
        if out.finish != RUNNING:
            return [self._finish(request, FINISH_NAMES[out.finish])]
        if request.params.stop and self.decode is not None:
            end = stop_string_end(self.decode, request.output_ids, request.params.stop)
            if end is not None:
                del request.output_ids[end:]
                if request.logprobs is not None:
                    del request.logprobs[end:]
                return [self._finish(request, "stop")]
        return []


def stop_string_end(decode: Callable[[list[int]], str], ids: list[int], stops: Sequence[str]) -> int | None:
    """The fewest leading tokens of `ids` whose text contains one of `stops` (None: none does). Only the text of the
    last tokens is decoded: every token adds at least one character, so a stop string that the last token completed
    spans at most as many tokens as it has characters."""
    window = max(0, len(ids) - max(map(len, stops)) - 16)
    if not any(s in decode(ids[window:]) for s in stops):
        return None
    lo, hi = window + 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[window:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class QueueFullError(InvalidRequestError):
    """The scheduler's queue holds `max_queued` requests already (the server answers 429)."""


def cuda_row_bucket(n: int) -> int:
    """Decoded rows rounded up to 1, 2, 4, 8, then multiples of 8: few distinct shapes, so a step can be captured
    once per bucket (CUDA graphs) and replayed; the extra rows are idle slots."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
