"""GPU readiness check (run by benchmarks/gpu_check.sh on a CUDA machine; a few minutes).

0. The Triton kernels (benchmarks/triton_check.py): attention compiled, against attention in fp32 over the gathered
   K/V, and its exactness (a row's bits in any batch; whether a verification's rows equal the one-token steps');
   the batch-invariant linear kernel against fp32 sums and a row's bits alone and among 256; then attention timed
   against the gathered-SDPA path and a plain sum of the same K/V at Gemma 3 270M and Llama-3.1-8B shapes
   (`--triton-cells`, q = 1 and 5), and the linear kernel against cuBLAS at 1, 5, 64 and 256 rows, into the JSON's
   "triton_check", "triton_timings" and "linear_timings".
1. Greedy and seeded sampled output on tiny random models (a Llama and a hybrid, sliding-window Gemma 3) on the
   GPU: plain decoding and the self-speculative StreamingLLM and SnapKV drafters, their decode forwards replayed
   from CUDA graphs (`magicdec.graphs`), each equal to plain decoding with every kernel launched eagerly
   (`enforce_eager`).
2. Forward times at Llama-3.1-8B and Gemma 3 270M shapes with placeholder bf16 weights: a decode step (q=1 over
   S), a verification (q=gamma+1 over S) and a self-speculative draft step (q=1 over a `budget`-token cache), for
   each batch B and context S whose KV cache fits, eager and replayed from a CUDA graph (the GPU's own time), with
   the cost model's predictions beside each: the H200 preset (launch-free, as graphs run) and `eager` of it (the
   engine's kernel launches, what `--draft auto` plans with on a GPU).
3. The engine on the GPU (Gemma 3 270M shape, random weights): a plain decode step and a self-speculative round as
   `LLMEngine` runs them, Python and sampling included, eager (`_eager`) and replayed from CUDA graphs, against the
   forwards of item 2. Random weights make the
   acceptance meaningless; the round's time is what a real model's acceptance multiplies.
4. One row per cell of item 2 in the JSON's "cells" (what benchmarks/results/gpu_h200.json keeps): model, B, S, the
   decode, verification and draft ms (replayed from a graph where capture worked: `graphs`), `floor_ms` (the step's
   weight and KV bytes over the device's read rate, measured in this run by summing a 4 GiB tensor), `exact` (item 1),
   and the self-speculative speedup a round of these forwards gives at the acceptance measured on a CPU on PG-19
   (Gemma 3 270M: magicdec's shipped table; Llama-3.1-8B: the MagicDec paper's greedy rates), `acceptance_source`
   "projected": gamma as measured, plain decoding where drafting would not pay (a speedup of 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import traceback
from pathlib import Path

import torch

from magicdec.calibrate.timing import filled_cache, median_time, read_rate, synthetic_model
from magicdec.config import EngineConfig, ModelConfig
from magicdec.drafters import SelfSpecDrafter
from magicdec.engine import LLMEngine
from magicdec.errors import OutOfMemoryError
from magicdec.kv.hybrid import cache_bytes
from magicdec.memory import check_fits
from magicdec.planner import AcceptanceTable, Workload, expected_tokens, forward_cost, get_model_shape, get_profile
from magicdec.planner.hardware import eager
from magicdec.sampling import SamplingParams
from magicdec.profiles import builtin_acceptance
from magicdec.scheduler import FixedGamma
from magicdec.speculative import Speculation
from triton_check import check as check_triton
from triton_check import linear_timings, print_row
from triton_check import timings as time_triton

LLAMA31_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         rope_theta=500000.0, max_seq_len=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def gemma3_config(**hf) -> ModelConfig:
    """A Gemma 3 text model's config, read from Hugging Face `config.json` keys as the loader reads them (its
    conventions from magicdec.config.gemma3_fields)."""
    return ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                                "rope_local_base_freq": 1e4, "rms_norm_eps": 1e-6, **hf})


# google/gemma-3-270m's config.json: five sliding-window layers, then a global one, three times
GEMMA3_270M = gemma3_config(vocab_size=262144, hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=256, intermediate_size=2048, max_position_embeddings=32768,
                            sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256)
PROFILED = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
SHAPES = {"llama-3.1-8b": LLAMA31_8B, "gemma3-270m": GEMMA3_270M}


def check_lossless(device: torch.device) -> bool:
    tiny = {
        "llama": ModelConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256,
                             max_seq_len=2048),
        "gemma3": gemma3_config(vocab_size=512, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=64, intermediate_size=256, max_position_embeddings=2048,
                                sliding_window=96, sliding_window_pattern=3),
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (300, 120, 700, 45)]
    config = EngineConfig(max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + 40)
    ok = True
    for name, cfg in tiny.items():
        model = synthetic_model(cfg, device, torch.bfloat16, random=True)
        for mode, params in (("greedy", SamplingParams(max_tokens=40, ignore_eos=True)),
                             ("sampled", SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, top_p=0.9,
                                                        seed=3))):
            # the reference: plain decoding, every kernel launched eagerly
            ar = LLMEngine(model, dataclasses.replace(config, enforce_eager=True)).generate(prompts, params)
            for kind in ("plain", "streaming", "snapkv"):
                drafter = None if kind == "plain" else SelfSpecDrafter(model, kind, budget=64, gamma=3,
                                                                       reindex=kind == "streaming")
                engine = LLMEngine(model, config, speculation=drafter and Speculation(drafter, FixedGamma(3)))
                out = engine.generate(prompts, params)
                same = all(a.output_ids == s.output_ids for a, s in zip(ar, out))
                graphs = engine.runner.graphs.count if engine.runner.graphs is not None else 0
                print(f"lossless {mode}, {name} {kind} ({graphs} CUDA graphs) against eager plain decoding: "
                      f"{'OK' if same else 'MISMATCH'} (acceptance {engine.stats.acceptance_rate:.2f})", flush=True)
                ok &= same
    return ok


def graph_replay_s(fn, device: torch.device) -> float | None:
    """Median seconds of `fn`'s kernels replayed from a CUDA graph: its time without the host issuing them (what
    capturing it would give); None where capture fails."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()  # capture wants its first run on a side stream
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        print(f"CUDA graph capture failed: {e}", flush=True)
        return None
    return median_time(graph.replay, device, reps=10, warmup=2)


