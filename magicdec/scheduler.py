"""The scheduler: which requests run each step, and how (policy; the runner is the mechanism).

Requests wait in arrival order until a slot is free (slots are preallocated, so a free slot is memory for the
request's whole cache). An admitted request's prompt is prefilled in chunks, at most `max_prefill_tokens` per step
across requests, interleaved with the decode rounds of the running ones, so a long arrival does not stall the streams
already running (a standalone draft model prefills the same chunks in the same steps). With prefix caching, an
admitted request starts from the longest prefix of its prompt that the cache holds, and a request whose prompt shares
more leading blocks with a prompt being prefilled than the cache holds waits for that prefill to store them (n samples
of one prompt, or many questions about one document, prefill the shared part once). Each step decodes the slots below
the highest running one, with the draft length the speculation policy picks for the live batch; when no request waits
for a slot, running requests move down into free slots so that the decoded rows stay few. Every finish (EOS or the
token limit, as the runner reports them, a stop string, an abort) is decided here, and frees the request's slot at
once.
"""

from __future__ import annotations

import enum
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from magicdec.config import EngineConfig
from magicdec.errors import InvalidRequestError
from magicdec.kv.prefix_cache import BLOCK_SIZE, PrefixCache, block_keys
from magicdec.logprobs import TokenLogprob
from magicdec.prefill import cacheable_prefix, prefill_chunks
from magicdec.sampling import SamplingParams
from magicdec.step import LENGTH, RUNNING, STOPPED, PrefillWork, ScheduledStep, SlotAssignment, SlotOutput, StepResult

class GammaPolicy:
    """Each step's draft length (0: plain decoding) from the live sequences and their mean context; told how every
    decode round went, so that a policy may learn (`autoplan.Replanner`)."""

    def __call__(self, live: int, context: int) -> int:
        raise NotImplementedError

    def observe(self, gamma: int, accepted: Sequence[int], seconds: float) -> None:
        """A decode round that drafted `gamma` tokens per row (0: a plain step) took `seconds`; `accepted` holds each
        live row's accepted drafts."""


@dataclass(frozen=True)
class FixedGamma(GammaPolicy):
    """Always `gamma` draft tokens (0: never speculate)."""

    gamma: int

    def __call__(self, live: int, context: int) -> int:
        return self.gamma


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
    cached_tokens: int = 0  # leading prompt tokens copied from the prefix cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    accepted_hist: list[int] = field(default_factory=list)  # verify rounds by number of drafts accepted
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, where params.logprobs asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first), if asked

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

    @functools.cached_property
    def prompt_keys(self) -> list[bytes]:
        """The prefix cache's keys of the prompt's blocks that a hit may cover."""
        return block_keys(self.prompt_ids[: cacheable_prefix(len(self.prompt_ids))])


