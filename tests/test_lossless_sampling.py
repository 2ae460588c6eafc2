"""Speculative sampling is lossless: spec-sampled tokens follow the target's distribution exactly, and a
seeded request gives the same tokens with and without speculation.

A tiny random target (vocab 24) generates the first four tokens of thousands of requests of one prompt,
each with its own seed, for every drafter (self-speculation over a StreamingLLM / SnapKV cache whose budget
is below the prompt length, and a deliberately bad standalone draft model); the empirical distributions of
the generated tokens are compared with the exact target distribution, enumerated with the target model, by
a chi-square test. A negative control shows the same test rejects a verifier that accepts every draft.

Plus unit tests of the sampler (counter-based noise, CPU candidate paths) and of accept_drafts.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import magicdec.runner as runner_mod
from conftest import kv_pool, run_engine
from magicdec.config import ModelConfig
from magicdec.drafters import ModelDrafter, SelfQuantDrafter, SelfSpecDrafter, VegasDrafter
from magicdec.kv import KVCache
from magicdec.model import Transformer
from magicdec.sampling import (ARGMAX_BLOCK, RowParams, SamplingParams, argmax, probs_from_logits, sample_probs,
                               sample_tokens)
from magicdec.verify import accept_drafts

V = 24  # vocabulary of the tiny models
PROMPT_LEN = 20
BUDGET = 8  # sparse draft caches: well below the prompt length, so drafts really differ from the target
N = 5000  # independent sequences (one batch)
NEW = 4  # generated tokens examined: positions 1..4 (1 comes from the prefill, 2..4 from spec rounds)
P_MIN = 1e-4  # chi-square p-value threshold (21 tests under the null: family-wise false alarm ~0.2%)

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
        rows = RowParams.of([SamplingParams(**kw)] * len(triples), [0] * len(triples), "cpu")
        p = probs_from_logits(logits.double(), rows).reshape(V, V, V, 4, V)
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
    if kind == "self-quant":
        return SelfQuantDrafter(target, gamma)
    if kind == "self-vegas":
        return VegasDrafter(target, BUDGET, gamma)
    return ModelDrafter(bad_draft, "dense", BUDGET, gamma, reindex=False)


# drafter -> gamma: with 4 tokens, every position 2..4 is sometimes a draft token, a correction and a bonus
DRAFTERS = {"self-streaming": 2, "self-snapkv": 1, "self-vegas": 3, "self-quant": 2, "model": 1}


def spec_sample(target, bad_draft, prompt, drafter: str, setting: str, n: int = N):
    """n requests of `prompt`, seeds 0..n-1, through an engine speculating with `drafter`: tokens [n, NEW]."""
    gamma = DRAFTERS[drafter]
    params = [SamplingParams(max_tokens=NEW, seed=i, **SETTINGS[setting]) for i in range(n)]
    cache = kv_pool(target, 1 << 24, target.dtype)
    run_engine(target, [prompt], params[:1], kv=cache)  # prefill the prompt once; the N requests copy it
    requests, stats = run_engine(target, [prompt] * n, params, drafter=make_drafter(drafter, target, bad_draft, gamma),
                                 gamma=gamma, kv=cache)
    assert all(len(r.output_ids) == NEW and r.finish_reason == "length" for r in requests)
    return torch.tensor([r.output_ids for r in requests]), stats


# each drafter under one sampling setting and each setting under one drafter: the acceptance rule and the filters are
# shared code, and test_seeded_spec_sampling_equals_plain_sampling runs every drafter under the same seeds as plain
# (self-quant only there: its 4-bit draft of the tiny model is rejected in under 1% of rounds, too few to test with)
@pytest.mark.parametrize(("drafter", "setting"),
                         [("self-streaming", "t0.7-top_p0.9"), ("self-snapkv", "top_k5"), ("self-vegas", "t1"),
                          ("model", "t1")])
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


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_seeded_spec_sampling_equals_plain_sampling(target, bad_draft, prompt, drafter):
    """The same seeds give the same tokens with and without a drafter: the draft changes speed, not output."""
    n = 200
    params = [SamplingParams(max_tokens=NEW, seed=i, **SETTINGS["t0.7-top_p0.9"]) for i in range(n)]
    plain, _ = run_engine(target, [prompt] * n, params)
    gamma = DRAFTERS[drafter]
    spec, stats = run_engine(target, [prompt] * n, params, drafter=make_drafter(drafter, target, bad_draft, gamma),
                             gamma=gamma)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert stats.verify_steps > 0 and len({tuple(r.output_ids) for r in plain}) > n // 4  # seeds differ


# --- negative control: the same test fails for a verifier that is not lossless -----------------------------------
def test_negative_control_detects_lossy_verification(monkeypatch, target, bad_draft, prompt, exact):
    def accept_all(target_tokens, draft, lengths=None):
        """Buggy verifier: every draft token accepted (= sampling from the draft), bonus from the target."""
        return torch.full_like(draft[:, 0], draft.shape[1]), target_tokens[:, -1]

    monkeypatch.setattr(runner_mod, "accept_drafts", accept_all)
    tokens, _ = spec_sample(target, bad_draft, prompt, "model", "t1", n=1000)  # a gross error: fewer samples show it
    emp = empirical(tokens)
    p_value, tv = chi_square(emp["t2"], exact["t1"]["t2"])
    assert p_value < 1e-12 and tv > 0.1, f"p={p_value:.2e} TV={tv:.3f}"
    # position 1 (sampled from the target's prefill logits, not verified) still passes
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


# --- the sampler ---------------------------------------------------------------------------------------------------
def rows_of(params: SamplingParams, n: int, seed0: int = 0) -> RowParams:
    return RowParams.of([params] * n, list(range(seed0, seed0 + n)), "cpu")


def _mixed_logits(vocab: int = 3000) -> torch.Tensor:
    """Rows whose top-p nucleus is small (peaked) and rows where it reaches past the candidates (flat): [4, 1, V]."""
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([6.0, 0.05, 3.0, 0.3])[:, None]
    return (torch.randn(4, vocab, generator=g) * scale)[:, None]


def test_top_p_matches_a_reference_nucleus():
    logits = _mixed_logits()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    probs = (logits / params.temperature).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # mass before the token reaches top_p
    ref = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    ref = ref / ref.sum(-1, keepdim=True)
    got = probs_from_logits(logits, rows_of(params, 4))
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref)


CPU_CASES = {
    "top_p": [SamplingParams(temperature=0.8, top_p=0.9)],
    "top_k": [SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=1.0, top_k=2000)],
    "top_k+top_p": [SamplingParams(temperature=1.2, top_k=300, top_p=0.95)],
    "temperature only": [SamplingParams(temperature=0.7)],
    "mixed with greedy": [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(), SamplingParams(top_p=0.5),
                          SamplingParams(temperature=1.0, top_k=5)],
}


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("fused", ["1", "0"])  # the native sampler, torch's operators
def test_cpu_candidate_sampler_draws_what_the_full_path_draws(case, fused, monkeypatch):
    """On CPU sampled rows are drawn from their 64 / 1024 most probable tokens when the filters keep nothing
    else; the tokens equal the full-vocabulary race's, for peaked rows (few candidates) and flat ones
    (nuclei past 1024 tokens: the full path)."""
    monkeypatch.setenv("MAGICDEC_FUSED", fused)
    n = 64
    logits = _mixed_logits().expand(4, n, -1).reshape(4 * n, 1, -1).contiguous()  # each row n times
    params = [CPU_CASES[case][i % len(CPU_CASES[case])] for i in range(4 * n)]
    rows = RowParams.of(params, list(range(4 * n)), "cpu")
    position = torch.arange(4 * n)[:, None] % 7
    full = sample_probs(probs_from_logits(logits, rows), rows.seed, position)
    full = torch.where(rows.greedy[:, None], logits.argmax(-1), full)
    assert torch.equal(sample_tokens(logits, rows, position), full)


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("fused", ["1", "0"])  # the native sampler, torch's operators
def test_a_part_of_the_vocabulary_draws_what_the_whole_draws_where_the_rest_is_impossible(case, fused, monkeypatch):
    """A draft head's logits over tokens `ids` (FR-Spec) draw, through `ids`, the tokens the whole vocabulary draws when
    every other token has logit -inf: the same noise per token id, so the same coupling with the target's draws."""
    monkeypatch.setenv("MAGICDEC_FUSED", fused)
    n, vocab = 64, 3000
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:1200].sort().values
    part = _mixed_logits(len(ids)).expand(4, n, -1).reshape(4 * n, 1, -1).contiguous()
    whole = torch.full((4 * n, 1, vocab), float("-inf")).index_copy_(-1, ids, part)
    params = [CPU_CASES[case][i % len(CPU_CASES[case])] for i in range(4 * n)]
    rows = RowParams.of(params, list(range(4 * n)), "cpu")
    position = torch.arange(4 * n)[:, None] % 7
    drawn = sample_tokens(part, rows, position, ids)
    assert torch.isin(drawn, ids).all()
    assert torch.equal(drawn, sample_tokens(whole, rows, position))
    full = sample_probs(probs_from_logits(part, rows), rows.seed, position, ids)  # the full path, as on CUDA
    assert torch.equal(torch.where(rows.greedy[:, None], ids[part.argmax(-1)], full), drawn)