def forward_ms(model, batch: int, q: int, kv_len: int) -> tuple[float, float | None]:
    """Median ms of a forward of `batch` x `q` tokens over a cache of kv_len entries: eager, and replayed from a CUDA
    graph (None off CUDA or where capture fails)."""
    device = model.device
    cache = filled_cache(model.cfg, batch, kv_len, q, model.dtype, device)
    tokens = torch.randint(0, 1000, (batch, q), device=device)
    eager = median_time(lambda: model(tokens, cache), device, reps=5, warmup=2) * 1e3
    graph = graph_replay_s(lambda: model(tokens, cache), device) if device.type == "cuda" else None
    del cache
    torch.cuda.empty_cache()
    return eager, graph and graph * 1e3


@torch.inference_mode()
def step_times(device: torch.device, name: str, batches, contexts, gamma: int, budget: int) -> list[dict]:
    cfg = SHAPES[name]
    model = synthetic_model(cfg, device, torch.bfloat16)
    shape, hw = get_model_shape(name), get_profile("h200")
    rows = []
    for S in contexts:
        for B in batches:
            try:
                check_fits(cache_bytes(cfg, B, S + gamma + 1, torch.bfloat16, gamma + 1) + 2 * 1024**3, device,
                           f"{name} B={B} S={S}")
            except OutOfMemoryError as e:
                print(f"skip: {e}", flush=True)
                continue
            steps = (("decode", 1, S), ("verify", gamma + 1, S), ("draft", 1, budget))
            (t_dec, g_dec), (t_ver, g_ver), (t_dra, g_dra) = (forward_ms(model, B, q, L) for _, q, L in steps)
            # the preset as CUDA graphs run (beside the replays) and as the eager engine runs (beside the eager times)
            pred = {f"{prefix}{k}": forward_cost(Workload(shape, profile, B, S), q, L).time * 1e3
                    for prefix, profile in (("", hw), ("eager_", eager(hw))) for k, q, L in steps}
            row = {"model": name, "B": B, "S": S, "decode_ms": t_dec, "verify_ms": t_ver, "draft_ms": t_dra,
                   "verify/decode": t_ver / t_dec, "draft/decode": t_dra / t_dec,
                   "graph_decode_ms": g_dec, "graph_verify_ms": g_ver, "graph_draft_ms": g_dra,
                   **{f"pred_{k}_ms": v for k, v in pred.items()}}
            rows.append(row)
            print_row(row)
    del model
    torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def engine_rounds(device: torch.device, batch: int, context: int, gamma: int, budget: int, new: int,
                  profile: bool = False) -> dict:
    """ms of a plain decode step and of a self-speculative round (StreamingLLM, fixed gamma) as the engine runs them
    on the Gemma 3 270M shape, random weights; `profile`: the operators' table of each measured run."""
    model = synthetic_model(GEMMA3_270M, device, torch.bfloat16, random=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 262144, (context,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    config = EngineConfig(max_num_seqs=batch, max_model_len=context + new + gamma + 1, prefill_chunk=4096,
                          enable_prefix_caching=False)
    out = {"B": batch, "S": context, "gamma": gamma, "budget": budget}
    runs = [(f"{kind}{suffix}", kind, eager) for eager, suffix in ((True, "_eager"), (False, ""))
            for kind in ("plain", "self_streaming")]
    for label, kind, eager in runs:
        spec = None if kind == "plain" else Speculation(SelfSpecDrafter(model, "streaming", budget, gamma, True),
                                                        FixedGamma(gamma))
        engine = LLMEngine(model, dataclasses.replace(config, enforce_eager=eager), speculation=spec)
        # first-use costs (Triton's compilation, the graphs' capture) out of the timing: the same engine runs again
        engine.generate(prompts, SamplingParams(max_tokens=gamma + 2, ignore_eos=True))
        engine.reset_stats()
        with torch.profiler.profile(activities=PROFILED) if profile else contextlib.nullcontext() as prof:
            engine.generate(prompts, params)
        if profile:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        s = engine.stats
        engine.record_graphs(s)
        out[f"{label}_graphs"], out[f"{label}_capture_s"] = s.cuda_graphs, s.graph_capture_s
        out[f"{label}_prefill_s"] = s.prefill_s
        out[f"{label}_round_ms"] = s.decode_s / s.steps * 1e3
        out[f"{label}_tokens_per_round"] = s.decode_tokens / s.steps / batch
        print(f"engine {label}: B={batch} S={context} prefill {s.prefill_s:.2f} s, {s.steps} rounds of "
              f"{out[f'{label}_round_ms']:.2f} ms, {out[f'{label}_tokens_per_round']:.2f} tokens a row a round "
              f"({s.cuda_graphs} CUDA graphs, captured in {s.graph_capture_s:.2f} s)", flush=True)
    return out


def read_gbs(device: torch.device, gib: float = 4.0) -> float:
    """GB/s the device reads a `gib`-GiB tensor at (`read_rate`): the rate a step's floor is priced at."""
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    gbs = read_rate(x, reps=10) / 1e9
    del x
    torch.cuda.empty_cache()
    return gbs


def projected_speedup(table: AcceptanceTable, budget: int, S: int, mode: str, gamma: int, decode: float,
                      verify: float, draft: float) -> float | None:
    """Tokens a second of self-speculation (StreamingLLM, `budget`) over plain decoding, from measured forwards and
    the table's rate at S (None where it has none); 1 where drafting would not pay (auto decodes plainly)."""
    try:
        alpha = table.alpha("self-streaming", budget, S, mode)
    except KeyError:
        return None
    return max(1.0, expected_tokens(alpha, gamma) * decode / (gamma * draft + verify))


def summary_cells(result: dict, gamma: int, budget: int, gbs: float) -> list[dict]:
    """The issue's per-cell summary of the step-time rows (see the module, item 4)."""
    tables = {"gemma3-270m": builtin_acceptance("Gemma3ForCausalLM"), "llama-3.1-8b": AcceptanceTable.paper_default()}
    out = []
    for r in result["rows"]:
        graphs = r["graph_decode_ms"] is not None
        t = {k: r[f"graph_{k}_ms"] if graphs else r[f"{k}_ms"] for k in ("decode", "verify", "draft")}
        cfg, shape = SHAPES[r["model"]], get_model_shape(r["model"])
        floor = (cache_bytes(cfg, r["B"], r["S"], torch.bfloat16, 1) + shape.weight_bytes(2)) / (gbs * 1e9) * 1e3
        row = {"model": r["model"], "B": r["B"], "S": r["S"], **{f"{k}_ms": v for k, v in t.items()},
               "floor_ms": floor, "graphs": graphs, "exact": bool(result.get("lossless")), "gamma": gamma}
        for mode, label in (("greedy", "greedy"), ("sampling", "sampled")):
            row[f"auto_speedup_{label}"] = projected_speedup(tables[r["model"]], budget, r["S"], mode, gamma,
                                                             t["decode"], t["verify"], t["draft"])
        row["acceptance_source"] = "projected"
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,64,128", help="batches at Llama-3.1-8B shapes")
    ap.add_argument("--contexts", default="8192,16384,32768", help="contexts at Llama-3.1-8B shapes")
    ap.add_argument("--gemma-batches", default="32,128,256")
    ap.add_argument("--gemma-contexts", default="8192,32768")
    ap.add_argument("--engine", default="32x8192", help="BxS of the engine check on the Gemma 3 shape ('' skips)")
    ap.add_argument("--profile", action="store_true", help="print the operators' table of the engine check's runs")
    ap.add_argument("--triton-cells", default="gemma3-270m:32x8192,gemma3-270m:256x32768,llama-3.1-8b:32x8192,"
                    "llama-3.1-8b:64x16384", help="model:BxS cells timing the Triton attention ('' skips)")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script at small --*batches/--*contexts")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(name, torch.__version__, flush=True)
    result = {"device": name, "torch": torch.__version__, "gamma": args.gamma,
              "budget": args.budget, "rows": [], "errors": []}
    sections = []
    if device.type == "cuda":  # the kernels' own checks first: every forward below runs them
        sections.append(("triton_check", lambda: check_triton(device)))
        triton_cells = [(m, *map(int, bs.split("x")))
                        for m, bs in (c.split(":") for c in args.triton_cells.split(",") if c)]
        sections.append(("triton_timings", lambda: {"cells": time_triton(device, triton_cells)}))
        sections.append(("linear_timings", lambda: {"cells": linear_timings(device)}))
    sections.append(("lossless", lambda: check_lossless(device)))
    sections.append(("read_gbs", lambda: read_gbs(device, 4.0 if device.type == "cuda" else 0.25)))
    sections.append(("gemma3-270m", lambda: step_times(device, "gemma3-270m", ints(args.gemma_batches),
                                                        ints(args.gemma_contexts), args.gamma, args.budget)))
    if args.engine:
        B, S = map(int, args.engine.split("x"))
        sections.append(("engine", lambda: engine_rounds(device, B, S, args.gamma, args.budget, 32, args.profile)))
    if args.batches and args.contexts:  # '' skips (a dry run on a CPU cannot hold 8B parameters)
        sections.append(("llama-3.1-8b", lambda: step_times(device, "llama-3.1-8b", ints(args.batches),
                                                             ints(args.contexts), args.gamma, args.budget)))
    for name, run in sections:  # each section's result is written as it ends: a later failure keeps it
        try:
            value = run()
        except Exception:  # a check that breaks is reported and the others still run
            result["errors"].append(f"{name}: {traceback.format_exc()}")
            print(result["errors"][-1], flush=True)
            continue
        if isinstance(value, list):
            result["rows"] += value
        else:
            result[name] = value
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "read_gbs" in result:
        result["cells"] = summary_cells(result, args.gamma, args.budget, result["read_gbs"])
        Path(args.out).write_text(json.dumps(result, indent=1))
    raise SystemExit(0 if result.get("lossless") and not result["errors"] else 1)


if __name__ == "__main__":
    main()
