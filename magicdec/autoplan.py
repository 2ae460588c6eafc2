"""`--draft auto`: pick AR or a self-speculative configuration for a batch shape with the planner.

    from magicdec import LLM, SpeculativeConfig
    llm = LLM()
    llm.generate(prompts, params, speculative=SpeculativeConfig("auto"))  # planned for this call's batch and context
    print(describe(llm.last_auto.plan))                                    # what it chose, and why

`LLM` plans an `auto` setting with `choose` at the shape of the engine it runs (`LLM.plan` for `generate`'s); `choose`
also plans for any shape, or for a model or machine you do not have (a `ModelShape`, a profile).

The draft length is re-planned every engine step (the `Replanner`, the scheduler's gamma policy): requests arrive and
finish and contexts grow, and all of it moves the best gamma. The strategy and budget stay as chosen at the start;
where plain decoding is the better choice for the live batch (say, few sequences at a short context), that step
decodes plainly, and drafting resumes when it pays. The re-planner (`Replanner`) learns from the rounds it sees: the
acceptance rate of the text being generated, and how long draft rounds and plain steps take against the cost model's
predictions.

The model's shape and dtypes come from the Transformer; the hardware profile is the one `magicdec calibrate` saved
for the device and the dtype in use (else the preset measured in that dtype, on this kind of CPU where there is one);
the acceptance rates are the ones measured for this model (else the table shipped with the package, measured on
SmolLM2-135M with PG-19 text). See `magicdec.profiles`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import statistics
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from magicdec import dtypes
from magicdec.drafters.vocab import head_coverage
from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer
from magicdec.model import Transformer, weight_dtype
from magicdec.planner import (AcceptanceTable, HardwareProfile, ModelShape, Plan, Workload, get_profile, plan,
                              round_time, strategy_kv_bytes)
from magicdec.profiles import load_acceptance, load_profile, target_shape
from magicdec.scheduler import GammaPolicy
from magicdec.speculative import SpeculativeConfig, corpus_token_counts

#: Self-speculative strategies `choose` searches besides AR.
SELF_STRATEGIES = ("self-streaming", "self-snapkv")
#: Draft budgets and lengths searched by default (budgets are capped below the context by the planner).
DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_GAMMAS = tuple(range(1, 9))
#: Contexts the per-step re-planner distinguishes (plans are cached per live batch and context bucket).
REPLAN_GRANULARITY = 64
#: How much faster than plain decoding speculation must be predicted before `--draft auto` drafts: a
#: calibrated profile predicts forwards within ~9% (median), and a choice made on a closer call can lose
#: (benchmarks/README.md, "--draft auto").
MIN_PREDICTED_SPEEDUP = 1.06
#: Weight, in drafted tokens, of the acceptance table's rate against what a run observes: the table was
#: measured on a few prompts, and other text (held-out books, chat) accepts more or less.
PRIOR_TOKENS = 64
#: Per round, the weight left to the acceptance counts so far: the last ~50 rounds weigh most, so that the rate
#: follows the text being generated (a server's requests change), and while plain decoding runs the rate
#: drifts back to the table's and drafting is tried again where the table says it pays.
ACCEPTANCE_DECAY = 0.98
#: Rounds of each kind (plain, speculative) whose measured time the re-planner compares with the cost model
#: (their median: one outlier does not move it, two rounds that agree do).
TIMING_WINDOW = 3
#: Rounds of the chosen kind after which the re-planner runs the other to time it; the interval doubles, up to
#: EXPLORE_MOST, while the choice holds and the times and the live batch stay within EXPLORE_MOVED of what they were,
#: and starts again otherwise.
EXPLORE_EVERY = 32
#: Rounds before the other kind is timed for the first time: a plan the timings contradict (a cost the profile
#: does not price, such as K/V that several rows share staying in the last-level cache) is corrected within a few
#: rounds, not after EXPLORE_EVERY of a run that may be only a few dozen rounds long.
EXPLORE_FIRST = 4
EXPLORE_MOST = 256
EXPLORE_MOVED = 0.2
#: The bounds of the scale the timings put on the cost model's speculative round times, relative to its plain steps
#: (`Replanner.spec_time_scale`). Below 1 a plan predicted slower than plain decoding may draft once both are timed: on
#: a Zen 4 VM a quick profile measured while memory read fast chose plain decoding for B = 32 x 8k, where drafting had
#: measured 1.04x sampled and 1.22x greedy within the hour (the read rate moves 2x within minutes). `choose` builds the
#: drafter wherever the scale's floor would make it pay (a close call) and starts plain.
MIN_TIME_SCALE = 0.75
MAX_TIME_SCALE = 4.0
#: Priced per-row draft lengths (`draft_stop="auto"`): bins of the product of a row's draft confidences, in which
#: the chance that a drafted token is accepted is learned; each bin starts from its midpoint as if it had seen
#: STOP_PRIOR_TOKENS tokens; every STOP_EXPLORE-th round no row stops, so that the bins below the threshold learn too.
STOP_BINS = 10
STOP_PRIOR_TOKENS = 4
STOP_EXPLORE = 8

#: A dtype as `choose` takes it: a torch dtype, a name (fp32, bf16, fp16) or bytes per element.
Dtype = torch.dtype | str | float


class Choice(NamedTuple):
    """What `choose` picked: the drafter's settings and its Replanner (both None: plain decoding), and the plan."""

    speculative: SpeculativeConfig | None
    replanner: Replanner | None
    plan: Plan