def test_per_row_filters_match_one_row_at_a_time():
    """Rows with different temperature / top-k / top-p in one batch get what each would get alone."""
    logits = _mixed_logits(500).expand(4, 2, 500).contiguous()
    params = [SamplingParams(temperature=0.5, top_k=7), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(), SamplingParams(temperature=1.0, top_k=40, top_p=0.95)]
    together = probs_from_logits(logits, RowParams.of(params, [0] * 4, "cpu"))
    for i, p in enumerate(params[:2] + params[3:]):
        alone = probs_from_logits(logits[i : i + 1] if i < 2 else logits[3:4], RowParams.of([p], [0], "cpu"))
        torch.testing.assert_close(together[i if i < 2 else 3], alone[0])
    assert ((together[0] > 0).sum(-1) <= 7).all() and ((together[0] > 0).sum(-1) >= 1).all()


def test_cpu_candidate_sampler_follows_the_distribution():
    """Peaked rows (drawn from candidates) and flat rows (nucleus past the candidates) both follow the
    filtered distribution (chi-square over 12000 seeds)."""
    from magicdec.sampling import CPU_CANDIDATES

    params = SamplingParams(temperature=1.0, top_p=0.95)
    logits = _mixed_logits(vocab=1500)  # the flat rows' nuclei (~1400 tokens) still pass the 1024 candidates
    probs = probs_from_logits(logits, rows_of(params, 4))[:, 0]
    support = (probs > 0).sum(-1)
    assert (support > CPU_CANDIDATES[-1]).any() and (support <= CPU_CANDIDATES[0]).any()
    n = 12000
    for row in range(probs.shape[0]):
        tokens = sample_tokens(logits[row].expand(n, 1, -1), rows_of(params, n), torch.zeros(n, 1, dtype=torch.long))
        assert chi_square(torch.bincount(tokens[:, 0], minlength=probs.shape[1]), probs[row])[0] > P_MIN, row


