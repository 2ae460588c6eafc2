"""Speculative sampling is lossless: spec-sampled tokens follow the target's distribution exactly.

A tiny random target (vocab 24) generates the first four tokens of thousands of identical prompts in one
batch, for every drafter (self-speculation over a StreamingLLM / SnapKV cache whose budget is below the
prompt length, and a deliberately bad standalone draft model); the empirical distributions of the
generated tokens are compared with the exact target distribution, enumerated with the target model, by a
chi-square test. Negative controls show the same test rejects a sampler that accepts every draft token and
one that resamples rejections from p instead of the residual max(0, p - q).

Plus unit tests of verify_greedy / verify_sampling on hand-made tensors.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import magicdec.decode as decode_mod
from magicdec.config import ModelConfig
from magicdec.decode import generate_ids
from magicdec.drafters import ModelDrafter, SelfSpecDrafter
from magicdec.kv import KVCache
from magicdec.model import Transformer
from magicdec.sampling import SamplingParams, probs_from_logits, sample
from magicdec.verify import verify_greedy, verify_sampling

V = 24  # vocabulary of the tiny models
PROMPT_LEN = 20
BUDGET = 8  # sparse draft caches: well below the prompt length, so drafts really differ from the target
N = 5000  # independent sequences (one batch)
NEW = 4  # generated tokens examined: positions 1..4 (1 comes from the prefill, 2..4 from spec rounds)
P_MIN = 1e-4  # chi-square p-value threshold (63 tests under the null: family-wise false alarm ~0.6%)

SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
    "top_k5": dict(temperature=1.0, top_k=5),
}


def tiny_model(seed: int, lm_scale: float = 4.0) -> Transformer:
    """A random tiny Llama; the LM head is scaled so next-token distributions are peaked but far from one-hot
    (mean entropy ~1.8 nats over 24 tokens, mean top probability ~0.4)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256)
    model = Transformer(cfg)
    with torch.no_grad():
        model.output.weight.mul_(lm_scale)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(0)


@pytest.fixture(scope="module")
def bad_draft() -> Transformer:
    return tiny_model(1)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()


# --- exact target distributions ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exact(target, prompt):
    """Per setting: the exact marginals of t1..t4 and joints of consecutive pairs, by enumerating every
    (t1, t2, t3) continuation of the prompt with the target."""
    triples = torch.tensor(list(itertools.product(range(V), repeat=3)))  # [V^3, 3] all (t1, t2, t3)
    with torch.inference_mode():
        one = KVCache(target.cfg, 1, PROMPT_LEN, torch.float32, "cpu")
        first = target(torch.tensor([prompt]), one)[:, -1:]  # [1, 1, V]
        one.commit(PROMPT_LEN)
        # every continuation shares the prompt's K/V: broadcast it and run only the 3 continuation tokens
        cache = KVCache(target.cfg, len(triples), PROMPT_LEN + 3, torch.float32, "cpu")
        cache.k[:, :, :, :PROMPT_LEN] = one.k
        cache.v[:, :, :, :PROMPT_LEN] = one.v
        cache.commit(PROMPT_LEN)
        rest = target(triples, cache)  # [V^3, 3, V]: p(t2|t1), p(t3|t1,t2), p(t4|t1,t2,t3)
        logits = torch.cat((first.expand(len(triples), -1, -1), rest), dim=1)  # [V^3, 4, V]
    out = {}
    for name, kw in SETTINGS.items():
        p = probs_from_logits(logits.double(), SamplingParams(**kw)).reshape(V, V, V, 4, V)
        joint = (
            p[0, 0, 0, 0][:, None, None, None]  # p(t1)
            * p[:, 0, 0, 1][:, :, None, None]  # p(t2 | t1)
            * p[:, :, 0, 2][:, :, :, None]  # p(t3 | t1, t2)
            * p[:, :, :, 3]  # p(t4 | t1, t2, t3)
        )  # [t1, t2, t3, t4]
        assert abs(joint.sum().item() - 1) < 1e-9
        out[name] = {
            "t1": joint.sum((1, 2, 3)), "t2": joint.sum((0, 2, 3)),
            "t3": joint.sum((0, 1, 3)), "t4": joint.sum((0, 1, 2)),
            "t1,t2": joint.sum((2, 3)), "t2,t3": joint.sum((0, 3)), "t3,t4": joint.sum((0, 1)),
        }
    return out


