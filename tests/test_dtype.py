"""The compute dtype: `dtype="auto"` from the CPU's flags, attention over a bf16 cache, and bf16 against
the fp32 reference on the real model.

The bf16 tolerances were measured on this project's CPUs (`git show e3fc202:benchmarks/README.md`, "bf16 on CPU"):
over 1024 tokens of three PG-19 books, max|bf16 - fp32| / max|fp32| of the logits is 0.026-0.035 and the greedy
top-1 token agrees at 97-98% of positions. On the native kernels (AVX512-BF16) a verification forward and
one-token steps give the same logits bit for bit; on torch's bf16 operators they may pick different
greedy tokens, within 0.15 of each other in fp32 logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from magicdec import cpu, kernels
from magicdec.kv import KVCache
from magicdec.model import attend, attention_bias
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig

LOGIT_TOL = 0.06  # max|bf16 - fp32| / max|fp32| over real text
TOP1_AGREEMENT = 0.95  # fraction of positions whose bf16 argmax is the fp32 one
TIE_GAP = 0.5  # fp32 logit gap below which bf16 may order two tokens either way


# --- dtype="auto" ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [{"avx512f", "amx_bf16", "amx_tile"}, {"avx512f", "avx512_bf16"}])
def test_auto_picks_bf16_where_the_cpu_multiplies_bf16(monkeypatch, flags):
    monkeypatch.setattr(cpu, "bf16_matmul_speedup", lambda: 3.0)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset(flags))
    assert choice.dtype == torch.bfloat16 and choice.name == "bf16"
    assert ("amx_bf16" if "amx_bf16" in flags else "avx512_bf16") in str(choice)


def test_auto_picks_fp32_without_bf16_hardware(monkeypatch):
    def never() -> float:
        raise AssertionError("no timing needed without the flags")

    monkeypatch.setattr(cpu, "bf16_matmul_speedup", never)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset({"avx2", "fma", "avx512f"}))  # e.g. a Zen 3
    assert choice.dtype == torch.float32 and "no AMX-BF16 or AVX512-BF16" in choice.reason


def test_auto_picks_fp32_where_bf16_measures_slower(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_matmul_speedup", lambda: 0.01)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset({"avx512_bf16"}))
    assert choice.dtype == torch.float32 and "100.0x slower" in choice.reason


def test_auto_keeps_bf16_on_cuda():
    assert cpu.auto_dtype(torch.device("cuda"), frozenset()).dtype == torch.bfloat16


def test_bf16_matmul_speedup_is_measured_once():
    first = cpu.bf16_matmul_speedup()
    assert first > 0 and cpu.bf16_matmul_speedup() == first
    assert cpu.bf16_matmul_speedup.cache_info().currsize == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_and_llm_follow_auto(monkeypatch, tiny_llama, dtype):
    from magicdec.engine import LLM

    monkeypatch.setattr("magicdec.loading.auto_kernel_dtype", lambda device: cpu.DtypeChoice(dtype, "mocked"))
    llm = LLM(tiny_llama[0].source, device="cpu", dtype="auto")
    assert llm.model.dtype == dtype and llm.kv_dtype == dtype
    assert llm.loaded.dtype_choice == cpu.DtypeChoice(dtype, "mocked")
    explicit = LLM(tiny_llama[0].source, device="cpu", dtype="fp32")
    assert explicit.model.dtype == torch.float32 and explicit.loaded.dtype_choice.reason == "requested"


def test_machine_info_records_cpu_flags(monkeypatch):
    from magicdec.calibrate.machine import machine_info

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"fma", "avx512_bf16", "sse2", "amx_bf16"}))
    assert machine_info("cpu")["cpu_flags"] == ["amx_bf16", "avx512_bf16", "fma"]


# --- bf16 attention -------------------------------------------------------------------------------------
@pytest.fixture
def torch_attention(monkeypatch):
    """Attention on torch's operators (the path where the native kernel does not run)."""
    monkeypatch.setattr(kernels, "takes", lambda *args: False)


@pytest.mark.parametrize("q", [1, 4, 9])
def test_bf16_attention_matches_sdpa_in_fp32(q, torch_attention):
    """The matmul path over a bf16 cache (ragged rows) against fp32 SDPA over the same values."""
    g = torch.Generator().manual_seed(q)
    B, KV, G, L, hd = 3, 3, 3, 300, 64
    xq, k, v = (torch.randn(B, KV, n, hd, generator=g).bfloat16() for n in (G * q, L, L))
    lens = torch.tensor([L - q, L - q - 50, 7])
    mask = (torch.arange(L)[None, None, None, :] <= (lens[:, None] + torch.arange(q))[:, None, :, None])
    out = attend(xq, k, v, attention_bias(mask, G, torch.bfloat16))
    ref = F.scaled_dot_product_attention(xq.float(), k.float(), v.float(), attn_mask=mask.repeat(1, 1, G, 1))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.01  # measured 0.003-0.005; a lost mask or scale gives ~1