@pytest.mark.parametrize("vocab,k", [(4096, 64), (32768, 64), (262144, 64), (1500, 64), (49152, 1024), (100, 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_indices_are_the_k_largest_logits(vocab, k, ties):
    """The block-maxima top-k (candidates of a large vocabulary) picks logits of the values torch.topk picks, largest
    first, also where logits tie (quantized to a few values) and where the vocabulary has no whole blocks."""
    from magicdec.sampling import top_indices

    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab + k))
    if ties:
        logits = (logits * 2).round()
    got = top_indices(logits, k)
    assert got.shape == (5, k) and (got >= 0).all() and (got < vocab).all()
    assert all(len(set(row)) == k for row in got.tolist())  # distinct tokens
    assert torch.equal(logits.gather(1, got), logits.topk(k, dim=-1).values)


@pytest.mark.parametrize("vocab", [ARGMAX_BLOCK * 2, ARGMAX_BLOCK * 192, 262144, ARGMAX_BLOCK * 3 + 5, 100])
@pytest.mark.parametrize("values", ["ties", "normal", "nan", "all -inf"])
def test_blocked_argmax_is_torchs_argmax(vocab, values):
    """The first index of the maximum, as torch's argmax gives it: ties across and within blocks, NaN as the maximum."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, vocab, generator=g)
    if values == "ties":
        logits = torch.randint(0, 3, logits.shape, generator=g).float()
    elif values == "nan":
        logits.view(-1, vocab)[::2, torch.randint(0, vocab, (2,), generator=g)] = float("nan")
    elif values == "all -inf":
        logits.fill_(float("-inf"))
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax(logits[:, 1:3]), logits[:, 1:3].argmax(dim=-1))  # a strided view


def test_noise_is_independent_across_positions_and_seeds():
    """Draws at consecutive positions of one seed, and of consecutive seeds, are independent (joint chi-square)."""
    p = torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(3)), 0)
    n = 30000
    probs = p.expand(n, 2, -1)
    a = sample_probs(probs, torch.arange(n), torch.tensor([[5, 6]]).expand(n, 2))  # two positions per seed
    joint = torch.bincount(a[:, 0] * 6 + a[:, 1], minlength=36)
    assert chi_square(joint, (p[:, None] * p[None, :]).flatten())[0] > P_MIN
    b = sample_probs(probs[:, :1], torch.arange(n) * 2, torch.zeros(n, 1, dtype=torch.long))[:, 0]
    c = sample_probs(probs[:, :1], torch.arange(n) * 2 + 1, torch.zeros(n, 1, dtype=torch.long))[:, 0]
    assert chi_square(torch.bincount(b * 6 + c, minlength=36), (p[:, None] * p[None, :]).flatten())[0] > P_MIN


def test_sample_is_a_function_of_seed_and_position_only():
    logits = torch.randn(3, 4, 100)
    rows = rows_of(SamplingParams(temperature=1.0), 3, seed0=10)
    pos = torch.arange(12).view(3, 4)
    first = sample_tokens(logits, rows, pos)
    assert torch.equal(first, sample_tokens(logits, rows, pos))
    assert torch.equal(first[1:2, 2:], sample_tokens(logits[1:2, 2:], rows.row(1), pos[1:2, 2:]))  # alone, a slice


def test_tiny_temperature_is_greedy():
    logits = torch.randn(2, 3, 50) * 10
    rows = RowParams.of([SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-6, top_p=0.5)], [1, 2], "cpu")
    assert torch.equal(sample_tokens(logits, rows, torch.zeros(2, 3, dtype=torch.long)), logits.argmax(-1))


# --- accept_drafts ---------------------------------------------------------------------------------------------------
def test_accept_drafts_gamma1():
    n, nxt = accept_drafts(torch.tensor([[3, 5], [3, 5]]), torch.tensor([[3], [4]]))
    assert n.tolist() == [1, 0]
    assert nxt.tolist() == [5, 3]  # all accepted -> bonus from position g+1; rejected -> target's own token


def test_accept_drafts_prefix_semantics():
    target = torch.tensor([[1, 2, 3, 4]] * 4)
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3], [1, 2, 0]])
    n, nxt = accept_drafts(target, draft)
    assert n.tolist() == [3, 1, 0, 2]  # a later match after a mismatch does not count
    assert nxt.tolist() == [4, 2, 1, 3]
