"""benchmarks/bench_perplexity.py's numbers: perplexity from log-probabilities, greedy agreement, the chunks of the
transformers reference, and the serve flag of a KV dtype."""

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_perplexity

    return bench_perplexity


def test_perplexity_weighs_every_token_alike(bench):
    assert bench.perplexity([[math.log(0.5)] * 4]) == pytest.approx(2.0)
    # two windows of 1 and 3 tokens: the mean over the 4 tokens, not the mean of the windows' perplexities
    windows = [[math.log(0.25)], [math.log(0.5)] * 3]
    assert bench.perplexity(windows) == pytest.approx(math.exp(-(math.log(0.25) + 3 * math.log(0.5)) / 4))


def test_logprob_gap_pairs_tokens_and_refuses_other_lengths(bench):
    assert bench.logprob_gap([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]]) == {"mean": 0.5, "max": 1.0}
    with pytest.raises(ValueError):
        bench.logprob_gap([[-1.0, -2.0]], [[-1.0]])


@pytest.mark.parametrize("tokens, reference, prefix, equal", [
    ("abcd", "abcd", 4, 1.0),
    ("abxd", "abcd", 2, 0.75),
    ("xbcd", "abcd", 0, 0.75),
    ("ab", "abcd", 2, 0.5),  # a shorter continuation counts the missing positions as different
    ("", "", 0, 0.0),
])
def test_agreement(bench, tokens, reference, prefix, equal):
    assert bench.agreement(list(tokens), list(reference)) == {"prefix": prefix, "equal": equal}


def test_summary_compares_with_the_reference(bench):
    ref = {"config": "bf16", "windows": [{"logprobs": [-1.0, -1.0], "greedy": list("abc"), "score_s": 2.0}]}
    other = {"config": "int8", "windows": [{"logprobs": [-1.0, -1.2], "greedy": list("abd"), "score_s": 1.0}]}
    row = bench.summarize(other, ref)
    assert row["perplexity"] == pytest.approx(math.exp(1.1))
    assert row["vs_reference"] == pytest.approx(math.exp(0.1) - 1)
    assert (row["greedy_prefix_min"], row["greedy_equal"], row["tokens"]) == (2, pytest.approx(2 / 3), 2)
    assert bench.summarize(ref, ref)["vs_reference"] == 0.0


@pytest.mark.parametrize("n, split, chunk, expected", [
    (10, 7, 4, [(0, 4), (4, 7), (7, 8), (8, 10)]),
    (8, 4, 4, [(0, 4), (4, 8)]),
    (5, 3, 512, [(0, 3), (3, 5)]),
])
def test_chunks_end_at_the_greedy_split(bench, n, split, chunk, expected):
    assert bench.chunk_bounds(n, split, chunk) == expected
