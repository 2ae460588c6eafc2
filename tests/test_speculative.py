"""Greedy speculative decoding on the default model is lossless: it emits exactly the autoregressive tokens.

One ragged batch of four corpus prompts (40, 150, 400 and 900 tokens) is prefilled once into the KV blocks (the draft
model's K/V too); every run maps its prefill from there, so the expensive prefill is paid once per module. Covered:
every drafter (self-speculation over StreamingLLM and SnapKV, reindexed or not; a standalone draft model - the default
GGUF itself - with a dense, StreamingLLM and SnapKV cache), gamma 1, 3 and 5, budgets below (64) and above (2048) the
prompt lengths, max_tokens 23 (not a multiple of gamma + 1), EOS inside a draft, stop strings, exact max_tokens, a
per-step draft length that changes and drops to plain decoding and back, requests arriving while others decode, slot
reuse, and the LLM API. """

from __future__ import annotations

import pytest
import torch

import magicdec.runner as runner_mod
from conftest import kv_pool, run_engine
from magicdec.drafters import ModelDrafter, SelfSpecDrafter, VegasDrafter
from magicdec.kv.blocks import BLOCK_SIZE, KVManager, block_keys
from magicdec.prefill import cacheable_prefix
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma, GammaPolicy

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
def cache(model) -> KVManager:
    return kv_pool(model, 1 << 31, model.dtype)


