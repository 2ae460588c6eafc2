"""Query-aware drafts (self-vegas): the attention shares, the selection, the in-place tables, and exactness."""

from __future__ import annotations

import pytest
import torch

from magicdec.config import GLOBAL, ModelConfig
from magicdec.drafters import VegasDrafter
from magicdec.engine import LLM
from magicdec.kv.blocks import BLOCK_SIZE, NULL_BLOCK, block_storage
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.sparse import DEFAULT_SINK
from magicdec.kv.vegas import AttentionShares, VegasKVCache, select, vegas_top, vegas_window
from magicdec.model import attention_shares
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig


def test_attention_shares_are_the_tokens_softmax_summed_over_its_heads():
    torch.manual_seed(0)
    B, KV, G, q, L, hd = 2, 3, 2, 3, 40, 16
    xq, keys = torch.randn(B, KV, G * q, hd), torch.randn(B, KV, L, hd)
    mask = torch.rand(B, 1, q, L) > 0.3
    bias = torch.zeros(B, 1, q, L).masked_fill(~mask, float("-inf"))
    for row in range(q):
        got = attention_shares(xq, keys, bias, row, q)
        want = torch.zeros(B, KV, L)
        for g in range(G):
            s = torch.einsum("bkd,bkld->bkl", xq[:, :, g * q + row], keys) / hd**0.5
            want += (s + bias[:, :, row]).softmax(-1)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got.sum(-1), torch.full((B, KV), float(G)))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_select_keeps_the_top_positions_between_the_sink_and_the_window(native, monkeypatch):
    from magicdec import kernels

    if native and not kernels.selects(torch.zeros(1)):
        pytest.skip("no native layer operators on this CPU")
    if not native:
        monkeypatch.setenv("MAGICDEC_FUSED", "0")
    layers, B, KV, L, top, window = 2, 3, 2, 64, 5, 8
    shares = torch.rand(layers, B, KV, L)
    scores = shares.sum(2)  # selected by the sum over the KV heads
    lens = torch.tensor([60, 16, 12])  # row 1: 4 selectable positions; row 2: none
    chosen = select(shares, lens, top, window)
    assert chosen.shape == (B, layers, top)
    for b in range(B):
        lo, hi = DEFAULT_SINK, int(lens[b]) - window
        for layer in range(layers):
            picked = chosen[b, layer]
            n = max(0, min(top, hi - lo))
            assert (picked[: top - n] == -1).all() and (picked[top - n :] >= 0).all()  # as many in every layer
            assert picked[top - n :].tolist() == sorted(picked[top - n :].tolist())
            if n:
                expect = (lo + scores[layer, b, lo:hi].topk(n).indices).sort().values
                assert picked[top - n :].tolist() == expect.tolist()


def test_vegas_budget_splits_into_sink_selection_and_window():
    for budget in (8, 64, 128, 256, 512):
        assert DEFAULT_SINK + vegas_top(budget) + vegas_window(budget) == budget and vegas_top(budget) > 0


def paged_rows(cfg, rows: int, blocks_per_row: int, positions: list[int]):
    """A PagedKVCache over a random pool, its rows mapped to shuffled blocks, holding `positions`."""
    nb = rows * blocks_per_row + 1
    k, v = block_storage(cfg, nb, torch.float32, "cpu")  # head-major, as the KV manager's
    k.normal_(), v.normal_()
    cache = PagedKVCache(cfg, k, v, rows, blocks_per_row)
    ids = (torch.randperm(nb - 1) + 1).view(rows, blocks_per_row)
    for r in range(rows):
        cache.set_blocks(r, 0, ids[r].tolist())
    cache.lens.copy_(torch.tensor(positions))
    cache.next_pos.copy_(torch.tensor(positions))
    return cfg, cache


