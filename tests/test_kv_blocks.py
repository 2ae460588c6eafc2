"""The KV manager's blocks: pool accounting under random admit / grow / preempt / free / store sequences (hypothesis),
preemption that never changes a token on the real model (greedy, seeded sampled, speculative), prefix hits that map
the cached blocks without copying them, and requests that can never fit the pool refused up front."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import kv_pool, run_engine
from magicdec.config import EngineConfig, ModelConfig
from magicdec.engine import LLM, LLMEngine, resolve_config
from magicdec.errors import InvalidRequestError
from magicdec.kv.blocks import BLOCK_SIZE, NULL_BLOCK, BlockPool, KVManager, block_keys, blocks_for
from magicdec.sampling import SamplingParams

# --- pool accounting ------------------------------------------------------------------------------------------
TINY_CFG = ModelConfig(vocab_size=16, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8)
N_REQUESTS = 4


def check_pool(kv: KVManager) -> None:
    """The pool's bookkeeping is consistent with the requests' block lists."""
    pool = kv.pool
    assert all(r >= 0 for r in pool.refs) and pool.refs[NULL_BLOCK] == 0
    held = Counter(b for owned in (kv.held, kv.draft_held) for blocks in owned.values() for b in blocks)
    for blocks in kv.held.values():
        assert len(set(blocks)) == len(blocks)  # a request holds a block once
    for request_id, blocks in kv.draft_held.items():  # a sparse draft cache's blocks are its request's alone
        assert request_id in kv.held and all(pool.refs[b] == 1 and b not in pool.key_of for b in blocks)
    assert NULL_BLOCK not in held
    assert all(pool.refs[b] == held[b] for b in range(pool.num_blocks))  # refs == the lists naming it
    free_ids, evictable = list(pool.free_ids), list(pool.evictable)
    assert len(set(free_ids)) == len(free_ids) and not set(free_ids) & set(evictable)
    free = set(free_ids) | set(evictable)
    assert NULL_BLOCK not in free and not free & set(held)  # no block both free and held
    assert free | set(held) == set(range(1, pool.num_blocks))  # every block is somewhere
    assert pool.num_free + len(held) == pool.num_blocks - 1 and pool.num_used == len(held)
    assert all(pool.refs[b] == 0 for b in free)
    # cached blocks: by_key <-> key_of one to one; a free block has no key, an evictable one has
    assert len(pool.by_key) == len(pool.key_of)
    assert all(pool.key_of[b] == k for k, b in pool.by_key.items())
    assert not set(free_ids) & set(pool.key_of) and set(evictable) <= set(pool.key_of)
    for request_id, keys in kv.keyed.items():  # a request's keys name its leading blocks' prefixes
        assert len(keys) <= len(kv.held.get(request_id, []))


def test_blocks_let_go_are_taken_again_before_blocks_never_used():
    """A request's unkeyed blocks, once let go, are handed out again (the last let go first, each request's in
    ascending order) before blocks never used, whose memory has not been touched; keyed blocks nobody holds only after
    both, least recently used first."""
    pool = BlockPool(10)
    first, second = pool.take(3), pool.take(2)
    assert (first, second) == ([1, 2, 3], [4, 5])
    pool.register(4, b"a prefix")
    pool.release(first)
    pool.release(second)  # 4 stays cached, 5 is free
    assert pool.take(5) == [5, 1, 2, 3, 6]
    assert pool.take(4) == [7, 8, 9, 4]
    assert pool.num_free == 0


#: (op, request, tokens): "step" admits a waiting request (its hit, then a first chunk) or grows a running one
OPS = st.lists(st.tuples(st.sampled_from(["step"] * 6 + ["free"] * 2 + ["drop"]),
                         st.integers(0, N_REQUESTS - 1), st.integers(1, 3 * BLOCK_SIZE)), min_size=10, max_size=60)
# each request: (leading blocks it shares with a common document, its length, a seed for the rest)
SEQS = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6 * BLOCK_SIZE), st.integers(0, 3)),
                min_size=N_REQUESTS, max_size=N_REQUESTS)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(num_blocks=st.integers(2, 14), seqs=SEQS, ops=OPS, caching=st.booleans())
def test_pool_accounting_under_random_sequences(num_blocks, seqs, ops, caching):
    """Admissions (a prefix hit, then the blocks of a first chunk), growth that preempts the newest request where the
    pool runs dry (as the scheduler does), stores of filled blocks, frees and cold starts, in any order: the pool's
    bookkeeping stays consistent, the null block is never handed out, a block is written only by its one holder, a
    hit's blocks hold exactly the tokens of the prefix it covers, a draft model's hit covers only blocks its own
    prefill filled since they were last taken, and the blocks some requests' sparse draft caches take at admission
    are theirs alone until they go."""
    kv = KVManager(TINY_CFG, num_blocks, torch.float32, "cpu", caching=caching)
    doc = torch.randint(0, 1000, (4 * BLOCK_SIZE,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = []
    for shared, n, seed in seqs:
        rest = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed + 10 * len(tokens)))
        tokens.append((doc[: shared * BLOCK_SIZE] + rest.tolist())[: max(n, 1)])
    content: dict[int, list[int | None]] = {}  # block -> the token each position was written with
    computed: dict[str, int] = {}  # active request -> positions written
    drafted: set[int] = set()  # blocks a draft model's prefill filled since they were last taken
    order: list[str] = []  # active requests, oldest first

    def write(rid: str, ids: list[int], start: int, end: int) -> None:
        blocks = kv.blocks_of(rid)
        for pos in range(start, end):
            block = blocks[pos // BLOCK_SIZE]
            assert block != NULL_BLOCK and kv.pool.refs[block] == 1 and block not in kv.pool.key_of
            content.setdefault(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = ids[pos]

    def release(rid: str) -> None:
        kv.store(rid, tokens[int(rid)], computed[rid])
        kv.free(rid)
        del computed[rid]
        order.remove(rid)

    for op, i, amount in ops:
        rid, ids = str(i), tokens[i]
        if op == "step" and rid not in computed:
            keys = block_keys(ids[: max(0, len(ids) - 1)])
            hit = kv.match(rid, keys, len(ids))
            assert hit == kv.blocks_of(rid) and len(hit) == kv.cached_prefix(keys) or not caching
            for b, block in enumerate(hit):  # a hit's blocks hold what a prefill of its prefix writes
                assert content[block] == ids[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE]
            assert set(hit[: kv.drafted_prefix(hit)]) <= drafted  # the draft model's hit: blocks it filled
            computed[rid] = len(hit) * BLOCK_SIZE
            order.append(rid)
            first_end = min(len(ids), computed[rid] + amount)
            sparse = kv.take_draft(rid, i % 3) if i % 3 else []  # some draft with a sparse cache of 1 or 2 blocks
            if sparse is None or (new := kv.grow(rid, first_end)) is None:  # does not fit: not admitted
                release(rid)
            else:
                drafted.difference_update(new)
        elif op == "step":
            end = min(len(ids), computed[rid] + amount)
            while (new := kv.grow(rid, end)) is None:  # preempt the newest until it fits
                victim = order[-1]
                release(victim)
                if victim == rid:
                    break
            if new is not None:
                assert NULL_BLOCK not in new and all(kv.pool.refs[b] == 1 for b in new)
                for block in new:
                    content.pop(block, None)  # the runner zeroes a new block
                    drafted.discard(block)
                assert not set(new) & kv.drafted  # a new block holds no draft K/V
                write(rid, ids, computed[rid], end)
                computed[rid] = end
                kv.store(rid, ids, end)
                if i % 2:  # these requests' draft model prefills with them
                    kv.mark_drafted(rid, end)
                    drafted.update(kv.blocks_of(rid)[: end // BLOCK_SIZE])
        elif op == "free" and rid in computed:
            release(rid)
        elif op == "drop":
            kv.drop_cached()
        check_pool(kv)
    for rid in list(order):
        release(rid)
    check_pool(kv)
    assert kv.num_free == num_blocks - 1 and kv.usage == 0 and not kv.held and not kv.draft_held


# --- preemption on the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["fp32", "bf16-int8-kv"])
def target(request, default_model) -> tuple:
    """(model, KV dtype): SmolLM2 in fp32 over its default cache, and in bf16 over an int8 cache on the native kernels
    (skipped where none reads int8), whose resumed requests re-store the quantized rows they had."""
    if request.param == "fp32":
        model = default_model.model
        return model, resolve_config(EngineConfig(), model).kv_dtype
    from magicdec import kernels

    if not kernels.supported(torch.device("cpu"), torch.int8):
        pytest.skip("no native kernel reads an int8 cache on this CPU")
    return request.getfixturevalue("default_model_bf16").model, torch.int8


@pytest.fixture(scope="module")
def model(target):
    return target[0]


@pytest.fixture(scope="module")
def kv_dtype(target) -> torch.dtype:
    return target[1]


@pytest.fixture(scope="module")
def prompts(corpus_prompt) -> list[list[int]]:
    """Four prompts of 70 to 110 tokens (2 to 4 blocks each with their outputs)."""
    return [corpus_prompt(n, book=b, at=0.3) for n, b in ((90, 1), (70, 2), (110, 3), (80, 4))]


PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11),
          SamplingParams(max_tokens=20, ignore_eos=True),
          SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=12)]


def tiny_pool(model, dtype, blocks: int, caching: bool = True) -> KVManager:
    return kv_pool(model, blocks * KVManager.block_bytes(model.cfg, dtype), dtype, caching=caching)


@pytest.fixture(scope="module")
def unpreempted(model, kv_dtype, prompts):
    kv = tiny_pool(model, kv_dtype, 64, caching=False)
    requests, _ = run_engine(model, prompts, PARAMS, kv=kv)
    assert kv.preemptions == 0 and all(r.preemptions == 0 for r in requests)
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_preempted_requests_give_the_tokens_of_an_unpreempted_run(model, kv_dtype, prompts, unpreempted, caching):
    """A pool of 7 blocks (a request with its output takes 4 or 5): the newest requests are preempted while the older
    ones grow, and prefilled again later, prompt and output so far; greedy and seeded sampled requests give the tokens
    of a run in a pool large enough that nothing is preempted."""
    kv = tiny_pool(model, kv_dtype, 7, caching=caching)
    requests, _ = run_engine(model, prompts, PARAMS, kv=kv)
    assert [r.output_ids for r in requests] == unpreempted
    assert kv.preemptions > 0 and kv.preemptions == sum(r.preemptions for r in requests)
    assert any(r.preemptions for r, p in zip(requests, PARAMS) if p.temperature)  # a sampled request resumed too
    assert all(r.finish_reason == "length" for r in requests)
    assert kv.usage == 0 and not kv.held


@pytest.mark.parametrize("draft", ["self-streaming", "self-vegas"])
def test_preemption_under_speculation_is_exact(model, kv_dtype, prompts, unpreempted, draft):
    """Self-speculative decoding (its lookahead takes blocks too) in a pool that preempts: greedy and seeded sampled
    requests give the tokens of the unpreempted plain run, with a sparse cache of the draft's own (a block a request)
    and with a Vegas draft reading the target's blocks (a preempted row's selection is dropped with it)."""
    from magicdec.drafters import SelfSpecDrafter, VegasDrafter

    kv = tiny_pool(model, kv_dtype, 9)  # two requests fit at admission, and preempt as they grow
    drafter = SelfSpecDrafter(model, "streaming", 24, 3, reindex=True) if draft == "self-streaming" else \
        VegasDrafter(model, 24, 3)
    requests, stats = run_engine(model, prompts, PARAMS, kv=kv, drafter=drafter, gamma=3)
    assert [r.output_ids for r in requests] == unpreempted
    assert kv.preemptions > 0 and stats.gamma == 3
    assert kv.usage == 0 and not kv.held and not kv.draft_held


def test_a_sparse_draft_holds_its_blocks_from_admission_to_the_end(model, kv_dtype, prompts, unpreempted):
    """A SnapKV draft cache (40 + 5 slots: 2 blocks) lies in blocks of the target's pool: each running request holds
    its own, mapped into its row of the draft's table, from admission until it finishes; then all are back in the
    pool. Greedy and seeded sampled requests give the plain run's tokens."""
    from magicdec.drafters import SelfSpecDrafter
    from magicdec.kv.hybrid import paged_part
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation

    drafter = SelfSpecDrafter(model, "snapkv", 40, 3, reindex=False)
    assert drafter.blocks_per_request == 2
    kv = tiny_pool(model, kv_dtype, 64, caching=False)
    config = EngineConfig(max_num_seqs=2, max_model_len=160, kv_dtype=kv_dtype)  # 2 slots: requests come and go
    engine = LLMEngine(model, config, speculation=Speculation(drafter, FixedGamma(3)), kv=kv)
    requests = [engine.add_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, PARAMS))]
    steps = 0
    while engine.has_unfinished() and steps < 400:
        engine.step()
        steps += 1
        active = engine.scheduler.active
        assert set(kv.draft_held) == {r.request_id for r in active}
        for r in active:
            blocks = kv.draft_held[r.request_id]
            assert len(blocks) == 2 and not set(blocks) & set(kv.held[r.request_id])
            assert paged_part(drafter.cache).tables[r.slot, :2].tolist() == blocks
    assert not engine.has_unfinished()
    assert [r.output_ids for r in requests] == unpreempted
    assert kv.usage == 0 and not kv.held and not kv.draft_held


