"""Per-row draft lengths (`SpeculativeConfig.draft_stop`): each row stops drafting on its draft's confidence, and the
verification runs each row's own tokens only (`magicdec.model.Ragged`); the output stays plain decoding's."""

from __future__ import annotations

import pytest
import torch

from magicdec.autoplan import STOP_BINS
from magicdec.drafters.base import confidence
from magicdec.engine import LLM
from magicdec.errors import InvalidRequestError
from magicdec.kv.base import KVCache
from magicdec.model import Ragged
from magicdec.sampling import RowParams, SamplingParams, exponential_noise
from magicdec.speculative import SpeculativeConfig
from magicdec.verify import accept_drafts


@pytest.fixture(scope="module")
def native_llm():
    """The default model as `LLM` loads it by default (bf16 on the native kernels where the CPU has AVX512-BF16), over
    a KV pool of a fixed size."""
    return LLM(device="cpu", max_model_len=2048, kv_cache_gb=1)


@pytest.fixture(scope="module")
def prompts(corpus_prompt) -> list[list[int]]:
    return [corpus_prompt(n, book=b, at=0.3) for n, b in ((600, 2), (240, 4), (900, 6), (90, 8))]


PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)]


@pytest.mark.parametrize("draft", ["self-streaming", "self-vegas"])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_per_row_draft_lengths_equal_plain_decoding(native_llm, prompts, draft, params):
    """Rows of four ragged prompts stop drafting at different lengths (some at none: that row's verification is a
    plain step) and the tokens are plain decoding's, greedy and seeded sampled."""
    plain = [o.token_ids for o in native_llm.generate(prompt_token_ids=prompts, params=params)]
    spec = SpeculativeConfig(draft, budget=64, gamma=4, draft_stop=0.6)
    outs = native_llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    stats = native_llm.last_stats
    rounds = stats.verify_steps
    assert 0 < stats.drafted_tokens < 4 * rounds  # rows stopped early, not all at once
    accepted = sum(i * c for i, c in enumerate(stats.accepted_hist))
    assert stats.verified_per_token == pytest.approx((stats.drafted_tokens + rounds) / (accepted + rounds))


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_priced_draft_lengths_equal_plain_decoding(native_llm, prompts, kv_bound_profile, params):
    """`--draft auto --draft-stop auto`: the re-planner prices each round's threshold and learns from the rows'
    confidences; the tokens are plain decoding's."""
    plain = [o.token_ids for o in native_llm.generate(prompt_token_ids=prompts, params=params)]
    spec = SpeculativeConfig("auto", hardware=kv_bound_profile, mode="sampling" if params.temperature else "greedy",
                             draft_stop="auto")
    outs = native_llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    replanner, stats = native_llm.last_auto.replanner, native_llm.last_stats
    assert replanner.stop == "auto" and stats.verify_steps > 0 and stats.drafted_tokens > 0
    # it learned from the verified drafts' confidences: some bin's chance moved from its midpoint
    assert any(replanner.stop_chance(b) != pytest.approx((b + 0.5) / STOP_BINS) for b in range(STOP_BINS))


@pytest.mark.parametrize("draft", ["self-streaming", "self-vegas", "self-quant"])
def test_rows_that_stop_leave_the_later_draft_forwards(native_llm, prompts, draft, monkeypatch, draft_forward_rows):
    """Rows that stop drafting leave the round's later forwards, which run over the rows still drafting alone
    (`KVCache.take`; a 4-bit draft's rows, which own their storage, read it in place through a table of rows), and
    every row drafts what it drafts with all rows in every forward: the same tokens, drafts and acceptances as where
    no row leaves."""
    spec = SpeculativeConfig(draft, budget=64, gamma=4, draft_stop=0.6)
    runs = []
    for leave in (True, False):
        if not leave:
            monkeypatch.setattr(KVCache, "take", lambda self, index: None)
        draft_forward_rows.clear()
        outs = native_llm.generate(prompt_token_ids=prompts, params=PARAMS[1], speculative=spec)
        stats = native_llm.last_stats
        runs.append(([o.token_ids for o in outs], stats.drafted_tokens, stats.accepted_hist, list(draft_forward_rows)))
    (tokens, drafted, accepted, rows), (all_tokens, all_drafted, all_accepted, all_rows) = runs
    assert (tokens, drafted, accepted) == (all_tokens, all_drafted, all_accepted)
    assert len(rows) == len(all_rows) and all(a <= b for a, b in zip(rows, all_rows))
    assert sum(rows) < sum(all_rows)  # some forwards ran without the rows that had stopped


