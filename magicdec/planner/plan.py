"""Choice of decoding strategy, draft KV budget and draft length from the cost and acceptance models."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from magicdec import dtypes
from magicdec.planner.acceptance import AcceptanceTable, check_mode, expected_tokens
from magicdec.planner.cost import (Workload, decode_step_time, draft_time, forward_cost, selection_time,
                                   verify_step_time)
from magicdec.planner.models import ModelShape

STRATEGIES = ("ar", "self-streaming", "self-snapkv", "self-vegas", "self-quant", "model")
DRAFT_CACHES = ("dense", "streaming", "snapkv")


@dataclass(frozen=True)
class Plan:
    """The predicted-fastest way to decode one batch shape, and why."""

    strategy: str
    """"ar", "self-streaming", "self-snapkv", "self-vegas", "self-quant" or "model" (a standalone draft model)."""
    budget: int | None
    """Draft KV budget; None for AR, self-quant and a dense draft cache."""
    gamma: int
    """Draft tokens per step; 0 for AR."""
    draft_cache: str | None
    """"dense", "streaming" or "snapkv" for a draft model; None otherwise."""
    alpha: float | None
    """Per-token acceptance rate assumed (of the slowest sequence, see `plan`); None for AR."""
    predicted_throughput: float
    """Generated tokens per second over the whole batch."""
    predicted_speedup: float
    """predicted_throughput over that of plain autoregressive decoding."""
    verify_dominant: str
    """Dominant cost term of the target step (verification, or the decode step for AR)."""
    draft_dominant: str | None
    """Dominant cost term of a draft step; None for AR."""
    fits_in_memory: bool
    """Whether weights plus KV caches (target and draft) fit in device memory."""
    hardware: str = ""
    """Name of the hardware profile the plan was made with."""
    draft_vocab: int = 0
    """Rows of the draft's LM head: a draft head over that many frequent tokens, or 0 for the whole vocabulary."""


@dataclass(frozen=True)
class _Drafter:
    strategy: str
    cache: str | None
    budget: int | None
    key: str  # name in the acceptance table
    shape: ModelShape
    tp: int
    vocab: int = 0  # rows of the draft head; 0: the whole LM head
    coverage: float = 1.0  # share of the text's tokens the draft head holds
    kv_bytes: float | None = None  # bytes per K/V value the draft reads (None: the target's)


def strategy_kv_bytes(strategy: str, w: Workload) -> float | None:
    """Bytes per K/V value a drafter of `strategy` is priced at where they are not the target's (`w.kv_dtype_bytes`):
    self-quant's 4-bit levels sit in int8 rows with their scale (`magicdec.kv.lowbit`); a Vegas draft reads the
    target's one position at a time through token tables, priced as `w.hw.table_read_factor` times their bytes; None
    for the others."""
    if strategy == "self-quant":
        return dtypes.kv_nbytes("int8", w.shape.head_dim)
    if strategy == "self-vegas" and w.hw.table_read_factor != 1:
        return w.kv_dtype_bytes * w.hw.table_read_factor
    return None


def _drafters(
    w: Workload, draft: ModelShape | None, budgets: Iterable[int], strategies: set[str],
    draft_heads: Mapping[int, float],
) -> Iterator[_Drafter]:
    target, tp = w.shape, w.tp
    # A sparse cache whose budget reaches the context holds every token: it is a dense cache.
    sparse_budgets = sorted(b for b in set(budgets) if b < w.context)
    drafters = []
    # A Vegas draft reads `budget` positions per layer as a sparse cache does, through token tables (its bytes priced
    # by `strategy_kv_bytes`); its rounds' selection is priced by `round_time`.
    for strategy in ("self-streaming", "self-snapkv", "self-vegas"):
        if strategy in strategies:
            drafters += [_Drafter(strategy, None, budget, strategy, target, tp,
                                  kv_bytes=strategy_kv_bytes(strategy, w)) for budget in sparse_budgets]
    if "self-quant" in strategies:  # the whole context, at int8 rows' bytes
        drafters.append(_Drafter("self-quant", None, None, "self-quant", target, tp,
                                 kv_bytes=strategy_kv_bytes("self-quant", w)))
    if draft is not None and "model" in strategies:
        # Tensor parallelism splits KV heads, so a draft with fewer KV heads than devices runs on gcd(tp, n_kv_heads)
        # of them (as MagicDec runs TinyLlama on 4 of 8 GPUs).
        draft_tp = math.gcd(tp, draft.n_kv_heads)
        for cache in DRAFT_CACHES:
            drafters += [_Drafter("model", cache, budget, f"{draft.name}:{cache}", draft, draft_tp)
                         for budget in ([None] if cache == "dense" else sparse_budgets)]
    for d in drafters:
        for vocab, coverage in draft_heads.items():
            if vocab < d.shape.vocab_size:
                yield dataclasses.replace(d, vocab=vocab, coverage=coverage)


