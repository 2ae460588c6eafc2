"""Greedy speculative decoding on the default model is lossless: it emits exactly the autoregressive tokens.

One ragged batch of four corpus prompts (40, 150, 400 and 900 tokens) is prefilled once; every decode runs
on a fresh copy of that prefilled cache (the normal path, finished rows are dropped), so the expensive
prefill is paid once per module. Covered: every drafter (self-speculation over StreamingLLM and SnapKV,
reindexed or not; a standalone draft model - the default GGUF itself - with a dense, StreamingLLM and
SnapKV cache), gamma 1, 3 and 5, budgets below (64) and above (2048) the prompt lengths, max_tokens 23
(not a multiple of gamma + 1), EOS inside a draft, stop strings, exact max_tokens, and the engine API.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import magicdec.decode as decode_mod
from magicdec.decode import StopStrings, decode, prefill_prompts
from magicdec.drafters import ModelDrafter, SelfSpecDrafter
from magicdec.sampling import SamplingParams

MAX_TOKENS = 23
LENGTHS = ((40, 11), (150, 12), (400, 13), (900, 3))  # (prompt tokens, book)


@pytest.fixture(scope="module")
def model(default_model):
    return default_model.model


@pytest.fixture(scope="module")
def eos(default_model) -> tuple[int, ...]:
    return tuple(default_model.tokenizer.eos_ids)


@pytest.fixture(scope="module")
def prompts(corpus_prompt) -> list[list[int]]:
    return [corpus_prompt(n, book=b, at=0.55) for n, b in LENGTHS]


@pytest.fixture(scope="module")
def pre(model, prompts):
    """The batch prefilled once (with the attention SnapKV needs); never decoded itself, only copied."""
    return prefill_prompts(model, prompts, MAX_TOKENS, observe=True)


def fresh(pre):
    """An independent copy of a Prefilled: decoding mutates (and row-selects) the target cache."""
    cache = copy.copy(pre.cache)
    for name in ("k", "v", "lens", "next_pos"):
        setattr(cache, name, getattr(pre.cache, name).clone())
    return dataclasses.replace(pre, cache=cache, logits=pre.logits.clone())


@pytest.fixture(scope="module")
def ar(model, pre, eos):
    """The autoregressive reference: greedy, max_tokens 23, the model's EOS."""
    outs, stats = decode(model, fresh(pre), SamplingParams(max_tokens=MAX_TOKENS), eos)
    assert stats.gamma == 0 and stats.steps >= MAX_TOKENS - 1
    return outs


@pytest.fixture(scope="module")
def draft_model(default_path):
    """The default GGUF loaded a second time, as a standalone draft model (a distinct Transformer)."""
    from magicdec.loading import load_model

    return load_model(default_path, device="cpu", dtype=torch.float32).model


@pytest.fixture
def draft_prefill_reuses_target_prefill(monkeypatch, pre, draft_model):
    """The draft model has the target's weights, so its dense prefill of the batch is the target's prefill
    (bit for bit: same weights, same chunking; K/V, logits and SnapKV scores were checked equal): serve it
    from `pre` instead of recomputing ~3.6k padded tokens per test. The engine test below runs the real
    draft prefill, and the model-dense case checks that almost every draft is accepted."""
    real = decode_mod.prefill
    served = []

    def prefill(model, cache, tokens, lens, chunk, progress=None, observer=None):
        if model is draft_model and torch.equal(tokens, pre.tokens) and torch.equal(lens, pre.lens):
            src = pre.cache
            cache.k[:, :, :, : src.capacity] = src.k
            cache.v[:, :, :, : src.capacity] = src.v
            cache.lens, cache.next_pos, cache.max_len = src.lens.clone(), src.next_pos.clone(), src.max_len
            if observer is not None:
                observer.scores = list(pre.observer.scores)
            served.append(cache)
            return pre.logits.clone()
        return real(model, cache, tokens, lens, chunk, progress, observer)

    monkeypatch.setattr(decode_mod, "prefill", prefill)
    return served


def make_drafter(name: str, model, draft_model, gamma: int, budget: int, reindex: bool):
    kind, _, cache = name.partition("-")
    if kind == "self":
        return SelfSpecDrafter(model, cache, budget, gamma, reindex)
    return ModelDrafter(draft_model, cache, budget, gamma, reindex)


# (drafter, reindex, gamma, budget): every drafter, every gamma, both budget regimes, both position schemes
CASES = [
    ("self-streaming", True, 1, 64),
    ("self-streaming", True, 5, 2048),
    ("self-streaming", False, 3, 64),
    ("self-snapkv", False, 5, 64),
    ("self-snapkv", False, 1, 2048),
    ("self-snapkv", True, 3, 64),
    ("model-dense", False, 3, 64),
    ("model-streaming", True, 5, 64),
    ("model-snapkv", False, 1, 64),
]


