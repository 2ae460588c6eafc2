"""The engine's plain decoding: greedy parity with transformers, batch invariance, stopping rules, sampling,
the prompt cache, exact speculation over 16-bit caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import run_engine
from magicdec import engine as engine_module
from magicdec import kernels
from magicdec.drafters import SelfSpecDrafter
from magicdec.engine import LLM
from magicdec.runner import ModelRunner
from magicdec.sampling import SamplingParams

EOS = (2,)  # <|im_end|>, the default model's EOS
NEW = 32


@pytest.fixture(scope="module")
def long_prompts(corpus_prompt):
    """Three real prompts of different lengths, from different books."""
    return [corpus_prompt(n, book=b, at=0.5) for n, b in ((1100, 5), (170, 6), (600, 7))]


@pytest.fixture(scope="module")
def batch_greedy(default_model, long_prompts):
    """Our greedy output for the three prompts decoded together in one ragged batch."""
    return run_engine(default_model.model, long_prompts, SamplingParams(max_tokens=NEW), eos=EOS, prefill_chunk=256)


@pytest.fixture(scope="module")
def short_prompts(corpus_prompt):
    return [corpus_prompt(n, book=b, at=0.3) for n, b in ((40, 8), (90, 9), (25, 10))]


@pytest.fixture(scope="module")
def free_run(default_model, short_prompts):
    """16 greedy tokens per short prompt with no EOS at all (the reference for the stopping tests)."""
    outs, _ = run_engine(default_model.model, short_prompts, SamplingParams(max_tokens=16))
    assert all(o.finish_reason == "length" and len(o.output_ids) == 16 for o in outs)
    return [o.output_ids for o in outs]


def run(default_model, prompts, eos=(), **params):
    return run_engine(default_model.model, prompts, SamplingParams(**params), eos=eos,
                      tokenizer=default_model.tokenizer)[0]


# --- greedy parity -----------------------------------------------------------------------------------------
def test_greedy_batch_matches_transformers_generate(batch_greedy, long_prompts, hf_model):
    outs, stats = batch_greedy
    assert stats.requests == 3 and stats.max_batch == 3 and stats.prompt_tokens == sum(map(len, long_prompts))
    for out, prompt in zip(outs, long_prompts):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=NEW, do_sample=False, eos_token_id=EOS[0], pad_token_id=EOS[0])
        want = ref[0, len(prompt):].tolist()
        assert out.output_ids == want
        assert out.finish_reason == ("stop" if want[-1] in EOS else "length")
    assert stats.generated_tokens == sum(len(o.output_ids) for o in outs)
    assert stats.decode_tokens == stats.generated_tokens - 3  # each first token comes from the prefill


@pytest.mark.parametrize("chunk", [4, 512])
def test_tiny_model_ragged_greedy_matches_transformers(tiny_llama, chunk):
    """Ragged lengths down to a 1-token prompt (no observation window), EOS possible, small prefill chunks."""
    loaded, ref = tiny_llama
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 5, 40, 33)]
    outs, _ = run_engine(loaded.model, prompts, SamplingParams(max_tokens=20), eos=EOS, prefill_chunk=chunk)
    for out, prompt in zip(outs, prompts):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, do_sample=False, eos_token_id=EOS[0], pad_token_id=0)
        want = want[0, len(prompt):].tolist()
        assert out.output_ids == want
        assert out.finish_reason == ("stop" if want[-1] == EOS[0] else "length")


def test_repeated_prompts_are_prefilled_once(tiny_llama, monkeypatch):
    """With prefix caching, repeats of a prompt in one batch wait for its prefill and copy its blocks (as `--n`
    runs): each repeat computes only its last partial block and observation window, and gives the same tokens as
    prefilling each."""
    import magicdec.prefill as prefill_mod

    model = tiny_llama[0].model
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (100, 25)]
    rows = [prompts[0]] * 3 + [prompts[1]] + [prompts[0]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    separate, _ = run_engine(model, rows, params)
    computed = []
    real = prefill_mod.prefill_chunk
    monkeypatch.setattr(prefill_mod, "prefill_chunk",
                        lambda m, row, prompt, start, end, *a: computed.append(end - start) or real(m, row, prompt, start, end, *a))
    shared, stats = run_engine(model, rows, params, caching=True, prefill_chunk=16)
    # 100 + 25 tokens computed once; each of the three repeats copies 64 tokens (two blocks) and computes 36
    assert sum(computed) == 100 + 25 + 3 * 36 and stats.cached_tokens == 3 * 64
    assert [o.output_ids for o in shared] == [o.output_ids for o in separate]


def test_batch_invariance(default_model, batch_greedy, long_prompts):
    """Each sequence's greedy tokens alone equal its tokens in the ragged batch (and in another order)."""
    batch_outs, _ = batch_greedy
    for i in (1, 2):
        alone = run(default_model, [long_prompts[i]], EOS, max_tokens=24)[0]
        assert alone.output_ids == batch_outs[i].output_ids[:24]
    swapped = run(default_model, [long_prompts[2], long_prompts[1]], EOS, max_tokens=24)
    assert [o.output_ids for o in swapped] == [batch_outs[2].output_ids[:24], batch_outs[1].output_ids[:24]]


