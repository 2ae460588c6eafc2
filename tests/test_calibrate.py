"""Tests of calibration (hardware profile, acceptance MLE) and of `--draft auto` (autoplan.choose)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from hypothesis import given
from hypothesis import strategies as st

from magicdec.calibrate.acceptance import acceptance_mle, calibrate_acceptance, row_spread
from magicdec.calibrate.hardware import _Run, attention_rates, measure_hardware, nondecreasing, profile_from
from magicdec.cli import build_parser
from magicdec.commands.calibrate import calibrate_allreduce
from magicdec.config import EngineConfig
from magicdec.corpus import cut_prompts
from magicdec.distributed import shutdown_tp
from magicdec.errors import InvalidRequestError
from magicdec.loading import load_model
from magicdec.autoplan import (EXPLORE_EVERY, EXPLORE_FIRST, MIN_PREDICTED_SPEEDUP, MIN_TIME_SCALE, STOP_BINS,
                               STOP_EXPLORE, TIMING_WINDOW, choose, describe)
from magicdec.planner.hardware import CPU_PRESETS
from magicdec.profiles import (
    builtin_acceptance,
    default_acceptance_path,
    default_profile_path,
    load_acceptance,
    load_profile,
    preset_for_device,
    target_shape,
)
from magicdec.planner import (
    MODEL_PRESETS,
    PRESETS,
    AcceptanceTable,
    HardwareProfile,
    Workload,
    get_profile,
    round_time,
)
from magicdec.scheduler import GammaPolicy
from magicdec.speculative import Speculation, SpeculativeConfig

SMOL = MODEL_PRESETS["smollm2-135m"]


# --- hardware calibration --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_calibration(default_model):
    """Quick-mode calibration timing the real default model (so no synthetic model is built)."""
    return measure_hardware("cpu", quick=True, model=default_model.model)


@pytest.mark.slow
def test_quick_calibration_is_valid(quick_calibration, tmp_path, monkeypatch):
    cal = quick_calibration
    hw = cal.profile
    for field in ("flops_per_s", "mem_bandwidth", "mem_bytes"):
        assert getattr(hw, field) > 0 and math.isfinite(getattr(hw, field))
    for field in ("matmul_efficiency", "bandwidth_efficiency", "attention_efficiency"):
        assert 0 < getattr(hw, field) <= 1
    assert hw.fixed_overhead_s >= 0 and hw.per_layer_overhead_s >= 0
    assert hw.fixed_overhead_s + 30 * hw.per_layer_overhead_s > 0  # eager PyTorch is never free
    # plausible for a CPU: 1 GFLOP/s .. 100 TFLOP/s, 1 .. 1000 GB/s
    assert 1e9 < hw.flops_per_s < 1e14
    assert 1e9 < hw.mem_bandwidth < 1e12
    # The measurements' shape, not their values: how well a profile predicts forwards depends on what else the machine
    # runs, and is measured by benchmarks/validate_planner.py (and recorded in the profile's `check`).
    assert len(hw.linear_rates) == 4 and len(hw.attention_rates) == 4
    vegas = cal.measurements["vegas"]  # what a Vegas round adds: selection, reads through token tables
    assert hw.selection_s_per_share == vegas["seconds_select"] / (vegas["rows"] * vegas["layers"] * 3 * 8192) > 0
    assert hw.table_read_factor == max(1.0, vegas["seconds_token_table"] / vegas["seconds_block_table"])
    assert hw.shared_attention_factor == cal.measurements["shared_attention_factor"] and \
        0 < hw.shared_attention_factor <= 1
    forwards = cal.measurements["forwards"]
    assert forwards and all(p["seconds"] > 0 and 0 < p["predicted"] < math.inf for p in forwards)
    shapes = {}
    for p in forwards:
        shapes.setdefault((p["batch"], p["q"]), []).append((p["kv_len"], p["predicted"]))
    for points in shapes.values():  # the cost model: a longer context never costs less
        predicted = [t for _, t in sorted(points)]
        assert predicted == sorted(predicted), points
    check = cal.measurements["check"]
    assert 0 <= check["median_relative_error"] <= check["worst_relative_error"] < math.inf

    # JSON round trip, at the default path under $MAGICDEC_CACHE, and through get_profile
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    path = default_profile_path("cpu", "fp32")
    assert path == tmp_path / "hardware-cpu-fp32.json"
    assert hw.dtype == "fp32" and hw.name.endswith("t-fp32")  # measured in the model's dtype, and named so
    saved = cal.save()
    assert saved == path and path.is_file()
    assert path.with_suffix(".measurements.json").is_file()
    assert HardwareProfile.from_json(path) == hw
    assert get_profile(str(path)) == hw
    assert load_profile("cpu") == load_profile("cpu", "fp32") == hw  # autoplan finds the calibrated profile
    assert load_profile("cpu", "bf16") != hw  # but not for another dtype


def test_calibration_in_bf16_is_what_auto_plans_with(tiny_llama, tmp_path, monkeypatch):
    """A bf16 model is timed in bf16; the profile says so, and `choose` for a bf16 model picks it up. (A tiny model:
    the real model's calibration is checked above.)"""
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    model = load_model(tiny_llama[0].source, device="cpu", dtype=torch.bfloat16).model
    assert choose(model, 32, 8192)[2].hardware == load_profile("cpu", "bf16").name  # before: the bf16 preset
    assert PRESETS[load_profile("cpu", "bf16").name].dtype == "bf16"
    cal = measure_hardware("cpu", quick=True, model=model)
    assert cal.profile.dtype == cal.measurements["dtype"] == "bf16" and cal.profile.name.endswith("t-bf16")
    assert cal.save() == tmp_path / "hardware-cpu-bf16.json"
    assert choose(model, 32, 8192)[2].hardware == cal.profile.name
    assert choose(model, 32, 8192, dtype="fp32")[2].hardware != cal.profile.name
    # over an int8 cache (`magicdec calibrate --kv-cache-dtype int8`): a profile of its own, beside the other
    int8 = measure_hardware("cpu", quick=True, model=model, kv_dtype=torch.int8)
    assert int8.measurements["kv_dtype"] == "int8" and int8.profile.name.endswith("t-bf16-kv-int8")
    assert int8.save() == tmp_path / "hardware-cpu-bf16-kv-int8.json" and cal.save().is_file()


def test_default_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    assert default_profile_path("cuda:1", "bf16") == tmp_path / "hardware-cuda-1-bf16.json"
    assert default_profile_path("cpu", "bf16", "bf16") == tmp_path / "hardware-cpu-bf16.json"
    assert default_profile_path("cpu", "bf16", "int8") == tmp_path / "hardware-cpu-bf16-kv-int8.json"
    assert default_acceptance_path("SmolLM2-135M-Instruct.Q4_1") == tmp_path / "acceptance-SmolLM2-135M-Instruct.Q4_1.json"
    # nothing calibrated: the CPU preset measured in that dtype
    for dtype in ("fp32", "bf16"):
        assert load_profile("cpu", dtype).dtype == dtype and load_profile("cpu", dtype).name.startswith("cpu-")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_calibrate_under_torchrun_reads_the_profile_of_its_dtype(tmp_path, monkeypatch, dtype):
    """`magicdec calibrate` under torchrun, without --output, adds the all-reduce to the profile saved for
    its device and --dtype (here a one-rank group: the profile is missing, which it says)."""
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["calibrate", "--device", "cpu", "--dtype", dtype])
    try:
        with pytest.raises(InvalidRequestError, match=f"hardware-cpu-{dtype}.json"):
            calibrate_allreduce(args)
    finally:
        shutdown_tp()


