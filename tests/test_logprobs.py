"""Log-probabilities from the engine: log_softmax of the target's logits in fp32, for generated tokens
(`SamplingParams.logprobs`) and prompt tokens (`prompt_logprobs`, computed during prefill chunks); speculation gives
plain decoding's bit for bit where the native kernels run (a verification forward then gives the one-token steps'
logits exactly); a request asking for prompt log-probabilities does not take a cached prefix."""

from __future__ import annotations

import pytest
import torch

from conftest import kv_pool, run_engine
from magicdec.config import EngineConfig
from magicdec.drafters import ModelDrafter, SelfSpecDrafter
from magicdec.engine import LLMEngine
from magicdec.errors import InvalidRequestError
from magicdec.loading import load_model
from magicdec.model import attention_path, linear_path, weight_dtype
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma
from magicdec.speculative import Speculation

TOL = 2e-4  # fp32 against transformers' fp32: the same arithmetic in another order


@pytest.fixture(scope="module")
def prompts(corpus_prompt) -> list[list[int]]:
    return [corpus_prompt(150, book=1, at=0.3), corpus_prompt(40, book=2, at=0.6)]


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over every position of `ids` [T, V]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_greedy_and_prompt_logprobs_equal_transformers(default_model, hf_model, prompts):
    params = SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=3)
    requests, _ = run_engine(default_model.model, prompts, params, prefill_chunk=64)  # three chunks for the first
    for r in requests:
        ref = reference(hf_model, r.prompt_ids + r.output_ids)
        T = len(r.prompt_ids)
        assert len(r.logprobs) == len(r.output_ids) and len(r.prompt_logprobs) == T and r.prompt_logprobs[0] is None
        for t, entry in enumerate(r.prompt_logprobs[1:], 1):
            assert entry.token == r.prompt_ids[t] and len(entry.top) == 3
            assert entry.logprob == pytest.approx(ref[t - 1, entry.token].item(), abs=TOL)
            assert [lp for _, lp in entry.top] == pytest.approx(ref[t - 1].topk(3).values.tolist(), abs=TOL)
        for j, entry in enumerate(r.logprobs):
            row = ref[T - 1 + j]
            assert entry.token == r.output_ids[j] == entry.top[0][0]  # greedy: the most probable
            assert entry.logprob == pytest.approx(row[entry.token].item(), abs=TOL)
            assert [lp for _, lp in entry.top] == pytest.approx(row.topk(5).values.tolist(), abs=TOL)


def test_requests_that_do_not_ask_get_none_and_the_same_tokens(default_model, prompts):
    asking = SamplingParams(max_tokens=6, logprobs=0)
    requests, _ = run_engine(default_model.model, prompts, [asking, SamplingParams(max_tokens=6)])
    alone, _ = run_engine(default_model.model, prompts[1:], SamplingParams(max_tokens=6))
    assert requests[1].logprobs is None and requests[1].prompt_logprobs is None
    assert requests[1].output_ids == alone[0].output_ids
    assert [e.top for e in requests[0].logprobs] == [()] * 6


@pytest.fixture(scope="module")
def kernel_model(default_model_bf16):
    """The bf16 model where the native kernels compute its linear layers and attention (rows the same bits in any
    batch and query length); skipped where this CPU has no bf16 kernels."""
    model = default_model_bf16.model
    if attention_path(model.device, torch.bfloat16) != "native" or linear_path(model.device, weight_dtype(model)) \
            != "packed":
        pytest.skip("the native bf16 kernels do not run on this CPU")
    return model


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, logprobs=4, ignore_eos=True),
                                    SamplingParams(max_tokens=20, logprobs=4, ignore_eos=True, temperature=0.8,
                                                   top_p=0.9, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stop", [None, 0.6], ids=["gamma", "per-row"])
def test_speculative_logprobs_equal_plain_decodings_bit_for_bit(kernel_model, prompts, params, stop):
    """Also with per-row draft lengths, whose ragged verification gives each real token the padded one's logits."""
    plain, _ = run_engine(kernel_model, prompts, params)
    drafter = SelfSpecDrafter(kernel_model, "streaming", 64, 3, True)
    spec, stats = run_engine(kernel_model, prompts, params, drafter=drafter, gamma=3, draft_stop=stop)
    assert stats.gamma == 3 and sum(stats.accepted_hist[1:]) > 0  # it drafted, and drafts were accepted
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        assert a.logprobs == b.logprobs  # float equality of every value: the same bits


def test_prompt_logprobs_skip_the_prefix_cache_and_equal_a_cold_run(default_model, prompts):
    cache = kv_pool(default_model.model, 1 << 28, torch.float32)
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    cold, _ = run_engine(default_model.model, prompts[:1], params)
    run_engine(default_model.model, prompts[:1], SamplingParams(max_tokens=2), kv=cache)  # stores blocks
    warm, _ = run_engine(default_model.model, prompts[:1], params, kv=cache)
    plain, _ = run_engine(default_model.model, prompts[:1], SamplingParams(max_tokens=2), kv=cache)
    assert plain[0].cached_tokens > 0  # the blocks are there for requests that do not ask
    assert warm[0].cached_tokens == 0 and warm[0].prompt_logprobs == cold[0].prompt_logprobs


def test_prompt_logprobs_beside_a_draft_model_whose_cache_holds_the_prompt(default_model, default_path, prompts):
    """A standalone draft model keeps its own prefix cache; its hit does not let the target skip a chunk whose logits
    the request asks for."""
    draft = load_model(default_path, device="cpu", dtype=torch.float32).model
    config = EngineConfig(max_num_seqs=1, max_model_len=len(prompts[0]) + 2, enable_prefix_caching=True)
    engine = LLMEngine(default_model.model, config,
                       speculation=Speculation(ModelDrafter(draft, "dense", 256, 3, False), FixedGamma(3)))
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # both models' caches store the prompt
    [warm] = engine.generate(prompts[:1], params)
    cold, _ = run_engine(default_model.model, prompts[:1], params)
    assert warm.cached_tokens == 0 and warm.prompt_logprobs == cold[0].prompt_logprobs


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(llm):
    free = llm.generate(["The old lighthouse keeper"], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    out = llm.generate(["The old lighthouse keeper"], SamplingParams(max_tokens=16, stop=stop, logprobs=1,
                                                                     ignore_eos=True))[0]
    assert out.finish_reason == "stop" and [e.token for e in out.logprobs] == out.token_ids


def test_logprob_counts_are_checked():
    for bad in (21, -1, True, 1.5):
        with pytest.raises(InvalidRequestError):
            SamplingParams(logprobs=bad)
        with pytest.raises(InvalidRequestError):
            SamplingParams(prompt_logprobs=bad)
