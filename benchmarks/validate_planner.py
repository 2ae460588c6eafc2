"""Validate the planner on this machine: predicted against measured decode throughput and speedup.

The measurements are a `magicdec bench` sweep (benchmarks/spec_bench.sh throughput): for every
batch B and context S, prompts cut from inside PG-19 books are prefilled once, and plain
autoregressive decoding and every (drafter, budget, gamma) decode the same new tokens from that
prefill, side by side. Each greedy point is set against the planner's prediction from the
calibrated hardware profile (`magicdec calibrate`) and the acceptance table. The error is split into
its two halves: seconds per round (the cost model) and rounds (the acceptance model; the bench's
static batch runs until its slowest row is done). Per (B, S) the planner's choice among the measured configurations is
compared with the best measured one.

Writes benchmarks/results/validate_planner.json (the profile, every point with its predictions, a
summary) and benchmarks/results/validate_planner.png (predicted against measured), and prints a table.

    python benchmarks/validate_planner.py                       # benchmarks/results/throughput.json
    python benchmarks/validate_planner.py --bench other.json --profile my-profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", type=Path, default=RESULTS / "throughput.json", help="`magicdec bench` results")
    p.add_argument("--profile", type=Path, default=None,
                   help="hardware profile JSON (default: the one `magicdec calibrate` saved for this machine)")
    p.add_argument("--acceptance", type=Path, default=None,
                   help="acceptance table JSON (default: saved for the model, else the built-in one)")
    p.add_argument("--json", type=Path, default=RESULTS / "validate_planner.json")
    p.add_argument("--png", type=Path, default=RESULTS / "validate_planner.png")
    return p.parse_args(argv)


def relative(path: Path) -> str:
    """`path` as recorded in results: relative to the repository when inside it, not this machine's layout."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- predictions ------------------------------------------------------------------------------------------
def predict(shape, hw, batch: int, context: int, drafter: str, budget: int | None, gamma: int,
            alpha: float | None, dtype_bytes: float, kv_bytes: float) -> dict[str, float]:
    """Predicted step times and throughput of one configuration (alpha None: AR)."""
    from magicdec.planner import Workload, decode_step_time, draft_time, expected_tokens, verify_step_time

    w = Workload(shape, hw, batch, context, dtype_bytes, kv_bytes)
    if drafter == "ar":
        t = decode_step_time(w)
        return {"t_step": t, "throughput": batch / t}
    # per forward; self-speculation's first one reads one token (the others are copied from the target)
    t_d = draft_time(w, budget, gamma, first_tokens=1) / gamma
    t_v = verify_step_time(w, gamma)
    e = expected_tokens(alpha, gamma)
    return {"t_draft": t_d, "t_verify": t_v, "t_step": gamma * t_d + t_v, "throughput": batch * e / (gamma * t_d + t_v)}


