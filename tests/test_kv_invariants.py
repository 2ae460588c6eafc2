"""KV-cache invariants of speculative decoding, checked after every round on a tiny random model.

* The target cache holds exactly prompt + emitted tokens minus the pending one, and its K/V for those
  slots equal a one-shot (autoregressive-equivalent) forward of the same tokens, and those of a real AR run.
* A sparse draft cache holds min(context, budget) slots after every round (never more than
  budget + gamma + 1 while drafting); its slots are the sinks / SnapKV prefix and the most recent window,
  checked position by position against a reference computed in Python (keys un-rotated when reindexed).
* rotate_keys composes; eviction on synthetic K/V matches a Python model of StreamingLLM; SnapKV selects a
  valid top-k of pooled scores before its window; a budget covering the context keeps everything.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import random

import pytest
import torch

from magicdec.config import ModelConfig
from magicdec.decode import decode, prefill_prompts
from magicdec.drafters import ModelDrafter, SelfSpecDrafter
from magicdec.kv import KVCache
from magicdec.kv.sparse import (
    SNAPKV_KERNEL, SnapKVObserver, SparseKVCache, compress, rotate_keys, snapkv_index, snapkv_window,
)
from magicdec.model import Transformer, apply_rope, rope_cos_sin
from magicdec.sampling import SamplingParams

V = 64
BUDGET = 16
PROMPT_LENS = (5, 19, 37, 50)  # the first grows past the budget while decoding; the others start above it
MAX_TOKENS = 23
TOL = dict(atol=2e-5, rtol=1e-4)


def tiny_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256)
    model = Transformer(cfg)
    with torch.no_grad():
        model.output.weight.mul_(4.0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0)


@pytest.fixture(scope="module")
def draft_model() -> Transformer:
    return tiny_model(1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in PROMPT_LENS]


def clone_prefilled(pre):
    """An independent copy of a Prefilled (its target cache is mutated by decoding)."""
    cache = copy.copy(pre.cache)
    for name in ("k", "v", "lens", "next_pos"):
        setattr(cache, name, getattr(pre.cache, name).clone())
    return dataclasses.replace(pre, cache=cache)


@torch.inference_mode()
def kv_of(model: Transformer, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, KV, T, hd] of a one-shot forward of `tokens` (keys rotated by absolute position)."""
    cache = KVCache(model.cfg, 1, len(tokens), torch.float32, "cpu")
    model(torch.tensor([tokens]), cache)
    return cache.k[:, 0], cache.v[:, 0]


def make_drafter(name: str, target, draft_model, gamma: int, reindex: bool):
    kind, _, cache_kind = name.partition("-")
    if kind == "self":
        return SelfSpecDrafter(target, cache_kind, BUDGET, gamma, reindex)
    return ModelDrafter(draft_model, cache_kind, BUDGET, gamma, reindex)


