"""Automatic prefix caching: block keys, the pool's LRU and limits, and hits that decode exactly like cold prefills
(tiny random model for the mechanics, the real model for every drafter, fp32 and the native bf16 kernels)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_engine
from magicdec.drafters.model_draft import ModelDrafter
from magicdec.drafters.self_spec import SelfSpecDrafter
from magicdec.kv import KVCache
from magicdec.kv.prefix_cache import BLOCK_SIZE, PrefixCache, block_keys
from magicdec.prefill import OBSERVATION_WINDOW, prefill_chunks
from magicdec.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3)


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool(model, tokens: int) -> PrefixCache:
    return PrefixCache(model.cfg, PrefixCache.bytes_for(model.cfg, tokens, model.dtype), model.dtype)


def outputs(requests) -> list[list[int]]:
    return [r.output_ids for r in requests]


# --- keys and chunks ------------------------------------------------------------------------------------------
def test_block_keys_chain_their_prefix():
    a = random_ids(3 * BLOCK_SIZE + 5, 0)
    b = a[:BLOCK_SIZE] + [7] + a[BLOCK_SIZE + 1 :]  # differs in block 1 only
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 3 and len(block_keys(a[: BLOCK_SIZE - 1])) == 0
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a block's key depends on its whole prefix
    assert block_keys(a[:BLOCK_SIZE] * 2)[1] != ka[0]  # the same tokens at another depth differ


@pytest.mark.parametrize("n,chunk,start", [(40, 16, 0), (1100, 256, 0), (1100, 256, 320), (1100, 256, 1056),
                                            (64, 512, 32), (33, 8, 0)])
def test_prefill_chunks_after_a_hit_keep_the_cold_grid(n, chunk, start):
    """The chunks after a cached prefix end where a cold prefill's chunks end, the observation window last."""
    cold = prefill_chunks(n, chunk)
    warm = prefill_chunks(n, chunk, start)
    assert warm[0][0] == start and warm[-1] == cold[-1] == (n - min(OBSERVATION_WINDOW, n), n)
    assert all(e - s <= chunk for s, e in warm[:-1]) and all(a[1] == b[0] for a, b in zip(warm, warm[1:]))
    assert {e for _, e in warm} <= {e for _, e in cold} | {start}