def test_a_profile_measured_with_other_kernels_is_set_aside(tmp_path, monkeypatch):
    """Rates measured before a native kernel (or with another attention or linear path) would mislead the
    planner: load_profile warns and plans with the preset."""

    from magicdec.model import attention_path, linear_path

    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    preset = load_profile("cpu", "bf16")
    cpu = torch.device("cpu")
    attention, linear = attention_path(cpu, torch.bfloat16), linear_path(cpu, torch.bfloat16)
    path = default_profile_path("cpu", "bf16")
    mine = dataclasses.replace(preset, name="mine", attention=attention, linear=linear)
    mine.to_json(path)
    assert load_profile("cpu", "bf16").name == "mine"
    for other in ({"attention": "sdpa" if attention != "sdpa" else "native"},
                  {"linear": "torch" if linear != "torch" else "packed"}):
        dataclasses.replace(mine, name="other", **other).to_json(path)
        with pytest.warns(UserWarning, match="calibrate` again"):
            assert load_profile("cpu", "bf16") == preset
    dataclasses.replace(mine, name="old", attention=None, linear=None).to_json(path)  # a file from before both
    if attention == "native" or linear == "packed":
        with pytest.warns(UserWarning, match="older"):
            assert load_profile("cpu", "bf16") == preset
    else:
        assert load_profile("cpu", "bf16").name == "old"


