"""The phase accounting of decode rounds (magicdec.phases): what each kind of forward did, split into its parts, against
its floor; profiling changes no output."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from magicdec import scopes
from magicdec.cli import main
from magicdec.errors import InvalidRequestError
from magicdec.kv.hybrid import make_cache
from magicdec.phases import LINEARS, PhaseRecorder, _split
from magicdec.planner.models import MODEL_PRESETS
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig

from test_cli import DATA

PARTS = ("attention_ms", "linear_ms", "other_ms", "host_ms")


def _check_parts(kind: dict) -> None:
    """The parts of a forward add up to its wall time, and each is a time."""
    assert all(kind[p] >= 0 for p in PARTS[:3]) and kind["sampling_ms"] >= 0
    assert sum(kind[p] for p in PARTS) == pytest.approx(kind["ms"], rel=1e-9)
    assert kind["attention_ms"] > 0 and kind["linear_ms"] > 0 and kind["other_ms"] > 0
    assert kind["floor_ms"] > 0 and kind["ratio"] == pytest.approx(kind["ms"] / kind["floor_ms"])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculative_rounds_are_accounted_by_kind_of_forward(llm, corpus_prompt, mode):
    prompts = [corpus_prompt(200, book=i) for i in range(3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True,
                            **({"temperature": 0.7, "top_p": 0.9, "seed": 3} if mode == "sampled" else {}))
    spec = SpeculativeConfig("self-streaming", budget=64, gamma=2)
    plain_run = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=params, speculative=spec)]
    recorder = PhaseRecorder(3)
    outs = llm.generate(prompt_token_ids=prompts, params=params, speculative=spec, phases=recorder)
    assert [o.token_ids for o in outs] == plain_run  # profiling changes nothing
    assert scopes.active is None and recorder.closed
    report = llm.last_stats.phases
    assert report["rounds"] == 3 and set(report["kinds"]) == {"draft", "verify"}
    draft, verify = report["kinds"]["draft"], report["kinds"]["verify"]
    # a round: the first draft forward, gamma - 1 more, and one verification of gamma + 1 tokens
    assert draft["forwards"] == 3 * 2 and verify["forwards"] == 3
    assert draft["rows"] == verify["rows"] == 3 and draft["tokens"] == 1 and verify["tokens"] == 3
    assert draft["entries"] <= 64 + 2 + 2 and verify["entries"] >= 200  # the sparse cache against the whole row
    for kind in (draft, verify):
        _check_parts(kind)
    assert draft["sampling_ms"] > 0 and verify["sampling_ms"] > 0
    assert report["round_ms"] >= 2 * draft["ms"] + verify["ms"] and report["outside_ms"] >= 0
    assert report["read_rate_gbs"] > 0 and report["matmul_gflops"] > 0


def test_plain_decoding_is_accounted_and_a_long_window_closes_with_the_run(llm, corpus_prompt):
    recorder = PhaseRecorder(1000)
    llm.generate(prompt_token_ids=[corpus_prompt(100)], params=SamplingParams(max_tokens=5, ignore_eos=True),
                 phases=recorder)
    report = llm.last_stats.phases
    # 4 decode rounds after the prefill's token; the first ran in the step that finished the prefill, before the window
    assert set(report["kinds"]) == {"plain"} and llm.last_stats.steps == 4 and report["rounds"] == 3
    plain = report["kinds"]["plain"]
    assert plain["forwards"] == 3 and plain["rows"] == 1 and plain["entries"] >= 100
    _check_parts(plain)
    assert recorder.closed and not recorder.running and scopes.active is None
    assert llm.generate(prompt_token_ids=[corpus_prompt(100)], params=SamplingParams(max_tokens=2)) is not None
    assert llm.last_stats.phases is None


def test_operators_are_split_by_name():
    """Attention is our scope, linear layers are any library's `linear` (the packed kernel on vector instructions or
    on AMX tiles, torch's, and those a layer's sublayer call records inside it, the rest of whose time is other),
    nested scopes of ours are looked into, and everything else is other."""
    def event(name, us, *children):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=0, end=us), cpu_children=list(children))

    forward = event(scopes.FORWARD + "draft", 100, event(scopes.ATTENTION, 30), event("aten::linear", 1),
                    event("magicdec_avx512bf16::linear", 2), event("magicdec_avx512bf16::linear_tiles", 4),
                    event(scopes.PREFIX + "inner", 20, event("magicdec_avx512bf16::linear_tiles", 8),
                          event("aten::add", 16)),
                    event("magicdec_avx512bf16::rms_norm", 32),
                    event("magicdec_avx2::attention_out", 40, event("magicdec::linear", 25), event("aten::add", 5)))
    us = dict.fromkeys(("attention", "linear", "other"), 0.0)
    _split(forward, us)
    assert us == {"attention": 30, "linear": 40, "other": 63}


def test_a_layers_sublayer_calls_record_their_linear_layers(default_model_bf16, corpus_prompt):
    """Where a layer runs as two native calls (the default model in bf16 on a path computing in bf16), each records its
    linear layers as events of their own inside it, which `_split` counts as linear: one in `attention_in` (QKV), three
    in `attention_out` (output, gate and up, down)."""
    model = default_model_bf16.model
    tokens = torch.tensor([corpus_prompt(24)])
    if not model.layers[0]._in_two_calls(model.tok_embeddings(tokens)):
        pytest.skip("the layer operators do not compute in bf16 on this path")
    cache = make_cache(model.cfg, 1, 32, model.dtype, model.device, max_q=32)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        model(tokens, cache)
    for name, linears in (("::attention_in", 1), ("::attention_out", 3)):
        calls = [e for e in prof.events() if e.name.endswith(name)]
        assert len(calls) == model.cfg.n_layers
        assert all(sum(c.name.endswith(LINEARS) for c in e.cpu_children) == linears for e in calls)
        us = dict.fromkeys(("attention", "linear", "other"), 0.0)
        _split(SimpleNamespace(cpu_children=calls), us)
        assert 0 < us["linear"] < sum(e.time_range.end - e.time_range.start for e in calls)


def test_a_floor_counts_a_shared_prompts_blocks_once():
    """Rows over one prompt read its blocks together (cascade attention): a plain step's and a verification's floor
    count the K/V bytes before the last chunk once per group of `prefix_rows` rows; a draft's entries are its own."""
    shape = MODEL_PRESETS["smollm2-135m"]
    rows, entries = 32, 8192

    def floors(prefix_rows: float) -> dict[str, float]:
        recorder = PhaseRecorder(1)
        recorder.read_rate, recorder.matmul_rate = 20e9, 1e18  # bytes bound every forward
        for kind, tokens, n in (("plain", 1, entries), ("verify", 3, entries), ("draft", 1, 512)):
            f = recorder.forwards[kind]
            f.count, f.rows, f.tokens, f.entries = 1, rows, tokens, n
        report = recorder.report(shape, 2, 2, prefix_rows=prefix_rows)
        return {kind: k["floor_ms"] for kind, k in report["kinds"].items()}

    alone, shared = floors(1.0), floors(4.0)
    kv = rows * entries * shape.kv_bytes_per_token(2) / 20e9 * 1e3  # ms of every row's K/V
    once = (entries - 1024) / entries * 3 / 4  # the share of it a group of 4 does not read again
    for kind in ("plain", "verify"):
        assert alone[kind] - shared[kind] == pytest.approx(kv * once)
    assert shared["draft"] == alone["draft"]