# --- zero-copy hits -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", [False, True], ids=["plain", "draft-model"])
def test_a_hit_maps_the_first_requests_blocks_without_copying(tiny_llama, monkeypatch, draft):
    """A second request whose prompt starts with the first one's (and its reply) maps the first one's blocks into its
    table: its
    block list starts with them, its table rows name them, nothing is zeroed or written in them, only the blocks past
    the hit are new, and it decodes as a cold prefill does. With a standalone draft model, the draft model's K/V lie in
    the same blocks: the first prompt's blocks serve the second request's draft too, their draft K/V untouched, and
    the draft model computes only the rest."""
    import copy

    from magicdec.drafters import ModelDrafter
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation
    from test_prefix_cache import GREEDY, random_ids

    model = tiny_llama[0].model
    doc = random_ids(215, 21)  # its reply fills its last block: a block of the target's alone
    kv = kv_pool(model, 1 << 22)
    drafter = ModelDrafter(copy.deepcopy(model), "dense", 0, 3, False) if draft else None
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=512, enable_prefix_caching=True), kv=kv,
                       speculation=Speculation(drafter, FixedGamma(3)) if draft else None)
    first = engine.add_request("first", doc, GREEDY)
    blocks_a = []
    while engine.has_unfinished():
        blocks_a = kv.blocks_of("first") or blocks_a
        engine.step()
    assert first.finished and len(blocks_a) == blocks_for(len(doc) + len(first.output_ids))
    second = doc + first.output_ids + random_ids(60, 22)  # the next turn
    cold, _ = run_engine(model, [second], GREEDY)
    n_hit = (len(doc) + len(first.output_ids) - 1) // BLOCK_SIZE  # its computed blocks: prompt and output
    n_drafted = len(doc) // BLOCK_SIZE if draft else 0  # the draft model's prefill: the prompt's full blocks
    assert n_hit > n_drafted
    storages = (kv.k, kv.v) + ((kv.draft_k, kv.draft_v) if draft else ())
    before = [x[:, blocks_a[:n_hit]].clone() for x in storages]

    zeroed, grown, drafted = [], [], []
    zero_blocks, grow = kv.zero_blocks, kv.grow

    def zero_recorded(blocks):
        zeroed.extend(blocks)
        zero_blocks(blocks)

    def grow_recorded(request_id, tokens):
        new = grow(request_id, tokens)
        grown.extend(new or [])
        return new

    monkeypatch.setattr(kv, "zero_blocks", zero_recorded)
    monkeypatch.setattr(kv, "grow", grow_recorded)
    if draft:
        prefill = drafter.prefill

        def prefill_recorded(slot, prompt, end, target, observer):
            drafted.append(end - int(drafter.dense.lens[slot]))
            prefill(slot, prompt, end, target, observer)

        monkeypatch.setattr(drafter, "prefill", prefill_recorded)
    assert kv.cached_prefix(block_keys(second[: len(second) - 32])) == n_hit
    request = engine.add_request("second", second, GREEDY)
    engine.step()  # admitted with its hit, prefilled
    n_cached = request.cached_tokens // BLOCK_SIZE
    assert n_cached == n_hit and kv.blocks_of("second")[:n_cached] == blocks_a[:n_cached]
    assert engine.runner.paged.tables[request.slot, :n_cached].tolist() == blocks_a[:n_cached]
    if draft:  # the draft model's hit: the first prompt's blocks, read through the same table
        assert drafter.dense.tables is engine.runner.paged.tables
        assert sum(drafted) == len(second) - n_drafted * BLOCK_SIZE
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == cold[0].output_ids
    # only the blocks past the hit were taken and zeroed; the hit's blocks kept their K/V, bit for bit (the draft
    # model's of the blocks it prefilled too: those past them it computed again from the same tokens)
    assert len(grown) == blocks_for(len(second) + len(request.output_ids)) - n_cached
    assert not set(grown) & set(blocks_a[:n_cached]) and not set(zeroed) & set(blocks_a[:n_cached])
    after = [x[:, blocks_a[:n_hit]] for x in storages]
    assert all(torch.equal(a, b) for a, b in zip(after[:2], before[:2]))
    assert all(torch.equal(a[:, :n_drafted], b[:, :n_drafted]) for a, b in zip(after[2:], before[2:]))
    if draft:
        assert engine.stats.accepted_hist[3] == engine.stats.verify_steps  # the target's twin: its K/V were exact