def choose(
    model: Transformer | ModelShape, batch: int, context: int, *, kv_dtype: Dtype | None = None,
    model_name: str | None = None, profile: HardwareProfile | str | os.PathLike[str] | None = None,
    acceptance: AcceptanceTable | str | os.PathLike[str] | None = None, mode: str = "greedy",
    budgets: Iterable[int] = DEFAULT_BUDGETS, gammas: Iterable[int] = DEFAULT_GAMMAS,
    strategies: Iterable[str] | None = None, dtype: Dtype | None = None, draft_vocab: int = 0,
    vocab_corpus: str | None = None, tokenizer: Tokenizer | None = None, rows: int | None = None,
    graphs: bool = False, prefix_rows: float = 1.0, draft_stop: float | str | None = None,
) -> Choice:
    """The predicted-fastest way to decode `batch` sequences of `context` tokens with `model`.

    Returns Choice(SpeculativeConfig, the Replanner that picks each step's draft length, plan), or (None, None, plan)
    where plain decoding is predicted faster by more than timings could show (a closer call: `_search`). `strategies`
    (default: AR, StreamingLLM and SnapKV self-speculation, and self-quant on a GPU, `default_strategies`) are those
    searched. `model` is the Transformer that will decode (a planner ModelShape plans for a model or machine you do
    not have). `profile`: a HardwareProfile, preset name or JSON path (default: the calibrated profile of the model's
    device and dtype, else a preset). `acceptance`: a table or its JSON path (default: the one measured for the model
    named `model_name` (`profiles.model_key`), else the built-in table of its architecture). `mode`: "greedy" or
    "sampling" (temperature > 0). `dtype` defaults to the model's weights' (`weight_dtype`), `kv_dtype` to `dtype`;
    for a ModelShape, `dtype` defaults to the profile's, else 4 bytes on a CPU profile and 2 on others. Raises
    InvalidRequestError when the profile or the acceptance table cannot be found or read. Under tensor parallelism (a
    Transformer loaded as one rank) the ranks must use the same profile, and the plan is for the whole model over the
    ranks when the profile knows the all-reduce (`magicdec calibrate`), else for this rank's share alone.

    `draft_vocab` > 0 also prices drafting through a draft head of that many rows, the tokens most frequent in the
    text file `vocab_corpus` as `tokenizer` encodes it (`magicdec.drafters.vocab`): the plan takes it where it pays
    (`Plan.draft_vocab`), its acceptance the table's times the share of the corpus's tokens the head holds.

    `rows`: how many of the batch's sequences differ (default: all). A static batch decodes until its slowest sequence
    is done, so the plan prices the slowest of `rows`; greedy copies of one prompt decode alike and count once.

    `graphs`: the engine replays its decode forwards from CUDA graphs (`magicdec.graphs`), so an uncalibrated GPU's
    preset is priced without the host's kernel launches (`planner.hardware.eager` where not). `prefix_rows`: rows
    per shared prompt prefix (1: distinct prompts; `HardwareProfile.shared_attention_factor` prices it). `draft_stop`:
    per-row draft lengths, the Replanner's `draft_stop` (a threshold, or "auto": priced by the cost model)."""
    if dtype is None and isinstance(model, Transformer):
        dtype = weight_dtype(model)  # what the planner counts bytes of: 16-bit on the AVX2 kernels
    device = str(model.device) if isinstance(model, Transformer) else "cpu"
    try:
        hw = _hardware(profile, device, dtype, graphs)
        table = acceptance if isinstance(acceptance, AcceptanceTable) else (
            load_acceptance(model_name, model.cfg.architecture if isinstance(model, Transformer) else None)
            if acceptance is None else AcceptanceTable.from_json(acceptance))
    except (ValueError, OSError) as e:
        raise InvalidRequestError(str(e)) from None
    work = dataclasses.replace(_workload(model, hw, batch, context, dtype, kv_dtype), prefix_rows=prefix_rows)
    strategies = tuple(strategies) if strategies is not None else default_strategies(work, model)
    heads = _draft_heads(draft_vocab, vocab_corpus, tokenizer)
    # The decode loop caps gamma (MAX_GAMMA) and sparse budgets must be >= 8 (SpeculativeConfig).
    gammas, budgets = [g for g in gammas if 1 <= g <= 16], [b for b in budgets if b >= 8]
    best = _search(work, table, budgets, gammas, mode, strategies, rows, heads)
    if isinstance(model, Transformer) and model.tp is not None:
        best = model.tp.share(best)  # a rank may plan its own share of the model: rank 0's plan is every rank's
    if best.strategy == "ar":
        return Choice(None, None, best)
    replan = _replanner(work, table, best, gammas, mode, "ar" in strategies, heads[best.draft_vocab], draft_stop)
    head = {"draft_vocab": best.draft_vocab, "vocab_corpus": vocab_corpus} if best.draft_vocab else {}
    # Built for the longest draft it may re-plan to; the decode loop starts it at the planned length.
    return Choice(SpeculativeConfig.drafting(best.strategy, best.budget, gamma=max(gammas), **head), replan, best)