# --- the pool ---------------------------------------------------------------------------------------------------
def fill_row(model, tokens: list[int]) -> KVCache:
    """A one-row cache whose leading slots hold distinct K/V per token (random, so copies can be checked)."""
    cache = KVCache(model.cfg, 1, len(tokens) + 8, model.dtype, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    cache.commit(len(tokens))
    return cache


def test_pool_is_lru_bounded_and_evicts_a_chains_tail_first(tiny_llama):
    model = tiny_llama[0].model
    cache = pool(model, 4 * BLOCK_SIZE)
    a, b = random_ids(3 * BLOCK_SIZE, 1), random_ids(2 * BLOCK_SIZE, 2)
    cache.store(a, fill_row(model, a))
    assert len(cache.blocks) == 3 and cache.nbytes == 3 * cache.block_bytes
    cache.store(b, fill_row(model, b))  # one block of `a` must go: its last one
    assert cache.nbytes <= cache.max_bytes and len(cache.blocks) == 4
    assert cache.cached_prefix(block_keys(a)) == 2 and cache.cached_prefix(block_keys(b)) == 2


def test_load_copies_the_stored_entries(tiny_llama):
    model = tiny_llama[0].model
    cache = pool(model, 8 * BLOCK_SIZE)
    ids = random_ids(3 * BLOCK_SIZE + 7, 3)
    src = fill_row(model, ids)
    cache.store(ids, src)
    keys = cache.match(block_keys(ids), len(ids))
    assert len(keys) == 3 and cache.queries == len(ids) and cache.hits == 3 * BLOCK_SIZE
    row = KVCache(model.cfg, 1, len(ids) + 8, model.dtype, "cpu")
    cache.load(keys, row)
    n = 3 * BLOCK_SIZE
    assert int(row.lens[0]) == n and int(row.next_pos[0]) == n and not cache.pinned
    assert torch.equal(row.k[:, :, :, :n], src.k[:, :, :, :n]) and torch.equal(row.v[:, :, :, :n], src.v[:, :, :, :n])


def test_matched_blocks_are_never_evicted_before_they_are_copied(tiny_llama):
    model = tiny_llama[0].model
    cache = pool(model, 2 * BLOCK_SIZE)
    a, b = random_ids(2 * BLOCK_SIZE, 4), random_ids(2 * BLOCK_SIZE, 5)
    cache.store(a, fill_row(model, a))
    keys = cache.match(block_keys(a), len(a))
    cache.store(b, fill_row(model, b))  # the pool is full of pinned blocks: b is not stored
    assert cache.cached_prefix(block_keys(a)) == 2 and cache.cached_prefix(block_keys(b)) == 0
    cache.load(keys, KVCache(model.cfg, 1, 3 * BLOCK_SIZE, model.dtype, "cpu"))
    cache.store(b, fill_row(model, b))  # unpinned now: b evicts a
    assert cache.cached_prefix(block_keys(b)) == 2 and cache.cached_prefix(block_keys(a)) == 0


def test_a_chain_longer_than_the_pool_keeps_its_head_and_a_tiny_pool_is_off(tiny_llama):
    model = tiny_llama[0].model
    ids = random_ids(6 * BLOCK_SIZE, 6)
    cache = pool(model, 2 * BLOCK_SIZE)
    cache.store(ids, fill_row(model, ids))
    assert cache.cached_prefix(block_keys(ids)) == 2
    tiny = PrefixCache(model.cfg, cache.block_bytes - 1, model.dtype)
    tiny.store(ids, fill_row(model, ids))
    assert not tiny.enabled and not tiny.blocks and tiny.match(block_keys(ids), len(ids)) == []


# --- the engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_doc():
    """Prompts sharing a 300-token document, then distinct questions (one shorter than a block)."""
    doc = random_ids(300, 7)
    return [doc + random_ids(n, 10 + n) for n in (9, 50, 77)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_hits_decode_like_cold_prefills(tiny_llama, shared_doc, params):
    """Requests served from the prefix cache (the shared document, then whole prompts, then a chat's next turn
    with the first turn's output) give the same tokens as the same requests cold."""
    model = tiny_llama[0].model
    cold, _ = run_engine(model, shared_doc, params)
    cache = pool(model, 4096)
    first, stats = run_engine(model, shared_doc, params, prefix_cache=cache, prefill_chunk=64)
    assert outputs(first) == outputs(cold)
    # the repeats waited for the first prefill of the document and copied its blocks
    assert stats.cached_tokens == 2 * (300 // BLOCK_SIZE) * BLOCK_SIZE
    again, stats = run_engine(model, shared_doc, params, prefix_cache=cache, prefill_chunk=64)
    assert outputs(again) == outputs(cold)
    assert all(r.cached_tokens >= len(r.prompt_ids) - OBSERVATION_WINDOW - BLOCK_SIZE for r in again)
    turn2 = [p + r.output_ids + random_ids(OBSERVATION_WINDOW + 8, 30 + i) for i, (p, r) in enumerate(zip(shared_doc, cold))]
    cold2, _ = run_engine(model, turn2, params)
    warm2, stats = run_engine(model, turn2, params, prefix_cache=cache)
    assert outputs(warm2) == outputs(cold2)
    # the history, generated tokens included, came from the cache
    assert all(r.cached_tokens >= len(p) + len(o.output_ids) - BLOCK_SIZE for r, p, o in zip(warm2, shared_doc, cold))


def test_a_pool_too_small_runs_requests_uncached(tiny_llama, shared_doc):
    """Eviction under pressure while requests run (a pool of 3 blocks) never changes a token."""
    model = tiny_llama[0].model
    cold, _ = run_engine(model, shared_doc * 2, GREEDY, slots=2)
    small, _ = run_engine(model, shared_doc * 2, GREEDY, slots=2, prefix_cache=pool(model, 3 * BLOCK_SIZE))
    assert outputs(small) == outputs(cold)


def test_an_aborted_request_leaves_valid_blocks(tiny_llama, shared_doc):
    """A request aborted mid-prefill stores the blocks it computed; a later request reusing them is exact."""
    from conftest import drive

    model = tiny_llama[0].model
    cache = pool(model, 4096)
    cold, _ = run_engine(model, shared_doc[:1], GREEDY)
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine

    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, prefill_chunk=64, max_prefill_tokens=64), prefix_cache=cache)
    engine.add_request("gone", shared_doc[0], GREEDY)
    engine.step()
    engine.step()  # two chunks of 64 prefilled
    engine.abort_request("gone")
    assert cache.cached_prefix(block_keys(shared_doc[0])) == 128 // BLOCK_SIZE
    warm = drive(engine, shared_doc[:1], [GREEDY], [0])
    assert outputs(warm) == outputs(cold) and warm[0].cached_tokens == 128


DRAFTERS = {
    "self-streaming": lambda m: SelfSpecDrafter(m, "streaming", 64, 3, reindex=True),
    "self-snapkv": lambda m: SelfSpecDrafter(m, "snapkv", 96, 3, reindex=False),
    "model-dense": lambda m: ModelDrafter(m, "dense", 64, 3, reindex=True),
    "model-snapkv": lambda m: ModelDrafter(m, "snapkv", 96, 3, reindex=False),
}


@pytest.fixture(scope="module")
def real_prompts(corpus_prompt):
    """A 330-token book excerpt shared by three prompts with different continuations."""
    doc = corpus_prompt(330, book=3, at=0.4)
    return [doc + corpus_prompt(n, book=b, at=0.2) for n, b in ((40, 4), (90, 5), (7, 6))]


# every drafter in fp32 (which every CPU runs), and one of each kind on the native bf16 kernels: the hit's copy and
# the drafters' start from it are the same code in both dtypes
@pytest.mark.parametrize(("dtype", "drafter"), [*(("fp32", d) for d in DRAFTERS), ("native-bf16", "self-snapkv"),
                                                ("native-bf16", "model-dense")])
def test_every_drafter_is_exact_from_a_hit_on_the_real_model(default_model, real_prompts, drafter, dtype, request):
    """On SmolLM2: speculative decoding from prefix-cache hits (the document, then whole prompts) gives the tokens
    of the same requests prefilled cold, greedy and seeded-sampled, in fp32 and with the native bf16 kernels."""
    if dtype == "fp32":
        model = default_model.model
    else:
        from magicdec import kernels

        if not (kernels.supported(torch.device("cpu"), torch.bfloat16)):
            pytest.skip("no native bf16 kernels on this CPU")
        model = request.getfixturevalue("default_model_bf16").model
    make = DRAFTERS[drafter]
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SAMPLED, SamplingParams(max_tokens=8, ignore_eos=True)]
    cold, _ = run_engine(model, real_prompts, params, drafter=make(model), gamma=3)
    cache = PrefixCache(model.cfg, 1 << 28, model.dtype)
    warm, stats = run_engine(model, real_prompts, params, drafter=make(model), gamma=3, prefix_cache=cache)
    again, stats2 = run_engine(model, real_prompts, params, drafter=make(model), gamma=3, prefix_cache=cache)
    assert outputs(warm) == outputs(cold) and outputs(again) == outputs(cold)
    assert stats.cached_tokens >= 2 * 288 and stats2.cached_tokens >= sum(len(p) for p in real_prompts) - 3 * 64