def test_bf16_softmax_is_the_fp32_softmax_rounded(torch_attention):
    """The matmul path's softmax runs on bf16 scores (fp32 inside the kernel): its output is that of converting
    the scores to fp32 for the softmax and rounding the probabilities back (hd 64: the scale is a power of two),
    but for a one-ulp rounding of a few probabilities in 10^5 at some lengths (here 500 keys)."""
    g = torch.Generator().manual_seed(0)
    B, KV, G, q, L, hd = 2, 3, 3, 4, 500, 64
    xq, k, v = (torch.randn(B, KV, n, hd, generator=g).bfloat16() for n in (G * q, L, L))
    mask = (torch.arange(L)[None, None, None, :] <= (torch.tensor([L - q, 200])[:, None] + torch.arange(q))[:, None, :, None])
    scores = torch.matmul(xq, k.transpose(-1, -2)).float().mul_(hd ** -0.5)
    scores = scores.masked_fill_(~mask.repeat(1, 1, G, 1), float("-inf"))
    ref = torch.matmul(scores.softmax(-1).bfloat16(), v)
    out = attend(xq, k, v, attention_bias(mask, G, torch.bfloat16))
    assert (out != ref).float().mean() < 1e-3  # measured 2e-4
    assert rel_err(out, ref) < 1e-3


# --- bf16 against fp32 on the real model -------------------------------------------------------------------
def chunked_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position of one prompt, prefilled in chunks of `chunk` tokens."""
    cache = KVCache(model.cfg, 1, len(ids), model.dtype, "cpu")
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            t = torch.tensor([ids[s : s + chunk]])
            out.append(model(t, cache)[0])
            cache.commit(t.shape[1])
    return torch.cat(out)


def test_bf16_logits_and_top1_against_fp32(default_model, default_model_bf16, corpus_prompt):
    for book in (1, 5):
        ids = corpus_prompt(512, book=book, at=0.4)
        ref = chunked_logits(default_model.model, ids, 128)
        ours = chunked_logits(default_model_bf16.model, ids, 128)
        assert ours.dtype == torch.float32  # logits come out in fp32 whatever the compute dtype
        assert rel_err(ours, ref) < LOGIT_TOL
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= TOP1_AGREEMENT


# --- every drafter with a bf16 target ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_bf16():
    from magicdec.engine import LLM

    return LLM(device="cpu", dtype="bf16")


@pytest.fixture(scope="module")
def bf16_prompts(corpus_prompt) -> list[list[int]]:
    return [corpus_prompt(n, book=b, at=0.3) for n, b in ((200, 7), (450, 8))]


@pytest.fixture(scope="module")
def bf16_plain(llm_bf16, bf16_prompts):
    return llm_bf16.generate(prompt_token_ids=bf16_prompts, params=SamplingParams(max_tokens=16, ignore_eos=True))


@pytest.mark.parametrize("draft, cache", [("self-streaming", None), ("self-snapkv", None), ("self-vegas", None),
                                          ("self-quant", None), ("model", "dense"), ("model", "streaming"),
                                          ("model", "snapkv")])
def test_every_drafter_with_a_bf16_target(llm_bf16, default_model, default_path, bf16_prompts, bf16_plain, draft, cache):
    """Greedy speculation over a bf16 target emits the plain bf16 tokens: exactly on the native kernels
    (row-invariant: verification and one-token steps round alike); on torch's operators, except where
    verification of gamma+1 tokens and a one-token step round a near-tie differently: then, at the first
    difference, the two tokens are within TIE_GAP of each other in the fp32 model (benchmarks/README.md, "Greedy
    losslessness in bf16", measures how often that happens)."""
    spec = SpeculativeConfig(draft, budget=64, gamma=3, draft_model=str(default_path) if cache else None,
                             draft_cache=cache or "streaming")
    outs = llm_bf16.generate(prompt_token_ids=bf16_prompts, params=SamplingParams(max_tokens=16, ignore_eos=True),
                             speculative=spec)
    assert llm_bf16.last_stats.acceptance_rate > 0.3  # the drafter drafts something the target accepts
    if kernels.supported(llm_bf16.model.device, llm_bf16.kv_dtype) and kernels.linear_supported(
            llm_bf16.model.device, llm_bf16.model.dtype):
        assert [o.token_ids for o in outs] == [o.token_ids for o in bf16_plain]
        return
    for prompt, plain, ours in zip(bf16_prompts, bf16_plain, outs):
        assert len(ours.token_ids) == 16
        differ = [i for i, (a, b) in enumerate(zip(plain.token_ids, ours.token_ids)) if a != b]
        if not differ:
            continue
        i = differ[0]
        logits = chunked_logits(default_model.model, prompt + plain.token_ids[:i], 512)[-1]
        gap = (logits[plain.token_ids[i]] - logits[ours.token_ids[i]]).abs().item()
        assert gap < TIE_GAP, (i, gap)