def _search(work: Workload, table: AcceptanceTable, budgets: list[int], gammas: list[int], mode: str,
            strategies: tuple[str, ...], rows: int | None, heads: dict[int, float]) -> Plan:
    """The plan `choose` takes: the predicted-fastest; where that is plain decoding, the drafter that would be chosen
    were its rounds MIN_TIME_SCALE times as long as the cost model says, if any (a close call: its plan at the model's
    own times, predicted slower than plain decoding; the Replanner starts plain and drafts once its timings say
    drafting is faster)."""
    search = functools.partial(plan, work, table, gammas=gammas, mode=mode, rows=rows)
    best = search(budgets=budgets, strategies=strategies, margin=MIN_PREDICTED_SPEEDUP, draft_heads=heads)
    if best.strategy != "ar":
        return best
    close = search(budgets=budgets, strategies=strategies, margin=MIN_PREDICTED_SPEEDUP,
                   spec_time_scale=MIN_TIME_SCALE, draft_heads=heads)
    if close.strategy == "ar":
        return best
    return search(budgets=[close.budget] if close.budget else [], strategies=[close.strategy],
                  draft_heads={close.draft_vocab: heads[close.draft_vocab]})


def default_strategies(work: Workload, model: Transformer | ModelShape) -> tuple[str, ...]:
    """What `choose` searches by default: AR, StreamingLLM and SnapKV self-speculation; Vegas self-speculation where
    the profile measured what its rounds add (`HardwareProfile.selection_s_per_share`: the selection, and the draft's
    reads through token tables), which calibrated and quick CPU profiles do and GPU presets do not; and self-quant
    over a 16-bit cache on a GPU (a model on CUDA; for a ModelShape, a profile that is not a CPU's), where attention
    is bound by the bytes the profile prices. On a CPU the profile's attention rate is its 16-bit kernel's, while the
    int8 kernel there is bound by its instructions (1.2-1.5x a bf16 step's speed at half the bytes;
    benchmarks/README.md), and over an int8 cache a self-quant draft step reads what a decode step reads: neither
    searches it."""
    gpu = model.device.type == "cuda" if isinstance(model, Transformer) else "cpu" not in work.hw.name
    vegas = ("self-vegas",) if work.hw.selection_s_per_share > 0 else ()
    quant = ("self-quant",) if gpu and work.kv_dtype_bytes >= 2 else ()
    return ("ar", *SELF_STRATEGIES, *vegas, *quant)