# --- stopping rules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_exact_per_sequence(default_model, short_prompts, free_run, max_tokens):
    outs = run(default_model, short_prompts, max_tokens=max_tokens, ignore_eos=True)
    for out, ref in zip(outs, free_run):
        assert out.finish_reason == "length"
        assert out.output_ids == ref[:max_tokens]


def test_eos_stops_each_row_independently(default_model, short_prompts, free_run):
    """Declare as EOS a token row 0 emits but row 1 never does: row 0 stops there, row 1 runs to length."""
    candidates = [t for t in free_run[0][3:] if t not in free_run[1]]
    assert candidates, "the free runs share every token; pick other prompts"
    eos = candidates[0]
    outs = run(default_model, short_prompts, (eos,), max_tokens=16)
    for out, ref in zip(outs, free_run):
        if eos in ref:
            cut = ref.index(eos) + 1
            assert out.output_ids == ref[:cut] and out.finish_reason == "stop"  # EOS is kept, like HF
        else:
            assert out.output_ids == ref and out.finish_reason == "length"
    assert outs[0].finish_reason == "stop" and outs[1].finish_reason == "length"

    ignored = run(default_model, short_prompts, (eos,), max_tokens=16, ignore_eos=True)
    assert [o.output_ids for o in ignored] == free_run and all(o.finish_reason == "length" for o in ignored)


def test_eos_as_first_token(default_model, short_prompts, free_run):
    """A sequence whose very first token (from prefill) is EOS has exactly that one token."""
    eos = free_run[2][0]
    outs = run(default_model, short_prompts, (eos,), max_tokens=16)
    assert outs[2].output_ids == [eos] and outs[2].finish_reason == "stop"
    for out, ref in zip(outs[:2], free_run[:2]):
        assert out.output_ids == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def test_stop_string_ends_at_the_completing_token(default_model, short_prompts, free_run):
    decode = default_model.tokenizer.decode
    text0 = decode(free_run[0])
    stop = text0[len(decode(free_run[0][:6])):][:3]  # three characters that appear after token 6 of row 0
    assert stop.strip(), f"unsuitable stop string {stop!r}"
    outs = run(default_model, short_prompts, max_tokens=16, stop=(stop,))
    for out, ref in zip(outs, free_run):
        # reference: the shortest prefix whose text contains the stop string
        n = next((k for k in range(1, len(ref) + 1) if stop in decode(ref[:k])), None)
        if n is None:
            assert out.output_ids == ref and out.finish_reason == "length"
        else:
            assert out.output_ids == ref[:n] and out.finish_reason == "stop"
    assert outs[0].finish_reason == "stop"


# --- sampling ----------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(default_model, short_prompts):
    kw = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, ignore_eos=True)
    a = [o.output_ids for o in run(default_model, short_prompts, seed=1234, **kw)]
    b = [o.output_ids for o in run(default_model, short_prompts, seed=1234, **kw)]
    c = [o.output_ids for o in run(default_model, short_prompts, seed=4321, **kw)]
    assert a == b
    assert a != c
    assert all(len(x) == 12 for x in a)


def test_top_k_1_sampling_is_greedy(default_model, short_prompts, free_run):
    outs = run(default_model, short_prompts, max_tokens=8, temperature=1.5, top_k=1, seed=5, ignore_eos=True)
    assert [o.output_ids for o in outs] == [r[:8] for r in free_run]


