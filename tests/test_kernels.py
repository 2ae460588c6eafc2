"""The native decode-attention kernel (magicdec.kernels): what it computes against fp32 SDPA, that every
query row is computed alike whatever the number of queries, when it is used, and the real model on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from magicdec import kernels
from magicdec.kv import KVCache
from magicdec.model import attention_bias, attention_path

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not kernels.supported(CPU, torch.bfloat16),
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
        assert attention_path(CPU, torch.bfloat16) == "matmul"
        kernels._extension.cache_clear()
        monkeypatch.undo()
        monkeypatch.setenv("MAGICDEC_NATIVE", "0")
        assert not kernels.supported(CPU, torch.bfloat16)
    finally:
        monkeypatch.undo()
        kernels._extension.cache_clear()
    assert attention_path(CPU, torch.float32) == "sdpa"  # fp32 caches keep SDPA
    assert not kernels.supported(torch.device("meta"), torch.bfloat16)


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