def empirical(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts for the same statistics from generated tokens [N, 4]."""
    t = tokens.unbind(1)
    out = {f"t{i + 1}": torch.bincount(t[i], minlength=V).double() for i in range(NEW)}
    for i in range(NEW - 1):
        out[f"t{i + 1},t{i + 2}"] = torch.bincount(t[i] * V + t[i + 1], minlength=V * V).double().reshape(V, V)
    return out


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson's chi-square goodness of fit -> (p-value, total variation). Cells with probability 0 must be
    empty (asserted); cells with expected count < min_expected are pooled, smallest first."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    impossible = probs <= 1e-12
    assert counts[impossible].sum() == 0, "tokens sampled where the target distribution has no mass"
    counts, probs = counts[~impossible], probs[~impossible] / probs[~impossible].sum()
    expected = n * probs
    order = expected.argsort()
    counts, expected = counts[order], expected[order]
    # pool the smallest cells until the pooled bin reaches min_expected
    cum = expected.cumsum(0)
    k = int((cum < min_expected).sum()) + 1  # cells 0..k-1 go into the pool
    if k > 1:
        counts = torch.cat((counts[:k].sum()[None], counts[k:]))
        expected = torch.cat((expected[:k].sum()[None], expected[k:]))
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item() if df else 1.0
    tv = 0.5 * (counts / n - expected / n).abs().sum().item()
    return p_value, tv


def make_drafter(kind: str, target: Transformer, bad_draft: Transformer, gamma: int):
    if kind == "self-streaming":
        return SelfSpecDrafter(target, "streaming", BUDGET, gamma, reindex=True)
    if kind == "self-snapkv":
        return SelfSpecDrafter(target, "snapkv", BUDGET, gamma, reindex=False)
    return ModelDrafter(bad_draft, "dense", BUDGET, gamma, reindex=False)


# drafter -> gamma: with 4 tokens, every position 2..4 is sometimes a draft token, a correction and a bonus
DRAFTERS = {"self-streaming": 2, "self-snapkv": 1, "model": 1}


def spec_sample(target, bad_draft, prompt, drafter: str, setting: str, seed: int = 0):
    gamma = DRAFTERS[drafter]
    params = SamplingParams(max_tokens=NEW, seed=seed, **SETTINGS[setting])
    draft = make_drafter(drafter, target, bad_draft, gamma)
    outs, stats = generate_ids(target, [prompt] * N, params, (), drafter=draft, gamma=gamma)
    assert all(len(o.token_ids) == NEW and o.finish_reason == "length" for o in outs)
    return torch.tensor([o.token_ids for o in outs]), stats


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_spec_sampling_follows_target_distribution(target, bad_draft, prompt, exact, drafter, setting):
    tokens, stats = spec_sample(target, bad_draft, prompt, drafter, setting)
    # the round really drafted and verified, and rejections happened (else the test proves little)
    assert stats.verify_steps >= N
    assert stats.accepted_hist[0] > 0.02 * stats.verify_steps
    emp = empirical(tokens)
    for stat in emp:
        p_value, tv = chi_square(emp[stat], exact[setting][stat])
        assert p_value > P_MIN, f"{drafter} {setting} {stat}: chi-square p={p_value:.2e}, TV={tv:.3f}"
        if "," not in stat:
            assert tv < 0.04, f"{drafter} {setting} {stat}: TV={tv:.3f}"


# --- negative controls: the same test fails for samplers that are not lossless ----------------------------------
def _accept_all(target_logits, draft, draft_probs, params, generator):
    """Buggy verifier: every draft token accepted, bonus from p_{g+1} (= sampling from the draft)."""
    p = probs_from_logits(target_logits[:, -1], params)
    return torch.full_like(draft[:, 0], draft.shape[1]), sample(p, generator)


def _resample_from_p(target_logits, draft, draft_probs, params, generator):
    """Buggy verifier: correct acceptance rule, but a rejection resamples from p_n instead of max(0, p_n - q_n)."""
    n, _ = verify_sampling(target_logits, draft, draft_probs, params, generator)
    p = probs_from_logits(target_logits, params)
    p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    return n, sample(p_n, generator)


@pytest.mark.parametrize("buggy", [_accept_all, _resample_from_p], ids=["accept-all", "resample-from-p"])
def test_negative_control_detects_lossy_verification(monkeypatch, target, bad_draft, prompt, exact, buggy):
    monkeypatch.setattr(decode_mod, "verify_sampling", buggy)
    tokens, _ = spec_sample(target, bad_draft, prompt, "model", "t1")
    emp = empirical(tokens)
    p_value, tv = chi_square(emp["t2"], exact["t1"]["t2"])
    assert p_value < 1e-12, f"{buggy.__name__}: p={p_value:.2e}"
    if buggy is _accept_all:
        # draft-only sampling is far from the target, in TV as well
        assert tv > 0.1
    # and position 1 (sampled from the target's prefill logits, not verified) still passes
    assert chi_square(emp["t1"], exact["t1"]["t1"])[0] > P_MIN


def test_chi_square_helper_sanity():
    """Exact multinomial samples pass, a slightly shifted distribution fails."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, 0).double()
    counts = torch.bincount(torch.multinomial(p, N, replacement=True, generator=g), minlength=V)
    assert chi_square(counts, p)[0] > P_MIN
    shifted = p.clone()
    shifted[p.argmax()] -= 0.05
    shifted[p.argmin()] += 0.05
    assert chi_square(counts, shifted)[0] < 1e-6
    zero = p.clone()
    zero[counts.argmax()] = 0
    with pytest.raises(AssertionError):
        chi_square(counts, zero / zero.sum())


# --- the CPU candidate paths of top-p filtering and sampling (vocabularies beyond CPU_CANDIDATES) -----------------
def _mixed_logits(vocab: int = 3000) -> torch.Tensor:
    """Rows whose top-p nucleus is small (peaked) and rows where it reaches past the candidates (flat)."""
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([6.0, 0.05, 3.0, 0.3])[:, None]
    return torch.randn(4, vocab, generator=g) * scale


def test_top_p_on_cpu_candidates_equals_the_full_sort():
    from magicdec.sampling import CPU_CANDIDATES

    logits = _mixed_logits()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    probs = (logits / params.temperature).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # mass before the token reaches top_p
    ref = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    ref = ref / ref.sum(-1, keepdim=True)
    got = probs_from_logits(logits, params)
    support = (got > 0).sum(-1)
    assert (support <= CPU_CANDIDATES).any() and (support > CPU_CANDIDATES).any()  # both paths ran
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref)