def _draft_heads(draft_vocab: int, vocab_corpus: str | None, tokenizer: Tokenizer | None) -> dict[int, float]:
    """The draft heads `choose` prices, and the share of the corpus's tokens each holds."""
    heads = {0: 1.0}
    if draft_vocab:
        if vocab_corpus is None or tokenizer is None:
            raise InvalidRequestError("a draft head (draft_vocab) is counted in a corpus: give vocab_corpus and the "
                                      "model's tokenizer")
        heads[draft_vocab] = head_coverage(corpus_token_counts(tokenizer, vocab_corpus), draft_vocab)
    return heads


def _hardware(profile: HardwareProfile | str | os.PathLike[str] | None, device: str,
              dtype: Dtype | None, graphs: bool) -> HardwareProfile:
    """The profile `choose` was given, or the one for the device and dtype (`graphs`: see `choose`)."""
    if profile is None:
        return load_profile(device, dtypes.short_name(dtype), graphs)
    return profile if isinstance(profile, HardwareProfile) else get_profile(profile)


def _workload(model: Transformer | ModelShape, hw: HardwareProfile, batch: int, context: int,
              dtype: Dtype | None, kv_dtype: Dtype | None) -> Workload:
    """The workload of `model` on `hw`: under tensor parallelism, the whole model over the ranks where the profile
    knows the all-reduce, else this rank's share alone."""
    if isinstance(model, ModelShape):
        shape, tp = model, 1
    else:
        shape, tp, group = target_shape(model.cfg), 1, model.tp
        if group is not None:
            # Every rank must take the same decisions: a profile that differs between machines would not.
            group.agree("the hardware profile for --draft auto", dataclasses.asdict(hw))
            if hw.ici_bandwidth is not None:
                shape, tp = target_shape(model.full_cfg), group.world_size
    if dtype is None:  # planning from a shape: the profile's dtype, else the device's usual one
        dtype = hw.dtype or (4 if hw.name.startswith(("cpu", "calibrated-cpu")) else 2)
    return Workload(shape, hw, batch, context, dtypes.nbytes(dtype), dtypes.kv_nbytes(kv_dtype or dtype, shape.head_dim),
                    tp)