@pytest.mark.parametrize("kind", ["amx", "avx512bf16", "avx2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_preset_follows_dtype_then_cpu_kind(monkeypatch, kind, dtype):
    import magicdec.cpu

    monkeypatch.setattr(magicdec.cpu, "cpu_kind", lambda: kind)
    hw = preset_for_device("cpu", dtype)
    assert hw.dtype == dtype  # the dtype decides the rates most (bytes per weight and KV element)
    same_kind = [n for n in CPU_PRESETS if n.startswith(f"cpu-{kind}-") and PRESETS[n].dtype == dtype]
    assert hw.name == (same_kind[0] if same_kind else hw.name)


# --- acceptance -----------------------------------------------------------------------------------------------
def _draw_hist(alpha: float, gamma: int, n: int, rng: random.Random) -> list[int]:
    hist = [0] * (gamma + 1)
    for _ in range(n):
        k = 0
        while k < gamma and rng.random() < alpha:
            k += 1
        hist[k] += 1
    return hist


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("gamma", [1, 3, 4, 8])
def test_acceptance_mle_recovers_alpha(alpha, gamma):
    rng = random.Random(1000 * gamma + int(100 * alpha))
    n = 20000
    hist = _draw_hist(alpha, gamma, n, rng)
    est = acceptance_mle(hist)
    # standard error of the MLE: sqrt(alpha (1 - alpha) / E[trials]), trials = E[accepted] + E[rejections]
    trials = n * sum(alpha**k for k in range(gamma))  # each step tries until a rejection or gamma accepts
    se = math.sqrt(alpha * (1 - alpha) / trials)
    assert abs(est - alpha) < max(5 * se, 0.005), (hist, est)


def test_acceptance_mle_exact_and_edges():
    # the expected histogram (probabilities) gives alpha back exactly
    alpha, gamma = 0.7, 4
    probs = [alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma]
    assert acceptance_mle([1e6 * p for p in probs]) == pytest.approx(alpha, rel=1e-12)
    assert acceptance_mle([0, 0, 0, 5]) == 1.0
    assert acceptance_mle([7, 0, 0]) == 0.0
    with pytest.raises(ValueError):
        acceptance_mle([0, 0, 0])
    with pytest.raises(ValueError):
        acceptance_mle([3])


def test_nondecreasing_pools_noise():
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert nondecreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert nondecreasing([]) == []


@given(st.lists(st.floats(0.0, 10.0), max_size=20))
def test_nondecreasing_is_monotone_and_keeps_the_total(values):
    out = nondecreasing(values)
    assert len(out) == len(values)
    assert all(a <= b + 1e-12 for a, b in zip(out, out[1:]))
    assert sum(out) == pytest.approx(sum(values))


def test_attention_rates_keep_the_faster_sweep():
    """A sweep slowed by other work on the machine (every long forward 50% slower) does not lower attention's rates:
    each forward's fastest time across the sweeps is taken."""
    shape = SMOL
    run = _Run(torch.device("cpu"), torch.float32, True, torch.float32, torch.float32)
    idle = [{"q": q, "batch": 8, "kv_len": 8192, "seconds": 0.10 * q, "seconds_short": 0.02 * q} for q in (1, 4)]
    busy = [dict(r, seconds=1.5 * r["seconds"]) for r in idle]
    rates = [r["kv_bytes_per_s"] for r in attention_rates(run, shape, busy, idle)]
    assert rates == [r["kv_bytes_per_s"] for r in attention_rates(run, shape, idle)]
    assert rates[0] == pytest.approx(8 * 8192 * shape.kv_bytes_per_token(4) / 0.08)
    assert all(a > b for a, b in zip(rates, (r["kv_bytes_per_s"] for r in attention_rates(run, shape, busy))))


@pytest.mark.parametrize("att_rate", [20e9, 50e9])
def test_read_bandwidth_is_never_the_linear_rate(att_rate):
    """The profile's memory bandwidth is the fastest rate that times bytes alone (plain reads, attention's long-less-
    short difference), never the one-row linear rate, which subtracts an estimated overhead and can come out above
    the memory's rate; that rate then sets the streaming efficiency at 1."""
    gb = 1e9
    m = {"linear": [{"tokens": n, "seconds": 0.004 * n, "weight_bytes_per_s": 86 * gb / n} for n in (1, 4)],
         "attention": [{"q": q, "batch": 8, "kv_len": 8192, "seconds": 0.1, "seconds_short": 0.02,
                        "kv_bytes_per_s": att_rate / q} for q in (1, 4)],
         "overhead": {"fixed_s": 0.001, "per_layer_s": 1e-4, "decode_loop_extra_s": 0.001},
         "square_matmul": [{"flops_per_s": 1e12}], "read_bandwidth": {"sum": 38 * gb, "mv": 30 * gb},
         "sampling": {"seconds_per_logit": 1e-9}, "vegas": {"seconds_per_share": 1e-9, "table_read_factor": 1.4}}
    hw = profile_from(m, SMOL, "test", torch.device("cpu"), torch.float32)
    assert hw.mem_bandwidth == max(38 * gb, att_rate)
    assert hw.bandwidth_efficiency == 1.0 and hw.linear_rates[0] == (1, 86 * gb)


def test_an_overhead_longer_than_the_forwards_does_not_inflate_the_flop_rate():
    """Tiny forwards timed under other work can measure an overhead longer than every linear forward; the linear
    layers' FLOP rate then takes off at most 95% of a forward's time, as their byte rates do."""
    m = {"linear": [{"tokens": n, "seconds": 0.01 * n, "weight_bytes_per_s": 1e10} for n in (1, 64)],
         "attention": [{"q": 1, "batch": 8, "kv_len": 8192, "seconds": 0.1, "seconds_short": 0.02,
                        "kv_bytes_per_s": 2e10}],
         "overhead": {"fixed_s": 0.3, "per_layer_s": 0.0, "decode_loop_extra_s": 0.0},
         "square_matmul": [{"flops_per_s": 1e11}], "read_bandwidth": {"sum": 3e10, "mv": 3e10},
         "sampling": {"seconds_per_logit": 1e-9}, "vegas": {"seconds_per_share": 1e-9, "table_read_factor": 1.4}}
    hw = profile_from(m, SMOL, "test", torch.device("cpu"), torch.float32)
    raw = 2 * 64 * SMOL.n_params_linear / 0.64
    assert hw.flops_per_s * hw.matmul_efficiency == pytest.approx(20 * raw)


def test_row_spread():
    assert row_spread([0.1, -0.1]) == pytest.approx(0.1 * 2**0.5)
    assert row_spread([0.0, 0.0, 0.0]) == 0.0
    with pytest.raises(ValueError):
        row_spread([0.2])


@pytest.mark.parametrize("architecture", [None, "LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_builtin_acceptance_tables(architecture):
    """Each architecture with a table of its own plans with it (Gemma 3's, measured up to 32k); others with
    SmolLM2's."""
    table = builtin_acceptance(architecture)
    assert set(table.drafters()) >= {"self-streaming", "self-snapkv"}
    assert load_acceptance(None, architecture) == table
    assert (table == builtin_acceptance()) != (architecture == "Gemma3ForCausalLM")
    for drafter in ("self-streaming", "self-snapkv"):
        for mode in ("greedy", "sampling"):
            assert 0.0 < table.row_spread(drafter, mode) < 0.3
            for budget in (256, 512, 1024):
                for context in (1024, 4096, 8192, 32768):
                    a = table.alpha(drafter, budget, context, mode)
                    assert 0.0 < a < 1.0


@pytest.mark.slow
def test_calibrate_acceptance_small(llm, corpus_texts):
    records: list[dict] = []
    table = calibrate_acceptance(llm, corpus_texts, drafters=("self-streaming", "self-quant"), budgets=(32, 64, 512),
                                 contexts=(256,), modes=("greedy",), gamma=3, n_prompts=2, new_tokens=8,
                                 records=records)
    # 512 is not below the context: skipped; self-quant reads the whole context, once, without a budget
    assert [(r["drafter"], r["budget"]) for r in records] == [("self-streaming", 32), ("self-streaming", 64),
                                                               ("self-quant", None)]
    for r in records:
        assert len(r["accepted_hist"]) == 4 and sum(r["accepted_hist"]) > 0
        assert r["alpha"] == acceptance_mle(r["accepted_hist"])
        assert table.alpha(r["drafter"], r["budget"], 256) == r["alpha"]
        assert len(r["row_alphas"]) == 2
    devs = [a - r["alpha"] for r in records[:2] for a in r["row_alphas"]]
    assert table.row_spread("self-streaming") == pytest.approx(row_spread(devs))
    prompts = cut_prompts(llm.tokenizer, corpus_texts, 3, 100)
    assert [len(p) for p in prompts] == [100, 100, 100]
    assert len({tuple(p) for p in prompts}) == 3


# --- autoplan.choose ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("profile", ["cpu-amx-2t-fp32", "calibrated"])
def test_choose_ar_at_batch_1_short_context_on_cpu(llm, profile, request):
    if profile == "calibrated":
        profile = request.getfixturevalue("quick_calibration").profile
    spec, replan, plan = choose(llm.model, 1, 1024, kv_dtype=llm.kv_dtype, profile=profile)
    assert plan.predicted_speedup < MIN_PREDICTED_SPEEDUP
    if spec is None:
        assert replan is None and plan.strategy == "ar" and plan.gamma == 0 and "autoregressive" in describe(plan)
    else:  # a close call: the drafter, but plain steps until timings say otherwise
        assert replan(1, 1024) == 0 and "plain until its timings say drafting is faster" in describe(plan)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["h100", "h200", "a100-80gb"])
def test_choose_speculates_where_kv_dominates(llm, preset):
    """The default model's shape on a GPU at batch 128 and 32k context: the KV cache dominates."""
    spec, replan, plan = choose(llm.model, 128, 32768, profile=preset, dtype="bf16", kv_dtype="bf16")
    assert isinstance(spec, SpeculativeConfig)
    assert spec.draft in ("self-streaming", "self-snapkv")
    assert spec.budget == plan.budget and plan.gamma >= 1
    assert plan.verify_dominant == "kv"
    assert plan.predicted_speedup > 1.5
    # built for the longest draft it may re-plan to; re-planned per step at the same point, for the mean
    # sequence (steady state) rather than the slowest of 128, at least as long a draft
    assert spec.gamma == 8 and replan(128, 32768) >= plan.gamma
    drafter = spec.build(llm.model)  # the config builds into a drafter for this model
    assert drafter.gamma == spec.gamma
    # fewer live sequences and a shorter context: the KV term shrinks, and so does the best draft length,
    # down to none (plain decoding) for a few short sequences
    assert 1 <= replan(32, 4096) < replan(128, 32768)
    assert replan(2, 4096) == 0
    # also in sampling mode, and with the LLM's own dtypes (fp32 on this CPU)
    assert choose(llm.model, 128, 32768, kv_dtype=llm.kv_dtype, profile=preset, mode="sampling")[0] is not None
    assert choose(llm.model, 128, 32768, kv_dtype=llm.kv_dtype, profile=preset)[0] is not None


def test_choose_prices_the_slowest_of_the_rows_that_differ():
    """A static batch runs until its slowest sequence is done; greedy copies of one prompt decode alike, so a batch
    of them is priced at the mean rate, not at the slowest of 128."""
    _, _, every_row = choose(SMOL, 128, 32768, profile="h100")
    _, _, one_prompt = choose(SMOL, 128, 32768, profile="h100", rows=1)
    assert one_prompt.alpha > every_row.alpha
    assert one_prompt.predicted_throughput > every_row.predicted_throughput


def test_replanner_follows_the_acceptance_it_observes():
    """The per-step re-planner starts from the table's rate and moves to what the run accepts: rounds that
    reject early shorten the draft (to plain decoding); while it decodes plainly the rate drifts back to the
    table's, it drafts again, and rounds that accept everything lengthen the draft again."""
    _, replan, plan = choose(SMOL, 128, 32768, profile="h100")
    start = replan(128, 32768)
    assert start >= 1 and replan.alpha(32768) > plan.alpha  # the mean row's rate, not the slowest of 128
    for _ in range(20):
        replan.observe(4, [0] * 128, 0.0)  # every draft rejected at its first token
    assert replan.alpha(32768) < 0.05 and replan(128, 32768) == 0
    low = replan.plan_at(128, 32768)  # the prediction again at the rate learned: plain decoding's
    assert low.gamma == 0 and low.predicted_throughput < plan.predicted_throughput
    chosen = []
    for _ in range(300):  # as the engine drives it
        chosen.append(replan(128, 32768))
        replan.observe(chosen[-1], [chosen[-1]] * 128, 0.0)
    assert chosen[0] == 0 and replan.alpha(32768) > 0.9 and max(chosen[-8:]) >= start  # plain steps timed between
    high = replan.plan_at(128, 32768)
    assert high.alpha == replan.alpha(32768) and high.predicted_throughput > plan.predicted_throughput


def test_replanner_counts_a_shorter_draft_kept_whole_as_no_rejection():
    """Rows that stop drafting on their own (per-row draft lengths) and keep all they drafted teach the re-planner
    a rate near 1, not the rate of rows rejected at their last token."""
    rates = []
    for drafted in ([1] * 128, None):
        _, replan, _ = choose(SMOL, 128, 32768, profile="h100")
        for _ in range(30):
            replan.observe(4, [1] * 128, 0.0, drafted)
        rates.append(replan.alpha(32768))
    assert rates[0] > 0.9 > 0.6 > rates[1]


def test_replanner_prices_per_row_draft_lengths():
    """`draft_stop="auto"`: a drafted token pays where its chance of acceptance exceeds its marginal seconds times the
    round's tokens per second (`stop_price`); the threshold is the lowest confidence product from which every bin's
    learned chance does, each bin learning from what verification kept, and every STOP_EXPLORE-th round no row stops
    so that the bins below the threshold learn too. A fixed threshold passes through."""
    assert choose(SMOL, 128, 32768, profile="h100", draft_stop=0.3)[1].draft_stop() == 0.3
    _, replan, plan = choose(SMOL, 128, 32768, profile="h100", draft_stop="auto")
    gamma = replan(128, 32768)
    assert gamma >= 1
    price = replan.stop_price()
    assert 0 < price < 1
    # before any round, each bin's chance is its midpoint
    assert replan.draft_stop() == max(0, math.ceil(price * STOP_BINS - 0.5)) / STOP_BINS
    # one row alone pays for the whole round's marginal seconds
    work = Workload(SMOL, get_profile("h100"), 1, 32768)
    alone = max(replan(1, 32768), 1)
    rounds = round_time(work, alone, budget=plan.budget), round_time(work, alone - 1, budget=plan.budget)
    alpha = replan.alpha(32768)
    tokens = sum(alpha**i for i in range(alone + 1))
    assert replan.stop_price() == pytest.approx((rounds[0] - rounds[1]) * tokens / rounds[0])
    replan(128, 32768)
    # the rate is learned from the rounds in which no row stops alone
    for i in range(STOP_EXPLORE):
        before = replan.alpha(32768)
        replan.observe(gamma, [0] * 128, 0.0, [gamma] * 128, [[0.9] * gamma] * 128)  # every draft rejected
        assert (replan.alpha(32768) < before) == (i == STOP_EXPLORE - 1)
    # tokens whose confidence product is 0.5 or more are accepted, the others rejected (four rows per bin a round)
    mids = [(b + 0.5) / STOP_BINS for b in range(STOP_BINS)] * 4
    stops = []
    for _ in range(4 * STOP_EXPLORE):
        replan.observe(1, [int(m >= 0.5) for m in mids], 0.0, [1] * len(mids), [[m] for m in mids])
        stops.append(replan.draft_stop())
    assert replan.stop_chance(4) < replan.stop_price() < 0.9 < replan.stop_chance(5)
    assert stops[-STOP_EXPLORE:] == [0.5] * (STOP_EXPLORE - 2) + [0.0, 0.5]  # every 8th round explores


def drive(replan, plan, profile, live, context, rounds, slowness, accept=None):
    """`rounds` steps of `replan` at `live` rows over `context`, a round taking `slowness[drafting]` times the cost
    model's seconds on preset `profile`, each row accepting its whole draft (at most `accept` tokens); the draft
    lengths chosen."""
    work = Workload(SMOL, get_profile(profile), live, context)
    chosen = []
    for _ in range(rounds):
        g = replan(live, context)
        chosen.append(g)
        replan.observe(g, [g if accept is None else min(g, accept)] * live,
                       slowness[g > 0] * round_time(work, g, budget=plan.budget))
    return chosen


def test_replanner_follows_the_round_times_it_measures():
    """Speculative rounds that take longer than the cost model predicts, relative to plain steps, turn the
    re-planner to plain decoding; it still times draft rounds now and then, TIMING_WINDOW in a row, less often while
    the times agree, and drafts again when rounds get cheap, down to MIN_TIME_SCALE of the model's time. Where
    drafting is chosen it times plain steps now and then, and soon after the batch or the chosen kind's time changes."""
    _, replan, plan = choose(SMOL, 32, 16384, profile="h100")

    def run(rounds, slowness, live=32):
        return drive(replan, plan, "h100", live, 16384, rounds, slowness, accept=2)

    first = run(4 * EXPLORE_EVERY, {False: 1.0, True: 1.0})
    # drafting; plain steps after EXPLORE_FIRST rounds (one untimed, then TIMING_WINDOW), again 2 x EXPLORE_EVERY later
    assert first[0] >= 1 and first[EXPLORE_FIRST:EXPLORE_FIRST + TIMING_WINDOW + 1] == [0] * (TIMING_WINDOW + 1)
    assert first.count(0) == 2 * TIMING_WINDOW + 1 and replan.spec_time_scale() == 1.0
    slow = run(8 * EXPLORE_EVERY, {False: 1.0, True: 3.0})
    assert replan.spec_time_scale() == 3.0
    # draft rounds timed 1, 2 and 4 x EXPLORE_EVERY rounds apart, TIMING_WINDOW in a row
    assert slow[-1] == 0 and 2 * TIMING_WINDOW <= sum(g > 0 for g in slow[-7 * EXPLORE_EVERY:]) <= 3 * TIMING_WINDOW
    fast = run(12 * EXPLORE_EVERY, {False: 1.0, True: 0.8})  # drafting measured cheaper than the model says
    assert replan.spec_time_scale() == 0.8 and fast[-1] >= 1
    assert run(4 * EXPLORE_EVERY, {False: 1.0, True: 0.5}) and replan.spec_time_scale() == MIN_TIME_SCALE
    steady = run(8 * EXPLORE_EVERY, {False: 1.0, True: 1.0})  # plain steps ever further apart
    assert steady.count(0) <= 4 * TIMING_WINDOW and replan.spec_time_scale() == 1.0
    run(4 * EXPLORE_EVERY, {False: 1.0, True: 1.0})
    moved = run(EXPLORE_EVERY + TIMING_WINDOW, {False: 2.0, True: 2.0})  # memory reads at half the rate
    assert moved.count(0) >= TIMING_WINDOW and replan.spec_time_scale() == 1.0  # the chosen kind moved: plain timed
    # the batch moves by more than a fifth: plain steps every EXPLORE_EVERY rounds; by one row, further apart
    moving = [run(1, {False: 1.0, True: 1.0}, live=24 + 8 * (i % 2))[0] for i in range(8 * EXPLORE_EVERY)]
    assert moving.count(0) >= 7 * TIMING_WINDOW
    wobbling = [run(1, {False: 1.0, True: 1.0}, live=31 + i % 2)[0] for i in range(8 * EXPLORE_EVERY)]
    assert wobbling.count(0) <= 3 * TIMING_WINDOW


def test_replanner_takes_no_account_of_untimed_rounds():
    """Rounds reported without seconds (profiled ones) teach the acceptance but neither the timings nor their
    schedule: no round of the other kind is run to time it."""
    _, replan, _ = choose(SMOL, 32, 16384, profile="h100")
    chosen = []
    for _ in range(4 * EXPLORE_EVERY):
        chosen.append(replan(32, 16384))
        replan.observe(chosen[-1], [1] * 32, 0.0)
    assert min(chosen) >= 1 and replan.spec_time_scale() == 1.0


def test_a_close_call_starts_plain_and_drafts_once_its_timings_say_so():
    """Where drafting is predicted slower than plain decoding, but within what the timings can correct
    (MIN_TIME_SCALE), `choose` returns the drafter with a Replanner that starts plain; it drafts where draft rounds
    measure cheaper than the model says, and stays plain, timing draft rounds ever further apart, where they do not.
    Further off, plain decoding without a drafter."""
    assert choose(SMOL, 2, 1024, profile="cpu-amx-2t-fp32")[:2] == (None, None)

    def run(slowness):
        spec, replan, plan = choose(SMOL, 1, 1024, profile="cpu-amx-2t-fp32")
        assert spec is not None and plan.strategy == spec.draft and plan.predicted_speedup < MIN_PREDICTED_SPEEDUP
        assert "plain until its timings say drafting is faster" in describe(plan)
        return drive(replan, plan, "cpu-amx-2t-fp32", 1, 1024, 8 * EXPLORE_EVERY, slowness)

    cheap = run({False: 1.0, True: 0.75})
    explored = EXPLORE_FIRST + TIMING_WINDOW + 1  # plain steps, then one untimed draft round and TIMING_WINDOW timed
    assert cheap[:EXPLORE_FIRST] == [0] * EXPLORE_FIRST and all(g >= 1 for g in cheap[EXPLORE_FIRST:explored + 1])
    assert cheap.count(0) < 4 * EXPLORE_FIRST  # drafting from then on, plain steps timed now and then
    even = run({False: 1.0, True: 1.0})
    assert even[-1] == 0 and even.count(1) <= 4 * (TIMING_WINDOW + 1)


def test_the_engine_reports_each_round_to_its_policy(tiny_llama):
    """LLMEngine calls the policy's observe(gamma, accepted counts of the live rows, seconds, their draft lengths)
    after every round."""
    from magicdec.engine import LLMEngine
    from magicdec.sampling import SamplingParams

    class Policy(GammaPolicy):
        rounds: list = []

        def __call__(self, live, context):
            return 2

        def observe(self, gamma, accepted, seconds, drafted=None, confidences=None):
            assert list(drafted) == [gamma] * len(accepted)  # every row drafts gamma without a draft stop
            self.rounds.append((gamma, list(accepted), seconds))

    model = tiny_llama[0].model
    drafter = SpeculativeConfig("self-streaming", budget=16, gamma=2).build(model)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=96), speculation=Speculation(drafter, Policy()))
    engine.generate([[1, 2, 3, 4] * 5, [5, 6, 7] * 4], SamplingParams(max_tokens=9, ignore_eos=True))
    assert Policy.rounds and all(g == 2 and 1 <= len(a) <= 2 and all(0 <= k <= 2 for k in a) and t > 0
                                 for g, a, t in Policy.rounds)
    assert sum(k + 1 for _, a, _ in Policy.rounds for k in a) >= 2 * 8  # every token after the first came from a round


def test_the_engine_reports_profiled_rounds_untimed(tiny_llama):
    """Rounds under the profiler (`phases`) reach the policy with 0 seconds, the others with their time."""
    from magicdec.engine import LLMEngine
    from magicdec.phases import PhaseRecorder
    from magicdec.sampling import SamplingParams

    class Policy(GammaPolicy):
        seconds: list = []

        def __call__(self, live, context):
            return 1

        def observe(self, gamma, accepted, seconds, drafted=None, confidences=None):
            self.seconds.append(seconds)

    model = tiny_llama[0].model
    drafter = SpeculativeConfig("self-streaming", budget=16, gamma=1).build(model)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=96), speculation=Speculation(drafter, Policy()))
    engine.generate([[1, 2, 3, 4] * 5, [5, 6, 7] * 4], SamplingParams(max_tokens=9, ignore_eos=True),
                    phases=PhaseRecorder(2))
    first = Policy.seconds.index(0.0)  # the window opens once every prompt is prefilled
    assert Policy.seconds[first:first + 2] == [0.0, 0.0] and Policy.seconds.count(0.0) == 2
    assert len(Policy.seconds) > 2 and min(Policy.seconds) >= 0.0  # the others timed


