"""Automatic prefix caching over the KV manager's blocks: block keys, the pool's LRU of cached blocks, hits that map
cached blocks, and hits that decode exactly like cold prefills (tiny random model for the mechanics, the real model
for every drafter, fp32 and the native bf16 kernels)."""

from __future__ import annotations

import pytest
import torch

from conftest import kv_pool, run_engine
from magicdec.drafters.model_draft import ModelDrafter
from magicdec.drafters.self_spec import SelfSpecDrafter
from magicdec.drafters.vegas import VegasDrafter
from magicdec.kv.blocks import BLOCK_SIZE, NULL_BLOCK, KVManager, block_keys
from magicdec.prefill import OBSERVATION_WINDOW, prefill_chunks
from magicdec.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3)


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_pool(model, n_blocks: int, caching: bool = True) -> KVManager:
    """A KV manager of `n_blocks` blocks (the null block included) in the model's dtype."""
    return kv_pool(model, n_blocks * KVManager.block_bytes(model.cfg, model.dtype), model.dtype, caching=caching)


def outputs(requests) -> list[list[int]]:
    return [r.output_ids for r in requests]


def cache_request(kv: KVManager, request_id: str, tokens: list[int]) -> list[int]:
    """What a request that prefilled `tokens` leaves behind: its full blocks keyed, then let go. Returns its blocks."""
    kv.match(request_id, [], len(tokens))
    blocks = kv.grow(request_id, len(tokens))
    assert blocks is not None
    kv.store(request_id, tokens, len(tokens))
    kv.free(request_id)
    return blocks


# --- keys and chunks ------------------------------------------------------------------------------------------
def test_block_keys_chain_their_prefix():
    a = random_ids(3 * BLOCK_SIZE + 5, 0)
    b = a[:BLOCK_SIZE] + [7] + a[BLOCK_SIZE + 1 :]  # differs in block 1 only
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 3 and len(block_keys(a[: BLOCK_SIZE - 1])) == 0
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a block's key depends on its whole prefix
    assert block_keys(a[:BLOCK_SIZE] * 2)[1] != ka[0]  # the same tokens at another depth differ
    assert block_keys(a, 1, ka[0]) == ka[1:]  # a chain continued from its parent's key


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
def test_pool_is_lru_bounded_and_evicts_a_chains_tail_first(tiny_llama):
    model = tiny_llama[0].model
    kv = blocks_pool(model, 5)  # four blocks for requests
    a, b = random_ids(3 * BLOCK_SIZE, 1), random_ids(2 * BLOCK_SIZE, 2)
    cache_request(kv, "a", a)
    assert kv.cached_prefix(block_keys(a)) == 3 and kv.num_free == 4 and kv.usage == 0
    assert len(kv.pool.by_key) == 3 and len(kv.pool.evictable) == 3
    cache_request(kv, "b", b)  # one block of `a` must go: its last one
    assert len(kv.pool.by_key) == 4 and kv.num_free == 4
    assert kv.cached_prefix(block_keys(a)) == 2 and kv.cached_prefix(block_keys(b)) == 2
    # touching `a` (a hit) makes it the most recently used: the next eviction takes b's tail
    kv.match("a2", block_keys(a), len(a))
    kv.free("a2")
    cache_request(kv, "c", random_ids(BLOCK_SIZE, 3))
    assert kv.cached_prefix(block_keys(a)) == 2 and kv.cached_prefix(block_keys(b)) == 1


def test_a_hit_maps_the_cached_blocks(tiny_llama):
    """A hit holds the blocks that computed the prefix (reference counted): no block is taken or copied."""
    model = tiny_llama[0].model
    kv = blocks_pool(model, 16)
    ids = random_ids(3 * BLOCK_SIZE + 7, 3)
    first = cache_request(kv, "first", ids)
    k0, v0 = kv.k[:, first].clone(), kv.v[:, first].clone()  # (blocks never written hold whatever memory held)
    free = kv.num_free
    hit = kv.match("second", block_keys(ids), len(ids))
    assert hit == first[:3] and kv.blocks_of("second") == first[:3]
    assert kv.queries == 2 * len(ids) and kv.hits == 3 * BLOCK_SIZE  # the first request's query found nothing
    assert [kv.pool.refs[b] for b in hit] == [1, 1, 1] and kv.num_free == free - 3 and kv.usage == 3 / 15
    for pool, before in ((kv.k, k0), (kv.v, v0)):  # (positions never written may hold NaN)
        torch.testing.assert_close(pool[:, first], before, rtol=0, atol=0, equal_nan=True)
    new = kv.grow("second", len(ids) + 1)  # only the block past the hit is new
    assert len(new) == 1 and new[0] not in hit and kv.blocks_of("second") == hit + new
    kv.free("second")
    assert kv.cached_prefix(block_keys(ids)) == 3 and kv.num_free == 15