def _replanner(work: Workload, table: AcceptanceTable, best: Plan, gammas: list[int], mode: str,
               plain: bool, coverage: float, stop: float | str | None) -> Replanner:
    """Mid-run, the choice is the chosen drafter (and draft head, which holds `coverage` of the text's tokens) at
    another length, or (if `plain`) plain decoding; rows stop drafting at `stop`."""

    def at(live: int, context: int) -> Workload:
        return dataclasses.replace(work, batch=live, context=context)

    kv_bytes = strategy_kv_bytes(best.strategy, work)

    return Replanner(
        lambda live, context, alpha, scale: plan(
            at(live, context), _single_rate(best, alpha, mode), budgets=[best.budget] if best.budget else [],
            gammas=gammas, mode=mode,
            strategies=[best.strategy, *(["ar"] if plain else [])],
            rows=1, margin=MIN_PREDICTED_SPEEDUP, spec_time_scale=scale, draft_heads={best.draft_vocab: 1.0}),
        lambda live, context, gamma: round_time(at(live, context), gamma, mode, budget=best.budget,
                                                draft_vocab=best.draft_vocab, draft_kv_bytes=kv_bytes,
                                                selects=best.strategy == "self-vegas"),
        prior=lambda context: table.alpha(best.strategy, best.budget, context, mode) * coverage,
        min_context=(best.budget or 0) + 1,
        planned=(work.batch, work.context),
        plain=plain,
        stop=stop,
    )


def _single_rate(best: Plan, alpha: float, mode: str) -> AcceptanceTable:
    """A table holding one rate for the chosen drafter at every context."""
    table = AcceptanceTable()
    table.add(best.strategy, alpha, budget=best.budget, mode=mode)
    return table


