"""The step contract: what the scheduler hands the runner for one engine step, and what comes back.

The scheduler decides (`ScheduledStep`), the runner executes on the model and caches and reports per slot
(`StepResult`), and the scheduler applies the results, deciding every finish. Nothing else passes between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from magicdec.logprobs import TokenLogprob
from magicdec.sampling import SamplingParams

#: How a slot's tokens of a step ended, as the runner sees it on the device: still running, at an EOS
#: token (`STOPPED`), or at the request's token limit (`LENGTH`). Stop strings are the scheduler's.
RUNNING, STOPPED, LENGTH = 0, 1, 2


@dataclass
class SlotAssignment:
    """A request taking a slot: what the runner needs to prefill and decode it. `prompt`: the tokens to prefill (a
    preempted request's output so far included: `generated` of them, which count towards its max_tokens); `cached`:
    the keys of its leading blocks found in the prefix cache and `blocks` the pool blocks holding them, mapped into the
    slot's table before its prefill chunks (which start after them, or after the draft model's hit where that is
    shorter); `drafted`: how many of those blocks hold a draft model's K/V too (its hit); `draft_blocks`: the blocks
    of its sparse draft cache."""

    slot: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    cached: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    drafted: int = 0
    generated: int = 0
    draft_blocks: list[int] = field(default_factory=list)


@dataclass
class PrefillWork:
    """Prompt tokens [start, end) of the request in `slot` (a model whose prefix hit covers some of them computes
    only the rest); the last chunk of a prompt samples its first token."""

    slot: int
    start: int
    end: int
    final: bool


@dataclass
class ScheduledStep:
    """What one step runs, in order: release the slots of preempted requests, move running requests (from, to) into
    free lower slots, hand slots to new requests, give slots new KV blocks (`grow`: slot, first table index, block
    ids), run prefill chunks, then a decode round (draft length gamma, 0 for plain decoding; rows stopping at
    `draft_stop`, see `GammaPolicy.draft_stop`) over slots [0, n_rows)."""

    release: list[int] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    assign: list[SlotAssignment] = field(default_factory=list)
    grow: list[tuple[int, int, list[int]]] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)
    n_rows: int = 0
    gamma: int = 0
    draft_stop: float | None = None


@dataclass
class SlotOutput:
    """The tokens a slot gained in a step (after EOS and the token limit cut them), how they ended (RUNNING, STOPPED
    or LENGTH), in a speculative round how many of its drafts the target accepted, the tokens' log-probabilities
    where the request asked for them, and in a speculative round how many tokens it drafted (with per-row draft
    lengths, also each drafted token's product of the draft's confidences up to it)."""

    slot: int
    tokens: list[int]
    finish: int
    accepted: int = 0
    logprobs: list[TokenLogprob] | None = None
    drafted: int = 0
    confidences: list[float] | None = None


@dataclass
class StepResult:
    """A step's results on the host: the first token of each request whose prefill finished, and the tokens of each
    decoded slot that gained any; seconds spent in prefill, the decode round and its drafting; and the log-probabilities
    of the prompt tokens its prefill chunks computed, as (slot, entries) in prompt order, for the requests that
    asked."""

    first: list[SlotOutput]
    decoded: list[SlotOutput]
    prefill_s: float
    decode_s: float
    draft_s: float
    prompt_logprobs: list[tuple[int, list[TokenLogprob]]] = field(default_factory=list)