def test_choose_without_a_model():
    """Planning for a machine and model you do not have: a ModelShape and a preset."""
    spec, replan, plan = choose(SMOL, 128, 32768, profile="h100")
    assert spec is not None and plan.verify_dominant == "kv"
    # one sequence left, its context below the draft budget: plain decoding wins, speculation ends
    assert replan(1, 100) == 0
    _, forced, _ = choose(SMOL, 128, 32768, profile="h100", strategies=[spec.draft])
    assert forced(1, 100) >= 1  # AR not allowed: the best draft length instead
    spec, _, plan = choose(SMOL, 2, 1024, profile="cpu-amx-2t-fp32")
    assert spec is None
    # an explicit table and profile file
    table = AcceptanceTable()
    table.add("self-streaming", 0.9, budget=256)
    spec, _, plan = choose(SMOL, 256, 65536, profile=PRESETS["h200"], acceptance=table)
    assert spec == SpeculativeConfig("self-streaming", budget=256, gamma=plan.gamma)
    # no candidate with a rate: AR
    spec, _, plan = choose(SMOL, 256, 65536, profile="h200", acceptance=AcceptanceTable())
    assert spec is None and plan.strategy == "ar"


def test_target_shape_from_config():
    from magicdec.calibrate.timing import model_config_from_shape

    cfg = model_config_from_shape(SMOL)
    shape = target_shape(cfg)
    assert dataclasses.replace(shape, name=SMOL.name) == SMOL