# --- the measurements ---------------------------------------------------------------------------------------
def bench_points(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The greedy points of a bench run with an explicit configuration, in this script's terms."""
    from magicdec.calibrate.acceptance import acceptance_mle

    new_tokens = doc["settings"]["new_tokens"]
    points = []
    for key, b in doc["points"].items():
        if "throughput" not in b or b["mode"] != "greedy" or b["draft"] == "auto":
            continue
        p = {"key": key, "batch": b["batch"], "context": b["context"], "context_used": b.get("context_used", b["context"]),
             # decode runs from the prompt length to new_tokens beyond it: predict at the mean
             "context_mean": b.get("context_used", b["context"]) + new_tokens // 2,
             "drafter": "ar" if b["draft"] == "none" else b["draft"], "budget": b["budget"] or None,
             "gamma": b["gamma"], "steps": b["steps"], "decode_s": b["decode_s"],
             # tiled copies of a greedy row decode alike: only the distinct prompts can be the slowest
             "rows": b["distinct_prompts"],
             "measured_throughput": b["throughput"],
             # tokens each row decodes after the first (which comes from the prefill)
             "generated_per_row": new_tokens - 1,
             # the loop's own work outside the timed draft and verify forwards (sampling bookkeeping,
             # host sync, the draft cache's per-round eviction)
             "other_s": b["decode_s"] - b["draft_s"] - b["verify_s"]}
        if p["drafter"] == "ar":
            p["measured_step_s"] = b["decode_s"] / b["steps"]
        else:
            p.update(accepted_hist=b["accepted_hist"], alpha_run=acceptance_mle(b["accepted_hist"]),
                     tokens_per_step=b["tokens_per_step"], measured_draft_s=b["draft_s"] / (b["steps"] * b["gamma"]),
                     measured_verify_s=b["verify_s"] / b["steps"])
        points.append(p)
    return points


# --- summary --------------------------------------------------------------------------------------------
def summarize(res: dict[str, Any], table, shape, hw, dtype_bytes: float, kv_bytes: float) -> None:
    """Errors, speedups and the planner's choice per cell, into res["summary"].

    Predictions use the acceptance of the slowest distinct row (`AcceptanceTable.alpha(rows=...)`):
    the bench decodes a static batch, which runs until its slowest row is done."""
    from magicdec.planner import Workload, expected_tokens, plan

    points = res["points"]
    if not points:
        return
    for p in points:
        ctx = p["context_mean"]
        if p["drafter"] == "ar":
            pr = predict(shape, hw, p["batch"], ctx, "ar", None, 0, None, dtype_bytes, kv_bytes)
            p.update(predicted_throughput=pr["throughput"], predicted_step_s=pr["t_step"])
            continue
        p["alpha_table"] = table.alpha(p["drafter"], p["budget"], p["context_used"], "greedy", rows=p["rows"])
        pr = predict(shape, hw, p["batch"], ctx, p["drafter"], p["budget"], p["gamma"], p["alpha_table"],
                     dtype_bytes, kv_bytes)
        p.update(predicted_throughput=pr["throughput"], predicted_draft_s=pr["t_draft"], predicted_verify_s=pr["t_verify"],
                 predicted_rounds=p["generated_per_row"] / expected_tokens(p["alpha_table"], p["gamma"]))
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
        mean_ctx = pts[0]["context_mean"]
        best = max(pts, key=lambda p: p["measured_throughput"])
        cell: dict[str, Any] = {"batch": batch, "context": context, "context_used": ctx, "n_points": len(pts),
                                "best": _label(best), "best_throughput": best["measured_throughput"]}
        if ar is not None and drafters:
            chosen_plan = plan(Workload(shape, hw, batch, mean_ctx, dtype_bytes, kv_bytes), table, budgets=budgets,
                               gammas=gammas, strategies=["ar", *drafters], rows=pts[0]["rows"])
            want = (chosen_plan.strategy, chosen_plan.budget if chosen_plan.gamma else None, chosen_plan.gamma)
            chosen = next((p for p in pts if (p["drafter"], p["budget"], p["gamma"]) == want), None)
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
            c["rounds_measured_over_predicted"] = statistics.median(p["steps"] / p["predicted_rounds"] for p in spec_pts)
        components[f"B={batch}"] = c
    # The two halves of a prediction: seconds per round (the cost model: one AR step, or gamma drafts
    # and a verification) and rounds (the acceptance model: a static batch runs until its slowest row
    # is done, and rows that finish early still ride along).
    round_err = [abs(_predicted_round(p) / (p["decode_s"] / p["steps"]) - 1) for p in points]
    spec = [p for p in points if p["drafter"] != "ar"]
    extra_rounds = [p["steps"] / (p["generated_per_row"] / p["tokens_per_step"]) - 1 for p in spec]
    rounds_err = [abs(p["predicted_rounds"] / p["steps"] - 1) for p in spec]
    res["summary"] = {
        "n_points": len(points),
        "round_time_rel_error": {"median": statistics.median(round_err), "worst": max(round_err)},
        "rounds_beyond_mean_row_median": statistics.median(extra_rounds) if extra_rounds else None,
        "rounds_rel_error": {"median": statistics.median(rounds_err), "worst": max(rounds_err)} if spec else None,
        "throughput_rel_error": {"median": statistics.median(err), "worst": max(err), "worst_point": worst["key"],
                                 "median_signed": statistics.median(signed)},
        "speedup_rel_error": {"median": statistics.median(sp), "worst": max(sp)} if sp else None,
        "choice_within_10pct": f"{sum(within)}/{len(within)}",
        "components": components,
        "cells": cells,
    }


def _predicted_round(p: dict[str, Any]) -> float:
    if p["drafter"] == "ar":
        return p["predicted_step_s"]
    return p["gamma"] * p["predicted_draft_s"] + p["predicted_verify_s"]


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
        r = s["round_time_rel_error"]
        print(f"{s['n_points']} points. Predicted seconds per round (the cost model): median error "
              f"{100 * r['median']:.1f}%, worst {100 * r['worst']:.1f}%")
        if s.get("rounds_rel_error") is not None:
            r = s["rounds_rel_error"]
            print(f"Predicted rounds (the acceptance model, slowest of the distinct rows): median error "
                  f"{100 * r['median']:.1f}%, worst {100 * r['worst']:.1f}%; the runs took "
                  f"{100 * s['rounds_beyond_mean_row_median']:.0f}% more rounds (median) than their mean row needed")
        print(f"Predicted throughput, relative error: median {100 * e['median']:.1f}%, "
              f"worst {100 * e['worst']:.1f}% ({e['worst_point']}); median signed {100 * e['median_signed']:+.1f}%")
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
    from magicdec.profiles import load_acceptance, load_profile, model_key, target_shape
    from magicdec.engine import LLM
    from magicdec.planner import AcceptanceTable, HardwareProfile

    args = parse_args(argv)
    with open(args.bench) as f:
        doc = json.load(f)
    llm = LLM(device="cpu")
    hw = HardwareProfile.from_json(args.profile) if args.profile else load_profile("cpu")
    table = AcceptanceTable.from_json(args.acceptance) if args.acceptance else load_acceptance(model_key(llm.loaded.source))
    res: dict[str, Any] = {"bench": relative(args.bench), "machine": doc.get("machine"), "settings": doc.get("settings"),
                           "profile": dataclasses.asdict(hw), "points": bench_points(doc)}
    summarize(res, table, target_shape(llm.model.cfg), hw, float(llm.model.dtype.itemsize), float(llm.kv_dtype.itemsize))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    report(res, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
