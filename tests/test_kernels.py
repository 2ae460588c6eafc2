"""The native kernels (magicdec.kernels): decode attention against fp32 SDPA and the packed bf16 linear
layer against an fp32 matmul; that every row is computed alike whatever the batch and the number of
queries; when they are used; and the real model on them, whose verification forward then gives the
one-token steps' logits bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from magicdec import kernels
from magicdec.kv import KVCache
from magicdec.model import PackedLinear, Transformer, attention_bias, attention_path, pack_linears

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not kernels.supported(CPU, torch.bfloat16),
                                  reason="the CPU lacks AVX512-BF16 or the kernel did not build")
needs_linear = pytest.mark.skipif(not kernels.linear_supported(CPU, torch.bfloat16),
                                  reason="the CPU lacks AVX512-BF16 or the kernel did not build")


def ragged(B: int, KV: int, G: int, q: int, L: int, hd: int, lens: list[int], capacity: int, seed: int = 0):
    """bf16 queries and K/V views [B, KV, L, hd] of a larger buffer (as a cache hands them out), and a
    causal mask [B, 1, q, L] over per-row lengths."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(B, KV, G * q, hd, generator=g).bfloat16()
    k, v = (torch.randn(B, KV, capacity, hd, generator=g).bfloat16()[:, :, :L] for _ in range(2))
    slots = torch.tensor(lens)[:, None] + torch.arange(q)  # where each row's q new tokens sit
    mask = torch.arange(L)[None, None, None, :] <= slots[:, None, :, None]
    return xq, k, v, mask


def reference(xq, k, v, mask, G):
    return F.scaled_dot_product_attention(xq.float(), k.float(), v.float(), attn_mask=mask.repeat(1, 1, G, 1))


@needs_kernel
@pytest.mark.parametrize("B, G, q, L, hd, lens", [
    (1, 3, 1, 1, 64, [0]),                     # one cached position
    (2, 3, 1, 15, 64, [14, 3]),                # shorter than a tile
    (3, 3, 4, 300, 64, [296, 200, 7]),         # ragged rows, a partial last tile
    (2, 1, 9, 2100, 64, [2091, 1500]),         # several chunks, whole hidden tiles at the end
    (1, 4, 6, 777, 128, [771]),                # head dim 128
    (4, 3, 16, 64, 64, [48, 40, 1, 0]),        # 48 query rows; a row with nothing cached before it
    (1, 3, 256, 1000, 64, [744]),              # a prefill chunk: 768 query rows, causal among themselves
    (2, 3, 100, 300, 64, [200, 0]),            # and a prompt's first chunk
])
def test_matches_fp32_sdpa(B, G, q, L, hd, lens):
    xq, k, v, mask = ragged(B, 2, G, q, L, hd, lens, capacity=L + 37)
    assert k.stride(2) == hd and not k.is_contiguous()  # strided views, as caches give
    out = kernels.decode_attention(xq, k, v, attention_bias(mask, G, torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == xq.shape
    # bf16 queries, K and probabilities: measured 0.002-0.004; a lost mask, scale or tile gives ~1
    assert rel_err(out, reference(xq, k, v, mask, G)) < 0.01


@needs_kernel
def test_every_query_row_is_computed_alike_whatever_the_number_of_queries():
    """A verification forward (q new tokens) attends for its first token exactly as a one-token step does."""
    B, KV, G, q, L, hd = 3, 3, 3, 5, 1500, 64
    xq, k, v, mask = ragged(B, KV, G, q, L, hd, [1400, 900, 20], capacity=L)
    bias = attention_bias(mask, G, torch.bfloat16)  # rows ordered (head in group, token)
    full = kernels.decode_attention(xq, k, v, bias).view(B, KV, G, q, hd)
    first = xq.view(B, KV, G, q, hd)[:, :, :, :1].reshape(B, KV, G, hd)
    one = kernels.decode_attention(first, k, v, attention_bias(mask[:, :, :1], G, torch.bfloat16))
    assert torch.equal(one.view(B, KV, G, hd), full[:, :, :, 0])


@needs_kernel
def test_fully_hidden_chunks_are_skipped_not_averaged():
    """A row whose visible positions all fall in one chunk: other chunks contribute nothing (NaN in the
    hidden slots, which a kernel that read them would spread)."""
    xq, k, v, mask = ragged(1, 1, 1, 1, 4096, 64, [100], capacity=4096)
    k[:, :, 512:], v[:, :, 512:] = float("nan"), float("nan")
    out = kernels.decode_attention(xq, k, v, attention_bias(mask, 1, torch.bfloat16))
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(xq, k[:, :, :101], v[:, :, :101], mask[..., :101], 1)) < 0.01


def test_off_without_the_instructions_or_when_disabled(monkeypatch):
    try:
        kernels._extension.cache_clear()
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
        assert not kernels.supported(CPU, torch.bfloat16)
        assert not kernels.linear_supported(CPU, torch.bfloat16)
        assert attention_path(CPU, torch.bfloat16) == "matmul"
        kernels._extension.cache_clear()
        monkeypatch.undo()
        monkeypatch.setenv("MAGICDEC_NATIVE", "0")
        assert not kernels.supported(CPU, torch.bfloat16)
        assert not kernels.linear_supported(CPU, torch.bfloat16)
    finally:
        monkeypatch.undo()
        kernels._extension.cache_clear()
    assert attention_path(CPU, torch.float32) == "sdpa"  # fp32 caches keep SDPA
    assert not kernels.supported(torch.device("meta"), torch.bfloat16)
    assert not kernels.linear_supported(CPU, torch.float32)


@needs_kernel
def test_real_model_steps_with_and_without_the_kernel(default_model_bf16, corpus_prompt, monkeypatch):
    """The bf16 model over a real 700-token context (its prefill on the kernel too), one-token and four-token
    steps on the kernel against torch's matmul path (both bf16: measured max logit difference 0.03 of the
    largest logit), same argmax."""
    model = default_model_bf16.model
    ids = corpus_prompt(700, book=3, at=0.5)

    def steps(native: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels, "takes", kernels.takes if native else (lambda *a: False))
        cache = KVCache(model.cfg, 1, 800, torch.bfloat16, "cpu")
        with torch.inference_mode():
            model(torch.tensor([ids[:-5]]), cache)
            cache.commit(len(ids) - 5)
            return [model(torch.tensor([ids[-5:-4]]), cache)[0], model(torch.tensor([ids[-5:-1]]), cache)[0]]

    original = kernels.takes
    ours = steps(True)
    ref = steps(False)
    monkeypatch.setattr(kernels, "takes", original)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 0.06
        assert torch.equal(a.argmax(-1), b.argmax(-1))


# --- the packed bf16 linear layer -------------------------------------------------------------------------
@needs_linear
@pytest.mark.parametrize("M, K, N, bias", [
    (1, 576, 960, False),     # a decode step's qkv projection
    (7, 1536, 576, True),     # a partial row block, a bias
    (13, 100, 37, False),     # N not a multiple of the 64-column group, K not of 32
    (64, 64, 200, True),      # full row blocks
])
def test_linear_matches_fp32_and_gives_a_row_the_same_bits_in_any_batch(M, K, N, bias):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    packed = kernels.pack_linear(w)
    out = kernels.linear(x, packed, N, b)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert rel_err(out, ref) < 0.01  # bf16 rounding of the output: ~0.002; a lost pair or column gives ~1
    alone = torch.cat([kernels.linear(x[i : i + 1], packed, N, b) for i in range(M)])
    assert torch.equal(alone, out)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, packed, N, b), out)  # columns shared among threads or not
    finally:
        torch.set_num_threads(threads)
    batched = kernels.linear(x.view(1, M, K).expand(2, M, K), packed, N, b)  # leading dims kept
    assert batched.shape == (2, M, N) and torch.equal(batched[1], out)


