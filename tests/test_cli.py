"""The command line: generate, bench (resumable) and plan work (bad input: test_cli_bad_input.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from magicdec.autoplan import MAX_TIME_SCALE, MIN_TIME_SCALE
from magicdec.cli import main
from magicdec.planner import get_profile

DATA = Path(os.environ.get("MAGICDEC_DATA", Path(__file__).resolve().parents[1].parent / "shared/data/pg19_dev.jsonl"))


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_corrupt_model_file(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    code, _, err = run(["generate", "--model", str(bad), "--prompt", "hi"], capsys)
    assert code == 2 and err.startswith("magicdec: error:") and "Traceback" not in err


def test_argparse_errors_exit_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "magicdec", "generate", "--gamma", "zero"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "gamma" in proc.stderr


@pytest.mark.parametrize("draft", ["self-streaming", "self-quant"])
def test_generate_json_with_speculation(capsys, draft):
    code, out, err = run(["generate", "--corpus", str(DATA), "--num-prompts", "2", "--prompt-tokens", "300",
                          "--max-tokens", "12", "--draft", draft, "--budget", "64", "--gamma", "2",
                          "--compare-ar", "--json", "--dtype", "fp32"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["outputs"]) == 2
    assert all(len(o["token_ids"]) <= 12 and o["prompt_tokens"] == 300 for o in doc["outputs"])
    assert doc["runs"][-1]["identical"] == 2  # greedy speculative == greedy autoregressive
    assert [o["index"] for o in doc["outputs"]] == [0, 1]
    spec = doc["runs"][1]["stats"]
    assert spec["gamma"] == 2 and 0 <= spec["acceptance_rate"] <= 1
    # the second run takes each prompt's first 256 tokens (whole blocks short of the 32-token observation window)
    # from the prefix cache the first run filled, and computes only the last 44
    assert doc["runs"][0]["stats"]["cached_tokens"] == 0 and spec["cached_tokens"] == 2 * 256


def test_generate_n_samples_per_prompt_share_one_prefill(capsys):
    """--n 3: three sampled completions of each prompt, seeded --seed + i, sampled speculatively exactly as
    plainly (test_generate.py checks that each prompt is prefilled once)."""
    code, out, err = run(["generate", "--corpus", str(DATA), "--num-prompts", "2", "--prompt-tokens", "300",
                          "--max-tokens", "10", "--n", "3", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7",
                          "--draft", "self-streaming", "--budget", "64", "--gamma", "2", "--compare-ar", "--json",
                          "--dtype", "fp32"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    outs = doc["outputs"]
    assert [o["index"] for o in outs] == list(range(6)) and all(o["prompt_tokens"] == 300 for o in outs)
    assert doc["runs"][-1]["identical"] == 6  # seeded: speculative sampling draws what plain sampling draws
    assert len({tuple(o["token_ids"]) for o in outs[:3]}) > 1  # three different samples of prompt 0


def test_compare_ar_with_one_token_reports_no_speedup(capsys):
    """max_tokens 1: every token comes from the prefill, so there is no decode throughput to compare."""
    code, out, err = run(["generate", "--prompt", "The capital of France is", "--max-tokens", "1", "--draft",
                          "self-streaming", "--budget", "8", "--compare-ar", "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert "speedup over autoregressive decoding: none measured" in err and "0.0 tok/s" in err


def test_generate_text_prints_stats(capsys):
    code, out, err = run(["generate", "--prompt", "The capital of France is", "--max-tokens", "5"], capsys)
    assert code == 0
    assert "decode" in err and "tok/s" in err and "peak memory" in err
    assert "dtype " in err and "(auto: " in err and "KV cache" in err  # the dtype auto chose, and why
    assert out.startswith("--- [0]")


def test_bench_resumes_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--corpus", str(DATA), "--batch", "2", "--context", "200", "--drafters",
            "none,self-streaming", "--budget", "32", "--gamma", "1,2", "--max-tokens", "6", "--out", str(out)]
    code, printed, err = run(argv, capsys)
    assert code == 0 and "memory read rate after the runs:" in printed
    assert "warning" not in err  # one budget: each setting a point on the acceptance plot, whose legend names it
    doc = json.loads(out.read_text())
    points = {k: v for k, v in doc["points"].items()}
    assert len(points) == 3 and "machine" in doc and doc["settings"]["new_tokens"] == 6
    assert all(p["throughput"] > 0 and p["read_bandwidth_gbs"] > 0 for p in points.values())
    assert any("speedup" in p for p in points.values())
    assert (tmp_path / "bench_throughput.png").exists() and (tmp_path / "bench_acceptance.png").exists()
    stamps = {k: v["time"] for k, v in points.items()}
    argv[argv.index("1,2")] = "1,2,3"  # one more gamma, and a draft head of 1024 tokens: only new points run
    vocab_text = tmp_path / "vocab.txt"
    vocab_text.write_text(json.loads(DATA.open().readline())["text"][:100_000])
    assert run([*argv, "--draft-vocab", "0,1k", "--vocab-corpus", str(vocab_text)], capsys)[0] == 0
    doc = json.loads(out.read_text())
    assert len(doc["points"]) == 7 and len([k for k in doc["points"] if k.endswith("-V1024")]) == 3
    assert all(doc["points"][k]["time"] == t for k, t in stamps.items())


def test_bench_runs_auto_once_per_draft_head():
    from magicdec.bench import BenchGrid, point_key

    grid = BenchGrid(batches=[1], contexts=[256], drafters=["none", "auto"], budgets=[64], gammas=[2],
                     modes=["greedy"], new_tokens=8, draft_vocabs=[0, 1024], vocab_corpus="book.txt")
    assert [point_key(1, 256, c) for c in grid.configs()] == [
        "B1-S256-greedy-none-K0-g0", "B1-S256-greedy-auto-K0-g0", "B1-S256-greedy-auto-K0-g0-V1024"]
    assert grid.configs()[2]["vocab_corpus"] == "book.txt"


def test_generate_auto_prices_a_draft_head(tmp_path, capsys):
    """`--draft auto --draft-vocab` plans with the head among its choices and says what it chose."""
    vocab_text = tmp_path / "vocab.txt"
    vocab_text.write_text(json.loads(DATA.open().readline())["text"][:100_000])
    code, out, err = run(["generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--draft", "auto",
                          "--draft-vocab", "1k", "--vocab-corpus", str(vocab_text), "--hardware",
                          "cpu-avx512bf16-2t-bf16"], capsys)
    assert code == 0, err
    assert "auto: " in err and out.startswith("--- [0]")
    # where it drafted, the prediction again at the acceptance the run learned
    assert ("auto at the acceptance this run learned" in err) == ("auto: autoregressive" not in err)


def test_bench_auto_records_the_prediction_at_the_learned_acceptance(tmp_path, capsys, tiny_llama):
    """A `--draft auto` point keeps the plan's prediction (the acceptance table's rate) and the prediction again at
    the rate the run learned, so that the cost model's error and the table's can be told apart."""
    slow_attention = dataclasses.replace(get_profile("cpu-avx512bf16-2t-bf16"), name="slow-attention", dtype="fp32",
                                         attention_rates=((1.0, 1e6), (8.0, 1e6)))  # KV reads dominate: drafting pays
    slow_attention.to_json(tmp_path / "profile.json")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", tiny_llama[0].source, "--corpus", str(DATA), "--batch", "2", "--context", "1k",
            "--distinct-prompts", "1", "--drafters", "auto", "--max-tokens", "24", "--hardware",
            str(tmp_path / "profile.json"), "--out", str(out)]
    assert run(argv, capsys)[0] == 0
    (point,) = json.loads(out.read_text())["points"].values()
    assert point["chosen"].startswith("self-") and point["predicted_throughput"] > 0
    assert 0 <= point["learned_alpha"] <= 1 and point["predicted_throughput_learned"] > 0
    assert MIN_TIME_SCALE <= point["time_scale"] <= MAX_TIME_SCALE


def test_bench_shares_prefill_and_shortens_long_contexts(tmp_path, capsys, tiny_llama):
    """Batches of one context tile one prefill of the distinct prompts; a context the model cannot hold
    with the new tokens runs at the longest length that fits (the tiny model holds 1024 tokens); with
    --repeats each point keeps the median of its interleaved runs."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", tiny_llama[0].source, "--corpus", str(DATA), "--batch", "2,4", "--context", "4k",
            "--distinct-prompts", "2", "--drafters", "none,self-streaming", "--budget", "32", "--gamma", "2",
            "--max-tokens", "6", "--repeats", "2", "--out", str(out)]
    assert run(argv, capsys)[0] == 0
    points = json.loads(out.read_text())["points"]
    assert len(points) == 4
    assert all(len(p["throughput_runs"]) == 2 and p["throughput"] == min(p["throughput_runs"]) for p in points.values())
    assert {p["context"] for p in points.values()} == {4096}
    assert {p["context_used"] for p in points.values()} == {1024 - 6}
    assert len({p["prefill_s"] for p in points.values()}) == 1  # one prefill for both batch sizes
    assert all(p["throughput"] > 0 and p["steps"] > 0 for p in points.values())