def test_builtin_table_is_valid_json():
    from importlib import resources

    data = json.loads((resources.files("magicdec") / "data" / "acceptance_smollm2.json").read_text())
    assert data["entries"] and all(0 <= e["alpha"] <= 1 for e in data["entries"])


def test_quick_profile_is_measured_once_per_cpu_threads_dtype_kernels_model_and_source(tiny_llama, tmp_path,
                                                                                       monkeypatch, capsys):
    """Where `magicdec calibrate` has not run, `--draft auto` measures this machine quickly on first use (with a
    progress line), keeps the profile, and reuses it; another thread count, model config or magicdec source measures
    again; a calibrated profile of the device and dtype wins, but for an 8-bit KV cache, measured apart."""

    import magicdec.calibrate.quick as quick

    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    measured = []
    real = quick.measure_hardware
    monkeypatch.setattr(quick, "measure_hardware", lambda *a, **kw: measured.append(kw["model"]) or real(*a, **kw))
    model = tiny_llama[0].model
    first = quick.planning_profile(model)
    assert measured == [model] and "measuring this machine for the planner" in capsys.readouterr().err
    assert first.dtype == "fp32" and first.name.startswith("quick-cpu-") and 1e9 < first.mem_bandwidth < 1e12
    path = quick.quick_profile_path(model.cfg, torch.float32)
    assert path.is_file() and HardwareProfile.from_json(path) == first
    assert quick.planning_profile(model) == first and len(measured) == 1  # reused, not measured again
    assert choose(model, 8, 512, profile=first)[2].hardware == first.name
    old = json.loads(path.read_text())
    old["sampling_s_per_token"] = old.pop("sampling_s_per_logit")  # as an older magicdec kept it
    path.write_text(json.dumps(old))
    assert quick.planning_profile(model).name == first.name and len(measured) == 2  # measured again, not an error
    assert "unknown hardware profile fields" in capsys.readouterr().err and HardwareProfile.from_json(path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert quick.quick_profile_path(model.cfg, torch.float32) != path  # keyed by the thread count too
    finally:
        torch.set_num_threads(threads)
    assert quick.quick_profile_path(model.cfg, torch.bfloat16) != path
    assert quick.quick_profile_path(dataclasses.replace(model.cfg, vocab_size=262144), torch.float32) != path
    assert quick.source_digest() == quick.source_digest() and len(quick.source_digest()) == 12
    with monkeypatch.context() as patched:
        patched.setattr(quick, "source_digest", lambda: "other-source")  # as another magicdec's sources hash
        assert quick.quick_profile_path(model.cfg, torch.float32) != path
    first.to_json(default_profile_path("cpu", "fp32"))  # as `magicdec calibrate` saves one
    assert quick.planning_profile(model) is None and len(measured) == 2  # choose then loads the calibrated one
    assert quick.planning_profile(model, torch.float32) is None  # a KV cache stored as the weights: the same
    # an int8 cache: attention measured over int8 rows, kept apart (the calibrated profile measured 32-bit rows)
    int8 = quick.planning_profile(model, torch.int8)
    assert len(measured) == 3 and int8.name.endswith("-kv-int8") and int8.name != first.name
    assert quick.quick_profile_path(model.cfg, torch.float32, torch.int8) != path
    int8.to_json(default_profile_path("cpu", "fp32", "int8"))  # as `magicdec calibrate --kv-cache-dtype int8` saves
    assert quick.planning_profile(model, torch.int8) == int8 and len(measured) == 3
