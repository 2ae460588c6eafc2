"""Validate the planner on this machine: predicted vs measured decode throughput and speedup.

For every batch size B and context S of the grid, prompts of S tokens cut from inside PG-19 books are
prefilled once; plain autoregressive decoding and every (drafter, budget, gamma) of the grid then
decode `--new-tokens` tokens per sequence (EOS ignored, greedy) from that same prefill
(`decode(..., reuse=True)`). Each measurement is set against the planner's prediction from the
calibrated hardware profile and the measured acceptance table (and, to separate the cost model's
error from the acceptance model's, against the prediction with the acceptance rate measured in that
very run). Per (B, S) the planner's choice among the grid's configurations is compared with the best
measured one.

Writes benchmarks/results/validate_planner.json (machine info, profile, every point; resumable:
points already there are skipped) and benchmarks/results/validate_planner.png (predicted vs
measured scatter), and prints a table.

    PYTHONPATH=. python benchmarks/validate_planner.py --threads 2 --minutes 40
    PYTHONPATH=. python benchmarks/validate_planner.py --report     (table and plot from the JSON only)

Points run smallest (B x S) first; a (B, S) cell whose predicted time (prefill + all its decodes)
does not fit in the remaining --minutes, or whose KV cache does not fit in the available memory,
is skipped and listed as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
JSON_PATH = RESULTS / "validate_planner.json"
PNG_PATH = RESULTS / "validate_planner.png"
PROFILE_PATH = RESULTS / "validate_planner.profile.json"
DATA = Path(os.environ.get("MAGICDEC_DATA", ROOT.parent / "shared" / "data" / "pg19_dev.jsonl"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--drafters", nargs="+", default=["self-streaming", "self-snapkv"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--minutes", type=float, default=40.0, help="wall-time budget of this invocation")
    p.add_argument("--profile", type=Path, default=None,
                   help="hardware profile JSON (default: the one in the results, else calibrate now)")
    p.add_argument("--acceptance", type=Path, default=None,
                   help="acceptance table JSON (default: saved for the model, else the built-in one)")
    p.add_argument("--json", type=Path, default=JSON_PATH)
    p.add_argument("--png", type=Path, default=PNG_PATH)
    p.add_argument("--report", action="store_true", help="only print the table and draw the plot")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each cell wait (up to 5 min) until the 1-minute load average is below this")
    return p.parse_args(argv)


# --- results file ---------------------------------------------------------------------------------------
def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        with open(path) as f:
            return json.load(f)
    return {"points": [], "cells": {}, "runs": []}


def save_results(res: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.json")
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def point_key(batch: int, context: int, drafter: str, budget: int | None, gamma: int) -> str:
    return f"B{batch}-S{context}-{drafter}-{budget}-{gamma}"


# --- predictions ------------------------------------------------------------------------------------------
def predict(shape, hw, batch: int, context: int, drafter: str, budget: int | None, gamma: int,
            alpha: float | None, dtype_bytes: float, kv_bytes: float) -> dict[str, float]:
    """Predicted step times and throughput of one configuration (alpha None: AR)."""
    from magicdec.planner import decode_step_time, draft_step_time, expected_tokens, verify_step_time

    if drafter == "ar":
        t = decode_step_time(shape, hw, batch, context, dtype_bytes, kv_bytes)
        return {"t_step": t, "throughput": batch / t}
    t_d = draft_step_time(shape, hw, batch, context, budget, dtype_bytes, kv_bytes)
    t_v = verify_step_time(shape, hw, batch, context, gamma, dtype_bytes, kv_bytes)
    e = expected_tokens(alpha, gamma)
    return {"t_draft": t_d, "t_verify": t_v, "t_step": gamma * t_d + t_v, "throughput": batch * e / (gamma * t_d + t_v)}


def predict_prefill(shape, hw, batch: int, context: int, chunk: int, dtype_bytes: float, kv_bytes: float) -> float:
    """Predicted prefill seconds (chunked forwards), to budget the wall time."""
    from magicdec.planner import forward_cost

    total, pos = 0.0, 0
    while pos < context:
        q = min(chunk, context - pos)
        total += forward_cost(shape, hw, batch, q, pos + q, dtype_bytes, kv_bytes).time
        pos += q
    return total


# --- the measurements -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from magicdec.autoplan import load_acceptance, target_shape
    from magicdec.calibrate import acceptance_mle, cut_prompts, machine_info, measure_hardware, sampling_params
    from magicdec.decode import MAX_GAMMA, decode, prefill_prompts
    from magicdec.engine import LLM
    from magicdec.errors import OutOfMemoryError
    from magicdec.memory import available_bytes
    from magicdec.planner import AcceptanceTable, HardwareProfile
    from magicdec.speculative import SpeculativeConfig

    t_start = time.time()
    deadline = t_start + 60 * args.minutes
    res = load_results(args.json)
    info = machine_info("cpu")
    print(f"machine: {info['cpu']}, {info['cpu_count']} cores, torch threads {info['torch_threads']}, "
          f"load {info.get('loadavg')}", flush=True)

    llm = LLM(device="cpu")
    shape = target_shape(llm)
    dtype_bytes = float(llm.model.dtype.itemsize)
    kv_bytes = float(llm.kv_dtype.itemsize)

    # hardware profile: given, else the one the results were made with, else calibrate now (full)
    if args.profile is not None:
        hw = HardwareProfile.from_json(args.profile)
    elif "profile" in res:
        hw = HardwareProfile(**res["profile"])
    elif PROFILE_PATH.exists():
        hw = HardwareProfile.from_json(PROFILE_PATH)
    else:
        print("calibrating the hardware profile (full mode)...", flush=True)
        cal = measure_hardware(
            "cpu", quick=False, model=llm.model,
            progress=lambda d, t, label: print(f"  calibrate [{d}/{t}] {label}", flush=True))
        cal.save(PROFILE_PATH)
        hw = cal.profile
        res["calibration_fit"] = cal.measurements.get("fit")
    res["profile"] = dataclasses.asdict(hw)
    table = AcceptanceTable.from_json(args.acceptance) if args.acceptance else load_acceptance(llm)
    res["acceptance_source"] = str(args.acceptance) if args.acceptance else "saved for the model, else built-in"
    res["settings"] = {"batches": args.batches, "contexts": args.contexts, "gammas": args.gammas,
                       "budgets": args.budgets, "drafters": args.drafters, "new_tokens": args.new_tokens,
                       "mode": "greedy", "ignore_eos": True}
    res["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info})
    res["machine"] = info
    print(f"profile: {hw}", flush=True)

    with open(DATA) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    done = {p["key"] for p in res["points"]}
    limit = llm.model.cfg.max_seq_len - args.new_tokens - MAX_GAMMA - 2
    params = sampling_params("greedy", args.new_tokens)
    eos = llm.tokenizer.eos_ids

    configs = [("ar", None, 0)] + [(d, b, g) for d in args.drafters for b in args.budgets for g in args.gammas]
    cells = sorted(((b, s) for b in args.batches for s in args.contexts), key=lambda c: (c[0] * c[1], c[0]))
    for batch, context in cells:
        ctx = min(context, limit)
        todo = [c for c in configs if point_key(batch, context, *c) not in done and (c[1] is None or c[1] < ctx)]
        cell_key = f"B{batch}-S{context}"
        if not todo:
            continue
        # Will it fit, in memory and in the time left? (predicted with the profile; measured AR is used
        # below to rescale once the cell runs)
        kv_need = batch * (ctx + args.new_tokens + MAX_GAMMA + 2) * llm.model.cfg.kv_bytes_per_token(int(kv_bytes))
        if kv_need > 0.85 * available_bytes(torch.device("cpu")):
            res["cells"][cell_key] = {"skipped": f"KV cache {kv_need / 2**30:.1f} GiB exceeds available memory"}
            print(f"skip {cell_key}: {res['cells'][cell_key]['skipped']}", flush=True)
            save_results(res, args.json)
            continue
        t_pre = predict_prefill(shape, hw, batch, ctx, llm.prefill_chunk, dtype_bytes, kv_bytes)
        t_dec = 0.0
        for d, b, g in todo:
            alpha = None if d == "ar" else _alpha(table, d, b, ctx)
            p = predict(shape, hw, batch, ctx, d, b, g, alpha, dtype_bytes, kv_bytes)
            t_dec += batch * args.new_tokens / p["throughput"]
        est = 1.3 * (t_pre + t_dec)  # the CPU runs slower than predicted at small shapes; keep a margin
        left = deadline - time.time()
        if est > left:
            res["cells"].setdefault(cell_key, {})["skipped"] = (
                f"predicted {est / 60:.1f} min (prefill {t_pre / 60:.1f}) > {left / 60:.1f} min left")
            print(f"skip {cell_key}: {res['cells'][cell_key]['skipped']}", flush=True)
            save_results(res, args.json)
            continue
        if args.max_load is not None:
            _wait_for_quiet(args.max_load)
        print(f"cell B={batch} S={ctx}: {len(todo)} configs, predicted {est / 60:.1f} min", flush=True)
        prompts = cut_prompts(llm.tokenizer, texts, ctx, batch)
        observe = any(d == "self-snapkv" for d, _, _ in todo)
        try:
            pre = prefill_prompts(llm.model, prompts, args.new_tokens, kv_dtype=llm.kv_dtype,
                                  chunk=llm.prefill_chunk, observe=observe)
        except OutOfMemoryError as e:
            res["cells"][cell_key] = {"skipped": str(e)}
            save_results(res, args.json)
            continue
        cell = res["cells"].setdefault(cell_key, {})
        cell.pop("skipped", None)
        cell.update({"batch": batch, "context": context, "context_used": ctx, "prefill_s": pre.seconds,
                     "prefill_predicted_s": t_pre, "load_at_start": list(os.getloadavg())})
        print(f"  prefill {pre.seconds:.1f}s (predicted {t_pre:.1f}s)", flush=True)
        for d, b, g in todo:
            if time.time() > deadline:
                print("  out of time", flush=True)
                break
            if d == "ar":
                drafter, gamma = None, 0
            else:
                drafter, gamma = SpeculativeConfig(d, budget=b, gamma=g).build(llm)
            load = os.getloadavg()[0]
            _, stats = decode(llm.model, pre, params, eos, drafter=drafter, gamma=gamma,
                              prefill_chunk=llm.prefill_chunk, reuse=True)
            measured = stats.generated_tokens / stats.decode_s
            point: dict[str, Any] = {
                "key": point_key(batch, context, d, b, g), "batch": batch, "context": context, "context_used": ctx,
                "drafter": d, "budget": b, "gamma": g, "generated": stats.generated_tokens, "steps": stats.steps,
                "decode_s": stats.decode_s, "draft_s": stats.draft_s, "verify_s": stats.verify_s,
                # the loop's own work outside the timed draft and verify calls (sampling bookkeeping,
                # host sync, and for sparse drafters the per-round eviction of the draft cache)
                "other_s": stats.decode_s - stats.draft_s - stats.verify_s,
                "measured_throughput": measured, "load1": load,
            }
            if d == "ar":
                pr = predict(shape, hw, batch, ctx, d, b, g, None, dtype_bytes, kv_bytes)
                point.update(predicted_throughput=pr["throughput"], predicted_step_s=pr["t_step"],
                             measured_step_s=stats.decode_s / stats.steps)
            else:
                alpha_run = acceptance_mle(stats.accepted_hist)
                alpha_table = _alpha(table, d, b, ctx)
                pr = predict(shape, hw, batch, ctx, d, b, g, alpha_table, dtype_bytes, kv_bytes)
                pr_run = predict(shape, hw, batch, ctx, d, b, g, alpha_run, dtype_bytes, kv_bytes)
                point.update(
                    accepted_hist=stats.accepted_hist, alpha_run=alpha_run, alpha_table=alpha_table,
                    tokens_per_step=stats.tokens_per_step,
                    predicted_throughput=pr["throughput"], predicted_throughput_run_alpha=pr_run["throughput"],
                    predicted_draft_s=pr["t_draft"], predicted_verify_s=pr["t_verify"],
                    measured_draft_s=stats.draft_s / (stats.steps * g), measured_verify_s=stats.verify_s / stats.steps,
                )
            res["points"].append(point)
            done.add(point["key"])
            save_results(res, args.json)
            print(f"  {d:15s} budget {str(b):>4s} gamma {g}: measured {measured:8.2f} tok/s, "
                  f"predicted {point['predicted_throughput']:8.2f}", flush=True)
        del pre
    res["runs"][-1]["seconds"] = time.time() - t_start
    summarize(res, table, shape, hw, dtype_bytes, kv_bytes)
    save_results(res, args.json)


def _alpha(table, drafter: str, budget: int, context: int) -> float:
    return table.alpha(drafter, budget, context, "greedy")


def _wait_for_quiet(max_load: float, patience_s: float = 300) -> None:
    t0 = time.time()
    while os.getloadavg()[0] > max_load and time.time() - t0 < patience_s:
        time.sleep(10)


# --- summary --------------------------------------------------------------------------------------------
def summarize(res: dict[str, Any], table, shape, hw, dtype_bytes: float, kv_bytes: float) -> None:
    """Errors, speedups and the planner's choice per cell, into res["summary"]."""
    from magicdec.planner import plan

    points = res["points"]
    if not points:
        return
    # Predictions are a function of (profile, table): recompute them so that they always match the
    # profile stored in the results (or the one given on the command line).
    for p in points:
        ctx = p["context_used"]
        if p["drafter"] == "ar":
            pr = predict(shape, hw, p["batch"], ctx, "ar", None, 0, None, dtype_bytes, kv_bytes)
            p.update(predicted_throughput=pr["throughput"], predicted_step_s=pr["t_step"])
            continue
        p["alpha_table"] = _alpha(table, p["drafter"], p["budget"], ctx)
        pr = predict(shape, hw, p["batch"], ctx, p["drafter"], p["budget"], p["gamma"], p["alpha_table"],
                     dtype_bytes, kv_bytes)
        pr_run = predict(shape, hw, p["batch"], ctx, p["drafter"], p["budget"], p["gamma"], p["alpha_run"],
                         dtype_bytes, kv_bytes)
        p.update(predicted_throughput=pr["throughput"], predicted_throughput_run_alpha=pr_run["throughput"],
                 predicted_draft_s=pr["t_draft"], predicted_verify_s=pr["t_verify"])
    by_cell: dict[tuple[int, int], list[dict]] = {}
    for p in points:
        by_cell.setdefault((p["batch"], p["context"]), []).append(p)
    cells = []
    for (batch, context), pts in sorted(by_cell.items(), key=lambda kv: (kv[0][0] * kv[0][1], kv[0][0])):
        ar = next((p for p in pts if p["drafter"] == "ar"), None)
        for p in pts:
            if ar is not None:
                p["measured_speedup"] = p["measured_throughput"] / ar["measured_throughput"]
                p["predicted_speedup"] = p["predicted_throughput"] / ar["predicted_throughput"]
        drafters = sorted({p["drafter"] for p in pts if p["drafter"] != "ar"})
        budgets = sorted({p["budget"] for p in pts if p["budget"] is not None})
        gammas = sorted({p["gamma"] for p in pts if p["gamma"]})
        ctx = pts[0]["context_used"]
        best = max(pts, key=lambda p: p["measured_throughput"])
        cell: dict[str, Any] = {"batch": batch, "context": context, "context_used": ctx, "n_points": len(pts),
                                "best": _label(best), "best_throughput": best["measured_throughput"]}
        if ar is not None and drafters:
            chosen_plan = plan(shape, hw, batch, ctx, table, budgets=budgets, gammas=gammas,
                               dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_bytes,
                               strategies=["ar", *drafters])
            key = point_key(batch, context, chosen_plan.strategy, chosen_plan.budget, chosen_plan.gamma)
            chosen = next((p for p in pts if p["key"] == key), None)
            cell["choice"] = _label(chosen) if chosen else f"{chosen_plan.strategy} (not measured)"
            cell["choice_predicted_speedup"] = chosen_plan.predicted_speedup
            if chosen is not None:
                ratio = chosen["measured_throughput"] / best["measured_throughput"]
                cell["choice_vs_best"] = ratio
                cell["choice_within_10pct"] = ratio >= 0.9
            cell["best_measured_speedup"] = best["measured_throughput"] / ar["measured_throughput"]
        cells.append(cell)
    err = [abs(p["predicted_throughput"] / p["measured_throughput"] - 1) for p in points]
    signed = [p["predicted_throughput"] / p["measured_throughput"] - 1 for p in points]
    err_run = [abs(p["predicted_throughput_run_alpha"] / p["measured_throughput"] - 1)
               for p in points if "predicted_throughput_run_alpha" in p]
    sp = [abs(p["predicted_speedup"] / p["measured_speedup"] - 1) for p in points
          if "measured_speedup" in p and p["drafter"] != "ar"]
    worst = max(points, key=lambda p: abs(p["predicted_throughput"] / p["measured_throughput"] - 1))
    within = [c["choice_within_10pct"] for c in cells if "choice_within_10pct" in c]
    # Where the error comes from: measured / predicted time of each part of a step, per batch size,
    # and the share of a speculative round spent outside the timed draft and verify forwards.
    components: dict[str, dict[str, float]] = {}
    for batch in sorted({p["batch"] for p in points}):
        pts = [p for p in points if p["batch"] == batch]
        ar_pts = [p for p in pts if p["drafter"] == "ar"]
        spec_pts = [p for p in pts if p["drafter"] != "ar"]
        c: dict[str, float] = {}
        if ar_pts:
            c["ar_step_measured_over_predicted"] = statistics.median(
                p["measured_step_s"] / p["predicted_step_s"] for p in ar_pts)
        if spec_pts:
            c["draft_forward_measured_over_predicted"] = statistics.median(
                p["measured_draft_s"] / p["predicted_draft_s"] for p in spec_pts)
            c["verify_measured_over_predicted"] = statistics.median(
                p["measured_verify_s"] / p["predicted_verify_s"] for p in spec_pts)
            c["other_share_of_round"] = statistics.median(p["other_s"] / p["decode_s"] for p in spec_pts if "other_s" in p)
            c["other_s_per_round_median"] = statistics.median(p["other_s"] / p["steps"] for p in spec_pts if "other_s" in p)
            # the prediction with the measured non-forward time per round added (what a cost model of
            # the loop and the draft-cache eviction would recover)
            fixed = [abs(_predicted_with_other(p) / p["measured_throughput"] - 1) for p in spec_pts if "other_s" in p]
            c["rel_error_run_alpha_plus_measured_other_median"] = statistics.median(fixed)
        components[f"B={batch}"] = c
    res["summary"] = {
        "n_points": len(points),
        "throughput_rel_error": {"median": statistics.median(err), "worst": max(err), "worst_point": worst["key"],
                                 "median_signed": statistics.median(signed)},
        "throughput_rel_error_run_alpha": (
            {"median": statistics.median(err_run), "worst": max(err_run)} if err_run else None),
        "speedup_rel_error": {"median": statistics.median(sp), "worst": max(sp)} if sp else None,
        "choice_within_10pct": f"{sum(within)}/{len(within)}",
        "components": components,
        "cells": cells,
    }