def round_time(w: Workload, gamma: int, mode: str = "greedy", draft: ModelShape | None = None,
               budget: int | None = None, draft_tp: int | None = None, draft_vocab: int = 0,
               draft_kv_bytes: float | None = None, selects: bool = False) -> float:
    """Predicted seconds of one decode round of the workload: a plain step for gamma 0, else gamma forwards of
    `draft` (default: the target itself, self-speculation) over its cache (`budget` entries; None: dense; its values
    of `draft_kv_bytes`, default the target's) on `draft_tp` devices (default: the target's) and the target's
    verification of gamma + 1 tokens. `draft_vocab`: the rows of the draft's LM head (a draft head,
    `magicdec.drafters.vocab`; 0: its whole vocabulary). In sampling mode, every position drawn costs the profile's
    `sampling_s_per_logit` per row and logit it draws from: gamma positions from the draft's head, gamma + 1 from the
    target's. `selects`: a Vegas round, whose verification leaves the attention shares its selection ranks
    (`selection_time`)."""
    t_logit = w.batch * w.hw.sampling_s_per_logit if mode == "sampling" else 0.0
    vocab = w.shape.vocab_size
    if gamma == 0:
        return decode_step_time(w) + vocab * t_logit
    drafting = _drafting(w, draft or w.shape, draft_vocab, draft_tp, draft_kv_bytes)
    t_draft = draft_time(drafting, budget, gamma, first_tokens=2 if draft is not None else 1)
    t_sample = (gamma * drafting.shape.vocab_size + (gamma + 1) * vocab) * t_logit
    return t_draft + verify_step_time(w, gamma) + t_sample + (selection_time(w) if selects else 0.0)


def _drafting(w: Workload, shape: ModelShape, draft_vocab: int, tp: int | None, kv_bytes: float | None) -> Workload:
    """The workload a draft's forwards run: `shape` through a head of `draft_vocab` rows on `tp` devices, reading K/V
    values of `kv_bytes` (None: the target's devices and bytes)."""
    return dataclasses.replace(w, shape=_with_head(shape, draft_vocab), tp=tp or w.tp,
                               kv_dtype_bytes=kv_bytes or w.kv_dtype_bytes)


def _with_head(shape: ModelShape, draft_vocab: int) -> ModelShape:
    """`shape` drafting through a head of `draft_vocab` rows (0: its own LM head)."""
    return dataclasses.replace(shape, vocab_size=draft_vocab) if draft_vocab else shape


def _memory(w: Workload, shape: ModelShape, kv_len: int, devices: int, weights: bool) -> float:
    """Bytes per device of `shape`'s KV caches for the workload's batch at `kv_len`, and its weights if asked."""
    kv = w.batch * (kv_len * shape.kv_bytes_per_token(w.kv_dtype_bytes) + shape.window_kv_bytes(w.context,
                                                                                                w.kv_dtype_bytes))
    return ((shape.weight_bytes(w.dtype_bytes) if weights else 0.0) + kv) / devices


def _check_plan_args(w: Workload, chosen: set[str], gammas: list[int], mode: str, rows: int) -> None:
    if not chosen or not chosen <= set(STRATEGIES):
        raise ValueError(f"strategies must be a non-empty subset of {STRATEGIES}, got {sorted(chosen)}")
    if not gammas or gammas[0] < 1:
        raise ValueError(f"gammas must be positive, got {gammas}")
    if w.batch < 1 or w.context < 1:
        raise ValueError(f"batch and context must be positive, got {w.batch}, {w.context}")
    check_mode(mode)
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")


@dataclass(frozen=True)
class _Candidate:
    throughput: float
    drafter: _Drafter
    gamma: int
    alpha: float
    fits: bool


def _best_speculative(
    w: Workload, acceptance: AcceptanceTable, drafters: Iterable[_Drafter], gammas: list[int], mode: str,
    rows: int, spec_time_scale: float,
) -> _Candidate | None:
    """The speculative candidate of highest predicted throughput; those that do not fit in memory are skipped unless
    even AR does not fit."""
    target_memory = _memory(w, w.shape, w.context, w.tp, weights=True)
    ar_fits = target_memory <= w.hw.mem_bytes
    best: _Candidate | None = None
    for d in drafters:
        try:
            alpha = acceptance.alpha(d.key, d.budget, w.context, mode, rows=rows) * d.coverage
        except KeyError:
            continue
        # Self-speculation shares the target's weights, and a Vegas draft its K/V; a draft model brings its own.
        held = 0 if d.strategy == "self-vegas" else w.context if d.budget is None else d.budget
        drafting = _drafting(w, d.shape, d.vocab, d.tp, d.kv_bytes)
        fits = target_memory + _memory(drafting, d.shape, held, d.tp, weights=d.strategy == "model") \
            <= w.hw.mem_bytes
        if ar_fits and not fits:
            continue
        for g in gammas:
            t_round = round_time(w, g, mode, d.shape if d.strategy == "model" else None, d.budget, d.tp, d.vocab,
                                 d.kv_bytes, selects=d.strategy == "self-vegas")
            throughput = w.batch * expected_tokens(alpha, g) / (spec_time_scale * t_round)
            if best is None or throughput > best.throughput:
                best = _Candidate(throughput, d, g, alpha, fits)
    return best