@pytest.mark.parametrize("rounds", [0, -1, 1.5])
def test_a_window_of_no_rounds_is_refused(rounds):
    with pytest.raises(InvalidRequestError, match="at least one decode round"):
        PhaseRecorder(rounds)


def test_generate_phases_prints_the_table_and_writes_json(capsys):
    argv = ["generate", "--corpus", str(DATA), "--num-prompts", "2", "--prompt-tokens", "200", "--max-tokens", "8",
            "--draft", "self-streaming", "--budget", "64", "--gamma", "2", "--dtype", "fp32", "--phases", "2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[spec] phases of 2 decode rounds" in err and "   draft " in err and "  verify " in err
    assert main(argv + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["runs"][0]["stats"]
    assert stats["phases"]["rounds"] == 2 and set(stats["phases"]["kinds"]) == {"draft", "verify"}


def test_generate_refuses_a_window_of_no_rounds(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--phases", "0"])
    assert e.value.code == 2 and "--phases" in capsys.readouterr().err


def test_bench_records_each_runs_phases(tmp_path, capsys, tiny_llama):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", tiny_llama[0].source, "--corpus", str(DATA), "--batch", "2", "--context", "256",
            "--drafters", "none,self-streaming", "--budget", "32", "--gamma", "2", "--max-tokens", "6",
            "--phases", "2", "--out", str(out)]
    assert main(argv) == 0
    points = json.loads(out.read_text())["points"]
    kinds = {p["draft"]: set(p["phases"]["kinds"]) for p in points.values()}
    assert kinds == {"none": {"plain"}, "self-streaming": {"draft", "verify"}}
    assert all(p["phases"]["rounds"] == 2 for p in points.values())