@pytest.mark.parametrize(
    "name,reindex,gamma,budget", CASES, ids=[f"{n}-ri{int(r)}-g{g}-b{b}" for n, r, g, b in CASES]
)
def test_greedy_speculative_equals_autoregressive(
    model, draft_model, pre, ar, eos, draft_prefill_reuses_target_prefill, name, reindex, gamma, budget
):
    drafter = make_drafter(name, model, draft_model, gamma, budget, reindex)
    outs, stats = decode(model, fresh(pre), SamplingParams(max_tokens=MAX_TOKENS), eos, drafter=drafter, gamma=gamma)
    for i, (s, a) in enumerate(zip(outs, ar)):
        assert s.token_ids == a.token_ids, f"row {i} (prompt {LENGTHS[i][0]} tokens) differs from AR"
        assert s.finish_reason == a.finish_reason
        if a.finish_reason == "length":
            assert len(s.token_ids) == MAX_TOKENS
    assert stats.gamma == gamma and len(stats.accepted_hist) == gamma + 1
    assert stats.generated_tokens == sum(len(o.token_ids) for o in outs)
    full = stats.accepted_hist[gamma] / stats.verify_steps
    if name.startswith("model"):
        assert draft_prefill_reuses_target_prefill, "the draft prefill was not served"
    if name == "model-dense" or budget >= 2048:
        # the draft sees the target's whole context: it is the target, and (numerics aside) always right
        assert full >= 0.9, stats.accepted_hist
    else:
        # a sparse draft is sometimes wrong: the rounds really rolled back
        assert full < 1.0 and stats.accepted_hist[0] + stats.accepted_hist[1] > 0, stats.accepted_hist


def test_reference_is_nontrivial(ar):
    """The AR reference ran to max_tokens on (at least most) rows, so equality above means something."""
    assert sum(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in ar) >= 3
    assert len({tuple(o.token_ids) for o in ar}) == len(ar)


# --- EOS inside a draft -------------------------------------------------------------------------------------------
def pick_eos(ar, gamma: int) -> tuple[int, int, int]:
    """(row, k, token): a token the longest row emits first at position k, where k lands inside a draft
    (not the last draft token nor the bonus) when every draft is accepted: (k - 1) % (gamma + 1) < gamma - 1."""
    row = len(ar) - 1
    ids = ar[row].token_ids
    for k in range(3, len(ids) - 2):
        if (k - 1) % (gamma + 1) < gamma - 1 and ids[k] not in ids[:k]:
            return row, k, ids[k]
    pytest.fail("no suitable EOS stand-in in the AR output")


@pytest.mark.parametrize("name,gamma,budget", [("model-dense", 5, 64), ("self-snapkv", 3, 64)])
def test_eos_inside_a_draft(model, draft_model, pre, ar, draft_prefill_reuses_target_prefill, name, gamma, budget):
    row, k, tok = pick_eos(ar, gamma)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ar_eos, _ = decode(model, fresh(pre), params, [tok])
    drafter = make_drafter(name, model, draft_model, gamma, budget, False)
    rounds = []
    accept = drafter.accept

    def record(n, nxt, live):
        rounds.append((drafter.drafted.clone(), n.clone(), live.clone()))
        accept(n, nxt, live)

    drafter.accept = record
    spec, _ = decode(model, fresh(pre), params, [tok], drafter=drafter, gamma=gamma)
    assert ar_eos[row].token_ids == ar[row].token_ids[: k + 1] and ar_eos[row].finish_reason == "stop"
    for s, a in zip(spec, ar_eos):
        assert s.token_ids == a.token_ids and s.finish_reason == a.finish_reason
        if tok in a.token_ids:
            assert a.token_ids.index(tok) == len(a.token_ids) - 1 and a.finish_reason == "stop"
    if name == "model-dense":
        # the EOS really was accepted inside a draft with more drafted tokens after it, which were dropped
        assert any(
            (d[i, : n[i]] == tok).any() and int((d[i] == tok).nonzero()[0]) < gamma - 1
            for d, n, live in rounds for i in range(len(n)) if live[i]
        ), "the EOS never landed inside an accepted draft"


# --- stop strings -----------------------------------------------------------------------------------------------
def test_stop_string_mid_round(model, draft_model, pre, ar, eos, default_model):
    tok = default_model.tokenizer
    row = 2
    ids = ar[row].token_ids
    # a stop string completed by a token in the middle of the output: the text of tokens 9..10
    stop = tok.decode(ids[9:11]).strip()
    assert stop and stop not in tok.decode(ids[:9])
    stops = StopStrings((stop,), tok.decode)
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,))
    ar_stop, _ = decode(model, fresh(pre), params, eos, stop_strings=stops)
    gamma = 3
    drafter = SelfSpecDrafter(model, "streaming", 64, gamma, True)
    spec, _ = decode(model, fresh(pre), params, eos, drafter=drafter, gamma=gamma, stop_strings=stops)
    for s, a, full in zip(spec, ar_stop, ar):
        assert s.token_ids == a.token_ids and s.finish_reason == a.finish_reason
        assert full.token_ids[: len(a.token_ids)] == a.token_ids
    out = spec[row].token_ids
    assert spec[row].finish_reason == "stop" and len(out) <= 11
    assert stop in tok.decode(out) and stop not in tok.decode(out[:-1])  # cut at the completing token