class Replanner(GammaPolicy):
    """`--draft auto`'s per-step draft length for the chosen drafter: the plan at the live batch and mean context,
    corrected by what this run measures.

    Steady state (rows=1): one step's tokens are its rows' mean acceptance; slower rows stay on to be re-planned as
    the batch they leave behind shrinks. Two measurements correct the plan (`observe`, called by the engine after
    every decode round):
    - acceptance: the rate starts at the acceptance table's and moves toward the rounds observed, the
      truncated-geometric estimate of (accepted tokens + PRIOR_TOKENS x table rate) / (accepted + rejections +
      PRIOR_TOKENS), counts decaying by ACCEPTANCE_DECAY a round, so that text which accepts less (sampling, held-out
      books) drafts shorter or not at all;
    - cost: the seconds of recent speculative rounds over the cost model's prediction, relative to the same ratio of
      plain steps, scales the predicted cost of speculation (the model errs differently for the two, e.g. at a batch
      or context the profile did not measure; per-forward overheads weigh most at a few rows; a profile measured
      while memory read faster or slower than it does now), within [MIN_TIME_SCALE, MAX_TIME_SCALE]. So that both
      are known, TIMING_WINDOW rounds of the kind not chosen run early (EXPLORE_FIRST), then now and then
      (EXPLORE_EVERY, and soon after the live batch or either kind's time moves): a plain step costs nothing against
      plain decoding; a one-token draft round, where timings could turn drafting on (a close call), risks a fraction
      of one step.

    Per-row draft lengths priced (`stop="auto"`, `draft_stop`): a row keeps a drafted token while the chance that it
    is accepted pays for it. That chance is learned per bin of the product of the row's draft confidences up to the
    token (`magicdec.drafters.base.confidence`), from what verification kept; the price is the cost model's: one
    more token of one row costs the round's marginal seconds for it (a draft forward and a verified token, less what
    the other rows share), and returns the round's tokens per second, so the token pays where its chance exceeds
    (marginal seconds) x (tokens per second) (`stop_price`). The acceptance rate the draft length is planned with is
    then learned from the rounds in which no row stops (every STOP_EXPLORE-th): the tokens the other rounds draft are
    those their confidence favours, and their rate would plan drafts longer than the rows then draft."""

    def __init__(self, plan_at: Callable[[int, int, float, float], Plan], predict: Callable[[int, int, int], float],
                 prior: Callable[[int], float], min_context: int, planned: tuple[int, int], plain: bool = True,
                 stop: float | str | None = None):
        """`plan_at(live, context, alpha, spec_time_scale)`: the plan of the chosen drafter there (gamma 0: plain
        decoding); `predict(live, context, gamma)`: the cost model's seconds of that round; `prior(context)`: the
        acceptance table's rate; `min_context`: the shortest context planned at (beyond the draft budget); `planned`:
        the (batch, context) `choose` planned at, where `describe_learned` predicts again; `plain`: whether plain
        steps may run (else every round drafts and only the acceptance is learned); `stop`: per-row draft lengths,
        a fixed threshold or "auto" (priced; None: off)."""
        self._plan_at = functools.lru_cache(maxsize=4096)(plan_at)
        self._predict = functools.lru_cache(maxsize=4096)(predict)
        self._prior = prior
        self._min_context = min_context
        self._plain = plain
        self.planned = planned
        self.accepted = 0.0
        self.rejected = 0.0
        # measured / predicted seconds of recent rounds: [plain steps, speculative rounds]; the first round of each
        # kind is left out (first calls allocate and warm up). A draft round after plain steps is timed like any
        # other: the self-speculative drafter copies the entries of the tokens it missed.
        self._slowness = (collections.deque(maxlen=TIMING_WINDOW), collections.deque(maxlen=TIMING_WINDOW))
        self._warm = [False, False]
        self._timed_live: list[int | None] = [None, None]  # live rows when each kind was last timed
        self._since = 0  # rounds of the chosen kind since the other one was last timed
        self._interval = EXPLORE_EVERY
        self._burst: list[bool] = []  # the other kind's rounds timed in this exploration: whether each one's time moved
        self._drafting = True  # the kind the plan chose last
        self._planned: tuple[int, int] = (1, min_context)  # (live, context) of the last call
        self._gamma = 0  # the draft length of the last call
        self.stop = stop
        # per bin of confidence products: drafted tokens verified, and those accepted (decaying by ACCEPTANCE_DECAY
        # each round that reports them)
        self._stop_seen = [0.0] * STOP_BINS
        self._stop_kept = [0.0] * STOP_BINS
        self._stop_rounds = 0

    def alpha(self, context: int) -> float:
        """The acceptance rate planned with at `context`, rounded to 0.01 (plans are cached per rate)."""
        prior = self._prior(max(context, self._min_context))
        rate = (self.accepted + PRIOR_TOKENS * prior) / (self.accepted + self.rejected + PRIOR_TOKENS)
        return round(rate, 2)

    def plan_at(self, live: int, context: int) -> Plan:
        """The plan at `live` rows and `context` with the acceptance learned so far and the cost model's own timings:
        what the cost model predicts for the text being generated (the plan `choose` returned predicted with the
        acceptance table's rate)."""
        context = max(context, self._min_context)
        return self._plan_at(live, context, self.alpha(context), 1.0)

    def _gamma_at(self, live: int, context: int, alpha: float, spec_time_scale: float) -> int:
        return self._plan_at(live, context, alpha, spec_time_scale).gamma

    def spec_time_scale(self) -> float:
        """Measured over predicted seconds of speculative rounds, relative to plain steps (1 until both are
        measured), rounded to 0.05 and kept within [MIN_TIME_SCALE, MAX_TIME_SCALE]."""
        plain, spec = self._slowness
        if not plain or not spec:
            return 1.0
        ratio = statistics.median(spec) / statistics.median(plain)
        return min(MAX_TIME_SCALE, max(MIN_TIME_SCALE, round(ratio * 20) / 20))

    def __call__(self, live: int, mean_context: int) -> int:
        """The draft length at the live batch and mean context (planned at REPLAN_GRANULARITY tokens); 0 where plain
        decoding is predicted faster; now and then the other kind of round, to time it."""
        # Rows with long prompts may finish first; the plan needs a context beyond the sparse budget.
        context = max(mean_context // REPLAN_GRANULARITY * REPLAN_GRANULARITY, self._min_context)
        self._planned = (live, context)
        alpha = self.alpha(context)
        gamma = self._gamma_at(live, context, alpha, self.spec_time_scale())
        if (gamma > 0) != self._drafting:
            self._drafting, self._since, self._interval, self._burst = gamma > 0, 0, EXPLORE_EVERY, []
        timed_live = self._timed_live[not self._drafting]
        if timed_live is not None and abs(live - timed_live) > EXPLORE_MOVED * timed_live:  # the batch moved since
            self._interval = min(self._interval, EXPLORE_EVERY)  # (a server's moves a little most rounds)
        never_timed = timed_live is None
        if self._burst or self._since >= (min(self._interval, EXPLORE_FIRST) if never_timed else self._interval):
            if gamma and self._plain:
                gamma = 0
            elif not gamma and self._gamma_at(live, context, alpha, MIN_TIME_SCALE):  # timings could turn drafting on
                gamma = 1
        self._gamma = gamma
        return gamma

    def draft_stop(self) -> float | None:
        """A fixed `stop` as given; "auto": the lowest bin edge of confidence products above which every bin's
        learned chance of acceptance is at least `stop_price` (at most the top bin's lower edge), or 0 (no row stops,
        its tokens teach the bins and the rate) every STOP_EXPLORE-th round."""
        if self.stop != "auto":
            return self.stop
        if self._exploring():
            return 0.0
        price, edge = self.stop_price(), STOP_BINS - 1
        while edge > 0 and self.stop_chance(edge - 1) >= price:
            edge -= 1
        return edge / STOP_BINS

    def _exploring(self) -> bool:
        """Whether the coming (or, in `observe`, the last) drafting round is one in which no row stops."""
        return self.stop == "auto" and self._stop_rounds % STOP_EXPLORE == STOP_EXPLORE - 1

    def stop_chance(self, b: int) -> float:
        """The learned chance that a drafted token whose confidence product falls in bin b is accepted."""
        prior = (b + 0.5) / STOP_BINS
        return (self._stop_kept[b] + STOP_PRIOR_TOKENS * prior) / (self._stop_seen[b] + STOP_PRIOR_TOKENS)

    def stop_price(self) -> float:
        """The chance of acceptance at which one more drafted token of one row pays for itself at the last call's
        live rows, context and gamma: its marginal seconds (the second difference of the cost model's round time in
        rows and gamma: what a row's token adds that the other rows do not share) times the round's predicted tokens
        per second at the learned acceptance."""
        live, context = self._planned
        gamma = max(self._gamma, 1)

        def extra(rows: int) -> float:  # seconds one more drafted token a row adds to a round of `rows` rows
            return self._predict(rows, context, gamma) - self._predict(rows, context, gamma - 1) if rows else 0.0

        alpha = self.alpha(context)
        tokens = live * sum(alpha**i for i in range(gamma + 1))  # a round's expected tokens
        return max(0.0, extra(live) - extra(live - 1)) * tokens / self._predict(live, context, gamma)

    def observe(self, gamma: int, accepted: Sequence[int], seconds: float,
                drafted: Sequence[int] | None = None, confidences: Sequence[Sequence[float]] | None = None) -> None:
        """A round that drafted `gamma` tokens per row (0: a plain step) in `seconds`; `accepted` holds each live
        row's accepted count, `drafted` its draft's length where rows stop on their own (None: gamma each; a row that
        kept all of a shorter draft met no rejection), and `confidences` its drafted tokens' confidence products."""
        self.accepted *= ACCEPTANCE_DECAY
        self.rejected *= ACCEPTANCE_DECAY
        # priced stops keep the drafts their confidence favours: only the rounds without stops teach the rate
        if gamma and (self.stop != "auto" or self._exploring()):
            self.accepted += sum(accepted)
            self.rejected += sum(1 for k, d in zip(accepted, drafted or [gamma] * len(accepted)) if k < d)
        if confidences is not None and self.stop == "auto":  # a fixed stop has no price to learn
            self._learn_stops(accepted, confidences)
        spec = gamma > 0
        warm, self._warm[spec] = self._warm[spec], True
        if seconds <= 0:  # untimed: the timings and their schedule take no account of it
            return
        window, moved = self._slowness[spec], False
        if warm:
            slowness = seconds / self._predict(*self._planned, gamma)
            moved = bool(window) and abs(slowness / statistics.median(window) - 1) > EXPLORE_MOVED
            window.append(slowness)
            self._timed_live[spec] = self._planned[0]
        if spec == self._drafting:
            self._since += 1
            if moved:  # the chosen kind's time moved (the memory's read rate, say): time the other kind soon
                self._interval = EXPLORE_EVERY
        elif warm:  # the other kind is timed TIMING_WINDOW rounds in a row, beside the chosen kind's recent ones
            self._burst.append(moved)
            if len(self._burst) == TIMING_WINDOW:  # again soon if its time moved, else after twice as many rounds
                self._since = 0
                self._interval = EXPLORE_EVERY if any(self._burst) else min(2 * self._interval, EXPLORE_MOST)
                self._burst = []

    def _learn_stops(self, accepted: Sequence[int], confidences: Sequence[Sequence[float]]) -> None:
        """Each drafted token that was verified counts in its confidence product's bin, as kept where the target
        accepted it (every token before a row's first rejection)."""
        self._stop_rounds += 1
        self._stop_seen = [n * ACCEPTANCE_DECAY for n in self._stop_seen]
        self._stop_kept = [n * ACCEPTANCE_DECAY for n in self._stop_kept]
        for k, products in zip(accepted, confidences):
            for i, product in enumerate(products):
                b = min(int(product * STOP_BINS), STOP_BINS - 1)
                self._stop_seen[b] += 1
                self._stop_kept[b] += i < k


def describe_learned(replanner: Replanner) -> str:
    """One line, after a run: the prediction again, at the shape `choose` planned for, with the acceptance the run
    learned (`Replanner.plan_at`), and the scale its timings put on drafting's cost (`Replanner.spec_time_scale`)."""
    live, context = replanner.planned
    learned = replanner.plan_at(live, context)
    what = f"gamma {learned.gamma}" if learned.strategy != "ar" else "plain decoding"
    return (f"auto at the acceptance this run learned (alpha {replanner.alpha(context):.2f}): {what}, "
            f"{learned.predicted_throughput:.1f} tok/s predicted; draft rounds timed at "
            f"{replanner.spec_time_scale():.2f}x the cost model's, relative to plain steps")


def describe(plan_: Plan) -> str:
    """One line saying what was chosen and why, for logs and `--draft auto`."""
    if plan_.strategy == "ar":
        return (f"auto: autoregressive ({plan_.predicted_throughput:.1f} tok/s predicted with profile "
                f"{plan_.hardware}; speculation does not pay here, step dominated by {plan_.verify_dominant})")
    head = f" draft head {plan_.draft_vocab}" if plan_.draft_vocab else ""
    budget = f" budget {plan_.budget}" if plan_.budget else ""
    close = ("; within the cost model's error of plain decoding: plain until its timings say drafting is faster"
             if plan_.predicted_speedup < MIN_PREDICTED_SPEEDUP else "")  # a close call (`_search`)
    return (f"auto: {plan_.strategy}{budget} gamma {plan_.gamma}{head} "
            f"(alpha {plan_.alpha:.2f}, {plan_.predicted_throughput:.1f} tok/s predicted with profile "
            f"{plan_.hardware}, {plan_.predicted_speedup:.2f}x over AR; verify dominated by "
            f"{plan_.verify_dominant}{close})")


__all__ = ["Choice", "Replanner", "choose", "describe"]
