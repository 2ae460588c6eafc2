"""The native kernels (magicdec.kernels) on every instruction-set path this CPU can run (each forced in turn:
AVX512-BF16, and AVX2 + FMA + F16C, which any x86 CPU with AVX2 runs, including one with AVX-512): decode attention
against fp32 SDPA and the packed linear layer against an fp32 matmul; that every row is computed alike whatever the
batch and the number of queries; dispatch by CPU flags; and the real model on them, whose verification forward then
gives the one-token steps' logits bit for bit. The attention tests run over every KV dtype a path's kernel reads: its
16-bit storage and, where it reads them, int8 rows (magicdec.kv.quant)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import randomize_, rel_err

from magicdec import kernels
from magicdec.kv import KVCache, quant
from magicdec.kv.blocks import block_storage
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.vegas import AttentionShares
from magicdec.model import (PackedLinear, Ragged, Transformer, apply_rope, attention_bias, attention_path,
                            pack_linears, rotate, weight_dtype)
from magicdec.sampling import CPU_CANDIDATES, RowParams, SamplingParams, sample_tokens

CPU = torch.device("cpu")


def force(name: str | None) -> kernels.IsaPath | None:
    """Make `name` the kernel path of this process (None: the CPU's own pick) and return what runs."""
    if name is None:
        os.environ.pop("MAGICDEC_ISA", None)
    else:
        os.environ["MAGICDEC_ISA"] = name
    kernels.isa_path.cache_clear()
    kernels.tiles.cache_clear()
    return kernels.isa_path()


@pytest.fixture(params=[False, True], ids=["vector", "tiles"])
def tiles(request, monkeypatch) -> bool:
    """The avx512bf16 kernels' products on vector instructions, then on AMX tiles (skipped where the CPU has none);
    the process's own choice is restored afterwards. Other paths run their one version once."""
    monkeypatch.setenv("MAGICDEC_AMX", "1" if request.param else "0")
    kernels.tiles.cache_clear()
    if request.param and not kernels.tiles():
        pytest.skip("no AMX tiles on this path or CPU")
    yield request.param
    monkeypatch.undo()
    kernels.tiles.cache_clear()


@pytest.fixture(params=[p.name for p in kernels.PATHS])
def isa(request) -> kernels.IsaPath:
    """Each kernel path in turn, forced, its kernels built; skipped where this CPU lacks its flags or a build fails.
    The CPU's own pick is restored afterwards."""
    before = os.environ.get("MAGICDEC_ISA")
    path = force(request.param)
    try:
        if path is None:
            pytest.skip(f"this CPU lacks the flags of the {request.param} kernels")
        storage = path.storage[0]
        if not (kernels.supported(CPU, storage) and kernels.linear_supported(CPU, path.compute, storage)):
            pytest.skip(f"the {request.param} kernels did not build")
        yield path
    finally:
        force(before)


def storages(path: kernels.IsaPath) -> list[torch.dtype]:
    """The KV dtypes `path`'s attention kernel reads: its 16-bit ones, and int8 where it reads them."""
    return [*path.storage, *([torch.int8] if path.int8 else [])]


def bias_dtype(storage: torch.dtype, path: kernels.IsaPath) -> torch.dtype:
    return quant.attention_dtype(storage, path.compute)


def poison(t: torch.Tensor) -> None:
    """NaN into cached rows: their values, or an int8 row's scale (bytes 0xFF)."""
    t.fill_(-1 if t.dtype == torch.int8 else float("nan"))


def ragged(B: int, KV: int, G: int, q: int, L: int, hd: int, lens: list[int], capacity: int, dtype: torch.dtype,
           storage: torch.dtype, seed: int = 0):
    """Queries [B, KV, G*q, hd] in `dtype` and K/V views [B, KV, L, row] stored in `storage` (`quant.store`) of a
    larger buffer (as a cache hands them out), and a causal mask [B, 1, q, L] over per-row lengths."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(B, KV, G * q, hd, generator=g).to(dtype)
    k, v = (quant.store(torch.randn(B, KV, capacity, hd, generator=g), storage)[:, :, :L] for _ in range(2))
    slots = torch.tensor(lens)[:, None] + torch.arange(q)  # where each row's q new tokens sit
    mask = torch.arange(L)[None, None, None, :] <= slots[:, None, :, None]
    return xq, k, v, mask


def reference(xq, k, v, mask, G):
    k, v = quant.load(k, torch.float32), quant.load(v, torch.float32)
    return F.scaled_dot_product_attention(xq.float(), k, v, attn_mask=mask.repeat(1, 1, G, 1))


def tolerance(path: kernels.IsaPath, storage: torch.dtype | None = None) -> float:
    """Of the kernels against fp32 over the same stored values. bf16 queries, products and probabilities
    (AVX512-BF16): measured 0.002-0.004; over int8 rows, the queries quantized to int8 too: 0.006-0.009; fp32
    arithmetic (AVX2): ~1e-6. A lost mask, scale, tile or column gives ~1."""
    if storage == torch.int8:
        return 0.02
    return 0.01 if path.compute == torch.bfloat16 else 1e-4


@pytest.mark.parametrize("B, G, q, L, hd, lens", [
    (1, 3, 1, 1, 64, [0]),                     # one cached position
    (2, 3, 1, 15, 64, [14, 3]),                # shorter than a tile
    (3, 3, 4, 300, 64, [296, 200, 7]),         # ragged rows, a partial last tile
    (2, 1, 9, 2100, 64, [2091, 1500]),         # several chunks, whole hidden tiles at the end
    (1, 4, 6, 777, 128, [771]),                # head dim 128
    (2, 4, 4, 530, 256, [526, 300]),           # head dim 256, 16 query rows: a Gemma 3 verification
    (4, 3, 16, 64, 64, [48, 40, 1, 0]),        # 48 query rows; a row with nothing cached before it
    (1, 3, 256, 1000, 64, [744]),              # a prefill chunk: 768 query rows, causal among themselves
    (2, 3, 100, 300, 64, [200, 0]),            # and a prompt's first chunk
])
def test_matches_fp32_sdpa(isa, tiles, B, G, q, L, hd, lens):
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, 2, G, q, L, hd, lens, L + 37, isa.compute, storage)
        assert k.stride(2) == k.shape[-1] and not k.is_contiguous()  # strided views, as caches give
        out = kernels.decode_attention(xq, k, v, attention_bias(mask, G, bias_dtype(storage, isa)))
        assert out.dtype == torch.float32 and out.shape == xq.shape
        assert rel_err(out, reference(xq, k, v, mask, G)) < tolerance(isa, storage), storage


@pytest.mark.parametrize("hd", [64, 256])  # the K tile transposed; products along the dims, rows in blocks of 4
@pytest.mark.parametrize("G", [1, 2, 3, 4])  # a step's rows: the K tile in registers at 64 dims (four rows or fewer)
def test_every_query_row_is_computed_alike_whatever_the_number_of_queries(isa, tiles, hd, G):
    """A verification forward (q new tokens) attends for its first token exactly as a one-token step does, with
    one thread as with two (G rows a step, 5 G a verification: blocks of rows end in different places)."""
    B, KV, q, L = 3, 3, 5, 1500
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, KV, G, q, L, hd, [1400, 900, 20], L, isa.compute, storage)
        bias = attention_bias(mask, G, bias_dtype(storage, isa))  # rows ordered (head in group, token)
        full = kernels.decode_attention(xq, k, v, bias).view(B, KV, G, q, hd)
        first = xq.view(B, KV, G, q, hd)[:, :, :, :1].reshape(B, KV, G, hd)
        one = kernels.decode_attention(first, k, v, attention_bias(mask[:, :, :1], G, bias_dtype(storage, isa)))
        assert torch.equal(one.view(B, KV, G, hd), full[:, :, :, 0]), storage
        with threads(1):
            assert torch.equal(kernels.decode_attention(xq, k, v, bias).view(B, KV, G, q, hd), full), storage


@pytest.mark.parametrize("q, lens", [(1, [1400, 900, 20]), (5, [1400, 900, 20]), (300, [1000, 0, 600])])
def test_a_bias_row_per_token_serves_every_query_head(isa, tiles, q, lens):
    """The bias of one row per new token [B, 1, q, L] (what the model passes the kernel) gives the bits of the bias
    repeated for each grouped query head, also where a prefill chunk's rows are split into blocks."""
    B, KV, G, L, hd = 3, 2, 3, 1500, 64
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, KV, G, q, L, hd, lens, L, isa.compute, storage)
        dtype = bias_dtype(storage, isa)
        short = kernels.decode_attention(xq, k, v, attention_bias(mask, 1, dtype))
        assert torch.equal(short, kernels.decode_attention(xq, k, v, attention_bias(mask, G, dtype)))
        with pytest.raises(RuntimeError, match="R dividing"):
            kernels.decode_attention(xq, k, v, attention_bias(mask, G + 1, dtype))