# --- max_tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_exact_when_a_round_overshoots(model, draft_model, pre, ar, eos, draft_prefill_reuses_target_prefill,
                                                  max_tokens):
    """gamma 5 with an always-right draft emits 6 tokens a round: the output must still stop at max_tokens."""
    drafter = ModelDrafter(draft_model, "dense", 64, 5, False)
    outs, stats = decode(model, fresh(pre), SamplingParams(max_tokens=max_tokens), eos, drafter=drafter, gamma=5)
    for s, a in zip(outs, ar):
        assert len(a.token_ids) >= max_tokens and eos[0] not in a.token_ids[: max_tokens]
        assert s.token_ids == a.token_ids[:max_tokens]
        assert s.finish_reason == "length" and len(s.token_ids) == max_tokens
    assert stats.steps == {1: 0, 2: 1}.get(max_tokens, stats.steps) and stats.steps <= max_tokens - 1


def test_replanned_gamma_keeps_outputs_and_counts_drafts(llm, corpus_prompt):
    """A re-planner changing the draft length every REPLAN_EVERY rounds (as `--draft auto` does while
    the batch shrinks and contexts grow) leaves greedy outputs those of plain decoding."""
    from magicdec.decode import REPLAN_EVERY
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(n, book=b, at=0.6) for n, b in ((300, 3), (80, 4), (150, 5))]
    params = SamplingParams(max_tokens=160, ignore_eos=True)  # enough for three re-plans
    plain = llm.generate(prompt_token_ids=ids, params=params)
    calls = []

    def replan(live: int, context: int) -> int:
        calls.append((live, context))
        return (1, 4, 2, 9)[min(len(calls) - 1, 3)]  # 9 is clamped to the drafter's gamma, 5

    cfg = SpeculativeConfig("self-streaming", budget=64, gamma=5, replan=replan)
    spec = llm.generate(prompt_token_ids=ids, params=params, speculative=cfg)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    stats = llm.last_stats
    assert stats.gamma_changes[:3] == [(0, 1), (REPLAN_EVERY, 4), (2 * REPLAN_EVERY, 2)]
    assert calls[0][0] == 3 and all(1 <= live <= 3 for live, _ in calls)  # rows finish at their own pace
    assert calls[0][1] == (300 + 80 + 150) // 3 and calls[1][1] > calls[0][1]  # contexts grow
    assert len(stats.accepted_hist) == 6 and 0 < stats.acceptance_rate <= 1


def test_replanner_can_end_speculation(llm, corpus_prompt):
    """A re-planner returning 0 switches the run to plain decoding for good; outputs do not change."""
    from magicdec.decode import REPLAN_EVERY
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(n, book=b, at=0.4) for n, b in ((200, 6), (90, 7))]
    params = SamplingParams(max_tokens=3 * REPLAN_EVERY * 2, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=ids, params=params)
    calls = []

    def replan(live: int, context: int) -> int:
        calls.append(live)
        return 3 if len(calls) == 1 else 0

    cfg = SpeculativeConfig("self-streaming", budget=64, gamma=3, replan=replan)
    spec = llm.generate(prompt_token_ids=ids, params=params, speculative=cfg)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    stats = llm.last_stats
    assert stats.gamma_changes == [(0, 3), (REPLAN_EVERY, 0)]
    assert len(calls) == 2  # no re-planning once speculation has ended
    assert stats.verify_steps == 2 * REPLAN_EVERY  # speculative rounds: the first REPLAN_EVERY, both rows
    assert stats.drafted_tokens == 3 * 2 * REPLAN_EVERY
    assert stats.steps > REPLAN_EVERY
    from magicdec.cli import format_stats

    assert f"gamma 3 from round 0, none (plain decoding) from round {REPLAN_EVERY} (re-planned)" in format_stats(stats, "x")


# --- through the engine: real draft prefill, SpeculativeConfig --------------------------------------------------
def test_engine_speculative_matches_plain(llm, default_path, corpus_prompt):
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(n, book=b, at=0.35) for n, b in ((120, 0), (45, 1), (90, 2))]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    plain = llm.generate(prompt_token_ids=ids, params=params)
    for cfg in (
        SpeculativeConfig("model", draft_model=str(default_path), draft_cache="dense", gamma=3, budget=64),
        SpeculativeConfig("model", draft_model=str(default_path), draft_cache="snapkv", gamma=2, budget=64),
    ):
        spec = llm.generate(prompt_token_ids=ids, params=params, speculative=cfg)
        for s, p in zip(spec, plain):
            assert (s.token_ids, s.text, s.finish_reason) == (p.token_ids, p.text, p.finish_reason), cfg
        stats = llm.last_stats
        assert stats.gamma == cfg.gamma and stats.verify_steps > 0
        if cfg.draft_cache == "dense":  # the draft is the target with its whole context
            assert stats.accepted_hist[cfg.gamma] >= 0.9 * stats.verify_steps, stats.accepted_hist
