"""The Triton attention kernels (magicdec.kernels.triton_attention) under Triton's interpreter on CPU tensors, against
attention over the gathered K/V in fp32: paged and dense K/V, a bias or per-row lengths, sliding windows, GQA, and
the exactness the fixed split size gives (a row's bits whatever the batch, and a verification row equal to the
one-token step's).

Triton chooses between its compiler and its interpreter when a function is decorated: its own library's when triton
is imported, this module's kernels when magicdec.kernels.triton_attention is. So TRITON_INTERPRET=1 is set for this
worker before triton is imported (on a CPU-only build of torch nothing else imports it, and the magicdec module only
imports it under the interpreter), and the fixture reloads the magicdec module, which another test of the worker may
have imported first. On a machine with CUDA the module is skipped: benchmarks/gpu_check.py tests the compiled
kernels there."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from conftest import use_triton_interpreter

use_triton_interpreter()

from magicdec.kernels import triton_attention  # noqa: E402
from magicdec.kv import quant  # noqa: E402
from magicdec.kv.paged import gather  # noqa: E402
from magicdec.model import attention_path, attention_shares  # noqa: E402

BS = 32  # positions per block, as magicdec.kv.blocks


@pytest.fixture(scope="module")
def ta() -> ModuleType:
    """The module with its kernels decorated under Triton's interpreter."""
    module = triton_attention if triton_attention.interpreted() else importlib.reload(triton_attention)
    assert module.interpreted()
    return module