def test_fully_hidden_chunks_are_skipped_not_averaged(isa, tiles):
    """A row whose visible positions all fall in one chunk: other chunks contribute nothing (NaN in the
    hidden slots, which a kernel that read them would spread)."""
    for storage in storages(isa):
        xq, k, v, mask = ragged(1, 1, 1, 1, 4096, 64, [100], 4096, isa.compute, storage)
        poison(k[:, :, 512:])
        poison(v[:, :, 512:])
        out = kernels.decode_attention(xq, k, v, attention_bias(mask, 1, bias_dtype(storage, isa)))
        assert torch.isfinite(out).all()
        want = reference(xq, k[:, :, :101], v[:, :, :101], mask[..., :101], 1)
        assert rel_err(out, want) < tolerance(isa, storage), storage


def paged(k: torch.Tensor, v: torch.Tensor, bs: int, *, nhd: bool = False, spare: int = 5, seed: int = 0):
    """K/V [B, KV, L, hd] copied into pools [NB, KV, bs, hd] as a paged cache holds them: each row's blocks of bs
    positions (the last one partial, filled with noise) in a shuffled order among `spare` blocks of unrelated random
    data, the block table [B, nblk + 1] (int32; its last column names a spare block). `nhd`: pools stored
    [NB, bs, KV, hd] and viewed transposed (strides other than a contiguous pool's)."""
    g = torch.Generator().manual_seed(seed)
    B, KV, L, hd = k.shape
    nblk = -(-L // bs)
    NB = B * nblk + spare
    ids = torch.randperm(NB, generator=g).int()
    table = torch.cat([ids[: B * nblk].view(B, nblk), ids[-1:].expand(B, 1)], 1)  # a spare block past L
    pools = []
    for x in (k, v):
        shape = (NB, bs, KV, hd) if nhd else (NB, KV, bs, hd)
        pool = torch.randn(shape, generator=g).to(x.dtype)
        pool = pool.transpose(1, 2) if nhd else pool
        rows = torch.cat([x, torch.randn(B, KV, nblk * bs - L, hd, generator=g).to(x.dtype)], 2)
        pool[table[:, :nblk].flatten().long()] = rows.view(B, KV, nblk, bs, hd).transpose(1, 2).flatten(0, 1)
        pools.append(pool)
    return *pools, table


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("q", [1, 4, 9, 40])
def test_a_paged_cache_gives_the_bits_of_the_contiguous_one(isa, tiles, q, hd, bs):
    """Attention over K/V in blocks of a pool, read through a block table, equals attention over the same positions
    stored contiguously exactly: ragged rows, contexts over several chunks (1024) and blocks, a partial last block,
    and a context shorter than one block; pools of either stride order."""
    B, KV, G = 3, 2, 3
    for storage in storages(isa):
        for L, nhd in ((2100, False), (q + 7, True)):
            lens = [L - q, min(1500, L - q), min(37, L - q)]
            xq, k, v, mask = ragged(B, KV, G, q, L, hd, lens, L + 37, isa.compute, storage, seed=q + hd + bs)
            bias = attention_bias(mask, 1, bias_dtype(storage, isa))
            pk, pv, table = paged(k, v, bs, nhd=nhd, seed=L)
            assert kernels.takes(xq, pk, pv, bias, table)
            want = kernels.decode_attention(xq, k, v, bias)
            assert torch.equal(kernels.decode_attention(xq, pk, pv, bias, table), want), (storage, L)
            poison(pk[table[:, -1].long()])  # the table's blocks past L are never read
            assert torch.equal(kernels.decode_attention(xq, pk, pv, bias, table), want), (storage, L)


@pytest.mark.parametrize("hd", [64, 256])
@pytest.mark.parametrize("q", [1, 5])
def test_a_row_table_reads_some_rows_of_a_larger_cache_in_place(isa, tiles, q, hd):
    """A table of one block a row [m, 1] over a cache [B, KV, L, hd] of any L (a ring of 527 slots) reads the rows it
    names in place: the bits of those rows attended alone, over chunk boundaries; the other rows are never read."""
    B, KV, G, L = 5, 2, 3, 1100 + 527 * (hd == 256)
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, KV, G, q, L, hd, [L - q, 1000, 300, L - q, 7], L, isa.compute, storage, seed=q)
        bias = attention_bias(mask, 1, bias_dtype(storage, isa))
        index = torch.tensor([3, 0, 4])
        pool_k, pool_v = k.contiguous(), v.contiguous()  # [B, KV, L, row]: B blocks of L positions
        for x in (pool_k, pool_v):
            poison(x[1:3])
        table = index[:, None].to(torch.int32)
        assert kernels.takes(xq[index], pool_k, pool_v, bias[index], table)
        got = kernels.decode_attention(xq[index], pool_k, pool_v, bias[index], table)
        assert torch.equal(got, kernels.decode_attention(xq[index], k[index], v[index], bias[index])), storage


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("q", [1, 3, 9])
def test_rows_sharing_blocks_get_the_bits_of_rows_of_their_own(isa, tiles, q, hd, monkeypatch):
    """Rows whose chunks of context are the same blocks of the pool (a prompt prefix the prefix cache shares) attend
    over them in one task, their query rows together, and each row gets exactly the bits it gets over a copy of its
    own: groups over whole chunks, a chunk shared only in part, a row over the same blocks behind another bias (its
    context ends inside a shared chunk), rows of their own; and so with MAGICDEC_CASCADE=0 (a pass per row). The
    attention shares of a token's query rows (a Vegas verification asks for them) keep their bits too."""
    B, KV, G, L, shared = 6, 2, 3, 2600, 2100
    lens = [L - q, 900, L - q, L - q - 5, 1200, 1500]
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, KV, G, q, L, hd, lens, L + 37, isa.compute, storage, seed=q + hd)
        for x in (k, v):
            x[[2, 3, 5], :, :shared] = x[0, :, :shared]
        bias = attention_bias(mask, 1, bias_dtype(storage, isa))
        want, want_shares = kernels.decode_attention(xq, k, v, bias), torch.empty(B, KV, L)
        assert torch.equal(kernels.decode_attention(xq, k, v, bias, shares=want_shares, share_row=q - 1), want)
        pk, pv, table = paged(k, v, 16, seed=hd)
        assert torch.equal(kernels.decode_attention(xq, pk, pv, bias, table), want), storage
        table[[2, 3, 5], : shared // 16] = table[0, : shared // 16]  # the same blocks, not copies
        for cascade in ("1", "0"):
            monkeypatch.setenv("MAGICDEC_CASCADE", cascade)
            assert kernels.groups() == (cascade == "1")
            assert torch.equal(kernels.decode_attention(xq, pk, pv, bias, table), want), (storage, cascade)
            shares = torch.full((B, KV, L), float("nan"))
            out = kernels.decode_attention(xq, pk, pv, bias, table, shares=shares, share_row=q - 1)
            assert torch.equal(out, want) and torch.equal(shares, want_shares), (storage, cascade)


def test_a_paged_cache_is_checked(isa):
    """Block tables the kernel cannot read are refused by `takes` and by the operator, not read past a pool."""
    storage = isa.storage[0]
    xq, k, v, mask = ragged(2, 2, 3, 1, 100, 64, [99, 50], 100, isa.compute, storage)
    bias = attention_bias(mask, 1, storage)
    pk, pv, table = paged(k, v, 32)
    run = lambda *a: kernels.decode_attention(xq, *a)  # noqa: E731
    assert not kernels.takes(xq, pk, pv, bias, table.long())
    with pytest.raises(RuntimeError, match="int32"):
        run(pk, pv, bias, table.long())
    assert not kernels.takes(xq, pk, pv, bias, table[:, :3])  # 3 blocks of 32 for 100 positions
    with pytest.raises(RuntimeError, match="blocks of 32"):
        run(pk, pv, bias, table[:, :3])
    odd = torch.zeros(8, 2, 48, 64, dtype=storage)  # blocks of 48 positions, several a row
    assert not kernels.takes(xq, odd, odd, bias, table)
    with pytest.raises(RuntimeError, match="power of two"):
        run(odd, odd, bias, table)
    bad = table.clone()
    bad[1, 2] = pk.shape[0]
    with pytest.raises(RuntimeError, match="not in"):
        run(pk, pv, bias, bad)


def share_reference(xq, k, v, mask, G: int, row: int) -> torch.Tensor:
    """fp32 attention shares [B, KV, L]: the softmax probabilities of token `row`'s G query rows, summed."""
    B, KV, M, hd = xq.shape
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).repeat(1, 1, G, 1)
    k = quant.load(k, torch.float32)
    probs = (xq.float() @ k.transpose(-1, -2) * hd ** -0.5 + bias).softmax(-1)
    return probs.view(B, KV, G, M // G, -1)[:, :, :, row].sum(2)


@pytest.mark.parametrize("q, hd, L, lens", [
    (1, 64, 2100, [2099, 1500, 37]),     # several chunks, hidden tiles at the end, a row in one chunk
    (3, 64, 2100, [2097, 1029, 0]),      # a verification; a row with nothing cached before it
    (3, 128, 530, [527, 300, 16]),
    (3, 256, 300, [297, 100, 200]),
    (50, 64, 300, [250, 100, 0]),        # 150 query rows a head: two blocks of rows, share rows in both
])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_shares_are_the_summed_probabilities_of_a_tokens_query_rows(isa, tiles, layout, q, hd, L, lens):
    """shares[b, h, l]: the softmax probabilities at l of the G query rows of token share_row, against fp32 over the
    same stored values; 0 where the bias hides l; a row sums to G; the attention output keeps its bits."""
    B, KV, G = 3, 2, 3
    for storage in storages(isa):
        xq, k, v, mask = ragged(B, KV, G, q, L, hd, lens, L + 37, isa.compute, storage, seed=q + hd)
        bias = attention_bias(mask, 1, bias_dtype(storage, isa))
        if layout == "contiguous":
            operands = (k, v, bias)
        else:
            pk, pv, table = paged(k, v, 32)
            operands = (pk, pv, bias, table)
        plain = kernels.decode_attention(xq, *operands)
        for row in sorted({0, q - 1}):
            shares = torch.full((B, KV, L), float("nan"))  # every position written
            out = kernels.decode_attention(xq, *operands, shares=shares, share_row=row)
            assert torch.equal(out, plain), (storage, row)
            assert rel_err(shares, share_reference(xq, k, v, mask, G, row)) < tolerance(isa, storage), (storage, row)
            assert torch.all(shares.masked_select(~mask[:, :, row].expand(B, KV, L)) == 0), (storage, row)
            assert torch.allclose(shares.sum(-1), torch.full((B, KV), float(G)), rtol=1e-5), (storage, row)


def test_bad_shares_are_refused(isa):
    storage = isa.storage[0]
    xq, k, v, mask = ragged(2, 2, 3, 3, 100, 64, [97, 50], 100, isa.compute, storage)
    bias = attention_bias(mask, 1, storage)

    def run(shares: torch.Tensor, row: int = 0) -> torch.Tensor:
        return kernels.decode_attention(xq, k, v, bias, shares=shares, share_row=row)

    for bad in (torch.zeros(2, 2, 100, dtype=torch.bfloat16), torch.zeros(2, 2, 101), torch.zeros(2, 3, 100),
                torch.zeros(2, 2, 200)[..., ::2], torch.zeros(2, 2, 1, 100)):
        with pytest.raises(RuntimeError, match=r"shares must be a contiguous fp32 tensor \[B, KV, L\]"):
            run(bad)
    with pytest.raises(RuntimeError, match="share_row 3 is not a bias row"):
        run(torch.zeros(2, 2, 100), 3)


def token_table(pools: list[torch.Tensor], B: int, L: int, seed: int = 0):
    """Pools [NB, KV, bs, W] viewed as blocks of one position (`kernels.token_view`, in place), a token table
    [B, L + 2] (int32) of each row's L positions drawn from across the pools' blocks in a shuffled order (two spare
    entries past L), and the rows it names copied into contiguous caches [B, KV, L, W] in its order."""
    g = torch.Generator().manual_seed(seed)
    NB, _, bs, _ = pools[0].shape
    picks = torch.stack([torch.randperm(NB * bs, generator=g)[: L + 2] for _ in range(B)])  # block * bs + offset
    (views, steps) = zip(*map(kernels.token_view, pools))
    assert len(set(steps)) == 1
    table = (picks // bs * steps[0] + picks % bs).int()
    blocks, offsets = picks[:, :L] // bs, picks[:, :L] % bs
    caches = [pool.transpose(1, 2)[blocks, offsets].transpose(1, 2).contiguous() for pool in pools]
    return views, table, caches


@pytest.mark.parametrize("hd, q, L, nhd", [(64, 3, 2100, False), (64, 1, 300, True), (128, 1, 300, False),
                                           (256, 3, 100, True)])
def test_a_token_table_reads_single_positions_in_place(isa, tiles, hd, q, L, nhd):
    """Pools viewed as blocks of one position, read through a table of single positions from any blocks in any
    order, give the bits (output and shares) of the same rows gathered into a contiguous cache; so do blocks of 8.
    Pools stored [NB, KV, 32, hd] or [NB, 32, KV, hd]. The wrapper runs blocks under 16 positions on vector
    instructions; the tiles operator refuses them."""
    B, KV, G = 3, 2, 3
    for storage in storages(isa):
        xq, _, _, mask = ragged(B, KV, G, q, L, hd, [L - q, L // 2, 5], L, isa.compute, storage, seed=hd)
        bias = attention_bias(mask, 1, bias_dtype(storage, isa))
        g = torch.Generator().manual_seed(L)
        shape = (2 * B * L // 32 + 8, 32, KV, hd) if nhd else (2 * B * L // 32 + 8, KV, 32, hd)
        pools = [quant.store(torch.randn(shape, generator=g), storage) for _ in range(2)]
        (pk, pv), table, (ck, cv) = token_table([p.transpose(1, 2) if nhd else p for p in pools], B, L, seed=hd)
        assert kernels.takes(xq, pk, pv, bias, table)
        shares, want_shares = torch.empty(B, KV, L), torch.empty(B, KV, L)
        want = kernels.decode_attention(xq, ck, cv, bias, shares=want_shares, share_row=q - 1, on_tiles=False)
        out = kernels.decode_attention(xq, pk, pv, bias, table, shares=shares, share_row=q - 1)
        assert torch.equal(out, want) and torch.equal(shares, want_shares), storage
        k8, v8, table8 = paged(ck, cv, 8, seed=L)  # blocks of 8 positions
        assert kernels.takes(xq, k8, v8, bias, table8)
        assert torch.equal(kernels.decode_attention(xq, k8, v8, bias, table8), want), storage
        if tiles and storage != torch.int8:
            with pytest.raises(RuntimeError, match="at least 16"):
                kernels._ops().decode_attention_tiles(xq, pk, pv, bias, kernels.CHUNK, table)


class threads:
    """`with threads(n):` torch's intra-op threads set to n for the block."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


# --- dispatch ---------------------------------------------------------------------------------------------
def test_dispatch_follows_the_flags_and_the_switches(monkeypatch):
    before = os.environ.get("MAGICDEC_ISA")
    try:
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2", "fma", "f16c"}))
        assert force(None) is kernels.AVX2  # AVX-512 without bf16 products: the AVX2 path
        assert force("avx512bf16") is None  # forced onto a path whose flags this CPU lacks: none
        assert not kernels.supported(CPU, torch.bfloat16) and not kernels.linear_supported(CPU, torch.bfloat16)
        assert attention_path(CPU, torch.bfloat16) == "matmul"
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2", "fma"}))  # no F16C
        assert force(None) is None and kernels.path_name() == "torch"
        monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(kernels.AVX512_BF16.flags + kernels.AVX2.flags))
        assert force(None) is kernels.AVX512_BF16 and force("avx2") is kernels.AVX2
        assert force("none") is None
        with pytest.raises(ValueError, match="MAGICDEC_ISA"):
            force("sse9")
        monkeypatch.setenv("MAGICDEC_NATIVE", "0")
        assert force(None) is None and force("avx2") is None
    finally:
        monkeypatch.undo()
        force(before)
    assert attention_path(CPU, torch.float32) == "sdpa"  # fp32 caches keep SDPA
    assert not kernels.supported(torch.device("meta"), torch.bfloat16)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    """A kernel that does not compile is off for the process, said once; torch's operators run instead."""
    before = os.environ.get("MAGICDEC_ISA")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(kernels.AVX2.flags))
    broken = dataclasses.replace(kernels.AVX2, cflags=("-fno-such-compiler-flag",))
    monkeypatch.setattr(kernels, "PATHS", (kernels.AVX512_BF16, broken))
    try:
        assert force("avx2") is broken  # a path of its own: not the built one, which stays loaded
        with caplog.at_level(logging.WARNING, logger="magicdec.kernels"):
            assert not kernels.supported(CPU, torch.float16)
            assert not kernels.supported(CPU, torch.float16)
            assert attention_path(CPU, torch.float16) == "sdpa"
        assert len([r for r in caplog.records if "building them failed" in r.message]) == 1
    finally:
        monkeypatch.undo()
        force(before)


# --- the real model ---------------------------------------------------------------------------------------
_models: dict[str, Transformer] = {}


def model_on(path: kernels.IsaPath, fp32, bf16) -> Transformer:
    """The default model as it loads on `path`: bf16 and packed on AVX512-BF16, fp32 over weights packed in the path's
    default 16-bit storage on AVX2. A copy of the session's bf16 or fp32 model, packed once for the path: the
    session's models loaded on whatever path the environment forced (MAGICDEC_ISA=avx2 leaves bf16 linears unpacked,
    and torch's bf16 matmuls do not give a row the same bits in every batch)."""
    if path.name not in _models:
        _models[path.name] = copy.deepcopy((bf16 if path.compute == torch.bfloat16 else fp32).model)
        pack_linears(_models[path.name], path.storage[0])
    return _models[path.name]


def test_real_model_steps_with_and_without_the_kernel(isa, default_model, default_model_bf16, corpus_prompt,
                                                      monkeypatch):
    """The model over a real 700-token context (its prefill on the kernel too), one-token and four-token steps on
    the attention kernel against torch's attention over the same cache (bf16: measured max logit difference 0.03
    of the largest logit; fp32 arithmetic: 1e-5), same argmax."""
    model = model_on(isa, default_model, default_model_bf16)
    storage = isa.storage[0]
    ids = corpus_prompt(700, book=3, at=0.5)

    def steps(native: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels, "takes", kernels.takes if native else (lambda *a: False))
        cache = KVCache(model.cfg, 1, 800, storage, "cpu")
        with torch.inference_mode():
            model(torch.tensor([ids[:-5]]), cache)
            cache.commit(len(ids) - 5)
            return [model(torch.tensor([ids[-5:-4]]), cache)[0], model(torch.tensor([ids[-5:-1]]), cache)[0]]

    original = kernels.takes
    ours = steps(True)
    ref = steps(False)
    monkeypatch.setattr(kernels, "takes", original)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < (0.06 if isa.compute == torch.bfloat16 else 1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("lens", [[1020], [1100, 300, 1018]])
def test_real_model_verification_equals_one_token_steps_bit_for_bit(isa, default_model, default_model_bf16,
                                                                    corpus_prompt, lens):
    """On the kernels a verification forward of 9 tokens gives the logits of 9 one-token steps over the same tokens
    exactly, alone and in a ragged batch, across an attention chunk boundary (1024), and while the attended length
    grows with each step (a cache far from full): greedy speculation then emits plain decoding's tokens whatever the
    numerics round."""
    model = model_on(isa, default_model, default_model_bf16)
    for storage in storages(isa):
        verify, steps = verification_and_steps(model, corpus_prompt, lens, storage)
        assert torch.equal(verify, steps), storage


def verification_and_steps(model, corpus_prompt, lens: list[int], storage: torch.dtype):
    """The logits of a verification forward of 9 tokens after real prompts of `lens` tokens, and those of the 9
    one-token steps over the same tokens, over a cache stored in `storage`."""
    q = 9
    texts = [corpus_prompt(n + q, book=i, at=0.5) for i, n in enumerate(lens)]
    cache = KVCache(model.cfg, len(lens), 4096, storage, "cpu")
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
    return verify, torch.stack(steps, 1)


@pytest.mark.parametrize("counts", [[3, 1, 2], [1, 4, 4]])
def test_ragged_verification_gives_the_padded_ones_logits_and_shares_bit_for_bit(isa, default_model,
                                                                                  default_model_bf16, corpus_prompt,
                                                                                  counts):
    """A verification whose rows verify their own number of tokens (`Ragged`: linear layers over the real tokens,
    attention per group of rows of one count) gives each real token the logits, and the first token the attention
    shares, of the verification padded to the longest row, bit for bit: per-row draft lengths keep speculation
    exact."""
    model = model_on(isa, default_model, default_model_bf16)
    q, lens = max(counts), [700, 300, 1030]
    texts = [corpus_prompt(n + q, book=i, at=0.5) for i, n in enumerate(lens)]
    new = torch.tensor([t[-q:] for t in texts])
    ragged = Ragged(counts, "cpu")
    for storage in storages(isa):
        k, v = block_storage(model.cfg, 3 * 40 + 1, storage, "cpu")
        k.zero_(), v.zero_()
        cache = PagedKVCache(model.cfg, k, v, 3, 40)
        for i, n in enumerate(lens):
            cache.set_blocks(i, 0, list(range(1 + 40 * i, 1 + 40 * (i + 1))))
            with torch.inference_mode():
                model(torch.tensor([texts[i][:n]]), cache.row(i))
            cache.row(i).commit(n)
        cache.truncate(cache.lens.clone())
        runs = []
        for layout in (None, ragged):
            shares = AttentionShares(model.cfg, torch.device("cpu"))
            with torch.inference_mode():
                runs.append((model(new, cache, shares=shares, ragged=layout), shares.shares.clone()))
        (padded, padded_shares), (packed, packed_shares) = runs
        assert packed.shape == (sum(counts), model.cfg.vocab_size)
        assert torch.equal(ragged.pick(padded), packed), storage
        assert torch.equal(padded_shares, packed_shares), storage


# --- the packed linear layer ------------------------------------------------------------------------------
@pytest.mark.parametrize("M, K, N, bias", [
    (1, 576, 960, False),     # a decode step's qkv projection
    (7, 1536, 576, True),     # a partial row block, a bias
    (13, 100, 37, False),     # N not a multiple of the column group, K not of 32 (no tiles)
    (64, 64, 200, True),      # full row blocks
    (37, 640, 130, True),     # tiles: two full row tiles and a partial one, a partial column group
])
def test_linear_matches_fp32_and_gives_a_row_the_same_bits_in_any_batch(isa, tiles, M, K, N, bias):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).to(isa.compute)
    for storage in isa.storage:
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(storage)
        b = torch.randn(N, generator=g).to(isa.compute) if bias else None
        packed = kernels.pack_linear(w, storage)
        out = kernels.linear(x, packed, N, b)
        assert out.dtype == isa.compute and out.shape == (M, N)
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        # bf16 rounding of the output: ~0.002; fp32 sums over the stored weights: ~1e-6; a lost column gives ~1
        assert rel_err(out, ref) < tolerance(isa)
        alone = torch.cat([kernels.linear(x[i : i + 1], packed, N, b) for i in range(M)])
        assert torch.equal(alone, out)
        with threads(1):
            assert torch.equal(kernels.linear(x, packed, N, b), out)  # columns shared among threads or not
        batched = kernels.linear(x.view(1, M, K).expand(2, M, K), packed, N, b)  # leading dims kept
        assert batched.shape == (2, M, N) and torch.equal(batched[1], out)
        wide = kernels.linear(x, packed, N, b, fp32=True)  # an LM head's logits: the fp32 sums themselves
        assert wide.dtype == torch.float32 and torch.equal(wide.to(isa.compute), out)
        assert rel_err(wide, ref) <= rel_err(out, ref)


@pytest.mark.parametrize("rows, dim", [(1, 576), (37, 640), (96, 64), (5, 100)])  # 100: no multiple of 16
def test_rms_norm_matches_torch_and_gives_a_row_the_same_bits_in_any_batch(isa, rows, dim):
    g = torch.Generator().manual_seed(rows)
    x, h = (torch.randn(rows, dim, generator=g).mul(3).to(isa.compute) for _ in range(2))
    w = torch.randn(dim, generator=g).to(isa.compute)
    assert kernels.fuses(x) and not kernels.fuses(x.double())
    out = kernels.rms_norm(x, w, 1e-6)
    ref = F.rms_norm(x, (dim,), w, 1e-6)
    # torch rounds once, after the weight, as the kernel does; only its own order of summing the squares differs
    assert rel_err(out, ref) < 1e-6 if isa.compute == torch.float32 else (out != ref).float().mean() < 0.01
    assert torch.equal(torch.cat([kernels.rms_norm(x[i : i + 1], w, 1e-6) for i in range(rows)]), out)
    with threads(1):
        assert torch.equal(kernels.rms_norm(x, w, 1e-6), out)
    residual = x.clone()
    normed = kernels.rms_norm(h, w, 1e-6, residual=residual)  # residual += h, then its norm
    assert torch.equal(residual, x + h) and torch.equal(normed, kernels.rms_norm(x + h, w, 1e-6))
    strided = torch.randn(rows, 2 * dim, generator=g).to(isa.compute)[:, :dim]  # rows apart, a contiguous last dim
    assert torch.equal(kernels.rms_norm(strided, w, 1e-6), kernels.rms_norm(strided.contiguous(), w, 1e-6))


@pytest.mark.parametrize("q, D", [(1, 64), (4, 64), (3, 256)])
def test_rope_gives_torchs_bits(isa, q, D):
    g = torch.Generator().manual_seed(q)
    B, H = 3, 5
    qkv = torch.randn(B, q, H + 2, D, generator=g).to(isa.compute).transpose(1, 2)  # [B, H + 2, q, D], a view
    x = qkv[:, :H]
    angles = torch.randn(B, 1, q, D, generator=g)
    cos, sin = angles.cos().to(isa.compute), angles.sin().to(isa.compute)
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    out = rotate(x, cos, sin)  # the layers' entry: the kernel where it fuses
    assert kernels.fuses(x) and out.is_contiguous() and torch.equal(out, ref) and torch.equal(out, apply_rope(x, cos, sin))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows, hidden", [(1, 1536), (96, 1536), (7, 2048), (5, 100)])
def test_glu_is_the_activation_times_up_and_gives_a_row_the_same_bits_in_any_batch(isa, gelu, rows, hidden):
    """act(gate) * up from the fused projection's rows: torch's result, act rounded before the product; SiLU to torch's
    bits but for its exp's last-bit roundings, GELU within a bf16 rounding (it avoids 1 + tanh's cancellation where
    torch computes it: torch's float result is the less accurate one there)."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * hidden, generator=g) * 4).to(isa.compute)
    x[0, :4] = torch.tensor([0.0, 90.0, -90.0, float("inf")])
    gate, up = x.chunk(2, dim=-1)
    ref = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    out = kernels.glu(x, gelu)
    assert out.shape == (rows, hidden) and out.is_contiguous()
    finite = ref.isfinite()
    assert torch.equal(out.isfinite(), finite)

    def err(want):  # relative, but absolute near 0 (GELU of very negative gates: torch's 1 + tanh cancels to 0)
        return ((out.double() - want.double()).abs() / want.double().abs().clamp_min(1e-3))[finite]

    if isa.compute == torch.float32:  # against float64: torch's float GELU is the less accurate one
        exact = (F.gelu(gate.double(), approximate="tanh") if gelu else F.silu(gate.double())) * up.double()
        assert err(exact).max() < 1e-5
    else:
        assert err(ref).max() <= 2.0**-7  # at most one bf16 rounding apart
        assert (out != ref)[finite].float().mean() < (0.2 if gelu else 1e-4)
    assert torch.equal(torch.cat([kernels.glu(x[i : i + 1], gelu) for i in range(rows)]), out)
    with threads(1):
        assert torch.equal(kernels.glu(x, gelu), out)
    strided = torch.randn(rows, 3 * hidden, generator=g).to(isa.compute)[:, : 2 * hidden]  # rows apart
    assert torch.equal(kernels.glu(strided, gelu), kernels.glu(strided.contiguous(), gelu))


@pytest.mark.parametrize("q, D", [(1, 64), (5, 256)])
def test_store_kv_writes_what_index_put_writes(isa, q, D):
    g = torch.Generator().manual_seed(q)
    NB, KV, BS, B = 40, 3, 16, 6
    kc, vc = (torch.randn(NB, KV, BS, D, generator=g).to(isa.compute) for _ in range(2))
    k = torch.randn(B, q, KV + 2, D, generator=g).to(isa.compute).transpose(1, 2)[:, :KV]  # a projection's view
    v = torch.randn(B, KV, q, D, generator=g).to(isa.compute)
    block = torch.randperm(NB, generator=g)[: B * q].view(B, q).long()
    block[-1] = 0  # an idle row's positions, all in one block
    offset = torch.randint(0, BS, (B, q), generator=g)
    offset[-1] = torch.arange(q)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.transpose(1, 2).index_put_((block, offset), k.transpose(1, 2))
    want_v.transpose(1, 2).index_put_((block, offset), v.transpose(1, 2))
    kernels.store_kv(kc, vc, k, v, block, offset)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_the_layer_ops_switch_gives_the_layers_back_to_torch(isa, monkeypatch):
    x = torch.randn(2, 64).to(isa.compute)
    monkeypatch.setenv("MAGICDEC_FUSED", "0")
    assert not kernels.fuses(x)
    monkeypatch.setenv("MAGICDEC_FUSED", "ops")
    assert kernels.fuses(x) and not kernels.sublayers(x)
    monkeypatch.setenv("MAGICDEC_FUSED", "1")
    assert kernels.fuses(x) and kernels.sublayers(x) and not kernels.fuses(x.to("meta"))


def forward_both_ways(model, forwards, monkeypatch, ragged: list[int] | None = None) -> None:
    """Run `forwards` (token batches [B, q], in turn over one cache; then, with `ragged`, a forward of its counts of
    real tokens a row) with each layer in its two sublayer calls and with the modules' operators one by one: the same
    logits, bit for bit, and the same K/V written."""
    runs = []
    for two_calls in (True, False):
        monkeypatch.setenv("MAGICDEC_FUSED", "1" if two_calls else "ops")  # ops: the operators a call at a time
        B = forwards[0].shape[0]
        q = max(ragged) if ragged else 0
        cache = KVCache(model.cfg, B, sum(t.shape[1] for t in forwards) + q, weight_dtype(model), "cpu")
        logits = []
        with torch.inference_mode():
            for tokens in forwards:
                assert model.layers[0]._in_two_calls(model.tok_embeddings(tokens)) == two_calls
                logits.append(model(tokens, cache))
                cache.commit(tokens.shape[1])
            if ragged:  # a verification of drafts of different lengths: [N, vocab] for the real tokens
                logits.append(model(forwards[-1][:, :q], cache, ragged=Ragged(ragged, "cpu")))
        runs.append((logits, cache.k.clone(), cache.v.clone()))
    (native, k1, v1), (modules, k2, v2) = runs
    assert all(torch.equal(a, b) for a, b in zip(native, modules))
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


LAYER_VARIANTS = {"llama": {}, "gemma-like": dict(qkv_bias=True, qk_norm=True, sandwich_norms=True,
                                                   activation="gelu_tanh", query_pre_attn_scalar=24.0)}


@pytest.mark.parametrize("variant", LAYER_VARIANTS)
def test_a_layer_in_two_sublayer_calls_gives_the_modules_bits(isa, tiny_llama, variant, monkeypatch):
    """`kernels.attention_in` / `attention_out` (a layer's operators before and after its attention, one call each)
    give what the modules' operators give, over a prefill, a one-token step, a verification-sized forward and a ragged
    one (per-row draft lengths): with QKV biases, Q/K norms, sandwich norms, GELU and a query scale (Gemma's) as
    without."""
    cfg = dataclasses.replace(tiny_llama[0].model.cfg, **LAYER_VARIANTS[variant])
    torch.manual_seed(0)
    model = Transformer(cfg)
    randomize_(model, seed=3)
    model = model.to(isa.compute).eval().requires_grad_(False)
    pack_linears(model, isa.storage[0])
    g = torch.Generator().manual_seed(1)
    forwards = [torch.randint(0, cfg.vocab_size, (3, q), generator=g) for q in (9, 1, 3)]
    forward_both_ways(model, forwards, monkeypatch, ragged=[3, 1, 2])


def test_the_real_model_in_two_sublayer_calls_gives_the_modules_bits(default_model_bf16, corpus_prompt, monkeypatch):
    """The same on the default model in bf16 over a book, where the CPU's path computes in bf16."""
    model = default_model_bf16.model
    ids = torch.tensor([corpus_prompt(200, book=2), corpus_prompt(200, book=4)])
    if not model.layers[0]._in_two_calls(model.tok_embeddings(ids)):
        pytest.skip("the layer operators do not compute in bf16 on this path")
    forward_both_ways(model, [ids[:, :196], ids[:, 196:197], ids[:, 197:200]], monkeypatch)


def test_top_positions_selects_by_score_and_breaks_ties_to_the_lower_position(isa):
    assert kernels.selects(torch.zeros(1))
    for heads in (1, 3):
        shares = torch.rand(6, heads, 500) ** 4
        scores = shares.sum(1)  # selected by the sum over the heads
        got = kernels.top_positions(shares, torch.tensor([480, 30, 9]), 4, 16)
        for r in range(6):
            hi = (480, 30, 9)[r % 3]
            n = min(16, max(0, hi - 4))
            want = (4 + scores[r, 4:hi].topk(n).indices).sort().values.tolist() if n else []
            assert got[r].tolist() == [-1] * (16 - n) + want
    scores = torch.zeros(4, 1, 300)
    scores[:, :, 250] = 0.5  # one clear winner, then 299 equal scores
    got = kernels.top_positions(scores, torch.tensor([290, 100]), 4, 6)
    assert got[0].tolist() == [4, 5, 6, 7, 8, 250] and got[2].tolist() == [4, 5, 6, 7, 8, 250]
    assert got[1].tolist() == got[3].tolist() == [4, 5, 6, 7, 8, 9]  # row 1 ends before position 250
    assert kernels.top_positions(scores, torch.tensor([7, 3]), 4, 6)[1].tolist() == [-1] * 6


def test_unpack_linear_gives_back_the_packed_weight(isa):
    """A draft head over part of an untied, packed LM head takes its rows from the packed weight."""
    w = torch.randn(100, 64)  # columns past 100 fill the last group with zeros
    storage = isa.storage[0]
    assert torch.equal(kernels.unpack_linear(kernels.pack_linear(w, storage), 100), w.to(storage))


@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears_swaps_every_linear_layer(isa, tiny_llama, tied):
    """A load-time transform: each nn.Linear becomes a PackedLinear (a tied LM head gets its own copy of
    the embedding table), and the model computes what it did (16-bit rounding apart)."""
    cfg = dataclasses.replace(tiny_llama[0].model.cfg, tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model = model.to(isa.compute).eval().requires_grad_(False)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    storage = isa.storage[0]
    with torch.inference_mode():
        before = model(tokens, KVCache(cfg, 2, 16, storage, "cpu"))
        pack_linears(model, storage)
        after = model(tokens, KVCache(cfg, 2, 16, storage, "cpu"))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * cfg.n_layers + 1
    assert model.output.fp32 and not any(m.fp32 for m in model.layers.modules() if isinstance(m, PackedLinear))
    assert weight_dtype(model) == storage and model.dtype == isa.compute
    # rounding order apart (bf16 model: measured 0 here; fp32 over fp16 weights: 1e-3); a misplaced weight gives ~1
    assert rel_err(after, before) < 0.03


def test_pack_linears_leaves_fp32_weights_alone(tiny_llama):
    """An fp32 model asked for as such keeps torch's fp32 linear layers on every path (the reference)."""
    model = tiny_llama[0].model
    pack_linears(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert weight_dtype(model) == torch.float32


# --- the sampler ------------------------------------------------------------------------------------------------
SAMPLER_CASES = {
    "top-p": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k": SamplingParams(temperature=1.0, top_k=40),
    "top-k and top-p": SamplingParams(temperature=1.2, top_k=300, top_p=0.95),
    "wide top-k": SamplingParams(temperature=1.0, top_k=2000),
    "temperature only": SamplingParams(temperature=0.7),
}


def sample_both_ways(logits, rows, position, monkeypatch, ids=None):
    """sample_tokens with the native sampler and with torch's operators."""
    monkeypatch.setenv("MAGICDEC_FUSED", "1")
    native = sample_tokens(logits, rows, position, ids)
    monkeypatch.setenv("MAGICDEC_FUSED", "0")
    torch_ops = sample_tokens(logits, rows, position, ids)
    monkeypatch.setenv("MAGICDEC_FUSED", "1")
    return native, torch_ops


@pytest.mark.parametrize("case", SAMPLER_CASES)
def test_the_sampler_draws_what_torch_draws_on_the_real_model(isa, default_model, corpus_prompt, monkeypatch, case):
    """On the default model's logits over a book, the native draw (from the candidates under top-k or top-p, from every
    token under temperature alone) gives torch's tokens, a row alone the same as in a batch, and leaves to the full
    path what it cannot draw (top-k past the candidates)."""
    ids = torch.tensor([corpus_prompt(192, book=3)])
    model = default_model.model
    cache = KVCache(model.cfg, 1, ids.shape[1], torch.float32, "cpu")
    with torch.inference_mode():
        logits = model(ids, cache)[0].view(64, 3, -1)  # [B, q, V]: rows of three positions
    params = SAMPLER_CASES[case]
    rows = RowParams.of([params] * 64, list(range(64)), "cpu")
    position = torch.arange(192).view(64, 3)
    native, torch_ops = sample_both_ways(logits, rows, position, monkeypatch)
    assert torch.equal(native, torch_ops)
    assert kernels.samples(logits)
    _, done = kernels.sample(logits, rows.greedy, rows.temperature, rows.top_k, rows.top_p, rows.seed, position, None,
                             CPU_CANDIDATES)
    if params.top_k > CPU_CANDIDATES[-1]:
        assert not done.any()
    elif params.top_k == 0 and params.top_p == 1:  # temperature alone: every token races, natively
        assert done.all()
    else:
        assert done.float().mean() > 0.8
    for r in (0, 17, 63):
        alone = sample_tokens(logits[r : r + 1], rows.row(r), position[r : r + 1])
        assert torch.equal(alone[0], native[r])


def test_the_sampler_leaves_rows_it_cannot_draw_to_the_full_path(isa):
    """NaN, +inf and all -inf rows are not drawn natively; greedy rows are done with token 0; a head over part of
    the vocabulary returns token ids."""
    V = 5000
    logits = torch.randn(6, 1, V) * 4
    logits[0, 0, 7] = float("nan")
    logits[1, 0, 9] = float("inf")
    logits[2] = float("-inf")
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 3 + [SamplingParams()]
    params += [SamplingParams(temperature=1.0, top_k=3)] * 2
    rows = RowParams.of(params, list(range(6)), "cpu")
    position = torch.zeros(6, 1, dtype=torch.long)
    head = torch.arange(V) * 3 + 1
    tokens, done = kernels.sample(logits, rows.greedy, rows.temperature, rows.top_k, rows.top_p, rows.seed, position,
                                  head, CPU_CANDIDATES)
    assert done[:, 0].tolist() == [False, False, False, True, True, True]
    assert tokens[3, 0] == 0
    assert all(tokens[r, 0] in head[logits[r, 0].topk(3).indices] for r in (4, 5))


# --- speculation on the AVX2 path -------------------------------------------------------------------------
_llms: dict = {}


@pytest.mark.parametrize("draft, cache", [("self-streaming", None), ("self-snapkv", None), ("self-vegas", None),
                                          ("self-quant", None), ("model", "dense"), ("model", "streaming"),
                                          ("model", "snapkv")])
def test_every_drafter_greedy_equals_plain_decoding(isa, default_path, corpus_prompt, draft, cache):
    """Greedy speculation on the kernels emits plain decoding's tokens exactly, with every drafter (the bf16 path:
    test_dtype.py, with a bf16 model asked for; here the model `dtype="auto"` loads on the AVX2 path)."""
    from magicdec.engine import LLM
    from magicdec.speculative import SpeculativeConfig

    if isa.compute != torch.float32:
        pytest.skip("test_dtype.py::test_every_drafter_with_a_bf16_target covers the bf16 path")
    if isa.name not in _llms:
        llm = LLM(device="cpu", max_model_len=1024)
        prompts = [corpus_prompt(n, book=b, at=0.3) for n, b in ((160, 7), (100, 8))]
        plain = llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=16, ignore_eos=True))
        _llms[isa.name] = llm, prompts, [o.token_ids for o in plain]
    llm, prompts, plain = _llms[isa.name]
    assert (llm.attention, llm.linear, llm.kernels, llm.kv_dtype) == ("native", "packed", isa.name, isa.storage[0])
    spec = SpeculativeConfig(draft, budget=64, gamma=3, draft_model=str(default_path) if cache else None,
                             draft_cache=cache or "streaming")
    outs = llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=16, ignore_eos=True),
                        speculative=spec)
    assert llm.last_stats.acceptance_rate > 0.3  # the drafter drafts something the target accepts
    assert [o.token_ids for o in outs] == plain