# --- bf16 KV cache -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp32-bf16-kv", "bf16-int8-kv"])
def test_speculation_equals_plain_decoding_token_for_token(dtype, default_model, default_model_bf16, short_prompts):
    """The README's claim for 16-bit and int8 caches: a verification forward computes the one-token steps' logits bit
    for bit, so greedy and seeded sampled speculation give plain decoding's tokens exactly. "bf16": the model as
    `dtype="auto"` loads it on an AVX512-BF16 CPU (bf16 weights, cache and kernels); "fp32-bf16-kv": fp32 arithmetic
    over a bf16 cache; "bf16-int8-kv": the bf16 model over an int8 cache (its kernel quantizes each query row alike in
    any forward). torch's own bf16 operators promise no such thing (the README says so): those cases are skipped."""
    kv = torch.int8 if dtype == "bf16-int8-kv" else torch.bfloat16
    if dtype != "fp32-bf16-kv" and not kernels.supported(torch.device("cpu"), kv):
        pytest.skip(f"no native kernel reads a {kv} cache on this CPU: torch's operators attend")
    model = (default_model if dtype == "fp32-bf16-kv" else default_model_bf16).model
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    for params in (greedy, sampled):
        plain, _ = run_engine(model, short_prompts, params, kv_dtype=kv)
        drafter = SelfSpecDrafter(model, "streaming", 32, 3, True)  # a budget the prompts overflow
        spec, stats = run_engine(model, short_prompts, params, kv_dtype=kv, drafter=drafter, gamma=3)
        assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
        assert stats.verify_steps > 0 and 0 < stats.acceptance_rate < 1


# --- the engine (text in, text out) --------------------------------------------------------------------------
def test_llm_builds_its_engine_and_draft_model_once(llm, default_path, short_prompts, free_run, monkeypatch):
    """Two generate calls with a `model` drafter load the draft weights once and run on one engine (the same
    caches); each gives the target's greedy tokens."""
    import magicdec.speculative as speculative

    loads, load = [], speculative.load_model
    monkeypatch.setattr(speculative, "load_model", lambda *a, **kw: loads.append(a) or load(*a, **kw))
    spec = speculative.SpeculativeConfig("model", budget=32, gamma=3, draft_model=str(default_path))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    shape = dict(max_num_seqs=len(short_prompts), max_model_len=max(map(len, short_prompts)) + 16)
    first = llm.generate(prompt_token_ids=short_prompts, params=params, speculative=spec)
    engine = llm.engine(spec, **shape)
    keys = engine.runner.cache.k
    second = llm.generate(prompt_token_ids=short_prompts, params=params, speculative=spec)
    assert len(loads) == 1
    assert llm.engine(spec, **shape) is engine and engine.runner.cache.k is keys
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == free_run
    assert llm.last_stats.verify_steps > 0


def test_engine_text_roundtrip_and_stop_string(llm, short_prompts, free_run):
    tok = llm.tokenizer
    texts = [tok.decode(p) for p in short_prompts]
    outs = llm.generate(prompt_token_ids=short_prompts, params=SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == free_run
    assert [o.text for o in outs] == [tok.decode(r) for r in free_run]
    assert all(o.finish_reason == "length" and o.prompt is None for o in outs)

    text0 = tok.decode(free_run[0])
    stop = text0[len(tok.decode(free_run[0][:6])):][:3]
    outs = llm.generate(prompt_token_ids=short_prompts, params=SamplingParams(max_tokens=16, stop=(stop,)))
    assert outs[0].finish_reason == "stop"
    assert outs[0].text == text0[: text0.index(stop)]  # the stop string itself is not returned
    assert stop not in outs[0].text

    outs = llm.generate(texts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].prompt == texts[0] and len(outs[0].token_ids) == 4
    assert llm.last_stats is not None and llm.last_stats.generated_tokens == 4


@pytest.mark.parametrize("memory_for", [0.3, 3.5, 1000])
def test_a_run_takes_the_slots_that_fit_in_memory(tiny_llama, monkeypatch, memory_for):
    """`LLM.generate` runs as many slots as 90% of the free memory holds beside the KV blocks, allocated already (at
    least one, at most the prompts), and every prompt still gets plain decoding's tokens, in fewer rounds of slots."""
    llm = LLM(tiny_llama[0].source, device="cpu", dtype="fp32", max_num_seqs=8, kv_cache_gb=0.01)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 7, 19, 40, 12, 25)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
    config = dataclasses.replace(llm.config, max_num_seqs=1, max_model_len=48)
    per_slot = ModelRunner.memory_bytes(llm.model, config, None)
    free = memory_for * per_slot
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: int(free / 0.9))
    llm.free_engine()
    outs = llm.generate(prompt_token_ids=prompts, params=params)
    slots = llm.engine(max_num_seqs=1, max_model_len=48).config.max_num_seqs
    assert slots == {0.3: 1, 3.5: 3, 1000: 6}[memory_for]
    assert [o.token_ids for o in outs] == want
