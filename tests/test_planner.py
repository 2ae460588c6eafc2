"""Tests of the planner: cost model arithmetic, acceptance model, strategy choice, I/O."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magicdec.planner import (
    MODEL_PRESETS,
    PRESETS,
    AcceptanceTable,
    HardwareProfile,
    ModelShape,
    decode_step_time,
    draft_time,
    expected_max_normal,
    expected_tokens,
    format_table,
    forward_cost,
    get_profile,
    plan,
    plan_table,
    plot_speedup,
    strategy_kv_bytes,
    round_time,
    selection_time,
    verify_step_time,
    Workload,
)
from magicdec.autoplan import MIN_PREDICTED_SPEEDUP, choose, default_strategies, describe
from magicdec.planner.hardware import GPU_LAUNCH_PER_LAYER_S, eager
from magicdec.profiles import preset_for_device

LLAMA2 = MODEL_PRESETS["llama-2-7b-32k"]
LLAMA3 = MODEL_PRESETS["llama-3.1-8b"]
TINYLLAMA = MODEL_PRESETS["tinyllama-1.1b"]

# Round numbers so the arithmetic below can be checked by hand.
TOY_HW = HardwareProfile(
    name="toy", flops_per_s=100e12, mem_bandwidth=1e12, mem_bytes=80e9,
    matmul_efficiency=0.5, bandwidth_efficiency=0.5, attention_efficiency=0.5,
    fixed_overhead_s=1e-3, ici_bandwidth=100e9,
)


def test_model_shape_counts():
    # Llama-2-7B, per layer: q,k,v,o = 4 * 4096 * 4096 = 67,108,864; MLP = 3 * 4096 * 11008
    # = 135,266,304; 32 layers = 6,476,005,376; lm head 4096 * 32000 = 131,072,000.
    assert LLAMA2.n_params_linear == 6_607_077_376
    # + embedding 131,072,000 + norms (2 * 32 + 1) * 4096 = 266,240 -> the familiar 6.74B.
    assert LLAMA2.n_params == 6_738_415_616
    assert LLAMA2.weight_bytes(2) == 2 * 6_738_415_616
    # K and V: 2 * 32 layers * 32 kv heads * 128 * 2 bytes = 512 KiB per token.
    assert LLAMA2.kv_bytes_per_token(2) == 524_288
    # GQA: 8 kv heads -> 2 * 32 * 8 * 128 * 2 = 128 KiB per token; 8.03B parameters.
    assert LLAMA3.kv_bytes_per_token(2) == 131_072
    assert LLAMA3.n_params == 8_030_261_248
    # Tied: the embedding is the lm head, counted once.
    smollm = MODEL_PRESETS["smollm2-135m"]
    assert smollm.n_params == smollm.n_params_linear + (2 * 30 + 1) * 576


def test_measured_rates_replace_the_roofline(tmp_path):
    """A calibrated profile's rates: log-log interpolation inside the measured range, compute-bound
    growth beyond it, constant below it; attention time is KV bytes over the rate at q."""
    hw = dataclasses.replace(TOY_HW, fixed_overhead_s=0.0, linear_rates=((1, 10e9), (4, 5e9), (16, 10e9)),
                             attention_rates=((1, 8e9), (8, 4e9)))
    w = LLAMA3.n_params_linear * 2

    def linear_time(tokens):
        return forward_cost(Workload(LLAMA3, hw, tokens, 0), 1, 0).time

    assert linear_time(1) == pytest.approx(w / 10e9)
    assert linear_time(2) == pytest.approx(w / (10e9 * 0.5**0.5))  # halfway (in log) from 1 to 4
    assert linear_time(4) == pytest.approx(w / 5e9)
    assert linear_time(32) == pytest.approx(2 * w / 10e9)  # beyond 16 tokens: time grows with tokens
    kv = 4 * 1000 * LLAMA3.kv_bytes_per_token(2)
    attention = forward_cost(Workload(LLAMA3, hw, 4, 1000), 8, 1000).time - forward_cost(Workload(LLAMA3, hw, 4, 0), 8, 0).time
    assert attention == pytest.approx(kv / 4e9)
    assert forward_cost(Workload(LLAMA3, hw, 1, 0), 1, 0).dominant == "weights"
    path = tmp_path / "hw.json"
    hw.to_json(path)
    assert HardwareProfile.from_json(path) == hw  # lists in JSON, tuples again when read
    with pytest.raises(ValueError, match="ascending"):
        dataclasses.replace(TOY_HW, linear_rates=((4, 1e9), (2, 1e9)))


def test_from_hf_config_matches_preset():
    config = {
        "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    }
    shape = ModelShape.from_hf_config(config, name="llama-3.1-8b")
    assert shape == LLAMA3
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_attention_heads": 32})


def test_forward_cost_memory_bound_by_hand():
    # Llama-2-7B, batch 8, one new token each, 4096 cached tokens, bf16, on TOY_HW.
    cost = forward_cost(Workload(LLAMA2, TOY_HW, batch=8, context=4096), q=1, kv_len=4096)
    # weights: 6,607,077,376 linear params * 2 bytes
    assert cost.bytes_weights == 13_214_154_752
    # KV: 8 * 4096 tokens * 524,288 bytes
    assert cost.bytes_kv == 17_179_869_184
    # activations per token per layer, inputs plus outputs of every linear layer:
    # 4 * 4096 (residual-width reads/writes) + (2 * 32 q/o heads + 2 * 32 k/v heads) * 128
    # + 3 * 11008 (gate, up, down) = 16,384 + 16,384 + 33,024 = 65,792; * 32 layers
    # = 2,105,344; + lm head 4096 in + 32000 out = 2,141,440 elements * 2 bytes * 8 tokens
    assert cost.bytes_activations == 2_141_440 * 2 * 8
    # linear flops: 2 * 8 tokens * 6,607,077,376; attention: 4 * 8 * 4096 * 32 * 32 * 128
    assert cost.flops_linear == 105_713_238_016
    assert cost.flops_attention == 17_179_869_184
    # Effective bandwidth 0.5 TB/s, linear 50 TFLOP/s, attention 50 TFLOP/s.
    t_linear = (13_214_154_752 + 34_263_040) / 0.5e12  # 26.50 ms, beats 105.7e9 / 50e12 = 2.11 ms
    t_kv = 17_179_869_184 / 0.5e12  # 34.36 ms, beats 17.2e9 / 50e12 = 0.34 ms
    assert cost.t_memory == pytest.approx(t_linear + t_kv)
    assert cost.t_compute == pytest.approx(105_713_238_016 / 50e12 + 17_179_869_184 / 50e12)
    assert cost.t_comm == 0
    assert cost.t_overhead == 1e-3
    assert cost.time == pytest.approx(t_linear + t_kv + 1e-3)  # 61.86 ms
    assert cost.dominant == "kv"


def test_forward_cost_compute_bound_and_tensor_parallel_by_hand():
    # Batch 256 x 8 tokens, no cache: linear flops 2 * 2048 * 6,607,077,376 = 27.06e12,
    # at 50 TFLOP/s = 541.3 ms, far above (13.2e9 + 2048 * 2,141,440 * 2) / 0.5e12 = 43.9 ms.
    cost = forward_cost(Workload(LLAMA2, TOY_HW, batch=256, context=0), q=8, kv_len=0)
    assert cost.time == pytest.approx(2 * 2048 * 6_607_077_376 / 50e12 + 1e-3)
    assert cost.dominant == "compute"
    # tp=2 halves every byte and flop but the LM head's (replicated: 4096 * 32000 = 131,072,000 params),
    # and adds 2 all-reduces per layer of 2048 tokens * 4096 * 2 bytes = 16 MiB, each moving
    # 2 * (2-1)/2 = 1x of it at 100 GB/s: 64 * 16,777,216 / 100e9 = 10.74 ms.
    cost_tp = forward_cost(Workload(LLAMA2, TOY_HW, batch=256, context=0, tp=2), q=8, kv_len=0)
    assert cost_tp.flops_linear == 2 * 2048 * ((6_607_077_376 - 131_072_000) / 2 + 131_072_000)
    assert cost_tp.t_comm == pytest.approx(64 * 16_777_216 / 100e9)
    assert cost_tp.time == pytest.approx(cost_tp.flops_linear / 50e12 + cost_tp.t_comm + 1e-3)
    # each all-reduce also pays the measured latency
    slow = dataclasses.replace(TOY_HW, allreduce_latency_s=20e-6)
    assert forward_cost(Workload(LLAMA2, slow, batch=256, context=0, tp=2), q=8, kv_len=0).t_comm == pytest.approx(cost_tp.t_comm + 64 * 20e-6)
    with pytest.raises(ValueError, match="ici_bandwidth"):
        forward_cost(Workload(LLAMA2, dataclasses.replace(TOY_HW, ici_bandwidth=None), 1, 0, tp=2), 1, 0)


def test_step_helpers():
    def time(shape, q, kv_len):
        return forward_cost(Workload(shape, TOY_HW, 4, kv_len), q, kv_len).time

    assert decode_step_time(Workload(LLAMA2, TOY_HW, 4, 8000)) == time(LLAMA2, 1, 8000)
    assert verify_step_time(Workload(LLAMA2, TOY_HW, 4, 8000), gamma=3) == time(LLAMA2, 4, 8000)
    # The draft's shape over the budget (a budget past the context is the context); the first draft forward
    # of a round reads `first_tokens` per row, the others one.
    assert draft_time(Workload(LLAMA2, TOY_HW, 4, 8000), budget=512, gamma=1, first_tokens=2) == time(LLAMA2, 2, 512)
    assert draft_time(Workload(LLAMA2, TOY_HW, 4, 8000), budget=512, gamma=3, first_tokens=2) == pytest.approx(
        time(LLAMA2, 2, 512) + 2 * time(LLAMA2, 1, 512))
    assert draft_time(Workload(LLAMA2, TOY_HW, 4, 300), budget=512, gamma=1, first_tokens=2) == time(LLAMA2, 2, 300)
    # Standalone draft: dense cache attends the whole context.
    assert draft_time(Workload(TINYLLAMA, TOY_HW, 4, 8000), budget=None, gamma=1, first_tokens=2) == time(TINYLLAMA, 2, 8000)
    # A self-speculative round's first draft forward reads one token: the others are copied from the target.
    assert draft_time(Workload(LLAMA2, TOY_HW, 4, 8000), budget=512, gamma=3, first_tokens=1) == pytest.approx(
        3 * time(LLAMA2, 1, 512))
    assert round_time(Workload(LLAMA2, TOY_HW, 4, 8000), 3, budget=512) == pytest.approx(
        3 * time(LLAMA2, 1, 512) + time(LLAMA2, 4, 8000))
    assert round_time(Workload(LLAMA2, TOY_HW, 4, 8000), 3, draft=TINYLLAMA, budget=512) == pytest.approx(
        time(TINYLLAMA, 2, 512) + 2 * time(TINYLLAMA, 1, 512) + time(LLAMA2, 4, 8000))


def test_expected_tokens_edge_cases():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.7, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # continuous as alpha -> 1
    assert expected_tokens(1 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)


def test_acceptance_interpolation():
    table = AcceptanceTable()
    table.add("self-streaming", 0.8, budget=256, context=1000)
    table.add("self-streaming", 0.6, budget=256, context=100000)
    table.add("self-streaming", 0.9, budget=1024)
    # log-midpoint of 1000 and 100000 is 10000: halfway between 0.8 and 0.6
    assert table.alpha("self-streaming", 256, 10000) == pytest.approx(0.7)
    assert table.alpha("self-streaming", 256, 500) == 0.8  # clamped
    # budget 512 is the log-midpoint of 256 and 1024: halfway between 0.7 and 0.9 at 10k
    assert table.alpha("self-streaming", 512, 10000) == pytest.approx(0.8)
    assert table.alpha("self-streaming", 4096, 10000) == 0.9  # above measured: clamped
    with pytest.raises(KeyError):
        table.alpha("self-streaming", 128, 10000)  # below measured: unknown
    with pytest.raises(KeyError):
        table.alpha("self-streaming", 256, 10000, mode="sampling")
    with pytest.raises(KeyError):
        table.alpha("self-snapkv", 256, 10000)

    paper = AcceptanceTable.paper_default()
    assert paper.alpha("self-streaming", 512, 4000) == 0.84
    assert paper.alpha("self-streaming", 512, 32000) == 0.81
    assert paper.alpha("self-streaming", 512, 200000) == 0.79
    assert paper.alpha("tinyllama-1.1b:streaming", 256, 8000) == 0.8


def test_slowest_row_acceptance():
    table = AcceptanceTable()
    table.add("self-streaming", 0.8, budget=256)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=0.02)  # tabulated exact value
    assert expected_max_normal(32) == pytest.approx(2.0697, abs=0.02)
    assert table.alpha("self-streaming", 256, 1000, rows=32) == 0.8  # no spread measured: every row alike
    table.set_row_spread("self-streaming", 0.1)
    assert table.row_spread("self-streaming", "sampling") == 0.0
    assert table.alpha("self-streaming", 256, 1000) == 0.8
    assert table.alpha("self-streaming", 256, 1000, rows=8) == pytest.approx(0.8 - 0.1 * expected_max_normal(8))
    table.set_row_spread("self-streaming", 0.5)
    assert table.alpha("self-streaming", 256, 1000, rows=32) == 0.0  # clamped
    with pytest.raises(ValueError):
        table.set_row_spread("self-streaming", -0.1)
    with pytest.raises(ValueError):
        expected_max_normal(0)


def test_plan_counts_the_slowest_row_of_a_static_batch():
    table = _high_acceptance_table(0.85)
    for drafter in ("self-streaming", "self-snapkv"):
        table.set_row_spread(drafter, 0.08)
    hw = get_profile("a100-80gb")
    static = plan(Workload(LLAMA3, hw, 32, 32768), table)
    steady = plan(Workload(LLAMA3, hw, 32, 32768), table, rows=1)
    assert steady.alpha == 0.85
    assert static.alpha == pytest.approx(0.85 - 0.08 * expected_max_normal(32))
    assert static.predicted_speedup < steady.predicted_speedup
    assert static.gamma <= steady.gamma  # a slower slowest row makes long drafts pay less
    with pytest.raises(ValueError):
        plan(Workload(LLAMA3, hw, 32, 32768), table, rows=0)


def test_json_round_trips(tmp_path):
    profile = dataclasses.replace(PRESETS["a100-80gb"], per_layer_overhead_s=3e-5)
    profile.to_json(tmp_path / "hw.json")
    assert HardwareProfile.from_json(tmp_path / "hw.json") == profile
    assert get_profile(str(tmp_path / "hw.json")) == profile
    assert get_profile("h100") is PRESETS["h100"]
    with pytest.raises(ValueError, match="a100-80gb"):
        get_profile("tpu-v9")

    table = AcceptanceTable.paper_default()
    table.add("tinyllama-1.1b:dense", 0.82)
    table.set_row_spread("self-streaming", 0.07, mode="sampling")
    table.to_json(tmp_path / "acc.json", meta={"corpus": "test"})
    assert AcceptanceTable.from_json(tmp_path / "acc.json") == table


def _high_acceptance_table(alpha=0.9):
    table = AcceptanceTable()
    for budget in (64, 128, 256, 512, 1024, 2048):
        table.add("self-streaming", alpha, budget=budget)
        table.add("self-snapkv", alpha, budget=budget)
    return table


def test_plan_picks_ar_when_speculation_cannot_win():
    # Short context, batch 1, fp32 on the CPU: the weights dominate a draft step as much as a
    # target step, so even 90% acceptance cannot pay for drafting.
    cpu = get_profile("cpu-amx-2t-fp32")
    table = _high_acceptance_table()
    best = plan(Workload(TINYLLAMA, cpu, batch=1, context=512, dtype_bytes=4, kv_dtype_bytes=4), acceptance=table)
    assert best.strategy == "ar"
    assert best.gamma == 0 and best.predicted_speedup == 1.0
    assert best.verify_dominant == "weights"
    # Forced to speculate, the best it can do is slower than AR.
    forced = plan(Workload(TINYLLAMA, cpu, 1, 512, dtype_bytes=4, kv_dtype_bytes=4), table,
                  strategies=["self-streaming", "self-snapkv"])
    assert forced.strategy != "ar" and forced.predicted_speedup < 1.0


def test_plan_speculates_when_kv_dominates():
    # Llama-3.1-8B on 8 x H100 at batch 128 and 32k context: 550 GB of KV cache against
    # 16 GB of weights, so a 512-token draft cache makes drafting cheap.
    best = plan(Workload(LLAMA3, get_profile("h100"), batch=128, context=32768, tp=8),
                acceptance=AcceptanceTable.paper_default())
    assert best.strategy == "self-streaming"
    assert best.budget == 512
    assert best.verify_dominant == "kv"
    assert best.predicted_speedup > 1.5
    assert best.fits_in_memory


def test_best_gamma_grows_with_batch_at_long_context():
    rows = plan_table([Workload(LLAMA2, get_profile("a100-80gb"), b, 32768) for b in [1, 2, 4, 8, 16, 32, 64, 128, 256]],
                      acceptance=AcceptanceTable.paper_default())
    gammas = [row["gamma"] for row in rows]
    assert gammas == sorted(gammas)
    assert gammas[-1] > gammas[0]
    speedups = [row["predicted_speedup"] for row in rows]
    assert speedups == sorted(speedups)


def test_margin_keeps_plain_decoding_on_close_calls():
    w = Workload(LLAMA3, get_profile("h100"), batch=128, context=32768, tp=8)
    args = dict(acceptance=AcceptanceTable.paper_default())
    best = plan(w, **args)
    assert best.strategy != "ar"
    assert plan(w, **args, margin=best.predicted_speedup * 0.99) == best
    assert plan(w, **args, margin=best.predicted_speedup * 1.01).strategy == "ar"


def test_sampling_work_is_charged_per_token_drawn():
    """In sampling mode a plain step draws one token per row and a round 2 gamma + 1, each over the vocabulary's
    logits; greedy mode is free."""
    hw = dataclasses.replace(get_profile("h100"), sampling_s_per_logit=1e-4 / LLAMA3.vocab_size)
    table = AcceptanceTable()
    for mode in ("greedy", "sampling"):
        for budget in (256, 512, 1024):
            table.add("self-streaming", 0.8, budget=budget, mode=mode)
    w = Workload(LLAMA3, hw, batch=128, context=32768, tp=8)
    args = dict(acceptance=table, strategies=["self-streaming"])
    greedy = plan(w, **args)
    assert greedy == plan(dataclasses.replace(w, hw=dataclasses.replace(hw, sampling_s_per_logit=0.0)), **args)
    sampled = plan(w, mode="sampling", **args, gammas=[greedy.gamma], budgets=[greedy.budget])
    t_round = (draft_time(w, greedy.budget, greedy.gamma, first_tokens=1)
               + verify_step_time(w, greedy.gamma) + (2 * greedy.gamma + 1) * 128e-4)
    assert sampled.predicted_throughput == pytest.approx(128 * expected_tokens(sampled.alpha, greedy.gamma) / t_round)
    ar = 128 / (decode_step_time(w) + 128e-4)
    assert sampled.predicted_speedup == pytest.approx(sampled.predicted_throughput / ar)
    # dear enough sampling makes plain decoding (one draw per token) the better choice
    costly = dataclasses.replace(hw, sampling_s_per_logit=1e-2 / LLAMA3.vocab_size)
    assert plan(dataclasses.replace(w, hw=costly), table, mode="sampling").strategy == "ar"


GEMMA = MODEL_PRESETS["gemma3-270m"]


def test_a_draft_head_cheapens_draft_forwards_and_their_sampling():
    """A draft head of V rows: the draft forwards read and multiply V rows of the LM head, and sampling draws the gamma
    draft positions from V logits (the gamma + 1 verified ones from the whole vocabulary)."""
    hw = dataclasses.replace(get_profile("cpu-avx512bf16-2t-bf16"), sampling_s_per_logit=1e-9)
    w = Workload(GEMMA, hw, batch=32, context=32768)
    head = dataclasses.replace(w, shape=dataclasses.replace(GEMMA, vocab_size=32768))
    for mode, t_logit in (("greedy", 0.0), ("sampling", 32e-9)):
        expected = (draft_time(head, 512, 3, first_tokens=1) + verify_step_time(w, 3)
                    + (3 * 32768 + 4 * GEMMA.vocab_size) * t_logit)
        assert round_time(w, 3, mode, budget=512, draft_vocab=32768) == pytest.approx(expected)
        assert round_time(w, 3, mode, budget=512, draft_vocab=32768) < round_time(w, 3, mode, budget=512)
    assert round_time(w, 0, "sampling") == pytest.approx(decode_step_time(w) + GEMMA.vocab_size * 32e-9)


def test_plan_drafts_through_a_head_where_it_pays():
    """Given draft heads and the share of the text each holds, the plan prices each drafter through each: Gemma 3's
    262k-row head dominates a draft step at B=32 x 32k, so a 32k head holding 99% of the text wins; one holding half
    of it accepts too little, and a head as large as the vocabulary is the LM head itself."""
    table = AcceptanceTable()
    for mode in ("greedy", "sampling"):
        table.add("self-streaming", 0.8, budget=512, mode=mode)
    w = Workload(GEMMA, get_profile("cpu-avx512bf16-2t-bf16"), batch=32, context=32768)
    args = dict(acceptance=table, strategies=["self-streaming"], budgets=[512])
    whole = plan(w, **args)
    assert whole.draft_vocab == 0 and plan(w, **args, draft_heads={0: 1.0}) == whole
    best = plan(w, **args, draft_heads={0: 1.0, 32768: 0.99})
    assert best.draft_vocab == 32768 and best.alpha == pytest.approx(0.99 * whole.alpha)
    assert best.predicted_throughput > whole.predicted_throughput
    assert plan(w, **args, draft_heads={0: 1.0, 32768: 0.5}).draft_vocab == 0
    assert plan(w, **args, draft_heads={0: 1.0, GEMMA.vocab_size: 1.0}) == whole


def test_plan_with_draft_model_uses_fewer_devices_for_few_kv_heads():
    best = plan(Workload(LLAMA2, get_profile("a100-80gb"), 64, 8000, tp=8), AcceptanceTable.paper_default(),
                draft=TINYLLAMA, strategies=["model"])
    assert (best.strategy, best.draft_cache, best.budget) == ("model", "streaming", 256)
    # TinyLlama has 4 KV heads: it runs on gcd(8, 4) = 4 devices, so its draft step is
    # slower than if it were split 8 ways.
    expected_draft = draft_time(Workload(TINYLLAMA, get_profile("a100-80gb"), 64, 8000, tp=4), 256, best.gamma, first_tokens=2)
    t_verify = verify_step_time(Workload(LLAMA2, get_profile("a100-80gb"), 64, 8000, tp=8), best.gamma)
    throughput = 64 * expected_tokens(0.8, best.gamma) / (expected_draft + t_verify)
    assert best.predicted_throughput == pytest.approx(throughput)


def test_plan_rejects_empty_search():
    with pytest.raises(ValueError, match="no speculative candidate"):
        plan(Workload(LLAMA2, TOY_HW, 8, 8000), AcceptanceTable(), strategies=["self-snapkv"])


def test_report(tmp_path):
    rows = plan_table([Workload(LLAMA2, get_profile("a100-80gb"), b, c) for c in [4096, 32768] for b in [1, 64]],
                      AcceptanceTable.paper_default())
    text = format_table(rows, ["batch", "context", "strategy", "gamma", "predicted_speedup"])
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert lines[0].split() == ["batch", "context", "strategy", "gamma", "predicted_speedup"]
    pytest.importorskip("matplotlib")
    plot_speedup(rows, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_planner_does_not_import_torch():
    code = "import magicdec.planner, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_presets_are_consistent():
    from magicdec.planner.hardware import CPU_PRESETS

    assert set(PRESETS) == {"a100-80gb", "h100", "h200", "l40s", "l40", *CPU_PRESETS}
    for name, profile in PRESETS.items():
        assert profile.name == name
    # CPU presets are measured profiles, named after what they measured: cpu-<kind>-<threads>t-<dtype>
    for name in CPU_PRESETS:
        kind, threads, dtype = name.split("-")[1:]
        assert kind in ("amx", "avx512bf16", "avx512", "avx2", "generic") and threads.endswith("t")
        assert PRESETS[name].dtype == dtype and PRESETS[name].linear_rates and PRESETS[name].attention_rates
    # Datasheet ratios the analysis depends on: H100 and H200 share compute, H200 has more bandwidth.
    assert PRESETS["h200"].flops_per_s == PRESETS["h100"].flops_per_s
    assert PRESETS["h200"].mem_bandwidth > PRESETS["h100"].mem_bandwidth
    assert math.isclose(PRESETS["l40s"].flops_per_s, 2 * PRESETS["l40"].flops_per_s, rel_tol=0.01)


def test_an_eager_gpu_forward_takes_at_least_its_kernel_launches():
    """On an H200, magicdec's eager Gemma 3 270M forwards took ~10 ms at any shape (host-bound) where CUDA-graph
    replays took 2-8: the eager profile prices a small model's forward at its launches, a large one's at its work."""
    hw = get_profile("h200")
    launched = eager(hw)
    assert launched.name == "h200-eager" and launched.launch_per_layer_s == GPU_LAUNCH_PER_LAYER_S > 0
    gemma = MODEL_PRESETS["gemma3-270m"]
    small = Workload(gemma, launched, batch=32, context=8192)
    assert decode_step_time(small) == pytest.approx(gemma.n_layers * GPU_LAUNCH_PER_LAYER_S)
    assert decode_step_time(Workload(gemma, hw, batch=32, context=8192)) < decode_step_time(small) / 2
    # Llama-3.1-8B at 128 x 32k streams 550 GB of KV cache: its work outlasts the launches
    large = Workload(LLAMA3, launched, batch=128, context=32768)
    assert decode_step_time(large) == pytest.approx(decode_step_time(dataclasses.replace(large, hw=hw)))
    assert forward_cost(small, 1, 8192).dominant == "overhead"
    # a draft step costs the launches too: where the launch-free preset drafts for the small model, the eager one
    # decodes plainly (on an H200 the engine's self-speculative round at B=32 x 8k took 4.5 plain steps)
    acceptance = AcceptanceTable.paper_default()
    wide = Workload(gemma, hw, batch=256, context=32768)
    assert plan(wide, acceptance=acceptance).predicted_speedup > 1.2
    assert plan(dataclasses.replace(wide, hw=launched), acceptance=acceptance).strategy == "ar"


def test_a_gpu_device_plans_with_its_preset_as_the_engine_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    hw = preset_for_device("cuda:0")
    assert hw.name == "h200-eager" and hw.launch_per_layer_s > 0
    assert preset_for_device("cuda:0").mem_bandwidth == get_profile("h200").mem_bandwidth
    # replayed from CUDA graphs, forwards launch no kernels from the host: the launch-free preset
    assert preset_for_device("cuda:0", graphs=True) == get_profile("h200")


def test_auto_plans_with_the_launch_free_preset_where_graphs_replay(monkeypatch):
    """`choose` takes the uncalibrated GPU's preset as the engine will run: launch-free where its decode forwards
    replay from CUDA graphs (the engine's default there), with the host's launches under `enforce_eager`."""
    from magicdec.autoplan import _hardware

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr("magicdec.profiles.default_profile_path", lambda device, dtype: Path("/nonexistent"))
    assert _hardware(None, "cuda:0", torch.bfloat16, graphs=True).name == "h200"
    assert _hardware(None, "cuda:0", torch.bfloat16, graphs=False).name == "h200-eager"


def test_a_quantized_draft_reads_the_whole_context_at_int8_bytes():
    """self-quant drafts over every cached token in int8 rows (4-bit levels and a scale): its draft forwards are priced
    at those bytes per value, it needs no budget, and the planner takes it over a sparse draft only where its higher
    acceptance outweighs reading the whole context (half the target's bytes a draft step, against a sparse draft's
    few)."""
    w = Workload(LLAMA3, TOY_HW, batch=64, context=32768)
    int8 = dataclasses.replace(w, kv_dtype_bytes=strategy_kv_bytes("self-quant", w))
    assert strategy_kv_bytes("self-quant", w) == (LLAMA3.head_dim + 4) / LLAMA3.head_dim
    assert strategy_kv_bytes("self-streaming", w) is None
    assert round_time(w, 3, draft_kv_bytes=int8.kv_dtype_bytes) == pytest.approx(
        draft_time(int8, None, 3, first_tokens=1) + verify_step_time(w, 3))
    table = AcceptanceTable()
    table.add("self-streaming", 0.2, budget=512)
    table.add("self-quant", 0.95)
    best = plan(w, table, strategies=["self-streaming", "self-quant"])
    assert (best.strategy, best.budget) == ("self-quant", None)
    assert plan(w, table, strategies=["self-streaming"]).strategy == "self-streaming"
    # with a sparse draft that accepts well, reading the whole context a draft step does not pay
    table.add("self-streaming", 0.85, budget=1024)
    assert plan(w, table, strategies=["self-streaming", "self-quant"]).strategy == "self-streaming"


def test_auto_searches_a_quantized_draft_where_its_profile_prices_it():
    """`choose` searches self-quant by default on a GPU profile over a 16-bit cache, where attention is bound by the
    bytes the profile prices; not on a CPU profile (its int8 kernel is bound by instructions, which a bf16 profile
    does not price), and never over an int8 cache (its draft would read what a decode step reads). Asked for, it
    builds the drafter without a budget and re-plans it per step."""
    table = AcceptanceTable()
    table.add("self-quant", 0.9)
    cpu = dataclasses.replace(TOY_HW, name="cpu-toy")
    assert choose(LLAMA3, 64, 32768, profile=cpu, acceptance=table).speculative is None
    assert choose(LLAMA3, 64, 32768, profile=TOY_HW, acceptance=table).plan.strategy == "self-quant"
    assert choose(LLAMA3, 64, 32768, profile=TOY_HW, acceptance=table, kv_dtype="int8").speculative is None
    asked = ("ar", "self-quant")
    assert choose(LLAMA3, 64, 32768, profile=TOY_HW, acceptance=table, kv_dtype="int8",
                  strategies=asked).plan.predicted_speedup < MIN_PREDICTED_SPEEDUP  # at most a close call
    choice = choose(LLAMA3, 64, 32768, profile=TOY_HW, acceptance=table, kv_dtype="bf16", strategies=asked)
    assert choice.plan.strategy == "self-quant" and choice.speculative.draft == "self-quant"
    assert "self-quant gamma" in describe(choice.plan)
    assert choice.replanner.plan_at(64, 32768).strategy == "self-quant"


def test_rows_sharing_a_prompt_pay_its_attention_as_measured():
    """`shared_attention_factor` (4 rows a prompt against rows of their own) prices every forward over the whole
    context at `prefix_rows`: 4 rows a prompt take the factor, distinct rows nothing off, 32 rows a prompt less than
    4 do; a sparse draft reads entries of its own, and a profile that did not measure it prices nothing off. A
    group's task computes all its rows' queries: where attention is compute-bound past 4 new tokens a row (measured
    rates), a verification of 3 tokens at 4 rows a prompt saves little. The planner then finds plain decoding
    faster, and drafting gaining less."""
    hw = dataclasses.replace(TOY_HW, shared_attention_factor=0.4)
    w = Workload(LLAMA3, hw, batch=32, context=16384)

    def attention(work, q=1, kv_len=16384):
        cost = forward_cost(work, q, kv_len)
        linear = forward_cost(dataclasses.replace(work, context=0), q, 0)
        return cost.time - linear.time

    alone, grouped = attention(w), (16384 - 1024) / 16384  # the last chunk of 1024 positions each row's own
    assert attention(dataclasses.replace(w, prefix_rows=4)) == pytest.approx((grouped * 0.4 + 1 - grouped) * alone)
    assert attention(dataclasses.replace(w, prefix_rows=1)) == pytest.approx(alone)
    assert attention(dataclasses.replace(w, prefix_rows=32)) < (grouped * 0.4 + 1 - grouped) * alone
    assert attention(dataclasses.replace(w, prefix_rows=4), q=3) == pytest.approx(
        (grouped * 0.4 + 1 - grouped) * attention(w, q=3))
    rated = Workload(LLAMA3, dataclasses.replace(hw, attention_rates=((1.0, 4e11), (4.0, 4e11))), 32, 16384)
    assert attention(dataclasses.replace(rated, prefix_rows=4)) == pytest.approx(
        (grouped * 0.4 + 1 - grouped) * attention(rated))
    # a group of 4 rows x 3 tokens takes 3 rows' passes (12 new tokens, compute-bound), plus 3 x 0.2 for the others
    assert attention(dataclasses.replace(rated, prefix_rows=4), q=3) == pytest.approx(
        (grouped * (3 + 3 * 0.2) / 4 + 1 - grouped) * attention(rated, q=3))
    assert attention(dataclasses.replace(w, prefix_rows=4), kv_len=512) == pytest.approx(attention(w, kv_len=512))
    assert attention(dataclasses.replace(w, hw=TOY_HW, prefix_rows=4)) == pytest.approx(attention(
        dataclasses.replace(w, hw=TOY_HW)))
    table = _rates(0.8, 0.8)
    distinct, shared = plan(w, table), plan(dataclasses.replace(w, prefix_rows=4), table)
    assert decode_step_time(dataclasses.replace(w, prefix_rows=4)) < decode_step_time(w)
    assert shared.predicted_speedup < distinct.predicted_speedup
    with pytest.raises(ValueError, match="shared_attention_factor"):
        dataclasses.replace(TOY_HW, shared_attention_factor=0)


def test_prompts_count_as_one_prefix_where_their_whole_chunks_agree():
    """`engine.prefix_rows`: rows per prompt prefix, prompts that agree over all their whole chunks of 1024 positions
    counted once (what the kernels group rows over); prompts shorter than a chunk share nothing."""
    from magicdec import kernels
    from magicdec.engine import prefix_rows
    from magicdec.planner.cost import GROUP_CHUNK

    assert GROUP_CHUNK == kernels.CHUNK  # the planner's copy of the kernels' chunk
    doc = list(range(3000))
    assert prefix_rows([doc] * 4 + [doc[::-1]] * 4) == 4
    assert prefix_rows([doc + [1], doc + [2, 3], doc[:1500]]) == 1.5  # the first two agree over 2 whole chunks
    assert prefix_rows([[5] * 1000] * 8) == 1 and prefix_rows([doc]) == 1


def test_a_prefix_is_planned_as_shared_only_where_the_kernels_group_its_rows(llm, monkeypatch):
    """`LLM` plans rows per shared prefix only where they attend over it together: the native kernels over a 16-bit
    cache with MAGICDEC_CASCADE on; not over an int8 cache, not through torch's attention (fp32), not with
    MAGICDEC_CASCADE=0 (read at each call, as the kernels read it)."""
    from magicdec.engine import LLM
    from magicdec.sampling import SamplingParams

    ids, params = [list(range(3000))] * 4, [SamplingParams(max_tokens=8)] * 4
    bf16 = LLM(device="cpu", dtype="bf16", kv_cache_gb=1)
    int8 = LLM(device="cpu", dtype="bf16", kv_cache_gb=1, kv_cache_dtype="int8")
    assert bf16._generate_shape(ids, params, "sampling")[3] == (4 if bf16.attention == "native" else 1)
    assert int8._generate_shape(ids, params, "sampling")[3] == 1 and int8.cascade == "off"
    assert llm._generate_shape(ids, params, "sampling")[3] == 1 and llm.cascade == "off"
    monkeypatch.setenv("MAGICDEC_CASCADE", "0")
    assert bf16._generate_shape(ids, params, "sampling")[3] == 1


def test_a_vegas_round_pays_its_selection_and_its_drafts_scattered_reads():
    """A Vegas draft reads the target's K/V through token tables, priced at the profile's `table_read_factor` times
    their bytes, and its round adds the verification's shares written ((G + 1) 4 bytes per row, global layer, KV head
    and position) and their ranking (`selection_s_per_share` each); it holds no K/V of its own. The planner takes it
    over StreamingLLM at the same budget only where its higher acceptance outweighs that."""
    hw = dataclasses.replace(TOY_HW, selection_s_per_share=1e-9, table_read_factor=1.5)
    w = Workload(LLAMA3, hw, batch=32, context=8192)
    shares = 32 * LLAMA3.n_layers * LLAMA3.n_kv_heads * 8192
    assert selection_time(w) == pytest.approx(shares * ((32 // 8 + 1) * 4 / (1e12 * 0.5) + 1e-9))
    assert selection_time(dataclasses.replace(w, batch=64, context=16384)) == pytest.approx(4 * selection_time(w))
    assert strategy_kv_bytes("self-vegas", w) == 2 * 1.5
    assert strategy_kv_bytes("self-vegas", dataclasses.replace(w, hw=TOY_HW)) is None  # not measured: as read
    scattered = dataclasses.replace(w, kv_dtype_bytes=3.0)
    assert round_time(w, 2, budget=256, draft_kv_bytes=3.0, selects=True) == pytest.approx(
        draft_time(scattered, 256, 2, first_tokens=1) + verify_step_time(w, 2) + selection_time(w))
    both = {"budgets": [256], "strategies": ["self-streaming", "self-vegas"]}
    # +0.02 acceptance does not pay for a round's selection, which a profile that did not measure it leaves out
    assert plan(w, _rates(0.80, 0.82), **both).strategy == "self-streaming"
    assert plan(dataclasses.replace(w, hw=TOY_HW), _rates(0.80, 0.82), **both).strategy == "self-vegas"
    vegas = plan(w, _rates(0.60, 0.90), **both)
    assert (vegas.strategy, vegas.budget) == ("self-vegas", 256)
    assert vegas.predicted_throughput == pytest.approx(32 * expected_tokens(0.90, vegas.gamma) / round_time(
        w, vegas.gamma, budget=256, draft_kv_bytes=3.0, selects=True))
    assert vegas.fits_in_memory


def _rates(streaming: float, vegas: float) -> AcceptanceTable:
    table = AcceptanceTable()
    table.add("self-streaming", streaming, budget=256)
    table.add("self-vegas", vegas, budget=256)
    return table


def test_auto_searches_vegas_where_the_profile_measured_its_selection():
    """`--draft auto` searches self-vegas with a profile that priced its rounds (calibrated and quick CPU profiles),
    not with one that did not (GPU presets, profiles kept by an older magicdec)."""
    w = Workload(LLAMA3, TOY_HW, batch=32, context=8192)
    assert "self-vegas" not in default_strategies(w, LLAMA3)
    measured = dataclasses.replace(w, hw=dataclasses.replace(TOY_HW, selection_s_per_share=1e-9))
    assert "self-vegas" in default_strategies(measured, LLAMA3)
    assert "self-vegas" not in default_strategies(Workload(LLAMA3, get_profile("h100"), 32, 8192), LLAMA3)