def plan(
    w: Workload, acceptance: AcceptanceTable, draft: ModelShape | None = None,
    budgets: Iterable[int] = (64, 128, 256, 512, 1024, 2048), gammas: Iterable[int] = range(1, 9), mode: str = "greedy",
    strategies: Iterable[str] | None = None, rows: int | None = None, margin: float = 1.0, spec_time_scale: float = 1.0,
    draft_heads: Mapping[int, float] | None = None,
) -> Plan:
    """Pick the strategy, budget and gamma with the highest predicted throughput for the workload.

    Searches plain AR decoding, StreamingLLM, SnapKV and Vegas self-speculation over `budgets`, self-quant (the whole
    context at int8 rows' bytes), and, when `draft` is given,
    that draft model with a dense, StreamingLLM or SnapKV cache, each over `gammas`. Drafters the acceptance table
    has no rate for are skipped. Speculation must beat AR strictly to be chosen.

    Throughput(spec) = B * E[tokens] / T_round(gamma) and Throughput(AR) = B / T_round(0), with `round_time`'s
    T_round (draft forwards, verification and, in sampling mode, the drawing of every position). `spec_time_scale`
    multiplies T_round(gamma > 0): the ratio of measured to predicted round times of speculation over that of plain
    steps, when a run has measured them (`autoplan.Replanner`). E[tokens] uses the acceptance rate of the slowest of
    `rows` distinct sequences (default: the batch), since a static batch runs until its slowest sequence is done;
    `rows=1` gives the steady-state rate of a continuously refilled batch. Candidates that do not fit in memory are
    skipped, unless even AR does not fit (then the search ignores memory and `fits_in_memory` is False).

    `strategies` restricts the search (default: all of STRATEGIES); leaving "ar" out returns the best speculative
    plan even when it is slower than AR. With "ar" in it, speculation is chosen only when predicted faster than
    `margin` times AR (a margin above 1 allows for the cost model's error).

    `draft_heads` maps draft-head sizes to the share of the text's tokens each head holds (default {0: 1.0}, the
    whole LM head alone): each drafter is also priced drafting through each head (FR-Spec), its draft forwards reading
    and sampling that many rows, its acceptance the table's times that share (a token outside the head is never
    proposed, and the draft's choice among the rest is as good as its choice among all)."""
    chosen = set(STRATEGIES if strategies is None else strategies)
    gammas = sorted(set(gammas))
    rows = w.batch if rows is None else rows
    _check_plan_args(w, chosen, gammas, mode, rows)
    drafters = _drafters(w, draft, budgets, chosen, draft_heads or {0: 1.0})
    best = _best_speculative(w, acceptance, drafters, gammas, mode, rows, spec_time_scale)
    ar_throughput = w.batch / round_time(w, 0, mode)
    if "ar" in chosen and (best is None or best.throughput <= margin * ar_throughput):
        ar_fits = _memory(w, w.shape, w.context, w.tp, weights=True) <= w.hw.mem_bytes
        decode = forward_cost(w, 1, w.context)
        return Plan("ar", None, 0, None, None, ar_throughput, 1.0, decode.dominant, None, ar_fits, w.hw.name)
    if best is None:
        raise ValueError(
            f"no speculative candidate among {sorted(chosen)}: none has an acceptance rate in {mode} "
            f"mode at these budgets (the table knows {acceptance.drafters()}) and fits in memory"
        )
    d, g = best.drafter, best.gamma
    kv_len = w.context if d.budget is None else d.budget
    drafting = forward_cost(_drafting(w, d.shape, d.vocab, d.tp, d.kv_bytes), 1, kv_len)
    return Plan(
        d.strategy, d.budget, g, d.cache, best.alpha, best.throughput, best.throughput / ar_throughput,
        forward_cost(w, g + 1, w.context).dominant, drafting.dominant, best.fits, w.hw.name, d.vocab,
    )


def plan_table(workloads: Iterable[Workload], acceptance: AcceptanceTable, **kwargs: Any) -> list[dict[str, Any]]:
    """`plan` of each workload (say, a grid of batch x context); one dict per workload (target, hardware, batch,
    context, Plan fields). `kwargs` go to `plan` (draft, budgets, gammas, mode, strategies, rows)."""
    return [{"target": w.shape.name, "hardware": w.hw.name, "batch": w.batch, "context": w.context,
             **dataclasses.asdict(plan(w, acceptance, **kwargs))} for w in workloads]