# --- the per-round monitor ----------------------------------------------------------------------------------
class Monitor:
    """Wraps a drafter's prefill / propose / accept / select_rows and checks every cache after each call."""

    def __init__(self, drafter, target: Transformer, prompts: list[list[int]], gamma: int):
        self.d, self.target, self.prompts, self.gamma = drafter, target, prompts, gamma
        self.rounds = 0
        self.rejections = 0  # verify steps (live rows) that rejected a draft token
        self.max_context = 0  # longest draft context seen (to make sure eviction was exercised)
        self.slots_checked = 0
        for name in ("prefill", "propose", "accept", "select_rows"):
            orig = getattr(drafter, name)
            setattr(drafter, name, functools.partial(getattr(self, "_" + name), orig))

    # wrappers
    def _prefill(self, orig, *args, **kwargs):
        bound = inspect.signature(orig).bind(*args, **kwargs)
        orig(*args, **kwargs)
        self.tc = bound.arguments["target_cache"]
        first = bound.arguments["first"].tolist()
        B = len(first)
        self.rows = list(range(B))  # original index of each current row
        self.seqs = [list(p) + [first[i]] for i, p in enumerate(self.prompts)]
        self.sparse = isinstance(self.d.cache, SparseKVCache)
        self.observer = None
        if self.sparse and self.d.cache_kind_name == "snapkv" and self.d.model is self.target:
            self.observer = bound.arguments["observer"]
            lens = torch.tensor([len(p) for p in self.prompts])
            self.index = snapkv_index(self.observer, lens, self.d.cache.budget, snapkv_window(self.d.cache.budget))
        if self.sparse:
            c = self.d.cache
            assert c.capacity == c.budget + self.gamma + 2
            self.prefix0 = [(c.k[:, i, :, : c.keep].clone(), c.v[:, i, :, : c.keep].clone()) for i in range(B)]
        self.check([1] * B, after_prefill=True)

    def _propose(self, orig, gamma, *args, **kwargs):
        c = self.d.cache
        before, n_pending = c.lens.clone(), self.d.n_pending.clone()
        out = orig(gamma, *args, **kwargs)
        assert torch.equal(c.lens, before + n_pending + gamma - 1)
        if self.sparse:
            assert int(c.lens.max()) <= c.budget + gamma + 1
        return out

    def _accept(self, orig, n, nxt, live):
        drafted = self.d.drafted.tolist()
        n_l, nxt_l, live_l = n.tolist(), nxt.tolist(), live.tolist()
        for i, r in enumerate(self.rows):
            if live_l[i]:
                self.seqs[r] += drafted[i][: n_l[i]] + [nxt_l[i]]
                self.rejections += n_l[i] < self.gamma
        orig(n, nxt, live)
        self.rounds += 1
        self.check(live_l)

    def _select_rows(self, orig, rows):
        orig(rows)
        self.rows = [self.rows[i] for i in rows.tolist()]

    # the invariants
    def expected_positions(self, N: int, P: int) -> list[int] | None:
        """Positions held by the draft cache: the prefix, then the window (a SnapKV prefix is checked apart).

        The prefix holds the first min(P, keep) positions (a prompt shorter than the prefix leaves it
        partly empty); the window holds at most budget - keep of the latest positions after it."""
        c = self.d.cache
        if not self.sparse:
            return list(range(N))
        n_prefix = min(P, c.keep)
        start = max(n_prefix, N - (c.budget - c.keep))
        return list(range(n_prefix)) + list(range(start, N))

    def check(self, live: list[int], after_prefill: bool = False) -> None:
        tc, c = self.tc, self.d.cache
        for i, r in enumerate(self.rows):
            if not live[i]:
                continue
            seq, P = self.seqs[r], len(self.prompts[r])
            committed = seq[:-1]  # the last emitted token is pending in the target too
            # target: exactly prompt + emitted - 1 slots, with the K/V of those tokens
            assert int(tc.lens[i]) == len(committed) == P + (len(seq) - P) - 1
            assert int(tc.next_pos[i]) == len(committed)
            Kt, Vt = kv_of(self.target, committed)
            torch.testing.assert_close(tc.k[:, i, :, : len(committed)], Kt, **TOL)
            torch.testing.assert_close(tc.v[:, i, :, : len(committed)], Vt, **TOL)
            # draft: everything but its pending tokens (1, or 2 after a fully accepted round)
            npend = int(self.d.n_pending[i])
            assert npend in (1, 2) and self.d.pending[i, :npend].tolist() == seq[-npend:]
            N = len(seq) - npend
            self.max_context = max(self.max_context, N)
            assert int(c.next_pos[i]) == N
            lens = int(c.lens[i])
            pos = self.expected_positions(N, P)
            if self.sparse:
                assert lens == len(pos) <= c.budget
            else:
                assert lens == N
            Kd, Vd = (Kt, Vt) if self.d.model is self.target else kv_of(self.d.model, seq[:N])
            first_slot = 0
            snap_prefix = self.sparse and self.d.cache_kind_name == "snapkv" and P > c.budget
            if snap_prefix:
                first_slot = c.keep
                pos = pos[c.keep :]
                k0, v0 = self.prefix0[r]
                # the selected prompt entries never move (re-indexing only rotates them along the window)
                assert torch.equal(c.v[:, i, :, : c.keep], v0)
                if not c.reindex:
                    assert torch.equal(c.k[:, i, :, : c.keep], k0)
                if after_prefill:
                    self.check_snapkv_prefix(i, P, Kd, Vd)
            if self.sparse:
                slots, held_pos = c.held(i)
                slots = slots[first_slot:]
            else:
                slots = held_pos = torch.arange(lens)
            p = torch.tensor(pos, dtype=torch.long)
            assert len(p) == len(slots)
            if self.sparse and not snap_prefix:
                assert torch.equal(held_pos, p)
            k = c.k[:, i][:, :, slots]  # [L, KV, n, hd]
            if getattr(c, "reindex", False):  # prefix entry j sits at position win_start - keep + j
                virtual = torch.where(slots < c.keep, int(c.win_start[i] - c.n_prefix[i]) + slots, p)
                k = rotate_keys(k, (p - virtual)[None, None, :], self.target.inv_freq)
            v = c.v[:, i][:, :, slots]
            # layer 0 K/V depend only on the token and its position; deeper layers on the (sparse) context,
            # so those must match the dense reference only for prompt entries (cut from a dense cache)
            torch.testing.assert_close(k[0], Kd[0][:, p], **TOL)
            torch.testing.assert_close(v[0], Vd[0][:, p], **TOL)
            in_prompt = p < P
            torch.testing.assert_close(k[:, :, in_prompt], Kd[:, :, p[in_prompt]], **TOL)
            torch.testing.assert_close(v[:, :, in_prompt], Vd[:, :, p[in_prompt]], **TOL)
            self.slots_checked += len(p)

    def check_snapkv_prefix(self, i: int, P: int, Kd, Vd) -> None:
        """Each (layer, head)'s prefix slots hold distinct prompt entries before the window, in order.

        Self-speculation: the entries are those of a valid top-k of the pooled observed scores (checked
        against a Python pooling), and slot j holds exactly that entry's K (rotated back from j when
        reindexed) and V. A model draft's observer is internal: its entries are identified by content,
        K and V together (only unambiguous without reindexing: layer-0 K/V then depend on the position).
        """
        c = self.d.cache
        W = c.budget - c.keep
        L, KV = c.k.shape[0], c.k.shape[2]
        j = torch.arange(c.keep)
        for layer in range(L):
            for h in range(KV):
                if self.observer is not None:
                    s = self.observer.scores[layer][i, h]
                    where = snapkv_reference_check(s, P, W, self.index[layer, i, h, : c.keep])
                else:
                    assert not c.reindex
                    k = c.k[layer, i, h, : c.keep, None, :]
                    v = c.v[layer, i, h, : c.keep, None, :]
                    dk = (k - Kd[layer, h, None, : P - W]).abs().amax(-1)
                    dv = (v - Vd[layer, h, None, : P - W]).abs().amax(-1)
                    dist = torch.maximum(dk, dv)  # [keep, P-W]
                    best, where = dist.min(-1)
                    assert (best < 1e-4).all(), "a SnapKV prefix slot holds no prompt entry before the window"
                    assert (where[1:] > where[:-1]).all(), f"SnapKV prefix not in ascending position order: {where}"
                k = c.k[layer, i, h, : c.keep]
                if c.reindex:
                    k = rotate_keys(k, where - (int(c.win_start[i] - c.n_prefix[i]) + j), self.target.inv_freq)
                torch.testing.assert_close(k, Kd[layer, h, where], **TOL)
                torch.testing.assert_close(c.v[layer, i, h, : c.keep], Vd[layer, h, where], **TOL)