def test_sampling_on_cpu_candidates_follows_the_distribution():
    from magicdec.sampling import CPU_CANDIDATES

    probs = probs_from_logits(_mixed_logits(), SamplingParams(temperature=1.0, top_p=0.95))
    assert ((probs > 0).sum(-1) > CPU_CANDIDATES).any() and ((probs > 0).sum(-1) <= CPU_CANDIDATES).any()
    g = torch.Generator().manual_seed(11)
    n = 20000
    tokens = torch.stack([sample(probs, g) for _ in range(n)])  # [n, rows]
    for row in range(probs.shape[0]):
        counts = torch.bincount(tokens[:, row], minlength=probs.shape[1])
        assert chi_square(counts, probs[row])[0] > P_MIN, row


# --- verify_greedy / verify_sampling on hand-made tensors ------------------------------------------------------
def one_hot_logits(rows: list[list[int]], vocab: int = 6, gap: float = 50.0) -> torch.Tensor:
    """[B, g+1, vocab] logits whose argmax (and, at temperature 1, essentially all mass) is the given token."""
    t = torch.tensor(rows)
    return torch.nn.functional.one_hot(t, vocab).float() * gap


def test_verify_greedy_gamma1():
    logits = one_hot_logits([[3, 5], [3, 5]])
    draft = torch.tensor([[3], [4]])
    n, nxt = verify_greedy(logits, draft)
    assert n.tolist() == [1, 0]
    assert nxt.tolist() == [5, 3]  # all accepted -> bonus from position g+1; rejected -> target's own token


def test_verify_greedy_prefix_semantics():
    logits = one_hot_logits([[1, 2, 3, 4]] * 4)
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3], [1, 2, 0]])
    n, nxt = verify_greedy(logits, draft)
    assert n.tolist() == [3, 1, 0, 2]  # a later match after a mismatch does not count
    assert nxt.tolist() == [4, 2, 1, 3]