def test_median_run_keeps_the_middle_run_whole():
    from magicdec.bench import median_run

    runs = [{"throughput": t, "steps": i} for i, t in enumerate([3.0, 1.0, 2.0])]
    assert median_run(runs) == {"throughput": 2.0, "steps": 2, "throughput_runs": [3.0, 1.0, 2.0]}
    assert median_run(runs[:1]) == runs[0]  # one run: recorded as it is


def test_plan_prints_table_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, _ = run(["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--batch", "1,128",
                        "--context", "1k,32k", "--plot", str(png)], capsys)
    assert code == 0 and png.exists()
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["batch", "context", "strategy"]
    rows = [line.split() for line in lines[2:]]
    by_point = {(int(r[0]), int(r[1])): r[2] for r in rows}
    assert by_point[(128, 32768)] != "ar"  # the KV term dominates: speculate


def test_plan_static_batch_against_steady_state(tmp_path, capsys):
    from magicdec.profiles import builtin_acceptance

    table = tmp_path / "acc.json"
    builtin_acceptance().to_json(table)  # has a per-sequence spread
    speedups = []
    for extra in ([], ["--steady-state"]):
        code, out, _ = run(["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--batch", "64",
                            "--context", "32k", "--acceptance", str(table), *extra], capsys)
        assert code == 0
        speedups.append(float(out.splitlines()[2].split()[5]))
    assert 1.0 < speedups[0] < speedups[1]  # the slowest of 64 sequences accepts less than the mean one


def test_out_of_memory_is_caught_up_front():
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine
    from magicdec.errors import OutOfMemoryError
    from magicdec.loading import load_model

    model = load_model().model
    with pytest.raises(OutOfMemoryError, match=r"needs [\d.]+ GiB but only [\d.]+ GiB is available"):
        LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 50))
