"""KV-cache invariants of speculative decoding in the serving engine, checked every step on a tiny random model.

* After every step (speculative or plain round), each running slot's target cache holds exactly prompt +
  emitted tokens minus the last one, with the K/V of a one-shot forward of those tokens; they also equal
  those of a real autoregressive run. A slot freed and not yet reused holds nothing.
* A sparse draft cache holds min(context, budget) entries after every round (never more than budget + slack
  while drafting, and budget + gamma + 1 when it had at most 2 tokens to read first); its entries are the
  sinks / SnapKV prefix and the most recent window, checked position by position against a reference
  computed in Python (keys un-rotated when reindexed). A dense draft cache holds its whole context.
* These hold for a slot reused by later requests (a long prompt after a short one and back), and across
  rounds of plain decoding, after which the draft cache catches up on more tokens than its ring's slack.
* rotate_keys composes; eviction on synthetic K/V matches a Python model of StreamingLLM; SnapKV selects a
  valid top-k of pooled scores before its window; a budget covering the context keeps everything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import random
from dataclasses import dataclass

import pytest
import torch
from conftest import drive, run_engine

from magicdec import kernels
from magicdec.config import EngineConfig, ModelConfig
from magicdec.drafters import ModelDrafter, SelfSpecDrafter
from magicdec.engine import LLMEngine
from magicdec.kv import KVCache
from magicdec.kv.blocks import block_storage
from magicdec.kv.paged import gather
from magicdec.kv.sparse import (
    SNAPKV_KERNEL, SnapKVObserver, SparseKVCache, compress_into, prefix_size, rotate_keys, snapkv_index,
    snapkv_window,
)
from magicdec.model import Transformer, apply_rope, rope_cos_sin
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma, GammaPolicy, Status
from magicdec.speculative import Speculation

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


def random_prompts(lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)


@torch.inference_mode()
def kv_of(model: Transformer, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, KV, T, hd] of a one-shot forward of `tokens` (keys rotated by absolute position)."""
    cache = KVCache(model.cfg, 1, len(tokens), torch.float32, "cpu")
    model(torch.tensor([tokens]), cache)
    return cache.k[:, 0], cache.v[:, 0]


def row_kv(pool: torch.Tensor, cache, slot: int, n: int) -> torch.Tensor:
    """[L, KV, n, hd]: the first n positions of a slot of the engine's paged target cache, read through its table."""
    table = cache.tables[slot : slot + 1]
    return torch.stack([gather(pool[layer], table, n)[0] for layer in range(pool.shape[0])])