def test_held_blocks_are_never_evicted(tiny_llama):
    model = tiny_llama[0].model
    kv = blocks_pool(model, 3)
    a, b = random_ids(2 * BLOCK_SIZE, 4), random_ids(2 * BLOCK_SIZE, 5)
    cache_request(kv, "a", a)
    kv.match("a2", block_keys(a), len(a))  # the pool is full of held blocks: b gets none
    assert kv.grow("b", len(b)) is None and kv.blocks_of("b") == [] and kv.cached_prefix(block_keys(a)) == 2
    kv.free("b")
    kv.free("a2")
    cache_request(kv, "b", b)  # nobody holds them now: b evicts a
    assert kv.cached_prefix(block_keys(b)) == 2 and kv.cached_prefix(block_keys(a)) == 0


def test_a_chain_keeps_its_head_and_a_pool_without_caching_keeps_nothing(tiny_llama):
    model = tiny_llama[0].model
    ids = random_ids(6 * BLOCK_SIZE, 6)
    kv = blocks_pool(model, 7)
    cache_request(kv, "long", ids)
    cache_request(kv, "other", random_ids(4 * BLOCK_SIZE, 7))  # evicts the chain's last four blocks
    assert kv.cached_prefix(block_keys(ids)) == 2
    kv.drop_cached()
    assert kv.cached_prefix(block_keys(ids)) == 0 and not kv.pool.by_key and kv.num_free == 6
    off = blocks_pool(model, 7, caching=False)
    cache_request(off, "long", ids)
    assert not off.pool.by_key and off.cached_prefix(block_keys(ids)) == 0
    assert off.match("again", block_keys(ids), len(ids)) == [] and off.hits == 0
    with pytest.raises(ValueError):
        KVManager(model.cfg, 1, model.dtype, "cpu")  # the null block alone


def test_the_null_block_is_never_handed_out(tiny_llama):
    model = tiny_llama[0].model
    kv = blocks_pool(model, 4)
    got = kv.grow("r", 3 * BLOCK_SIZE)
    assert sorted(got) == [1, 2, 3] and NULL_BLOCK not in got and kv.grow("s", 1) is None


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
    kv = kv_pool(model, 1 << 24)
    first, stats = run_engine(model, shared_doc, params, kv=kv, prefill_chunk=64)
    assert outputs(first) == outputs(cold)
    # the repeats waited for the first prefill of the document and mapped its blocks
    assert stats.cached_tokens == 2 * (300 // BLOCK_SIZE) * BLOCK_SIZE
    again, stats = run_engine(model, shared_doc, params, kv=kv, prefill_chunk=64)
    assert outputs(again) == outputs(cold)
    assert all(r.cached_tokens >= len(r.prompt_ids) - OBSERVATION_WINDOW - BLOCK_SIZE for r in again)
    turn2 = [p + r.output_ids + random_ids(OBSERVATION_WINDOW + 8, 30 + i)
             for i, (p, r) in enumerate(zip(shared_doc, cold))]
    cold2, _ = run_engine(model, turn2, params)
    warm2, stats = run_engine(model, turn2, params, kv=kv)
    assert outputs(warm2) == outputs(cold2)
    # the history, generated tokens included, came from the cache
    assert all(r.cached_tokens >= len(p) + len(o.output_ids) - BLOCK_SIZE for r, p, o in zip(warm2, shared_doc, cold))
    assert kv.usage == 0 and kv.num_free == kv.num_blocks - 1  # every block back, the cached ones evictable


def test_a_small_pool_evicts_and_preempts_without_changing_a_token(tiny_llama, shared_doc):
    """Eviction (and preemption) under pressure while requests run, in a pool that holds one request and a bit,
    never changes a token."""
    model = tiny_llama[0].model
    cold, _ = run_engine(model, shared_doc * 2, GREEDY, slots=2)
    kv = blocks_pool(model, 18)
    small, _ = run_engine(model, shared_doc * 2, GREEDY, slots=2, kv=kv, prefill_chunk=64)
    assert outputs(small) == outputs(cold)
    assert kv.usage == 0 and len(kv.pool.by_key) <= kv.num_blocks - 1


def test_an_aborted_request_leaves_valid_blocks(tiny_llama, shared_doc):
    """A request aborted mid-prefill keys the blocks it computed; a later request reusing them is exact."""
    from conftest import drive
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine

    model = tiny_llama[0].model
    kv = kv_pool(model, 1 << 24)
    cold, _ = run_engine(model, shared_doc[:1], GREEDY)
    config = EngineConfig(max_num_seqs=1, prefill_chunk=64, max_prefill_tokens=64, enable_prefix_caching=True)
    engine = LLMEngine(model, config, kv=kv)
    engine.add_request("gone", shared_doc[0], GREEDY)
    engine.step()
    engine.step()  # two chunks of 64 prefilled
    engine.abort_request("gone")
    assert kv.cached_prefix(block_keys(shared_doc[0])) == 128 // BLOCK_SIZE and kv.usage == 0
    warm = drive(engine, shared_doc[:1], [GREEDY], [0])
    assert outputs(warm) == outputs(cold) and warm[0].cached_tokens == 128


DRAFTERS = {
    "self-streaming": lambda m: SelfSpecDrafter(m, "streaming", 64, 3, reindex=True),
    "self-snapkv": lambda m: SelfSpecDrafter(m, "snapkv", 96, 3, reindex=False),
    "self-vegas": lambda m: VegasDrafter(m, 64, 3),
    "model-dense": lambda m: ModelDrafter(m, "dense", 64, 3, reindex=True),
    "model-snapkv": lambda m: ModelDrafter(m, "snapkv", 96, 3, reindex=False),
}


@pytest.fixture(scope="module")
def real_prompts(corpus_prompt):
    """A 330-token book excerpt shared by three prompts with different continuations."""
    doc = corpus_prompt(330, book=3, at=0.4)
    return [doc + corpus_prompt(n, book=b, at=0.2) for n, b in ((40, 4), (90, 5), (7, 6))]


# every drafter in fp32 (which every CPU runs), and one of each kind on the native bf16 kernels over bf16 and int8
# caches: the hit's mapped blocks and the drafters' start from it are the same code in every dtype
@pytest.mark.parametrize(("dtype", "drafter"), [*(("fp32", d) for d in DRAFTERS),
                                                *((n, d) for n in ("native-bf16", "native-int8")
                                                  for d in ("self-snapkv", "self-vegas", "model-dense"))])
def test_every_drafter_is_exact_from_a_hit_on_the_real_model(default_model, real_prompts, drafter, dtype, request):
    """On SmolLM2: speculative decoding from prefix-cache hits (the document, then whole prompts) gives the tokens
    of the same requests prefilled cold, greedy and seeded-sampled, in fp32 and with the native bf16 kernels over a
    bf16 or an int8 cache (whose blocks hold the quantized rows)."""
    kv_dtype = torch.int8 if dtype == "native-int8" else None
    if dtype == "fp32":
        model = default_model.model
    else:
        from magicdec import kernels

        if not (kernels.supported(torch.device("cpu"), kv_dtype or torch.bfloat16)):
            pytest.skip(f"no native kernels for a {dtype} cache on this CPU")
        model = request.getfixturevalue("default_model_bf16").model
    make = DRAFTERS[drafter]
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SAMPLED, SamplingParams(max_tokens=8, ignore_eos=True)]
    cold, _ = run_engine(model, real_prompts, params, drafter=make(model), gamma=3, kv_dtype=kv_dtype)
    kv = kv_pool(model, 1 << 28, kv_dtype)
    warm, stats = run_engine(model, real_prompts, params, drafter=make(model), gamma=3, kv=kv)
    again, stats2 = run_engine(model, real_prompts, params, drafter=make(model), gamma=3, kv=kv)
    assert outputs(warm) == outputs(cold) and outputs(again) == outputs(cold)
    assert stats.cached_tokens >= 2 * 288 and stats2.cached_tokens >= sum(len(p) for p in real_prompts) - 3 * 64