def test_per_row_draft_lengths_equal_plain_decoding_in_fp32(llm, prompts):
    """The same in fp32, the reference dtype, on the path it takes (`LLM.attention`, `LLM.linear`)."""
    params = PARAMS[0]
    plain = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params)]
    spec = SpeculativeConfig("self-streaming", budget=64, gamma=3, draft_stop=0.6)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)] == plain
    assert 0 < llm.last_stats.drafted_tokens < 3 * llm.last_stats.verify_steps


def test_a_threshold_no_draft_meets_decodes_plainly(native_llm, prompts):
    """Where every row stops before its first draft token, each round verifies one token a row: plain decoding's
    steps and tokens, nothing drafted, one token verified per token."""
    params = PARAMS[0]
    plain = [o.token_ids for o in native_llm.generate(prompt_token_ids=prompts, params=params)]
    spec = SpeculativeConfig("self-streaming", budget=64, gamma=3, draft_stop=0.999999)
    outs = native_llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)
    assert [o.token_ids for o in outs] == plain
    stats = native_llm.last_stats
    assert stats.drafted_tokens == 0 and stats.verified_per_token == 1.0 and stats.acceptance_rate == 0


def test_fewer_tokens_are_verified_per_token_than_with_a_fixed_draft_length(native_llm, prompts):
    """The point of stopping: at gamma 4, rows that stop verify fewer tokens for each token they produce."""
    params = PARAMS[1]
    verified = []
    for stop in (None, 0.5):
        spec = SpeculativeConfig("self-streaming", budget=64, gamma=4, draft_stop=stop)
        native_llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)
        verified.append(native_llm.last_stats.verified_per_token)
    assert verified[1] < verified[0]


def test_confidence_is_the_margin_of_the_race_that_draws_the_token():
    """A greedy row: 1 - p2 / p1 of its two most probable tokens; a sampled row: 1 - runner-up / winner of
    probability over the token's noise at its temperature, the noise its sampler draws with."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g) * 2
    logits[2, 7] = 40.0  # one token all but certain
    rows = RowParams.of([SamplingParams(), SamplingParams(temperature=0.7, seed=9), SamplingParams()], [0, 9, 0], "cpu")
    position = torch.tensor([5, 6, 7])
    got = confidence(logits, rows, position)
    p = logits[0].softmax(-1).topk(2).values
    assert got[0] == pytest.approx(float(1 - p[1] / p[0]), rel=1e-5)
    race = (logits[1] / 0.7).softmax(-1) / exponential_noise(rows.seed[1:2], position[1:2, None], torch.arange(300))[0, 0]
    top = race.topk(2).values
    assert got[1] == pytest.approx(float(1 - top[1] / top[0]), rel=1e-4)
    assert got[2] > 0.999 and ((got >= 0) & (got <= 1)).all()


def test_acceptance_never_passes_a_rows_draft_length():
    """A draft token past a row's length is never accepted, even where it equals the target's token, and the next
    token is the target's at the row's last verified position."""
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 9, 7]])
    n, nxt = accept_drafts(target, draft, torch.tensor([1, 3]))
    assert n.tolist() == [1, 1] and nxt.tolist() == [6, 6]
    n, nxt = accept_drafts(target, draft, torch.tensor([0, 3]))
    assert n.tolist() == [0, 1] and nxt.tolist() == [5, 6]


def test_ragged_layout_packs_and_pads_the_real_tokens():
    ragged = Ragged([2, 1, 3], "cpu")
    x = torch.arange(9).view(3, 3)
    assert ragged.pick(x).tolist() == [0, 1, 3, 6, 7, 8] and ragged.owner.tolist() == [0, 0, 1, 2, 2, 2]
    assert ragged.pad(ragged.pick(x), fill=-1).tolist() == [[0, 1, -1], [3, -1, -1], [6, 7, 8]]
    assert [(c, rows.tolist()) for c, rows in ragged.groups] == [(1, [1]), (2, [0]), (3, [2])]
    heads = torch.arange(3 * 2 * 3).view(3, 2 * 3)  # rows of 2 heads x 3 tokens, head then token
    cut = ragged.parts(heads, 1)
    assert [part.tolist() for part in cut] == [[[6, 9]], [[0, 1, 3, 4]], [[12, 13, 14, 15, 16, 17]]]


@pytest.mark.parametrize("stop", [0, 1, 1.5, float("nan"), "0.5", "Auto"])
def test_a_draft_stop_outside_the_open_unit_interval_is_refused(stop):
    with pytest.raises(InvalidRequestError, match="draft_stop must be a probability in"):
        SpeculativeConfig("self-streaming", draft_stop=stop)


def test_a_priced_draft_stop_needs_the_planner():
    with pytest.raises(InvalidRequestError, match="priced by the planner"):
        SpeculativeConfig("self-streaming", draft_stop="auto")