# --- requests that can never fit -------------------------------------------------------------------------------
def test_a_request_larger_than_the_pool_is_refused_up_front(tiny_llama):
    from test_prefix_cache import GREEDY, random_ids

    model = tiny_llama[0].model
    kv = kv_pool(model, 4 * KVManager.block_bytes(model.cfg, model.dtype))  # 3 blocks: 96 positions
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=512), kv=kv)
    with pytest.raises(InvalidRequestError, match="KV"):
        engine.add_request("big", random_ids(80, 1), GREEDY)  # 80 + 12 + the draft slack > 96
    assert not engine.has_unfinished() and "big" not in engine.requests
    ok = engine.add_request("ok", random_ids(40, 2), GREEDY)  # fits: it runs
    while engine.has_unfinished():
        engine.step()
    assert len(ok.output_ids) == GREEDY.max_tokens and kv.usage == 0


def test_a_sparse_draft_cache_counts_against_the_pool(tiny_llama):
    """A request whose blocks fit the pool alone but not beside its sparse draft cache's is refused up front, saying
    so; a shorter one runs, and its draft's blocks go back with its own."""
    from test_prefix_cache import GREEDY, random_ids

    from magicdec.drafters import SelfSpecDrafter
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation

    model = tiny_llama[0].model
    kv = kv_pool(model, 5 * KVManager.block_bytes(model.cfg, model.dtype))  # 4 blocks: 128 positions
    drafter = SelfSpecDrafter(model, "streaming", 40, 3, reindex=True)  # 45 slots: 2 blocks a request
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=512), kv=kv,
                       speculation=Speculation(drafter, FixedGamma(3)))
    with pytest.raises(InvalidRequestError, match="its sparse draft cache taking 64"):
        engine.add_request("three blocks", random_ids(40, 1), GREEDY)  # 40 + 12 + the slack: 3 blocks, + 2 > 4
    ok = engine.add_request("two blocks", random_ids(8, 2), GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert len(ok.output_ids) == GREEDY.max_tokens and kv.usage == 0 and not kv.draft_held


def test_dropping_an_engine_midway_gives_its_blocks_back(tiny_llama):
    """An engine dropped with a request still running (an interrupted run) leaves no block held in the LLM's pool,
    which outlives it."""
    llm = LLM(tiny_llama[0].source, device="cpu", dtype="fp32", kv_cache_gb=0.01)
    engine = llm.engine(max_num_seqs=2, max_model_len=128)
    engine.add_request("a", list(range(3, 70)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert llm.kv.usage > 0
    llm.free_engine()
    assert llm.kv.num_free == llm.kv.num_blocks - 1 and not llm.kv.held