@pytest.fixture(scope="module")
def ar(model, prompts, eos, cache):
    """The autoregressive reference: greedy, max_tokens 23, the model's EOS (its prefill fills the cache)."""
    requests, stats = run_engine(model, prompts, SamplingParams(max_tokens=MAX_TOKENS), eos=eos, kv=cache)
    assert stats.gamma == 0 and stats.steps >= MAX_TOKENS - 1
    assert all(cache.cached_prefix(block_keys(p)) == len(p) // 32 for p in prompts)
    return requests


def run(model, prompts, params, eos, cache, drafter=None, gamma=0, **kw):
    return run_engine(model, prompts, params, eos=eos, drafter=drafter, gamma=gamma, kv=cache, **kw)


@pytest.fixture(scope="module")
def draft_model(default_path):
    """The default GGUF loaded a second time, as a standalone draft model (a distinct Transformer)."""
    from magicdec.loading import load_model

    return load_model(default_path, device="cpu", dtype=torch.float32).model


@pytest.fixture(scope="module")
def drafted(model, draft_model, prompts, ar, eos, cache) -> list[int]:
    """The draft model's K/V of the prompts, in their blocks beside the target's: a draft model prefills them once
    here, and every later run's draft model maps them with its prefix hit, as the target does. Returns each prompt's
    blocks a hit then covers."""
    run(model, prompts, SamplingParams(max_tokens=1), eos, cache, ModelDrafter(draft_model, "dense", 64, 1, False), 1)
    return [cacheable_prefix(len(p)) // BLOCK_SIZE for p in prompts]


@pytest.fixture
def draft_hits(monkeypatch, drafted) -> list[int]:
    """The blocks of its hit that each admitted request's draft model found holding its own K/V (the LLM test below
    runs the real draft prefill)."""
    assign = ModelDrafter.assign
    served = []

    def assign_counting(self, slot, n, blocks):
        served.append(n)
        assign(self, slot, n, blocks)

    monkeypatch.setattr(ModelDrafter, "assign", assign_counting)
    return served


def make_drafter(name: str, model, draft_model, gamma: int, budget: int, reindex: bool):
    kind, _, cache = name.partition("-")
    if name == "self-vegas":
        return VegasDrafter(model, budget, gamma)
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
    ("self-vegas", False, 3, 64),
    ("self-vegas", False, 5, 128),
    ("model-dense", False, 3, 64),
    ("model-streaming", True, 5, 64),
    ("model-snapkv", False, 1, 64),
]


@pytest.mark.parametrize(
    "name,reindex,gamma,budget", CASES, ids=[f"{n}-ri{int(r)}-g{g}-b{b}" for n, r, g, b in CASES]
)
def test_greedy_speculative_equals_autoregressive(
    model, draft_model, prompts, ar, eos, cache, drafted, draft_hits, name, reindex, gamma, budget
):
    drafter = make_drafter(name, model, draft_model, gamma, budget, reindex)
    outs, stats = run(model, prompts, SamplingParams(max_tokens=MAX_TOKENS), eos, cache, drafter, gamma)
    for i, (s, a) in enumerate(zip(outs, ar)):
        assert s.output_ids == a.output_ids, f"row {i} (prompt {LENGTHS[i][0]} tokens) differs from AR"
        assert s.finish_reason == a.finish_reason
        if a.finish_reason == "length":
            assert len(s.output_ids) == MAX_TOKENS
    assert stats.gamma == gamma and len(stats.accepted_hist) == gamma + 1
    assert stats.generated_tokens == sum(len(o.output_ids) for o in outs)
    assert sum(sum(o.accepted_hist) for o in outs) == stats.verify_steps
    full = stats.accepted_hist[gamma] / stats.verify_steps
    if name.startswith("model"):
        assert draft_hits == drafted, "the draft prefill was not served"
    if name == "model-dense" or budget >= 2048:
        # the draft sees the target's whole context: it is the target, and (numerics aside) always right
        assert full >= 0.9, stats.accepted_hist
    else:
        # a sparse draft is sometimes wrong: the rounds really rolled back
        assert full < 1.0 and stats.accepted_hist[0] + stats.accepted_hist[1] > 0, stats.accepted_hist


def test_reference_is_nontrivial(ar):
    """The AR reference ran to max_tokens on (at least most) rows, so equality above means something."""
    assert sum(o.finish_reason == "length" and len(o.output_ids) == MAX_TOKENS for o in ar) >= 3
    assert len({tuple(o.output_ids) for o in ar}) == len(ar)


# --- EOS inside a draft -------------------------------------------------------------------------------------------
def pick_eos(ar, gamma: int) -> tuple[int, int, int]:
    """(row, k, token): a token the longest row emits first at position k, where k lands inside a draft
    (not the last draft token nor the bonus) when every draft is accepted: (k - 1) % (gamma + 1) < gamma - 1."""
    row = len(ar) - 1
    ids = ar[row].output_ids
    for k in range(3, len(ids) - 2):
        if (k - 1) % (gamma + 1) < gamma - 1 and ids[k] not in ids[:k]:
            return row, k, ids[k]
    pytest.fail("no suitable EOS stand-in in the AR output")


@pytest.mark.parametrize("name,gamma,budget,stop", [("model-dense", 5, 64, None), ("self-snapkv", 3, 64, None),
                                                    ("self-streaming", 5, 64, 0.3)])
def test_eos_inside_a_draft(monkeypatch, model, draft_model, prompts, ar, cache, draft_hits,
                            name, gamma, budget, stop):
    """An EOS accepted inside a draft ends the request there, as in plain decoding (also where rows stop drafting on
    their own: `stop`)."""
    row, k, tok = pick_eos(ar, gamma)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ar_eos, _ = run(model, prompts, params, [tok], cache)
    rounds = []
    real = runner_mod.accept_drafts

    def record(target, draft, lengths=None):
        n, nxt = real(target, draft, lengths)
        rounds.append((draft.clone(), n.clone()))
        return n, nxt

    monkeypatch.setattr(runner_mod, "accept_drafts", record)
    drafter = make_drafter(name, model, draft_model, gamma, budget, False)
    spec, _ = run(model, prompts, params, [tok], cache, drafter, gamma, draft_stop=stop)
    assert ar_eos[row].output_ids == ar[row].output_ids[: k + 1] and ar_eos[row].finish_reason == "stop"
    for s, a in zip(spec, ar_eos):
        assert s.output_ids == a.output_ids and s.finish_reason == a.finish_reason
        if tok in a.output_ids:
            assert a.output_ids.index(tok) == len(a.output_ids) - 1 and a.finish_reason == "stop"
    if name == "model-dense":
        # the EOS really was accepted inside a draft with more drafted tokens after it, which were dropped
        assert any((d[i, : n[i]] == tok).any() and int((d[i] == tok).nonzero()[0]) < gamma - 1
                   for d, n in rounds for i in range(len(n))), "the EOS never landed inside an accepted draft"


# --- stop strings -----------------------------------------------------------------------------------------------
def test_stop_string_mid_round(model, prompts, ar, eos, cache, default_model):
    tok = default_model.tokenizer
    row = 2
    ids = ar[row].output_ids
    # a stop string completed by a token in the middle of the output: the text of tokens 9..10
    stop = tok.decode(ids[9:11]).strip()
    assert stop and stop not in tok.decode(ids[:9])
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,))
    ar_stop, _ = run(model, prompts, params, eos, cache, tokenizer=tok)
    spec, _ = run(model, prompts, params, eos, cache, SelfSpecDrafter(model, "streaming", 64, 3, True), 3, tokenizer=tok)
    for s, a, full in zip(spec, ar_stop, ar):
        assert s.output_ids == a.output_ids and s.finish_reason == a.finish_reason
        assert full.output_ids[: len(a.output_ids)] == a.output_ids
    out = spec[row].output_ids
    assert spec[row].finish_reason == "stop" and len(out) <= 11
    assert stop in tok.decode(out) and stop not in tok.decode(out[:-1])  # cut at the completing token