def test_verify_sampling_all_accepted_takes_bonus_from_last_position():
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    B, vocab = 64, 6
    logits = torch.randn(B, 2, vocab, generator=g)
    logits[:, 1] = one_hot_logits([[4]] * B, vocab)[:, 0]  # p_{g+1} is (essentially) one-hot on 4
    draft_probs = probs_from_logits(logits[:, :1], params)  # q == p at the drafted position: always accepted
    draft = sample(draft_probs, g)
    n, nxt = verify_sampling(logits, draft, draft_probs, params, g)
    assert n.tolist() == [1] * B
    assert nxt.tolist() == [4] * B


def test_verify_sampling_first_rejected_samples_residual():
    params = SamplingParams(temperature=1.0)
    vocab, B = 6, 64
    g = torch.Generator().manual_seed(0)
    # p at position 1 puts all its mass on tokens 0 and 1; the draft (q one-hot on 2) proposes 2 -> p(2) = 0
    logits = torch.full((B, 3, vocab), -1e9)
    logits[:, 0, :2] = 0.0
    logits[:, 1:, 3] = 0.0
    q = torch.zeros(B, 2, vocab)
    q[:, 0, 2] = 1.0
    q[:, 1, 3] = 1.0
    draft = torch.tensor([[2, 3]] * B)
    n, nxt = verify_sampling(logits, draft, q, params, g)
    assert n.tolist() == [0] * B
    assert set(nxt.tolist()) <= {0, 1} and len(set(nxt.tolist())) == 2
    # now the draft overlaps p: q = p - except it moves mass to token 0; the residual max(0, p - q) is on 1 only
    q2 = torch.zeros(B, 2, vocab)
    q2[:, 0, 0] = 1.0
    q2[:, 1, 3] = 1.0
    draft2 = torch.tensor([[0, 3]] * B)
    n2, nxt2 = verify_sampling(logits, draft2, q2, params, g)
    # token 0 accepted with probability p(0)/q(0) = 1/2; rejected rows must draw token 1 (the residual)
    assert 0 < int((n2 == 0).sum()) < B
    assert (nxt2[n2 == 0] == 1).all()
    assert (n2[n2 > 0] == 2).all() and (nxt2[n2 == 2] == 3).all()  # then 3 (p = q one-hot) and bonus 3


def test_verify_sampling_first_token_is_exact():
    """One verify step in isolation: P(first output token) == p_1 for arbitrary p and q (Monte Carlo)."""
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(1)
    vocab, B = 8, 200_000
    p_logits = torch.randn(vocab, generator=g) * 1.5
    q_probs = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    logits = torch.stack((p_logits, torch.zeros(vocab))).expand(B, 2, vocab)
    q = q_probs.expand(B, 1, vocab)
    draft = torch.multinomial(q_probs, B, replacement=True, generator=g)[:, None]
    n, nxt = verify_sampling(logits, draft, q, params, g)
    first = torch.where(n >= 1, draft[:, 0], nxt)
    p = torch.softmax(p_logits.double(), 0)
    p_value, tv = chi_square(torch.bincount(first, minlength=vocab), p)
    assert p_value > P_MIN and tv < 0.01
    # acceptance rate is sum(min(p, q)) (Leviathan et al.)
    assert abs(n.float().mean().item() - torch.minimum(p, q_probs.double()).sum().item()) < 0.01


def test_verify_sampling_bonus_follows_last_target_distribution():
    """All drafts accepted: the bonus is drawn from p_{g+1} itself, whatever the draft's last distribution."""
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(2)
    vocab, B = 8, 100_000
    p1 = torch.softmax(torch.randn(vocab, generator=g), 0)
    p1 = torch.where(torch.arange(vocab) == 0, p1 + 1.5, p1)
    p1 = p1 / p1.sum()  # concentrated on token 0
    p2_logits = torch.randn(vocab, generator=g)
    logits = torch.stack((p1.log(), p2_logits)).expand(B, 2, vocab)
    q = probs_from_logits(logits[:, :1], params)  # q_1 == p_1: every draft is accepted
    draft = torch.multinomial(p1, B, replacement=True, generator=g)[:, None]
    n, nxt = verify_sampling(logits, draft, q, params, g)
    assert (n == 1).all()
    p_value, tv = chi_square(torch.bincount(nxt, minlength=vocab), torch.softmax(p2_logits.double(), 0))
    assert p_value > P_MIN and tv < 0.01