@pytest.mark.parametrize("drafter", [None, "self-streaming", "self-vegas"])
def test_rows_over_the_same_cached_blocks_attend_together_exactly(default_model_bf16, corpus_prompt, drafter,
                                                                  monkeypatch):
    """On SmolLM2 with the native bf16 kernels: rows whose prompts hit the same cached blocks over whole chunks of
    the attention (1024 positions) attend over them in one task (`kernels.groups`), plain steps and verifications
    alike (a Vegas verification's attention shares too, which its next draft selects from), and decode exactly the
    tokens of the same requests prefilled cold into blocks of their own, greedy and seeded-sampled."""
    from magicdec import kernels

    model = default_model_bf16.model
    if not kernels.attends(torch.device("cpu"), model.dtype, model.cfg.head_dim):
        pytest.skip("no native attention kernel on this CPU")
    doc = corpus_prompt(2100, book=7, at=0.3)
    prompts = [doc + corpus_prompt(n, book=b, at=0.6) for n, b in ((30, 1), (70, 2), (30, 1))]
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SAMPLED,
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.9, seed=4)]
    drafters = {"self-streaming": lambda: SelfSpecDrafter(model, "streaming", 128, 3, reindex=True),
                "self-vegas": lambda: VegasDrafter(model, 128, 3)}
    spec = {} if drafter is None else {"drafter": drafters[drafter](), "gamma": 3}
    cold, _ = run_engine(model, prompts, params, **spec)
    kv = kv_pool(model, 1 << 28)
    run_engine(model, prompts, params, kv=kv, **spec)
    warm, stats = run_engine(model, prompts, params, kv=kv, **spec)
    assert stats.cached_tokens >= 3 * 2048 and outputs(warm) == outputs(cold)
    if drafter == "self-vegas":  # the shares its drafts select from are a pass per row's: the same drafts accepted
        monkeypatch.setenv("MAGICDEC_CASCADE", "0")
        apart, stats_apart = run_engine(model, prompts, params, kv=kv, **spec)
        assert outputs(apart) == outputs(cold) and stats_apart.accepted_hist == stats.accepted_hist