def make_pool(kv: int, nb: int, hd: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """K, V pools [nb, kv, BS, hd] stored head-major and seen through a transpose, as `magicdec.kv.blocks` keeps
    them; block 0 (the null block) and every block no table names hold NaN, which a kernel must never read."""
    pools = []
    for _ in range(2):
        store = torch.randn(kv, nb, BS, hd, generator=gen).to(dtype)
        store[:, 0] = float("nan")
        pools.append(store.transpose(0, 1))
    return tuple(pools)


def make_tables(lens: list[int], q: int, nb: int, gen: torch.Generator) -> torch.Tensor:
    """[B, nblk] int32 tables of shuffled, non-contiguous block ids (each row enough for lens + q positions); the
    entries past a row's blocks name the null block."""
    need = [-(-(n + q) // BS) for n in lens]
    ids = (torch.randperm(nb - 1, generator=gen)[: sum(need)] + 1).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table


def causal_mask(lens: list[int], q: int, L: int, window: int = 0) -> torch.Tensor:
    """[B, q, L] bool: token t of row b sees positions (lens[b] + t - window, lens[b] + t]."""
    at = torch.tensor(lens)[:, None] + torch.arange(q)
    pos = torch.arange(L)
    seen = pos <= at[..., None]
    return seen & (pos > at[..., None] - window) if window else seen


def to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, q, L] bool -> [B, 1, q, L] additive bias, as `magicdec.model.attention_bias` with one group."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None]


def reference(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention in fp32 over contiguous K/V [B, KV, L, hd] with mask [B, q, L] (query row m is token m % q)."""
    M, q = xq.shape[2], mask.shape[1]
    rows = mask[:, None, torch.arange(M) % q]  # [B, 1, M, L]
    scores = xq.float() @ keys.float().transpose(-1, -2) * xq.shape[-1] ** -0.5
    return scores.masked_fill(~rows, float("-inf")).softmax(-1) @ values.float().nan_to_num()


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_case(lens: list[int], q: int, G: int, KV: int, hd: int, dtype: torch.dtype, seed: int = 0):
    """Queries [B, KV, G*q, hd], pools, tables and the gathered K/V [B, KV, L, hd] of one random case."""
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-(n + q) // BS) for n in lens) + 3
    kp, vp = make_pool(KV, nb, hd, dtype, gen)
    table = make_tables(lens, q, nb, gen)
    xq = torch.randn(len(lens), KV, G * q, hd, generator=gen).to(dtype)
    L = max(lens) + q
    return xq, kp, vp, table, gather(kp, table, L), gather(vp, table, L)


@pytest.mark.parametrize("G,q,hd,dtype", [(1, 1, 64, torch.bfloat16), (3, 4, 64, torch.float16),
                                          (4, 1, 256, torch.bfloat16), (4, 4, 128, torch.float32)])
def test_paged_matches_reference(ta, G, q, hd, dtype):
    """Ragged rows (one over two splits) through shuffled blocks; the bias and the lengths give the same bits."""
    lens = [3, 40, 530][: 3 if hd < 256 else 2]
    xq, kp, vp, table, keys, values = paged_case(lens, q, G, 2, hd, dtype)
    mask = causal_mask(lens, q, keys.shape[2])
    out = ta.attention(xq, kp, vp, table, bias=to_bias(mask, dtype))
    assert out.dtype == dtype and out.shape == xq.shape
    torch.testing.assert_close(out.float(), reference(xq, keys, values, mask), atol=TOL[dtype], rtol=TOL[dtype])
    by_lens = ta.attention(xq, kp, vp, table, lens=torch.tensor(lens, dtype=torch.int32), tokens=q)
    assert torch.equal(out, by_lens)


def test_sliding_window(ta):
    """A window of 100 over rows longer and shorter than it, by lengths and by the window's bias."""
    lens, q, window = [20, 300, 610], 4, 100
    xq, kp, vp, table, keys, values = paged_case(lens, q, 2, 1, 64, torch.float16, seed=1)
    mask = causal_mask(lens, q, keys.shape[2], window)
    expected = reference(xq, keys, values, mask)
    by_lens = ta.attention(xq, kp, vp, table, lens=torch.tensor(lens, dtype=torch.int32), tokens=q, window=window)
    torch.testing.assert_close(by_lens.float(), expected, atol=2e-3, rtol=2e-3)
    by_bias = ta.attention(xq, kp, vp, table, bias=to_bias(mask, torch.float16))
    torch.testing.assert_close(by_bias.float(), expected, atol=2e-3, rtol=2e-3)


def test_dense_cache_with_scattered_mask(ta):
    """Dense K/V [B, KV, L, hd] (a ring or a sparse draft cache: slots are not positions) under any mask; the
    bias has G*q rows (repeated per query head, as the model builds it for torch's operators)."""
    gen = torch.Generator().manual_seed(2)
    B, KV, G, q, L, hd = 2, 2, 3, 2, 96, 64
    keys = torch.randn(B, KV, L + 8, hd, generator=gen).to(torch.bfloat16)[:, :, :L]  # a strided prefix
    values = torch.randn(B, KV, L + 8, hd, generator=gen).to(torch.bfloat16)[:, :, :L]
    mask = torch.rand(B, q, L, generator=gen) < 0.3
    mask[:, :, 0] = True
    xq = torch.randn(B, KV, G * q, hd, generator=gen).to(torch.bfloat16)
    out = ta.attention(xq, keys, values, bias=to_bias(mask, torch.bfloat16).repeat(1, 1, G, 1))
    torch.testing.assert_close(out.float(), reference(xq, keys, values, mask), atol=1.6e-2, rtol=1.6e-2)


def test_a_row_table_reads_some_rows_of_a_dense_cache_in_place(ta):
    """A table of one block a row [m, 1] over a dense cache [B, KV, L, hd] of an odd L (a ring of 527 slots, some rows
    taken alone): the bits of those rows' own dense K/V; the other rows are never read."""
    gen = torch.Generator().manual_seed(7)
    B, KV, G, q, L, hd = 4, 2, 3, 2, 527, 64
    keys, values = (torch.randn(B, KV, L, hd, generator=gen).to(torch.bfloat16) for _ in range(2))
    index = torch.tensor([2, 0])
    mask = torch.rand(len(index), q, L, generator=gen) < 0.5
    mask[:, :, 0] = True
    xq = torch.randn(len(index), KV, G * q, hd, generator=gen).to(torch.bfloat16)
    bias = to_bias(mask, torch.bfloat16)
    want = ta.attention(xq, keys[index], values[index], bias=bias)
    for x in (keys, values):
        x[[1, 3]] = float("nan")
    assert torch.equal(ta.attention(xq, keys, values, index[:, None].to(torch.int32), bias=bias), want)


def test_row_bits_do_not_depend_on_the_batch(ta):
    """A row alone (its own L) and among four others of other lengths (a longer L, more splits): the same bits."""
    lens, q = [37, 5, 700, 64, 300], 4
    xq, kp, vp, table, _, _ = paged_case(lens, q, 4, 1, 128, torch.bfloat16, seed=3)
    mask = causal_mask(lens, q, max(lens) + q)
    lengths = torch.tensor(lens, dtype=torch.int32)
    crowd = ta.attention(xq, kp, vp, table, bias=to_bias(mask, torch.bfloat16))
    crowd_lens = ta.attention(xq, kp, vp, table, lens=lengths, tokens=q)
    for b in (0, 4):
        L = lens[b] + q
        alone = ta.attention(xq[b : b + 1], kp, vp, table[b : b + 1, : -(-L // BS)],
                             bias=to_bias(mask[b : b + 1, :, :L], torch.bfloat16))
        assert torch.equal(alone[0], crowd[b])
        alone_lens = ta.attention(xq[b : b + 1], kp, vp, table[b : b + 1], lens=lengths[b : b + 1], tokens=q)
        assert torch.equal(alone_lens[0], crowd_lens[b])


def test_verification_rows_equal_one_token_steps(ta):
    """A verification of q = 4 tokens per row over positions lens..lens+3 gives each token's rows the bits of the
    one-token step at that position over the same cache (the tile shape is fixed for up to ROWS query rows)."""
    lens, q, G = [30, 515], 4, 4
    xq, kp, vp, table, keys, _ = paged_case(lens, q, G, 1, 64, torch.bfloat16, seed=4)
    verify = ta.attention(xq, kp, vp, table, bias=to_bias(causal_mask(lens, q, keys.shape[2]), torch.bfloat16))
    for t in range(q):
        step_lens = [n + t for n in lens]
        rows = xq[:, :, t::q]  # token t of each query head: [B, KV, G, hd]
        step = ta.attention(rows, kp, vp, table, bias=to_bias(causal_mask(step_lens, 1, max(step_lens) + 1),
                                                                 torch.bfloat16))
        assert torch.equal(step, verify[:, :, t::q])


@pytest.mark.parametrize("G,q,share_row,dtype", [(3, 3, 0, torch.bfloat16), (3, 3, 2, torch.bfloat16),
                                                  (4, 1, 0, torch.float32), (1, 4, 1, torch.float16)])
def test_shares_match_reference(ta, G, q, share_row, dtype):
    """Each position's share of token `share_row`'s attention (its G query heads' probabilities summed) against
    torch's reference, over ragged rows through shuffled blocks (one row over two splits, one that sees nothing of a
    split); hidden positions get exactly 0, and the output keeps its bits."""
    lens = [3, 40, 530]
    xq, kp, vp, table, keys, _ = paged_case(lens, q, G, 2, 64, dtype, seed=6)
    L = keys.shape[2]
    bias = to_bias(causal_mask(lens, q, L), dtype)
    shares = torch.full((len(lens), 2, L), float("nan"))
    out = ta.attention(xq, kp, vp, table, bias=bias, shares=shares, share_row=share_row)
    assert torch.equal(out, ta.attention(xq, kp, vp, table, bias=bias))
    expected = attention_shares(xq, keys.nan_to_num(), bias, share_row, q)
    torch.testing.assert_close(shares, expected, atol=1e-5, rtol=1e-4)
    hidden = bias[:, :, share_row].expand_as(shares) < 0
    assert hidden.any() and (shares[hidden] == 0).all()
    torch.testing.assert_close(shares.sum(-1), torch.full((len(lens), 2), float(G)))
    with pytest.raises(ValueError):
        ta.attention(xq, kp, vp, table, bias=bias, shares=shares[:, :, :-1])


@pytest.mark.parametrize("q", [1, 4])
def test_int8_rows_match_reference(ta, q):
    """int8 rows carrying their fp32 scale (`magicdec.kv.quant`, as an int8 cache stores them) through shuffled
    blocks: read as `quant.load` reads them, the products in fp32, the output in the queries' dtype; a row alone and
    among the others gives the same bits. The null block's scales are NaN: reading it would show."""
    lens, G, hd = [3, 40, 530], 4, 64
    xq, kp, vp, table, _, _ = paged_case(lens, q, G, 2, hd, torch.float32, seed=5)
    xq = xq.to(torch.bfloat16)
    kq, vq = (quant.store(pool.nan_to_num(), torch.int8) for pool in (kp, vp))  # [nb, KV, BS, hd + 4]
    for pool in (kq, vq):
        pool[0, ..., -quant.SCALE_BYTES:] = torch.tensor([float("nan")]).view(torch.int8)
    L = max(lens) + q
    mask = causal_mask(lens, q, L)
    out = ta.attention(xq, kq, vq, table, bias=to_bias(mask, torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == xq.shape
    keys, values = (quant.load(gather(pool, table, L), torch.float32) for pool in (kq, vq))
    torch.testing.assert_close(out.float(), reference(xq, keys, values, mask), atol=1e-2, rtol=1e-2)
    lengths = torch.tensor(lens, dtype=torch.int32)
    assert torch.equal(ta.attention(xq, kq, vq, table, lens=lengths, tokens=q), out)
    alone = ta.attention(xq[1:2], kq, vq, table[1:2], lens=lengths[1:2], tokens=q)
    assert torch.equal(alone[0], out[1])


def test_takes_and_path(ta, monkeypatch):
    """The dispatch: CUDA only, MAGICDEC_TRITON=0 turns it off, and the operands `takes` declines."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ta.supported(cuda, torch.bfloat16) and not ta.supported(cpu, torch.bfloat16)
    assert ta.supported(cuda, torch.int8) and attention_path(cuda, torch.int8) == "triton"
    assert attention_path(cuda, torch.bfloat16) == "triton"
    assert attention_path(cpu, torch.float32) != "triton"
    monkeypatch.setenv("MAGICDEC_TRITON", "0")
    ta.switched_on.cache_clear()
    try:
        assert not ta.supported(cuda, torch.bfloat16) and attention_path(cuda, torch.float32) == "sdpa"
    finally:
        monkeypatch.delenv("MAGICDEC_TRITON")
        ta.switched_on.cache_clear()
    xq, kp, vp, table, keys, _ = paged_case([10], 1, 4, 1, 64, torch.bfloat16)
    bias = to_bias(causal_mask([10], 1, 11), torch.bfloat16)
    assert not ta.takes(xq, kp, vp, bias, table)  # CPU tensors
    monkeypatch.setattr(ta, "supported", lambda device, dtype: True)
    assert ta.takes(xq, kp, vp, bias, table)
    assert not ta.takes(xq, kp, vp, bias, table.long())
    assert not ta.takes(xq.repeat(1, 1, 17, 1), kp, vp, bias, table)  # 68 query rows: a prefill chunk
    with pytest.raises(ValueError):
        ta.attention(xq, kp, vp, table)