def test_the_tables_name_the_rows_own_positions_once_each(default_model):
    cfg, target = paged_rows(default_model.model.cfg, 3, 6, [150, 40, 3])
    draft = VegasKVCache(cfg, target, top=6, window=8)
    draft.follow(target.lens.clone(), torch.tensor([True, True, False]))
    shares = torch.rand(cfg.n_layers, 3, cfg.n_kv_heads, 192)
    draft.selected.copy_(select(shares, target.lens, 6, 8))
    q = 3
    mask = draft.attn_mask(q)
    E = DEFAULT_SINK + 6 + 8 + q
    assert mask.shape == (3, 1, q, E)
    assert draft._token_tables.dtype == torch.int32  # what the native kernels read tables in
    held = mask[:, 0, 0, : DEFAULT_SINK + 6 + 8].sum(1)
    assert draft.entries_read.tolist() == held.tolist()
    for layer in range(cfg.n_layers):
        table = draft._token_tables[layer]
        for b in range(3):
            n = int(draft.next_pos[b])  # row 2 follows nothing: its draft row is empty
            held = mask[b, 0, q - 1]  # the last new token sees every held entry
            flat = table[b][held]
            pos_of = {int(target.tables[b, p // BLOCK_SIZE]) * draft.step + p % BLOCK_SIZE: p for p in range(n + q)}
            positions = [pos_of[int(f)] for f in flat]  # every entry is one of the row's own positions
            assert len(set(positions)) == len(positions)  # none read twice
            assert set(range(min(n, DEFAULT_SINK))) <= set(positions)
            assert set(range(max(DEFAULT_SINK, n - 8), n + q)) <= set(positions)  # the window and the new tokens
            sel = draft.selected[b, layer]
            assert set(sel[sel >= 0].tolist()) <= set(positions)
    block, offset = draft._write
    assert (block[2] == NULL_BLOCK).all()  # a row that is not drafting writes nowhere of the target's
    assert block[0].tolist() == [int(target.tables[0, p // BLOCK_SIZE]) for p in range(150, 153)]


def test_shares_recorder_keeps_the_global_layers_only(default_model):
    cfg = default_model.model.cfg
    shares = AttentionShares(cfg, torch.device("cpu"))
    assert all(shares.buffer(layer, (1, 1, 4)) is not None for layer in cfg.layers_of(GLOBAL))
    assert shares.shares.shape == (len(cfg.layers_of(GLOBAL)), 1, 1, 4)


def test_shares_storage_is_kept_from_forward_to_forward():
    """Each forward's shares are a view of one storage, grown (with room for a longer context) only when a forward
    outgrows it: a buffer allocated each round was faulted in afresh."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, head_dim=8)
    shares = AttentionShares(cfg, torch.device("cpu"))
    first = shares.buffer(0, (4, 2, 100))
    storage = shares.shares.data_ptr()
    for L in (100, 101, 60, 125):  # the context grows by a round's tokens, a batch shrinks: the same storage
        shares.start()
        assert shares.buffer(1, (4, 2, L)).shape == (4, 2, L)
        assert shares.shares.shape == (3, 4, 2, L) and shares.shares.data_ptr() == storage
    shares.start()
    shares.buffer(0, (4, 2, 126))
    assert shares.shares.data_ptr() != storage and first.shape == (4, 2, 100)


def test_planned_memory_covers_the_largest_shares_storage(default_model):
    """A Vegas drafter's planned bytes (what the engine's memory check counts) cover its selections and the shares'
    storage grown for a verification of every slot over the whole capacity."""
    model = default_model.model
    drafter = VegasDrafter(model, 256, 2)
    slots, capacity = 4, 1000
    cfg = model.cfg
    for L in (capacity - 1, capacity):  # grown at the last-but-one forward, with room left for the last
        drafter.shares.start()
        drafter.shares.buffer(0, (slots, cfg.n_kv_heads, L))
    selections = slots * (cfg.n_layers * vegas_top(256) * 8 + 1)
    storage = drafter.shares._storage
    assert selections + storage.numel() * storage.element_size() <= drafter.cache_bytes(slots, capacity, model.dtype)


@pytest.fixture(scope="module")
def native_llm():
    """The default model as `LLM` loads it by default: bf16 on the native kernels where the CPU has AVX512-BF16, fp32
    with 16-bit storage on AVX2, torch's operators elsewhere."""
    return LLM(device="cpu", max_model_len=2048)


@pytest.mark.parametrize("gamma, budget", [(2, 64), (4, 128)])
def test_greedy_and_seeded_sampling_equal_plain_decoding(native_llm, corpus_prompt, gamma, budget):
    """The real SmolLM2 as loaded by default (the native kernels read the token tables and leave the shares):
    self-vegas's tokens are plain decoding's, greedy and seeded sampled, over ragged prompts longer than the
    budget."""
    llm = native_llm
    prompts = [corpus_prompt(n, book=b, at=0.4) for n, b in ((700, 3), (260, 5), (1100, 9))]
    spec = SpeculativeConfig("self-vegas", budget=budget, gamma=gamma)
    for params in (SamplingParams(max_tokens=40, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)):
        plain = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
        outs = llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)
        assert [o.token_ids for o in outs] == plain
        assert llm.last_stats.acceptance_rate > 0.3