def snapkv_reference_check(scores: torch.Tensor, n: int, window: int, selected: torch.Tensor) -> torch.Tensor:
    """Assert `selected` [k] is a valid SnapKV choice for one row/layer/head: ascending distinct positions
    before the observation window whose pooled scores (max over SNAPKV_KERNEL neighbours of the observed
    scores) are a top-k among those positions. Returns the positions."""
    half = SNAPKV_KERNEL // 2
    prefix = scores[: n - window]  # SnapKV pools over the prefix only
    pooled = torch.stack([prefix[max(0, j - half) : j + half + 1].max() for j in range(n - window)])
    assert (selected[1:] > selected[:-1]).all() and (selected >= 0).all() and (selected < n - window).all()
    chosen = torch.zeros(n - window, dtype=torch.bool)
    chosen[selected] = True
    if (~chosen).any():
        assert pooled[chosen].min() >= pooled[~chosen].max(), "SnapKV kept a lower-scored entry"
    return selected


def _kind(drafter) -> str:
    return getattr(drafter, "kind", None) or getattr(drafter, "cache_kind", None)


DRAFTER_CASES = [  # (drafter, reindex, gamma)
    ("self-streaming", True, 3),
    ("self-streaming", False, 1),
    ("self-snapkv", False, 4),
    ("self-snapkv", True, 2),
    ("model-dense", False, 3),
    ("model-streaming", True, 2),
    ("model-snapkv", False, 3),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name,reindex,gamma", DRAFTER_CASES, ids=[f"{d}-ri{int(r)}-g{g}" for d, r, g in DRAFTER_CASES])
def test_cache_invariants_every_round(target, draft_model, prompts, name, reindex, gamma, temperature):
    drafter = make_drafter(name, target, draft_model, gamma, reindex)
    drafter.cache_kind_name = _kind(drafter)
    mon = Monitor(drafter, target, prompts, gamma)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
    pre = prefill_prompts(target, prompts, MAX_TOKENS, observe=drafter.needs_target_attention)
    outs, stats = decode(target, pre, params, (), drafter=drafter, gamma=gamma)
    # the tracked sequences are the outputs: max_tokens exactly, from the emitted tokens
    for r, (out, prompt) in enumerate(zip(outs, prompts)):
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == mon.seqs[r][len(prompt) : len(prompt) + MAX_TOKENS]
    assert mon.rounds == stats.steps > 0
    assert mon.rejections > 0, "no draft was ever rejected: rollback untested"
    if mon.sparse:
        assert mon.max_context > BUDGET + 8, "eviction never exercised"
    assert mon.slots_checked > 100


# --- target cache vs a real autoregressive run ----------------------------------------------------------------
@pytest.mark.parametrize("name,reindex,gamma", [("self-streaming", True, 4), ("model-snapkv", False, 2)])
def test_target_cache_equals_autoregressive_run(target, draft_model, prompts, name, reindex, gamma):
    drafter = make_drafter(name, target, draft_model, gamma, reindex)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    pre = prefill_prompts(target, prompts, MAX_TOKENS, observe=drafter.needs_target_attention)
    ar_pre, spec_pre = clone_prefilled(pre), clone_prefilled(pre)
    # reuse=True: rows are never dropped, so slot b of each cache is prompt b afterwards
    ar, _ = decode(target, ar_pre, params, (), reuse=True)
    spec, stats = decode(target, spec_pre, params, (), drafter=drafter, gamma=gamma, reuse=True)
    assert stats.accepted_hist[gamma] < stats.verify_steps  # some rounds rolled back
    for b, (a, s, prompt) in enumerate(zip(ar, spec, prompts)):
        assert s.token_ids == a.token_ids
        n = len(prompt) + len(a.token_ids) - 1
        torch.testing.assert_close(spec_pre.cache.k[:, b, :, :n], ar_pre.cache.k[:, b, :, :n], **TOL)
        torch.testing.assert_close(spec_pre.cache.v[:, b, :, :n], ar_pre.cache.v[:, b, :, :n], **TOL)
    # reuse rolled both back to the prompts
    assert torch.equal(spec_pre.cache.lens, pre.lens) and torch.equal(ar_pre.cache.lens, pre.lens)


# --- RoPE rotations compose --------------------------------------------------------------------------------------
def test_rotate_keys_composes(target):
    g = torch.Generator().manual_seed(0)
    inv_freq = target.inv_freq
    hd = target.cfg.head_dim
    k = torch.randn(2, 3, 5, 7, hd, generator=g)
    a = torch.randint(-300, 300, (3, 1, 7), generator=g)
    b = torch.randint(-300, 300, (1, 5, 7), generator=g)
    ab = rotate_keys(rotate_keys(k, a, inv_freq), b, inv_freq)
    torch.testing.assert_close(ab, rotate_keys(k, a + b, inv_freq), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rotate_keys(rotate_keys(k, a, inv_freq), -a, inv_freq), k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rotate_keys(k, torch.zeros_like(a), inv_freq), k)
    # it is the model's RoPE: rotating an unrotated key by p == apply_rope at position p
    pos = torch.arange(7)
    cos, sin = rope_cos_sin(inv_freq, pos, torch.float32)
    torch.testing.assert_close(rotate_keys(k, pos, inv_freq), apply_rope(k, cos, sin))
    # rotations preserve norms and relative-position dot products
    torch.testing.assert_close(rotate_keys(k, a, inv_freq).norm(dim=-1), k.norm(dim=-1), atol=1e-4, rtol=1e-4)
    q = torch.randn(hd, generator=g)
    kk = torch.randn(hd, generator=g)
    d1 = rotate_keys(q, torch.tensor(40), inv_freq) @ rotate_keys(kk, torch.tensor(10), inv_freq)
    d2 = rotate_keys(q, torch.tensor(1030), inv_freq) @ rotate_keys(kk, torch.tensor(1000), inv_freq)
    assert abs(d1 - d2) < 1e-3
    # a wrong composition (e.g. a - b) is detectably different
    assert not torch.allclose(ab, rotate_keys(k, a - b, inv_freq), atol=1e-2)


# --- synthetic caches: eviction against a Python model ------------------------------------------------------------
def marker_cache(cfg: ModelConfig, lens: list[int], capacity: int, inv_freq: torch.Tensor, base: torch.Tensor):
    """A dense cache whose V at (row b, position p) is the marker 1000*b + p in every element, and whose K is
    one base vector rotated by p (as the model stores keys)."""
    B = len(lens)
    cache = KVCache(cfg, B, capacity, torch.float32, "cpu")
    p = torch.arange(capacity)
    marker = 1000.0 * torch.arange(B)[:, None] + p[None, :]  # [B, capacity]
    cache.v[:] = marker[None, :, None, :, None]
    keys = base.expand(cfg.n_layers, B, cfg.n_kv_heads, capacity, -1)
    cache.k[:] = rotate_keys(keys, p[None, None, None, :], inv_freq)
    cache.lens = torch.tensor(lens)
    cache.next_pos = torch.tensor(lens)
    cache.max_len = max(lens)
    return cache


def check_slots(cache: SparseKVCache, b: int, positions: list[int], base: torch.Tensor, inv_freq) -> None:
    """Row b holds exactly `positions` (prefix first, then the window in order), each slot with the V
    marker of its position and its key rotated by its position (by its virtual position just before the
    window for a re-indexed prefix entry)."""
    n = len(positions)
    assert int(cache.lens[b]) == n
    slots, held = cache.held(b)
    assert held.tolist() == positions, f"row {b}: holds {held.tolist()}, want {positions}"
    want = 1000.0 * b + torch.tensor(positions, dtype=torch.float32)
    got = cache.v[:, b, :, slots, 0]  # [L, KV, n]
    assert torch.equal(got, want.expand_as(got))
    rot = torch.tensor(positions)
    if cache.reindex:
        rot = torch.where(slots < cache.keep, int(cache.win_start[b] - cache.n_prefix[b]) + slots, rot)
    want_k = rotate_keys(base.expand(n, -1), rot, inv_freq)
    got_k = cache.k[:, b, :, slots]
    torch.testing.assert_close(got_k, want_k.expand_as(got_k), atol=1e-4, rtol=1e-4)


def held_after(prefix: list[int], window: list[int], budget: int, keep: int) -> list[int]:
    """The Python model of a sparse row: its prefix, then at most budget - keep latest window positions."""
    return prefix + window[max(0, len(window) - (budget - keep)) :]


@pytest.mark.parametrize("reindex", [True, False])
def test_streaming_eviction_matches_python_reference(target, reindex):
    cfg, inv_freq = target.cfg, target.inv_freq
    budget, gamma, sink = 12, 4, 4
    lens = [3, 12, 30]
    base = torch.randn(cfg.head_dim, generator=torch.Generator().manual_seed(0))
    dense = marker_cache(cfg, lens, 128, inv_freq, base)
    cache = compress(dense, "streaming", budget, reindex, gamma + 2, inv_freq)
    assert cache.keep == sink and cache.capacity == budget + gamma + 2
    # the Python model: each row's prefix and window positions
    prefix = [list(range(min(n, sink))) for n in lens]
    window = [list(range(min(n, sink), n)) for n in lens]
    length = list(lens)  # logical length of each row
    for b in range(3):
        check_slots(cache, b, held_after(prefix[b], window[b], budget, sink), base, inv_freq)
    rng = random.Random(0)
    B = len(lens)
    for _ in range(25):
        # a round: write q new tokens (as a forward would), keep n of them, then evict
        q = rng.randint(1, gamma + 1)
        mask = cache.attn_mask(q)
        assert mask.shape[-1] == cache.capacity
        newpos = cache.next_pos[:, None] + torch.arange(q)  # logical positions of the new tokens
        rope = cache.rope_positions(q)
        assert torch.equal(rope, newpos)  # queries and new keys keep their positions in both modes
        v_new = (1000.0 * torch.arange(B)[:, None] + newpos).float()[:, None, :, None]
        v_new = v_new.expand(B, cfg.n_kv_heads, q, cfg.head_dim)
        k_new = rotate_keys(base.expand(B, cfg.n_kv_heads, q, -1), rope[:, None, :], inv_freq)
        for layer in range(cfg.n_layers):
            cache.update(layer, k_new, v_new)
        before = cache.lens.clone()
        cache.commit(q)
        assert int(cache.lens.max()) <= budget + gamma + 1
        keep = [rng.randint(0, q) for _ in range(B)]
        cache.truncate(before + torch.tensor(keep))
        cache.evict()
        for b in range(B):
            window[b] += list(range(length[b], length[b] + keep[b]))
            length[b] += keep[b]
            check_slots(cache, b, held_after(prefix[b], window[b], budget, sink), base, inv_freq)
            assert int(cache.next_pos[b]) == length[b]
        assert int(cache.lens.max()) <= budget
    assert min(length) > budget + 10  # every row slid its window many times


def test_snapkv_selects_top_pooled_scores_before_window(target):
    cfg, inv_freq = target.cfg, target.inv_freq
    budget, gamma = 16, 3
    window = snapkv_window(budget)
    keep = budget - window
    lens = [10, 40, 64]
    base = torch.randn(cfg.head_dim, generator=torch.Generator().manual_seed(0))
    dense = marker_cache(cfg, lens, 80, inv_freq, base)
    S = max(lens)
    g = torch.Generator().manual_seed(1)
    obs = SnapKVObserver(cfg.n_layers)
    obs.scores = [torch.rand(len(lens), cfg.n_kv_heads, S, generator=g) for _ in range(cfg.n_layers)]
    obs.scores[0][1, 0, 20] = 50.0  # a standout prompt token: it and its pooled neighbours must be kept
    cache = compress(dense, "snapkv", budget, False, gamma + 2, inv_freq, obs)
    assert cache.keep == keep
    for b, n in enumerate(lens):
        if n <= budget:
            check_slots(cache, b, list(range(n)), base, inv_freq)
            continue
        assert int(cache.lens[b]) == budget
        slots, _ = cache.held(b)
        held = (cache.v[:, b, :, slots, 0] - 1000.0 * b).round().long()  # [L, KV, budget] positions
        assert (held[..., keep:] == torch.arange(n - window, n)).all()  # the observation window, in order
        prefix = held[..., :keep]
        assert (prefix[..., 1:] > prefix[..., :-1]).all() and (prefix < n - window).all()
        for layer in range(cfg.n_layers):
            for h in range(cfg.n_kv_heads):
                snapkv_reference_check(obs.scores[layer][b, h], n, window, prefix[layer, h])
    held_row = (cache.v[0, 1, 0, :keep, 0] - 1000).round().long().tolist()
    assert set(range(17, 24)) <= set(held_row), held_row
    # sliding the window keeps the selected prefix in place and drops the oldest window entries
    prefix_before = cache.v[:, :, :, :keep].clone()
    for _ in range(5):
        cache.attn_mask(1)
        for layer in range(cfg.n_layers):
            shape = (3, cfg.n_kv_heads, 1, cfg.head_dim)
            cache.update(layer, torch.zeros(shape), torch.full(shape, -1.0))
        cache.commit(1)
        cache.evict()
    assert torch.equal(cache.v[:, :, :, :keep][:, 1:], prefix_before[:, 1:])
    assert int(cache.lens.max()) == budget
    for b in (1, 2):
        slots, held = cache.held(b)
        window_slots = slots[keep:]
        old = 1000.0 * b + torch.arange(lens[b] - 3, lens[b]).float()  # the 3 newest of the old window
        assert torch.equal(cache.v[0, b, 0, window_slots[:3], 0], old)
        assert (cache.v[:, b, :, window_slots[3:]] == -1).all()
        assert held[keep:].tolist() == list(range(lens[b] - 3, lens[b] + 5))


@pytest.mark.parametrize("kind", ["streaming", "snapkv"])
@pytest.mark.parametrize("reindex", [True, False])
def test_budget_covering_context_keeps_everything(target, kind, reindex):
    cfg, inv_freq = target.cfg, target.inv_freq
    lens = [5, 12, 16]
    base = torch.randn(cfg.head_dim, generator=torch.Generator().manual_seed(0))
    dense = marker_cache(cfg, lens, 40, inv_freq, base)
    obs = SnapKVObserver(cfg.n_layers)
    obs.scores = [torch.rand(3, cfg.n_kv_heads, max(lens)) for _ in range(cfg.n_layers)]
    cache = compress(dense, kind, 16, reindex, 5, inv_freq, obs)
    assert torch.equal(cache.lens, dense.lens) and torch.equal(cache.next_pos, dense.next_pos)
    for b, n in enumerate(lens):
        slots, held = cache.held(b)
        assert held.tolist() == list(range(n))
        torch.testing.assert_close(cache.k[:, b, :, slots], dense.k[:, b, :, :n])
        assert torch.equal(cache.v[:, b, :, slots], dense.v[:, b, :, :n])
    k_before = cache.k.clone()
    cache.evict()  # at the budget: a no-op
    assert torch.equal(cache.k, k_before) and torch.equal(cache.lens, dense.lens)


def test_self_spec_with_budget_covering_context_drafts_like_the_target(target, prompts):
    """Nothing is evicted, so the draft is the target: (almost) every draft is accepted."""
    gamma = 3
    drafter = SelfSpecDrafter(target, "streaming", 256, gamma, True)
    pre = prefill_prompts(target, prompts, MAX_TOKENS)
    outs, stats = decode(target, pre, SamplingParams(max_tokens=MAX_TOKENS), (), drafter=drafter, gamma=gamma)
    assert stats.accepted_hist[gamma] >= 0.9 * stats.verify_steps
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_update_writes_each_row_at_its_own_slots(target, dtype):
    cfg = target.cfg
    cache = KVCache(cfg, 3, 12, dtype, "cpu")
    cache.commit(torch.tensor([0, 4, 7]))  # ragged rows
    q = 3
    cache.attn_mask(q)
    k = torch.randn(3, cfg.n_kv_heads, q, cfg.head_dim)
    v = torch.randn(3, cfg.n_kv_heads, q, cfg.head_dim)
    keys, values = cache.update(1, k, v)
    assert keys.shape == (3, cfg.n_kv_heads, 7 + q, cfg.head_dim)
    for row, start in enumerate((0, 4, 7)):
        assert torch.equal(cache.k[1, row, :, start : start + q], k[row].to(dtype))
        assert torch.equal(cache.v[1, row, :, start : start + q], v[row].to(dtype))
        assert not cache.k[1, row, :, :start].any() and not cache.k[1, row, :, start + q :].any()
    assert not cache.k[0].any()  # other layers untouched