@needs_linear
@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears_swaps_every_linear_layer_of_a_bf16_model(tiny_llama, tied):
    """A load-time transform: each nn.Linear becomes a PackedLinear (a tied LM head gets its own copy of
    the embedding table), and the model computes what it did (bf16 rounding apart)."""
    cfg = dataclasses.replace(tiny_llama[0].model.cfg, tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        before = model(tokens, KVCache(cfg, 2, 16, torch.bfloat16, "cpu"))
        pack_linears(model)
        after = model(tokens, KVCache(cfg, 2, 16, torch.bfloat16, "cpu"))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * cfg.n_layers + 1
    assert rel_err(after, before) < 0.03  # rounding order apart (measured 0 here); a misplaced weight gives ~1


def test_pack_linears_leaves_fp32_models_alone(tiny_llama):
    model = tiny_llama[0].model
    pack_linears(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_kernel
@needs_linear
@pytest.mark.parametrize("lens", [[1003], [1020], [1100, 300, 1018]])
def test_real_model_verification_equals_one_token_steps_bit_for_bit(default_model_bf16, corpus_prompt, lens):
    """In bf16 on the kernels a verification forward of 9 tokens gives the logits of 9 one-token steps
    over the same tokens exactly, alone and in a ragged batch, across an attention chunk boundary (1024), and
    while the attended length grows with each step (a cache far from full): greedy speculation then emits
    plain decoding's tokens whatever the numerics round."""
    model = default_model_bf16.model
    q = 9
    texts = [corpus_prompt(n + q, book=i, at=0.5) for i, n in enumerate(lens)]

    cache = KVCache(model.cfg, len(lens), 4096, torch.bfloat16, "cpu")
    new = torch.tensor([t[-q:] for t in texts])
    with torch.inference_mode():
        for i, n in enumerate(lens):  # each row alone, as the engine's prefill does
            row = cache.row(i)
            model(torch.tensor([texts[i][:n]]), row)
            row.commit(n)
        cache.truncate(cache.lens.clone())  # the batch's own bound on the lengths its rows' views advanced
        verify = model(new, cache)  # not committed: the steps then write the same slots again
        steps = []
        for j in range(q):
            steps.append(model(new[:, j : j + 1], cache)[:, 0])
            cache.commit(1)
    assert torch.equal(verify, torch.stack(steps, 1))