# --- max_tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_exact_when_a_round_overshoots(model, draft_model, prompts, ar, eos, cache,
                                                  draft_hits, max_tokens):
    """gamma 5 with an always-right draft emits 6 tokens a round: the output must still stop at max_tokens."""
    drafter = ModelDrafter(draft_model, "dense", 64, 5, False)
    outs, stats = run(model, prompts, SamplingParams(max_tokens=max_tokens), eos, cache, drafter, 5)
    for s, a in zip(outs, ar):
        assert len(a.output_ids) >= max_tokens and eos[0] not in a.output_ids[:max_tokens]
        assert s.output_ids == a.output_ids[:max_tokens]
        assert s.finish_reason == "length" and len(s.output_ids) == max_tokens
    assert stats.steps == {1: 0, 2: 1}.get(max_tokens, stats.steps) and stats.steps <= max_tokens - 1


# --- a draft length chosen per step ------------------------------------------------------------------------------
def test_per_step_draft_length_switches_to_plain_and_back(model, prompts, ar, eos, cache):
    """A policy changing the draft length every step, down to plain decoding and back (the draft cache then
    catches up on the tokens it missed, also more than its ring slack), keeps the outputs those of AR."""
    schedule = [3, 0, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 2, 4]  # 9 is capped to gamma 5; 8 plain rounds > the ring slack
    calls = []

    class Policy(GammaPolicy):
        def __call__(self, live: int, context: int) -> int:
            calls.append((live, context))
            return schedule[min(len(calls) - 1, len(schedule) - 1)]

    drafter = SelfSpecDrafter(model, "streaming", 64, 5, True)
    outs, stats = run(model, prompts, SamplingParams(max_tokens=MAX_TOKENS), eos, cache, drafter, policy=Policy())
    assert [o.output_ids for o in outs] == [a.output_ids for a in ar]
    assert [g for _, g in stats.gamma_changes][:6] == [3, 0, 1, 5, 0, 2]
    assert calls[0] == (4, sum(n for n, _ in LENGTHS) // 4) and calls[1][1] > calls[0][1]  # contexts grow
    gammas = [min(schedule[min(i, len(schedule) - 1)], 5) for i in range(len(calls))]
    assert stats.drafted_tokens == sum(g * live for g, (live, _) in zip(gammas, calls))
    assert 0 < stats.acceptance_rate <= 1 and len(stats.accepted_hist) == 6


# --- continuous batching ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 2])
def test_arrivals_mid_decoding_and_slot_reuse(model, prompts, ar, eos, cache, slots):
    """Requests arriving while others decode, queued for a free slot, and slots reused after a finished
    request: every output equals its AR reference, with speculation on."""
    drafter = SelfSpecDrafter(model, "snapkv", 64, 3, True)
    outs, stats = run(model, prompts, SamplingParams(max_tokens=MAX_TOKENS), eos, cache, drafter, 3, slots=slots,
                      arrivals=[0, 4, 5, 11])
    assert [o.output_ids for o in outs] == [a.output_ids for a in ar]
    assert stats.max_batch == slots


def test_requests_move_down_into_free_slots(model, prompts, ar, eos, cache):
    """A request that finishes early frees a low slot; with nothing waiting, the highest running request
    moves into it (tokens, sampling, target and draft caches) and the rounds decode fewer rows. Outputs
    stay those of AR, and a seeded sampled request gives the tokens it gives alone."""
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine
    from magicdec.speculative import Speculation

    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=5)
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=MAX_TOKENS), sampled,
              SamplingParams(max_tokens=MAX_TOKENS)]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=900 + MAX_TOKENS), eos_ids=eos,
                       kv=cache,
                       speculation=Speculation(SelfSpecDrafter(model, "streaming", 64, 3, True), FixedGamma(3)))
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    outs = engine.generate(prompts, params)
    moved = [i for i, s in enumerate(steps) if s.moves]
    assert moved and steps[moved[0]].moves == [(3, 0)]
    assert steps[moved[0] - 1].n_rows == 4 and steps[moved[0]].n_rows < 4
    assert outs[0].output_ids == ar[0].output_ids[:3]
    assert [outs[i].output_ids for i in (1, 3)] == [ar[i].output_ids for i in (1, 3)]
    alone, _ = run(model, [prompts[2]], sampled, eos, cache)
    assert outs[2].output_ids == alone[0].output_ids


