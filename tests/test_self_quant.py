"""The quantized self-speculative draft (`--draft self-quant`): its 4-bit cache, and its rows on a real model.

That its output is the target's (greedy and seeded sampled, on every kernel path and on Gemma 3) is tested beside
the other drafters: test_dtype.py, test_kernels.py, test_lossless_sampling.py, test_gemma.py."""

from __future__ import annotations

import pytest
import torch

from magicdec.engine import LLM
from magicdec.kv import KVCache, quant
from magicdec.kv.lowbit import COPY_CHUNK, RECENT, LowBitKVCache
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig


def filled_cache(cfg, lens: list[int], seed: int = 0) -> KVCache:
    """A dense fp32 cache whose rows hold random K/V, a large offset on some key channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(cfg, len(lens), max(lens) + 8, torch.float32, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.k[..., :4] += 20.0
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.commit(torch.tensor(lens))
    return cache


def dequantized(rows: torch.Tensor) -> torch.Tensor:
    return quant.load(rows, torch.float32)


def assert_rounded(rows: torch.Tensor, want: torch.Tensor, levels: int) -> None:
    """rows [..., row] hold want [..., hd] at `levels` steps of its row's scale, within half a step."""
    if not rows.numel():
        return
    assert rows[..., :-quant.SCALE_BYTES].abs().max() <= levels
    step = want.abs().amax(-1, keepdim=True) / levels
    assert ((dequantized(rows) - want).abs() <= step / 2 + 1e-5).all()


def test_rows_copied_from_the_target_are_4bit_keys_less_their_mean(tiny_llama):
    """Each row takes the mean of the keys it copies first (per layer and KV head); keys less that mean and values
    are stored at levels -7..7 of their row's scale, but for the prompt's last RECENT rows, at -127..127."""
    cfg = tiny_llama[0].model.cfg
    lens = [RECENT + 40, 13]
    src = filled_cache(cfg, lens)
    draft = LowBitKVCache(cfg, 2, RECENT + 64, "cpu")
    draft.append_from(src, src.lens, torch.tensor([True, True]))
    assert draft.lens.tolist() == lens and draft.recent_from.tolist() == [40, 13 - RECENT]
    for b, n in enumerate(lens):
        k, v = src.k[:, b, :, :n], src.v[:, b, :, :n]  # [layers, KV, n, hd]
        torch.testing.assert_close(draft.k_mean[b], k.mean(2))
        for rows, want in ((draft.k[:, b, :, :n], k - k.mean(2, keepdim=True)), (draft.v[:, b, :, :n], v)):
            old = max(n - RECENT, 0)
            assert_rounded(rows[:, :, :old], want[:, :, :old], quant.INT4_LEVELS)
            assert_rounded(rows[:, :, old:], want[:, :, old:], quant.INT8_LEVELS)
    # the offset channels no longer set the key rows' scale: 4 bits resolve what differs between keys
    assert (dequantized(draft.k[:, 0, :, :40]) - (src.k[:, 0, :, :40] - draft.k_mean[0][:, :, None])).abs().max() < 1.0


def test_later_copies_and_draft_forwards_keep_the_row_mean(tiny_llama):
    """A first copy longer than COPY_CHUNK (copied in chunks) stores every row as one would; tokens copied after it (a
    round's catch-up) and keys a draft forward writes are stored at 8 bits less the mean the row took first."""
    cfg = tiny_llama[0].model.cfg
    first, n = COPY_CHUNK + 10, COPY_CHUNK + 50
    src = filled_cache(cfg, [n], seed=1)
    draft = LowBitKVCache(cfg, 1, COPY_CHUNK + 64, "cpu")
    draft.append_from(src, torch.tensor([first]), torch.tensor([True]))
    mean = draft.k_mean.clone()  # [1, layers, KV, hd]
    draft.append_from(src, torch.tensor([n]), torch.tensor([True]))
    assert torch.equal(draft.k_mean, mean) and int(draft.lens) == n and int(draft.recent_from) == first - RECENT
    keys = src.k[:, 0, :, :n] - mean[0][:, :, None]
    assert torch.equal(draft.k[:, 0, :, :first - RECENT], quant.store(keys[:, :, :first - RECENT], quant.INT8,
                                                                      quant.INT4_LEVELS))
    assert torch.equal(draft.k[:, 0, :, first - RECENT:n], quant.store(keys[:, :, first - RECENT:], quant.INT8))
    k = torch.randn(1, cfg.n_kv_heads, 3, cfg.head_dim) + 20.0
    draft.attn_mask(3)
    draft.update(0, k, torch.randn_like(k))
    assert_rounded(draft.k[0, :, :, n:n + 3][None], k - mean[0, 0][:, None], quant.INT8_LEVELS)


@pytest.fixture(scope="module")
def llm_auto():
    """The default model as this CPU runs it by default (bf16 on AVX512-BF16, fp32 on the AVX2 path): on the native
    kernels, whose rows do not depend on the batch, so speculation is exact on every machine kind."""
    return LLM(device="cpu", dtype="auto", max_model_len=2048, prefill_chunk=128, enable_prefix_caching=True)


def test_a_prefix_hit_drafts_as_a_cold_prefill_does(llm_auto, corpus_prompt):
    """The draft's rows are copied once the target holds the whole prompt, so a prompt prefilled in chunks and the same
    prompt served from the prefix cache give the same draft cache: the same accepted drafts, round for round (and the
    target's tokens, as always). On SmolLM2 over a 700-token prompt the 4-bit draft accepts most drafts."""
    prompt = [corpus_prompt(700, book=9, at=0.4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = llm_auto.generate(prompt_token_ids=prompt, params=params)
    runs = []
    for _ in range(2):  # cold (the plain run left its blocks cached, so clear them), then a hit
        if not runs:
            llm_auto.clear_prefix_cache()
        out = llm_auto.generate(prompt_token_ids=prompt, params=params,
                                speculative=SpeculativeConfig("self-quant", gamma=4))
        assert out[0].token_ids == plain[0].token_ids
        runs.append(list(llm_auto.last_stats.accepted_hist))
    assert runs[0] == runs[1]
    assert llm_auto.last_stats.acceptance_rate > 0.6