def entries(cache: SparseKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's K and V of a sparse cache by slot, [L, B, KV, capacity, hd], read through its tables."""
    return tuple(torch.stack([gather(pool[layer], cache.tables, cache.capacity) for layer in range(pool.shape[0])])
                 for pool in (cache.k, cache.v))


def make_drafter(name: str, target, draft_model, gamma: int, reindex: bool):
    kind, _, cache_kind = name.partition("-")
    if kind == "self":
        return SelfSpecDrafter(target, cache_kind, BUDGET, gamma, reindex)
    return ModelDrafter(draft_model, cache_kind, BUDGET, gamma, reindex)


def new_engine(model: Transformer, prompts, params, slots: int, drafter=None, policy: GammaPolicy | None = None):
    """An engine whose slots fit every prompt with its max_tokens (no EOS)."""
    max_model_len = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    speculation = Speculation(drafter, policy or FixedGamma(drafter.gamma)) if drafter is not None else None
    return LLMEngine(model, EngineConfig(max_num_seqs=slots, max_model_len=max_model_len), speculation=speculation)


# --- the per-round monitor ----------------------------------------------------------------------------------
class Monitor:
    """Wraps the engine's drafter (prefill / propose / accept) and checks the caches of the engine's slots
    against references computed from the runner's token buffer: after each admission, while drafting, after
    each verified round, and after every step (`after_step`), plain-decoding rounds included."""

    def __init__(self, engine: LLMEngine, target: Transformer):
        self.engine, self.runner, self.d, self.target = engine, engine.runner, engine.runner.drafter, target
        self.kind = getattr(self.d, "kind", None) or self.d.cache_kind
        self.sparse = isinstance(self.d.cache, SparseKVCache)
        self.copies = self.d.model is target  # self-speculation catches up by copying the target's entries
        self.prompt_len: dict[int, int] = {}  # per slot, its request's prompt length
        self.prefix0: dict[int, tuple] = {}  # per slot with a SnapKV-selected prefix: its K, V and base at admission
        self.admissions: collections.Counter[int] = collections.Counter()  # per slot
        self.drafting: tuple[int, torch.Tensor] | None = None  # (gamma, n_tokens) of the round being verified
        self.rounds = self.rows_verified = self.rejections = 0
        self.max_context = self.max_unseen = self.entries_checked = 0
        self.moves = 0  # requests moved to a lower slot
        for name in ("prefill", "propose", "accept", "move"):
            setattr(self.d, name, functools.partial(getattr(self, "_" + name), getattr(self.d, name)))

    # wrappers
    def _prefill(self, orig, slot, prompt, end, target_row, observer):
        orig(slot, prompt, end, target_row, observer)
        if end < len(prompt):  # the draft cache is complete after the prompt's final chunk
            return
        c, P = self.d.cache, len(prompt)
        self.admissions[slot] += 1
        self.prompt_len[slot] = P
        if self.sparse:
            assert c.capacity == c.budget + self.d.slack == c.budget + self.d.gamma + 2
        if self.snap_prefix(P):
            base = int(c.win_start[slot] - c.n_prefix[slot])
            ck, cv = entries(c)
            self.prefix0[slot] = (ck[:, slot, :, : c.keep], cv[:, slot, :, : c.keep], base)
            self.check_snapkv_prefix(slot, prompt.tolist(), observer)
        self.check(slot, prompt.tolist(), n_target=P)

    def _move(self, orig, src, dst):
        orig(src, dst)
        self.moves += 1
        self.prompt_len[dst] = self.prompt_len.pop(src)
        self.prefix0.pop(dst, None)
        if src in self.prefix0:
            self.prefix0[dst] = self.prefix0.pop(src)

    def _propose(self, orig, n, gamma, seq, n_tokens, live, rows, target, stop=None):
        c = self.d.cache
        lens0, pos0 = c.lens[:n].clone(), c.next_pos[:n].clone()
        draft, lengths, sure = orig(n, gamma, seq, n_tokens, live, rows, target, stop)
        self.drafting = gamma, n_tokens.clone()
        for i in range(n):
            if not live[i]:  # a slot not decoding keeps its draft row
                assert c.lens[i] == lens0[i] and c.next_pos[i] == pos0[i]
                continue
            unseen, N, lens = int(n_tokens[i] - pos0[i]), int(n_tokens[i]) + gamma - 1, int(c.lens[i])
            self.max_unseen = max(self.max_unseen, unseen)
            assert int(c.next_pos[i]) == N
            if self.copies and unseen >= 1:  # all but the last unseen token copied, then the window slid
                assert lens == min(int(lens0[i]) + unseen - 1, int(c.n_prefix[i]) + c.budget - c.keep) + gamma
            elif unseen <= 2:  # the usual round: nothing evicted while drafting
                assert lens == lens0[i] + unseen + gamma - 1
            P = self.prompt_len[i]
            settled = self.expected_positions(N, P)  # what eviction will leave
            assert len(settled) <= lens <= len(settled) + self.d.slack
            window = lens - min(P, c.keep) if self.sparse else None
            tokens = seq[i, : n_tokens[i]].tolist() + draft[i, : gamma - 1].tolist()
            self.check_draft_entries(i, tokens, self.expected_positions(N, P, window))
        return draft, lengths, sure

    def _accept(self, orig, n, n_tokens, live):
        orig(n, n_tokens, live)
        gamma, before = self.drafting
        self.rounds += 1
        for i in live.nonzero()[:, 0].tolist():
            self.rows_verified += 1
            if n_tokens[i] == self.runner.limit[i]:  # finished: max_tokens may have cut its accepted drafts
                continue
            accepted = int(n_tokens[i] - before[i]) - 1
            self.rejections += accepted < gamma
            # the draft trails by the target's token, and by the last draft too when every draft was accepted
            assert int(n_tokens[i] - self.d.cache.next_pos[i]) == (2 if accepted == gamma else 1)

    def after_step(self) -> None:
        """Every running slot's caches hold its tokens; a slot released and not reused holds nothing."""
        runner = self.runner
        for slot, request in enumerate(self.engine.scheduler.slots):
            if request is not None and request.status is Status.RUNNING:
                n = int(runner.n_tokens[slot])
                tokens = runner.seq[slot, :n].tolist()
                assert runner.live[slot] and tokens == request.prompt_ids + request.output_ids
                self.check(slot, tokens, n_target=n - 1)  # the last emitted token is pending in the target too
            elif request is None and not runner.live[slot]:
                assert int(runner.cache.lens[slot]) == 0

    # the invariants
    def snap_prefix(self, P: int) -> bool:
        """Whether a prompt of P tokens gets a SnapKV-selected prefix (else the prefix is its first tokens)."""
        return self.sparse and self.kind == "snapkv" and P > self.d.cache.budget

    def expected_positions(self, N: int, P: int, window: int | None = None) -> list[int]:
        """Positions held by the draft cache at context N: the prefix, then the window.

        The prefix holds the first min(P, keep) positions (a prompt shorter than the prefix leaves it
        partly empty); the window at most `window` (default budget - keep) of the latest positions after it."""
        c = self.d.cache
        if not self.sparse:
            return list(range(N))
        n_prefix = min(P, c.keep)
        window = c.budget - c.keep if window is None else window
        return list(range(n_prefix)) + list(range(max(n_prefix, N - window), N))

    def check(self, slot: int, tokens: list[int], n_target: int) -> None:
        """Between rounds: slot's target cache holds tokens[:n_target] and its draft cache a context of
        N <= n_target of them (N < n_target after plain rounds), as its kind keeps it."""
        tc, c = self.runner.cache, self.d.cache
        assert int(tc.lens[slot]) == int(tc.next_pos[slot]) == n_target
        Kt, Vt = kv_of(self.target, tokens[:n_target])
        torch.testing.assert_close(row_kv(tc.k, tc, slot, n_target), Kt, **TOL)
        torch.testing.assert_close(row_kv(tc.v, tc, slot, n_target), Vt, **TOL)
        N = int(c.next_pos[slot])
        assert N <= n_target
        self.max_context = max(self.max_context, N)
        self.check_draft_entries(slot, tokens[:N], self.expected_positions(N, self.prompt_len[slot]))

    def check_draft_entries(self, slot: int, tokens: list[int], positions: list[int]) -> None:
        """The draft cache row of `slot` over the context `tokens` holds exactly the entries at `positions`.

        Layer 0's K/V depend only on the token and its position, so they must equal those of a one-shot
        draft-model forward of `tokens`; deeper layers depend on the (sparse) context, so only entries cut
        from a dense prefill (prompt positions) or held by a dense cache must match at every layer.
        A SnapKV-selected prefix is checked at admission (`check_snapkv_prefix`), and never changes after."""
        c, P = self.d.cache, self.prompt_len[slot]
        assert int(c.lens[slot]) == len(positions)
        slots, held = c.held(slot) if self.sparse else (torch.arange(len(positions)),) * 2
        ck, cv = entries(c) if self.sparse else (None, None)  # a sparse row's entries by slot
        if self.snap_prefix(P):
            k0, v0, base0 = self.prefix0[slot]
            # the selected prompt entries never move (re-indexing only rotates their keys along the window)
            assert torch.equal(cv[:, slot, :, : c.keep], v0)
            shift = torch.tensor(int(c.win_start[slot] - c.n_prefix[slot]) - base0 if c.reindex else 0)
            torch.testing.assert_close(ck[:, slot, :, : c.keep], rotate_keys(k0, shift, self.target.inv_freq), **TOL)
            slots, held, positions = slots[c.keep :], held[c.keep :], positions[c.keep :]
        p = torch.tensor(positions, dtype=torch.long)
        assert torch.equal(held, p), f"slot {slot} holds {held.tolist()}, want {positions}"
        Kd, Vd = kv_of(self.d.model, tokens)
        if self.sparse:
            k, v = ck[:, slot][:, :, slots], cv[:, slot][:, :, slots]  # [L, KV, n, hd]
        else:  # a dense draft's K/V lie in the request's blocks, beside the target's
            k, v = row_kv(c.k, c, slot, len(positions)), row_kv(c.v, c, slot, len(positions))
        if self.sparse and c.reindex:  # prefix entry j sits at position win_start - n_prefix + j
            virtual = torch.where(slots < c.keep, int(c.win_start[slot] - c.n_prefix[slot]) + slots, p)
            k = rotate_keys(k, (p - virtual)[None, None, :], self.target.inv_freq)
        torch.testing.assert_close(k[0], Kd[0][:, p], **TOL)
        torch.testing.assert_close(v[0], Vd[0][:, p], **TOL)
        exact = p < P if self.sparse else torch.ones_like(p, dtype=torch.bool)
        torch.testing.assert_close(k[:, :, exact], Kd[:, :, p[exact]], **TOL)
        torch.testing.assert_close(v[:, :, exact], Vd[:, :, p[exact]], **TOL)
        self.entries_checked += len(p)

    def check_snapkv_prefix(self, slot: int, prompt: list[int], observer: SnapKVObserver | None) -> None:
        """Each (layer, head)'s prefix slots hold distinct prompt entries before the window, in order.

        Self-speculation: the entries are those of a valid top-k of the pooled observed scores (checked
        against a Python pooling), and slot j holds exactly that entry's K (rotated back from j when
        reindexed) and V. A model draft's observer is internal: its entries are identified by content,
        K and V together (only unambiguous without reindexing: layer-0 K/V then depend on the position).
        """
        c, P = self.d.cache, len(prompt)
        Kd, Vd = kv_of(self.d.model, prompt)
        W = c.budget - c.keep
        ck, cv = entries(c)
        L, KV = ck.shape[0], ck.shape[2]
        j = torch.arange(c.keep)
        if self.d.model is self.target:
            index = snapkv_index(observer, torch.tensor([P]), c.budget, snapkv_window(c.budget))[:, 0]
        for layer in range(L):
            for h in range(KV):
                if self.d.model is self.target:
                    where = snapkv_reference_check(observer.scores[layer][0, h], P, W, index[layer, h, : c.keep])
                else:
                    assert not c.reindex
                    k = ck[layer, slot, h, : c.keep, None, :]
                    v = cv[layer, slot, h, : c.keep, None, :]
                    dk = (k - Kd[layer, h, None, : P - W]).abs().amax(-1)
                    dv = (v - Vd[layer, h, None, : P - W]).abs().amax(-1)
                    dist = torch.maximum(dk, dv)  # [keep, P-W]
                    best, where = dist.min(-1)
                    assert (best < 1e-4).all(), "a SnapKV prefix slot holds no prompt entry before the window"
                    assert (where[1:] > where[:-1]).all(), f"SnapKV prefix not in ascending position order: {where}"
                k = ck[layer, slot, h, : c.keep]
                if c.reindex:
                    k = rotate_keys(k, where - (int(c.win_start[slot] - c.n_prefix[slot]) + j), self.target.inv_freq)
                torch.testing.assert_close(k, Kd[layer, h, where], **TOL)
                torch.testing.assert_close(cv[layer, slot, h, : c.keep], Vd[layer, h, where], **TOL)


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


DRAFTER_CASES = [  # (drafter, reindex, gamma)
    ("self-streaming", True, 3),
    ("self-streaming", False, 1),
    ("self-snapkv", False, 4),
    ("self-snapkv", True, 2),
    ("model-dense", False, 3),
    ("model-streaming", True, 2),
    ("model-snapkv", False, 3),
]


@dataclass(frozen=True)
class Scenario:
    """Requests (prompt lengths, max_tokens, arrival steps) over `slots` slots. With `plain_run`, the draft
    length cycles through one round of drafting, `plain_run` rounds of plain decoding (more tokens than any
    draft cache's slack to catch up on), one of a single draft token, then `plain_run` of gamma."""

    prompt_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[int, ...]
    slots: int
    plain_run: int = 0
    temperatures: tuple[float, ...] = (0.0, 2.0)  # sampled above 1: the tiny model's peaked outputs seldom reject

    def policy(self, gamma: int) -> GammaPolicy:
        if not self.plain_run:
            return FixedGamma(gamma)
        return Cycle(itertools.cycle([gamma] + [0] * self.plain_run + [1] + [gamma] * self.plain_run))


class Cycle(GammaPolicy):
    """The next draft length of a sequence, whatever the batch."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, live: int, context: int) -> int:
        return next(self.steps)


SCENARIOS = {
    "batch": Scenario(PROMPT_LENS, (MAX_TOKENS,) * 4, (0,) * 4, slots=4),
    # requests end at different times: a slot goes from a 50-token prompt to one shorter than the sinks, another
    # from a 19-token prompt to a 37-token one (which slot takes which request depends on the acceptances)
    "slot-reuse": Scenario((50, 19, 2, 37, 5), (6, MAX_TOKENS, MAX_TOKENS, 12, MAX_TOKENS), (0, 0, 0, 4, 10), slots=2),
    "plain-rounds": Scenario(PROMPT_LENS, (MAX_TOKENS,) * 4, (0,) * 4, slots=4, plain_run=8),
    # a long prompt arrives at the end of a long plain run: the draft catches up 31 tokens beside its long
    # context (sampled only: greedy drafts of the lone request that follows are all accepted)
    "late-long-prompt": Scenario((20, 80), (60, 4), (0, 30), slots=2, plain_run=30, temperatures=(1.0,)),
}

def invariant_cases():
    for (name, reindex, gamma), (scenario, s) in itertools.product(DRAFTER_CASES, SCENARIOS.items()):
        for temperature in s.temperatures:
            case_id = f"{name}-ri{int(reindex)}-g{gamma}-{'sampled' if temperature else 'greedy'}-{scenario}"
            yield pytest.param(name, reindex, gamma, temperature, scenario, id=case_id)


@pytest.mark.parametrize("name,reindex,gamma,temperature,scenario", invariant_cases())
def test_cache_invariants_every_round(target, draft_model, name, reindex, gamma, temperature, scenario):
    s = SCENARIOS[scenario]
    prompts = random_prompts(s.prompt_lens)
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=7) for m in s.max_tokens]
    drafter = make_drafter(name, target, draft_model, gamma, reindex)
    engine = new_engine(target, prompts, params, s.slots, drafter, s.policy(gamma))
    mon = Monitor(engine, target)
    requests = drive(engine, prompts, params, list(s.arrivals), mon.after_step)
    for request, sp in zip(requests, params):
        assert request.finish_reason == "length" and len(request.output_ids) == sp.max_tokens
    # every slot served, each request admitted once (a slot-reuse scenario reuses slots)
    assert len(mon.admissions) == s.slots and sum(mon.admissions.values()) == len(prompts)
    assert mon.rounds > 0 and mon.rows_verified == engine.stats.verify_steps
    assert mon.rejections > 0, "no draft was ever rejected: rollback untested"
    # plain rounds happened exactly when the scenario asks, and the draft then caught up beyond its slack
    assert (engine.stats.steps > mon.rounds) == (mon.max_unseen > drafter.slack) == (s.plain_run > 0)
    if mon.sparse:
        assert mon.max_context > BUDGET + 8, "eviction never exercised"
    assert mon.entries_checked > 100
    if scenario in ("batch", "plain-rounds"):  # requests ending at different rounds, nothing waiting
        assert mon.moves > 0, "no request moved to a free lower slot"


# --- target cache vs a real autoregressive run ----------------------------------------------------------------
@pytest.mark.parametrize("name,reindex,gamma", [("self-streaming", True, 4), ("model-snapkv", False, 2)])
def test_target_cache_equals_autoregressive_run(target, draft_model, prompts, name, reindex, gamma):
    """A few speculative steps, then plain steps until every slot has as many tokens: same tokens, same K/V."""
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    drafter = make_drafter(name, target, draft_model, gamma, reindex)
    spec = new_engine(target, prompts, params, len(prompts), drafter, FixedGamma(gamma))
    ar = new_engine(target, prompts, params, len(prompts))
    for engine in (spec, ar):
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, sp)
    for _ in range(4):  # at most 1 + 4 * (gamma + 1) < MAX_TOKENS tokens: no slot finishes
        spec.step()
    while (ar.runner.n_tokens < spec.runner.n_tokens).any():
        ar.step()
    assert spec.stats.accepted_hist[gamma] < spec.stats.verify_steps  # some rounds rolled back
    for b, n in enumerate(spec.runner.n_tokens.tolist()):
        assert torch.equal(spec.runner.seq[b, :n], ar.runner.seq[b, :n])
        assert int(spec.runner.cache.lens[b]) == n - 1
        for spec_pool, ar_pool in ((spec.runner.cache.k, ar.runner.cache.k), (spec.runner.cache.v, ar.runner.cache.v)):
            torch.testing.assert_close(row_kv(spec_pool, spec.runner.cache, b, n - 1),
                                       row_kv(ar_pool, ar.runner.cache, b, n - 1), **TOL)


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


def compressed(dense: KVCache, kind: str, budget: int, reindex: bool, slack: int, inv_freq: torch.Tensor,
               observer: SnapKVObserver | None = None) -> SparseKVCache:
    """A sparse cache of `kind` with every row of `dense` compressed into it."""
    cache = sparse_cache(dense.cfg, dense.batch, budget, prefix_size(kind, budget), slack, dense.dtype, reindex,
                         inv_freq)
    compress_into(cache, dense, kind, observer)
    return cache


def sparse_cache(cfg, batch: int, budget: int, keep: int, slack: int, dtype: torch.dtype, reindex: bool,
                 inv_freq: torch.Tensor) -> SparseKVCache:
    """A sparse cache whose rows hold blocks of a pool of their own (zeroed), as requests take them at admission."""
    n = SparseKVCache.blocks_per_row(budget, slack)
    k, v = block_storage(cfg, 1 + batch * n, dtype, "cpu")
    k.zero_(), v.zero_()
    cache = SparseKVCache(cfg, k, v, batch, budget, keep, slack, reindex, inv_freq)
    for b in range(batch):
        cache.set_blocks(b, 0, list(range(1 + b * n, 1 + (b + 1) * n)))
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
    entries_k, entries_v = entries(cache)
    got = entries_v[:, b, :, slots, 0]  # [L, KV, n]
    assert torch.equal(got, want.expand_as(got))
    rot = torch.tensor(positions)
    if cache.reindex:
        rot = torch.where(slots < cache.keep, int(cache.win_start[b] - cache.n_prefix[b]) + slots, rot)
    want_k = rotate_keys(base.expand(n, -1), rot, inv_freq)
    got_k = entries_k[:, b, :, slots]
    torch.testing.assert_close(got_k, want_k.expand_as(got_k), atol=1e-4, rtol=1e-4)


def write_markers(cache: SparseKVCache, q: int, base: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Write q new tokens in every row as a forward would (uncommitted), with marker_cache's V and K."""
    B, cfg = cache.batch, cache.cfg
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
    cache = compressed(dense, "streaming", budget, reindex, gamma + 2, inv_freq)
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
        write_markers(cache, q, base, inv_freq)
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


@pytest.mark.parametrize("reindex", [True, False])
def test_append_from_copies_the_entries_a_row_missed(target, reindex):
    """Self-speculation's catch-up: each selected row takes the dense cache's entries at [next_pos, end) (only
    the latest budget - keep when it missed more) and slides its window to the budget; other rows keep theirs."""
    cfg, inv_freq = target.cfg, target.inv_freq
    budget, sink, lens = 12, 4, [3, 12, 30]
    base = torch.randn(cfg.head_dim, generator=torch.Generator().manual_seed(1))
    dense = marker_cache(cfg, lens, 128, inv_freq, base)  # holds every position's entry, as the target would
    cache = compressed(dense, "streaming", budget, reindex, 4, inv_freq)
    cache.append_from(dense, torch.tensor([5, 40, 33]), torch.tensor([True, True, False]))
    assert cache.next_pos.tolist() == [5, 40, 30]
    check_slots(cache, 0, held_after([0, 1, 2], [3, 4], budget, sink), base, inv_freq)  # a prompt inside the sinks
    check_slots(cache, 1, held_after([0, 1, 2, 3], list(range(4, 40)), budget, sink), base, inv_freq)  # 28 missed
    check_slots(cache, 2, held_after([0, 1, 2, 3], list(range(4, 30)), budget, sink), base, inv_freq)  # not selected


@pytest.mark.parametrize("G", [1, 3])
def test_snapkv_observer_scores_are_each_positions_softmax_weight_summed_over_heads_and_queries(G):
    """The observer's scores [B, KV, L]: each query row's softmax over the positions its mask shows, in bf16 products
    scaled in fp32, summed over the G heads of a KV head and the q observation queries: the bits of the plain chain of
    tensor operations."""
    B, KV, q, L, hd = 2, 2, 5, 40, 16
    g = torch.Generator().manual_seed(0)
    xq = torch.randn(B, KV * G, q, hd, generator=g)
    keys = torch.randn(B, KV, L, hd, generator=g).bfloat16()
    mask = torch.rand(B, 1, q, L, generator=g) > 0.3
    mask[..., 0] = True
    obs = SnapKVObserver(1)
    obs(0, xq, keys, mask)
    dots = (xq.reshape(B, KV, G * q, hd).bfloat16() @ keys.transpose(-1, -2)).float() / hd**0.5
    expected = dots.masked_fill(~mask.repeat(1, 1, G, 1), float("-inf")).softmax(-1).sum(2)
    assert torch.equal(obs.scores[0], expected)
    per_head = torch.zeros(B, KV, L)
    for h in range(KV * G):  # head h's rows: its G heads' queries are KV head h // G's rows, head-major
        head = (xq[:, h].bfloat16() @ keys[:, h // G].transpose(-1, -2)).float() / hd**0.5  # [B, q, L]
        per_head[:, h // G] += head.masked_fill(~mask[:, 0], float("-inf")).softmax(-1).sum(1)
    torch.testing.assert_close(obs.scores[0], per_head, rtol=1e-6, atol=1e-6)


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
    cache = compressed(dense, "snapkv", budget, False, gamma + 2, inv_freq, obs)
    assert cache.keep == keep
    for b, n in enumerate(lens):
        if n <= budget:
            check_slots(cache, b, list(range(n)), base, inv_freq)
            continue
        assert int(cache.lens[b]) == budget
        slots, _ = cache.held(b)
        held = (entries(cache)[1][:, b, :, slots, 0] - 1000.0 * b).round().long()  # [L, KV, budget] positions
        assert (held[..., keep:] == torch.arange(n - window, n)).all()  # the observation window, in order
        prefix = held[..., :keep]
        assert (prefix[..., 1:] > prefix[..., :-1]).all() and (prefix < n - window).all()
        for layer in range(cfg.n_layers):
            for h in range(cfg.n_kv_heads):
                snapkv_reference_check(obs.scores[layer][b, h], n, window, prefix[layer, h])
    held_row = (entries(cache)[1][0, 1, 0, :keep, 0] - 1000).round().long().tolist()
    assert set(range(17, 24)) <= set(held_row), held_row
    # sliding the window keeps the selected prefix in place and drops the oldest window entries
    prefix_before = entries(cache)[1][:, :, :, :keep].clone()
    for _ in range(5):
        cache.attn_mask(1)
        for layer in range(cfg.n_layers):
            shape = (3, cfg.n_kv_heads, 1, cfg.head_dim)
            cache.update(layer, torch.zeros(shape), torch.full(shape, -1.0))
        cache.commit(1)
        cache.evict()
    assert torch.equal(entries(cache)[1][:, :, :, :keep][:, 1:], prefix_before[:, 1:])
    assert int(cache.lens.max()) == budget
    for b in (1, 2):
        slots, held = cache.held(b)
        window_slots = slots[keep:]
        old = 1000.0 * b + torch.arange(lens[b] - 3, lens[b]).float()  # the 3 newest of the old window
        assert torch.equal(entries(cache)[1][0, b, 0, window_slots[:3], 0], old)
        assert (entries(cache)[1][:, b, :, window_slots[3:]] == -1).all()
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
    cache = compressed(dense, kind, 16, reindex, 5, inv_freq, obs)
    assert torch.equal(cache.lens, dense.lens) and torch.equal(cache.next_pos, dense.next_pos)
    for b, n in enumerate(lens):
        slots, held = cache.held(b)
        assert held.tolist() == list(range(n))
        entries_k, entries_v = entries(cache)
        torch.testing.assert_close(entries_k[:, b, :, slots], dense.k[:, b, :, :n])
        assert torch.equal(entries_v[:, b, :, slots], dense.v[:, b, :, :n])
    k_before = entries(cache)[0]
    cache.evict()  # at the budget: a no-op
    assert torch.equal(entries(cache)[0], k_before) and torch.equal(cache.lens, dense.lens)


@pytest.mark.parametrize("kind", ["streaming", "snapkv"])
def test_prompt_sized_dense_cache_compresses_a_short_prompt_whole(target, kind):
    """A model drafter compresses its prefill from a dense cache of exactly the prompt's length: a prompt
    shorter than the budget keeps every position, and its window then slides as the Python model says."""
    cfg, inv_freq = target.cfg, target.inv_freq
    budget, n = 16, 5
    base = torch.randn(cfg.head_dim, generator=torch.Generator().manual_seed(0))
    obs = SnapKVObserver(cfg.n_layers)
    obs.scores = [torch.rand(1, cfg.n_kv_heads, n) for _ in range(cfg.n_layers)]
    cache = compressed(marker_cache(cfg, [n], n, inv_freq, base), kind, budget, False, 5, inv_freq, obs)
    n_prefix = min(n, cache.keep)
    for length in range(n, 3 * budget):
        check_slots(cache, 0, held_after(list(range(n_prefix)), list(range(n_prefix, length)), budget, cache.keep),
                    base, inv_freq)
        write_markers(cache, 1, base, inv_freq)
        cache.commit(1)
        cache.evict()


def test_self_spec_with_budget_covering_context_drafts_like_the_target(target, prompts):
    """Nothing is evicted, so the draft is the target: (almost) every draft is accepted."""
    gamma = 3
    drafter = SelfSpecDrafter(target, "streaming", 256, gamma, True)
    requests, stats = run_engine(target, prompts, SamplingParams(max_tokens=MAX_TOKENS), drafter=drafter, gamma=gamma)
    assert stats.accepted_hist[gamma] >= 0.9 * stats.verify_steps
    assert all(len(r.output_ids) == MAX_TOKENS for r in requests)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_update_writes_each_row_at_its_own_slots(target, dtype, head_dim):
    cfg = dataclasses.replace(target.cfg, head_dim=head_dim)
    cache = KVCache(cfg, 3, 12, dtype, "cpu")
    cache.commit(torch.tensor([0, 4, 7]))  # ragged rows
    q = 3
    cache.attn_mask(q)
    k = torch.randn(3, cfg.n_kv_heads, q, head_dim)
    v = torch.randn(3, cfg.n_kv_heads, q, head_dim)
    keys, values, _ = cache.update(1, k, v)
    # 10 of 12 filled: torch's operators attend over the contiguous whole buffer, the native kernel over the prefix
    native = kernels.attends(torch.device("cpu"), dtype, head_dim)
    assert keys.shape == values.shape == (3, cfg.n_kv_heads, 10 if native else 12, head_dim)
    for row, start in enumerate((0, 4, 7)):
        assert torch.equal(cache.k[1, row, :, start : start + q], k[row].to(dtype))
        assert torch.equal(cache.v[1, row, :, start : start + q], v[row].to(dtype))
        assert not cache.k[1, row, :, :start].any() and not cache.k[1, row, :, start + q :].any()
    assert not cache.k[0].any()  # other layers untouched
    short = KVCache(cfg, 3, 40, dtype, "cpu")
    short.commit(torch.tensor([0, 4, 7]))
    short.attn_mask(q)
    assert short.update(1, k, v)[0].shape == (3, cfg.n_kv_heads, 7 + q, head_dim)  # under half: the prefix