class Scheduler:
    """Admission, chunked prefill, the per-step draft length, and retirement of finished requests."""

    def __init__(self, config: EngineConfig, gamma_policy: GammaPolicy, max_gamma: int = 0, *,
                 prefix_cache: PrefixCache | None = None, decode: Callable[[list[int]], str] | None = None,
                 row_bucket: Callable[[int], int] = lambda n: n):
        self.slots = [None] * config.max_num_seqs  # type: list[Request | None]
        self.prefill_chunk = config.prefill_chunk
        self.max_prefill_tokens = config.max_prefill_tokens or 1 << 62
        self.max_queued = config.max_queued
        self.gamma_policy = gamma_policy
        self.max_gamma = max_gamma  # the drafter's longest draft (0: no drafter)
        self.prefix_cache = prefix_cache
        self.draft_prefix_cache: PrefixCache | None = None  # a draft model's own (it prefills prompts too)
        self.decode = decode  # token ids -> text, for stop strings
        self.row_bucket = row_bucket  # decoded rows, rounded up to a shape a captured graph can replay
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []

    def set_speculation(self, gamma_policy: GammaPolicy, max_gamma: int,
                        draft_prefix_cache: PrefixCache | None = None) -> None:
        """Draft up to `max_gamma` tokens a round (0: never), as `gamma_policy` picks, from the next step on; a draft
        model that prefills prompts itself matches them in `draft_prefix_cache` (its `Drafter.prefix_cache`)."""
        self.gamma_policy, self.max_gamma = gamma_policy, max_gamma
        self.draft_prefix_cache = draft_prefix_cache

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
        """Retire a request that holds a slot; returns the slot, free from now on."""
        if request.status is Status.PREFILLING:
            self.prefilling.remove(request)
        self._retire(request, reason)
        self.slots[request.slot] = None
        return request.slot

    @staticmethod
    def _retire(request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        request.finish_time = time.monotonic()

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None and r.status is Status.RUNNING]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    # --- one step -------------------------------------------------------------------------------------------
    def _next_admissible(self, in_flight: set[bytes]) -> Request | None:
        """The first waiting request that would not find more of its prompt cached by waiting: one that shares more
        leading blocks with the prompts being prefilled (`in_flight`: their keys) than the cache holds waits for
        those prefills to store them."""
        for i, request in enumerate(self.waiting):
            keys = request.prompt_keys if in_flight and request.uses_prefix_cache else []
            shared = next((n for n, key in enumerate(keys) if key not in in_flight), len(keys))
            if not shared or shared <= self.prefix_cache.cached_prefix(keys[:shared]):
                del self.waiting[i]
                return request
        return None

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        caching = self.prefix_cache is not None and self.prefix_cache.enabled
        in_flight = {key for r in self.prefilling for key in r.prompt_keys} if caching else set()
        for slot, holder in enumerate(self.slots):
            if holder is None and self.waiting:
                request = self._next_admissible(in_flight)
                if request is None:
                    break
                step.assign.append(self._admit(request, slot, caching))
                in_flight.update(request.prompt_keys if caching else ())
        if not self.waiting:
            self._compact(step)
        budget = self.max_prefill_tokens
        joining = []
        for request in self.prefilling:
            while request.chunks and (budget > 0 or not step.prefills):
                start, end = request.chunks.popleft()
                budget -= end - start
                step.prefills.append(PrefillWork(request.slot, start, end, final=not request.chunks))
            if not request.chunks and request.params.max_tokens > 1:  # else its first token ends it
                joining.append(request)
            if budget <= 0:
                break
        decoding = self.running + joining
        if decoding:
            step.n_rows = min(len(self.slots), self.row_bucket(1 + max(r.slot for r in decoding)))
            context = sum(r.context for r in decoding) // len(decoding)
            step.gamma = min(self.max_gamma, self.gamma_policy(len(decoding), context))
        return step

    def _admit(self, request: Request, slot: int, caching: bool) -> SlotAssignment:
        """Give `slot` to `request`: its longest cached prefix is copied, the rest of its prompt prefilled.

        A draft model prefills the same chunks in the same steps, from its own prefix cache's hit. The chunks start
        where the shorter of the two hits ends, so the model with the longer one skips what it holds, and no step
        runs more than its budget of either model's prefill (a chat's next turn finds its history in the target's
        cache, whose blocks include past outputs, and only the prompt's blocks in the draft model's)."""
        keys, n = request.prompt_keys, len(request.prompt_ids)
        cached = self.prefix_cache.match(keys, n) if caching and request.uses_prefix_cache else []
        draft = self.draft_prefix_cache
        draft_cached = draft.match(keys, n) if caching and draft is not None else []
        request.slot, request.status = slot, Status.PREFILLING
        request.cached_tokens = len(cached) * BLOCK_SIZE
        start = min(len(cached), len(draft_cached)) if draft is not None else len(cached)
        request.chunks = deque(prefill_chunks(n, self.prefill_chunk, start * BLOCK_SIZE))
        self.slots[slot] = request
        self.prefilling.append(request)
        return SlotAssignment(slot, request.prompt_ids, request.params, request.seed, cached, draft_cached)

    def _compact(self, step: ScheduledStep) -> None:
        """Move running requests from the highest slots into free lower ones. A round decodes every slot below the
        highest running one, and an empty slot still rides through the linear layers at a row's cost; a move is one
        copy of the request's cache row. Called when no request waits for a slot."""
        while True:
            free = next((i for i, r in enumerate(self.slots) if r is None), None)
            top = max((r.slot for r in self.running), default=-1)
            if free is None or free > top:
                return
            request = self.slots[top]
            self.slots[free], self.slots[top], request.slot = request, None, free
            step.moves.append((top, free))

    def update(self, step: ScheduledStep, result: StepResult) -> tuple[list[Request], list[int]]:
        """Apply a step's results and decide which requests finish; returns the requests that gained tokens or
        finished, and the slots their finishing freed."""
        now = time.monotonic()
        changed: dict[int, Request] = {}
        freed: list[int] = []
        for slot, entries in result.prompt_logprobs:
            self.slots[slot].prompt_logprobs.extend(entries)
        for out in result.first:
            request = self.slots[out.slot]
            self.prefilling.remove(request)
            request.status, request.first_token_time = Status.RUNNING, now
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
            self.gamma_policy.observe(step.gamma, [out.accepted for out in result.decoded], result.decode_s)
        return list(changed.values()), freed

    def _append(self, request: Request, out: SlotOutput) -> list[int]:
        """Add a slot's new tokens to its request and finish it at EOS, its token limit or a stop string; returns the
        slot when that freed it."""
        request.output_ids.extend(out.tokens)
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