def test_chunked_prefill_interleaves_with_decoding(model, prompts, eos):
    """A long prompt arriving while a request decodes is prefilled in chunks, and the running request keeps
    producing a token every step meanwhile; outputs are unchanged by the chunking."""
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine

    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=900 + MAX_TOKENS, prefill_chunk=128,
                                           max_prefill_tokens=128), eos_ids=eos)
    short = engine.add_request("short", prompts[0], params)
    engine.step()  # the short prompt (40 tokens) prefills in one step
    long = engine.add_request("long", prompts[3], params)
    gained = []
    while long.first_token_time is None:
        before = len(short.output_ids)
        engine.step()
        gained.append(len(short.output_ids) - before)
    assert len(gained) >= 900 // 128 and all(g == 1 for g in gained[:-1])
    while engine.has_unfinished():
        engine.step()
    alone, _ = run_engine(model, [prompts[3]], params, eos=eos)
    assert long.output_ids == alone[0].output_ids


def test_abort_frees_the_slot(model, prompts, eos):
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine

    params = SamplingParams(max_tokens=MAX_TOKENS)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=200 + MAX_TOKENS), eos_ids=eos)
    first = engine.add_request("a", prompts[1], params)
    second = engine.add_request("b", prompts[0], params)
    engine.step()
    engine.step()
    engine.abort_request("a")
    while engine.has_unfinished():
        engine.step()
    assert first.finish_reason == "abort" and 1 <= len(first.output_ids) < MAX_TOKENS
    alone, _ = run_engine(model, [prompts[0]], params, eos=eos)
    assert second.output_ids == alone[0].output_ids and engine.scheduler.slots == [None]


# --- through the LLM API: real draft prefill, SpeculativeConfig ----------------------------------------------------
def test_llm_speculative_matches_plain(llm, default_path, corpus_prompt):
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


def test_seeded_sampling_alone_equals_in_a_crowd_with_speculation(llm, corpus_prompt):
    """A seeded sampled request gives the same tokens alone, among others, and with speculation on."""
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(n, book=b, at=0.3) for n, b in ((200, 4), (60, 5), (130, 6))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=ids[:1], params=params)[0].token_ids
    crowd = llm.generate(prompt_token_ids=ids, params=params)
    spec = llm.generate(prompt_token_ids=ids, params=params, speculative=SpeculativeConfig("self-streaming", 64, 3))
    assert crowd[0].token_ids == alone and spec[0].token_ids == alone
    assert [s.token_ids for s in spec] == [c.token_ids for c in crowd]
    assert llm.last_stats.verify_steps > 0