def _predicted_with_other(p: dict[str, Any]) -> float:
    """The prediction (with the run's own alpha) if the round also took the measured non-forward time."""
    e = _expected(p["alpha_run"], p["gamma"])
    round_predicted = p["batch"] * e / p["predicted_throughput_run_alpha"]
    return p["batch"] * e / (round_predicted + p["other_s"] / p["steps"])


def _expected(alpha: float, gamma: int) -> float:
    from magicdec.planner import expected_tokens

    return expected_tokens(alpha, gamma)


def _label(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return "ar" if p["drafter"] == "ar" else f"{p['drafter']} b{p['budget']} g{p['gamma']}"


def report(res: dict[str, Any], png: Path) -> None:
    from magicdec.planner import format_table

    points = res.get("points", [])
    if not points:
        print("no points yet")
        return
    rows = []
    for p in sorted(points, key=lambda p: (p["batch"] * p["context"], p["batch"], p["drafter"] != "ar",
                                           p["drafter"], p["budget"] or 0, p["gamma"])):
        rows.append({
            "B": p["batch"], "S": p["context_used"], "config": _label(p),
            "alpha_tab": p.get("alpha_table"), "alpha_run": p.get("alpha_run"),
            "meas_tok_s": p["measured_throughput"], "pred_tok_s": p["predicted_throughput"],
            "err": f"{100 * (p['predicted_throughput'] / p['measured_throughput'] - 1):+.0f}%",
            "meas_x": p.get("measured_speedup"), "pred_x": p.get("predicted_speedup"),
        })
    print(format_table(rows))
    s = res.get("summary")
    if s:
        print()
        e = s["throughput_rel_error"]
        print(f"{s['n_points']} points. Predicted throughput, relative error: median {100 * e['median']:.1f}%, "
              f"worst {100 * e['worst']:.1f}% ({e['worst_point']}); median signed {100 * e['median_signed']:+.1f}%")
        if s.get("throughput_rel_error_run_alpha"):
            r = s["throughput_rel_error_run_alpha"]
            print(f"  with each run's own measured alpha: median {100 * r['median']:.1f}%, worst {100 * r['worst']:.1f}%")
        if s.get("speedup_rel_error"):
            r = s["speedup_rel_error"]
            print(f"  predicted speedup over AR: median {100 * r['median']:.1f}%, worst {100 * r['worst']:.1f}%")
        crow = [{"B": c["batch"], "S": c["context_used"], "best measured": c["best"],
                 "best_x": c.get("best_measured_speedup"), "planner choice": c.get("choice", "-"),
                 "pred_x": c.get("choice_predicted_speedup"), "choice/best": c.get("choice_vs_best"),
                 "within 10%": c.get("choice_within_10pct")} for c in s["cells"]]
        print()
        print(format_table(crow))
        print(f"planner's choice within 10% of the best measured: {s['choice_within_10pct']} cells")
    skipped = {k: v["skipped"] for k, v in res.get("cells", {}).items() if "skipped" in v}
    for k, v in skipped.items():
        print(f"not run: {k}: {v}")
    plot(points, png)


def plot(points: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    colors = {1: "tab:blue", 8: "tab:orange", 32: "tab:green"}
    markers = {"ar": "s", "self-streaming": "o", "self-snapkv": "^"}
    ax = axes[0]
    for p in points:
        ax.scatter(p["measured_throughput"], p["predicted_throughput"], s=18,
                   c=colors.get(p["batch"], "tab:gray"), marker=markers.get(p["drafter"], "x"),
                   alpha=0.75, edgecolors="none")
    lo = min(min(p["measured_throughput"], p["predicted_throughput"]) for p in points) * 0.8
    hi = max(max(p["measured_throughput"], p["predicted_throughput"]) for p in points) * 1.25
    xs = [lo, hi]
    ax.plot(xs, xs, color="black", linewidth=0.8)
    for f in (0.9, 1.1):
        ax.plot(xs, [x * f for x in xs], color="grey", linewidth=0.6, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured throughput (tok/s)")
    ax.set_ylabel("predicted throughput (tok/s)")
    ax.set_title("throughput (dashed: ±10%)")
    ax = axes[1]
    spec = [p for p in points if "measured_speedup" in p and p["drafter"] != "ar"]
    for p in spec:
        ax.scatter(p["measured_speedup"], p["predicted_speedup"], s=18, c=colors.get(p["batch"], "tab:gray"),
                   marker=markers.get(p["drafter"], "x"), alpha=0.75, edgecolors="none")
    if spec:
        lo = min(min(p["measured_speedup"], p["predicted_speedup"]) for p in spec) * 0.9
        hi = max(max(p["measured_speedup"], p["predicted_speedup"]) for p in spec) * 1.1
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.axhline(1, color="grey", linewidth=0.6)
        ax.axvline(1, color="grey", linewidth=0.6)
    ax.set_xlabel("measured speedup over AR")
    ax.set_ylabel("predicted speedup over AR")
    ax.set_title("speculative speedup")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=f"B={b}") for b, c in colors.items()]
    handles += [Line2D([], [], color="black", marker=m, linestyle="", label=d) for d, m in markers.items()]
    axes[0].legend(handles=handles, fontsize="small")
    fig.suptitle("MagicDec planner vs measurement, SmolLM2-135M fp32 on this CPU")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.report:
        run(args)
    res = load_results(args.json)
    if args.report and res.get("points"):
        # recompute the summary (e.g. after editing the acceptance table or profile)
        from magicdec.autoplan import load_acceptance, target_shape
        from magicdec.engine import LLM
        from magicdec.planner import AcceptanceTable, HardwareProfile

        llm = LLM(device="cpu")
        hw = HardwareProfile.from_json(args.profile) if args.profile else HardwareProfile(**res["profile"])
        res["profile"] = dataclasses.asdict(hw)
        table = AcceptanceTable.from_json(args.acceptance) if args.acceptance else load_acceptance(llm)
        summarize(res, table, target_shape(llm), hw, float(llm.model.dtype.itemsize), float(llm.kv_dtype.itemsize))
        save_results(res, args.json)
    report(res, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