# --- SpeculativeConfig("auto"): the LLM plans it at the shape it runs ----------------------------------------------
def test_auto_settings_are_checked(llm):
    from magicdec.errors import InvalidRequestError
    from magicdec.speculative import SpeculativeConfig

    with pytest.raises(InvalidRequestError, match="unknown mode 'beam'"):
        SpeculativeConfig("auto", mode="beam")
    with pytest.raises(InvalidRequestError, match="what draft 'auto' plans with"):
        SpeculativeConfig("self-streaming", hardware="h200")
    with pytest.raises(InvalidRequestError, match="let LLM resolve it"):
        SpeculativeConfig("auto").build(llm.model)
    with pytest.raises(InvalidRequestError, match="only 'auto' is planned"):
        llm.plan(SpeculativeConfig("self-streaming"), [[5, 6, 7]])
    with pytest.raises(InvalidRequestError, match="unknown hardware profile 'nosuch'"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], speculative=SpeculativeConfig("auto", hardware="nosuch"))


def test_auto_drafts_where_it_pays_with_plain_decodings_tokens(llm, corpus_prompt, kv_bound_profile):
    """On a profile where drafting pays, `generate` plans for its prompts (as `plan` says beforehand), drafts with the
    re-planner and gives plain decoding's tokens; the engine plans for its slots at its longest request. The same
    setting over prompts too short for any draft budget decodes plainly: what a shape resolved to is not reused for
    another."""
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(n, book=b, at=0.45) for n, b in ((300, 0), (340, 1), (280, 2))]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=ids, params=params)
    auto = SpeculativeConfig("auto", hardware=kv_bound_profile)
    planned = llm.plan(auto, ids, params)
    spec = llm.generate(prompt_token_ids=ids, params=params, speculative=auto)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    chosen = llm.last_auto
    assert chosen.speculative.draft.startswith("self-") and chosen.plan == planned.plan
    assert chosen.replanner.planned == (3, 340 + MAX_TOKENS // 2) and llm.last_stats.verify_steps > 0
    llm.engine(auto, max_num_seqs=2, max_model_len=1024)
    assert llm.last_auto.replanner.planned == (2, 1024)
    llm.generate(prompt_token_ids=[p[:20] for p in ids], params=params, speculative=auto)
    assert llm.last_auto.speculative is None and llm.last_stats.verify_steps == 0


def test_auto_settles_a_close_call_by_timing_with_plain_decodings_tokens(llm, corpus_prompt):
    """One sequence at 1k on the CPU preset: drafting is predicted slower than plain decoding, but within what timings
    can correct, so `auto` builds the drafter, starts plain, times draft rounds after EXPLORE_FIRST plain steps, and
    gives plain decoding's tokens whatever it then chooses."""
    from magicdec.autoplan import EXPLORE_FIRST, MIN_PREDICTED_SPEEDUP
    from magicdec.speculative import SpeculativeConfig

    ids = [corpus_prompt(1000, book=1, at=0.3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=ids, params=params)
    spec = llm.generate(prompt_token_ids=ids, params=params,
                        speculative=SpeculativeConfig("auto", hardware="cpu-amx-2t-fp32"))
    chosen, stats = llm.last_auto, llm.last_stats
    assert chosen.speculative is not None and chosen.plan.predicted_speedup < MIN_PREDICTED_SPEEDUP
    assert stats.verify_steps > 0 and stats.gamma_changes[0] == (0, 0) and stats.gamma_changes[1][0] == EXPLORE_FIRST
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def test_auto_decodes_plainly_where_drafting_does_not_pay(llm, corpus_prompt):
    """On a machine whose linear layers are compute-bound and whose attention costs nothing, verifying drafts costs
    what decoding them would: `auto` plans plain decoding and drafts nothing."""
    from magicdec.planner import HardwareProfile
    from magicdec.speculative import SpeculativeConfig

    compute_bound = HardwareProfile(name="compute-bound", flops_per_s=1e12, mem_bandwidth=1e15, mem_bytes=8e9,
                                    linear_rates=((1, 8e10), (8, 1e10)), attention_rates=((1, 1e15), (8, 1e15)))
    ids = [corpus_prompt(n, book=b, at=0.45) for n, b in ((300, 0), (340, 1))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3)
    plain = llm.generate(prompt_token_ids=ids, params=params)
    spec = llm.generate(prompt_token_ids=ids, params=params,
                        speculative=SpeculativeConfig("auto", hardware=compute_bound, mode="sampling"))
    assert llm.last_auto.speculative is None and llm.last_auto.plan.strategy == "ar"
    assert llm.last_stats.verify_steps == 0 and [s.token_ids for s in spec] == [p.token_ids for p in plain]
