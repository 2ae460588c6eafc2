"""The CPU grid: plain (AR) and `--draft auto` decoding in bf16, optionally against fp32 AR, from `magicdec bench` runs.

    magicdec bench --dtype bf16 --batch 32 --context 4k,8k --drafters none,auto --modes greedy,sampling \\
        --max-tokens 64 --distinct-prompts 8 --repeats 3 --corpus ../shared/data/pg19_dev.jsonl \\
        --out /tmp/cpu_grid.json
    python benchmarks/tables.py --add-run /tmp/cpu_grid.json benchmarks/results/cpu_grid.json avx512bf16
    magicdec bench --dtype fp32 ... --drafters none --modes greedy --out /tmp/cpu_grid_fp32.json   # optional
    python benchmarks/cpu_grid.py [--run avx512bf16] [--fp32 /tmp/cpu_grid_fp32.json] [--bandwidth GB/s]
        [--out rows.json]

Prints one markdown row per batch x context: decode tok/s of bf16 AR and auto (greedy and sampled), auto's
speedups, fp32 AR and the bf16/fp32 ratio (with --fp32), and the bf16 AR step against its floor (the step's
weight and KV bytes at the read bandwidth `magicdec calibrate` measured for the shipped bf16 preset,
`--bandwidth` to override). benchmarks/tables.py renders the README's table with `grid_rows`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magicdec.planner.models import ModelShape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CALIBRATION = ROOT / "magicdec" / "data" / "hardware-cpu-avx512bf16-2t-bf16.measurements.json"


def read_run(path: Path, label: str | None) -> dict:
    """A `magicdec bench` run: the file `path`, or its run `label` where it holds runs by label (`tables.save_run`)."""
    doc = json.loads(path.read_text())
    if "runs" not in doc:
        return doc
    if label not in doc["runs"]:
        sys.exit(f"{path}: name one of its runs ({', '.join(doc['runs'])})")
    return doc["runs"][label]


def tok_s(doc: dict, batch: int, context: int, mode: str, draft: str) -> float | None:
    p = doc["points"].get(f"B{batch}-S{context}-{mode}-{draft}-K0-g0", {})
    return p.get("throughput")


def grid_rows(bf16: dict, fp32: dict | None = None, bandwidth: float | None = None,
              calibration: Path = CALIBRATION) -> list[dict]:
    """One row per (batch, context) of a bf16 bench run: tok/s, auto's ratios, bf16/fp32, AR step over floor."""
    cal = json.loads(calibration.read_text())
    bandwidth = bandwidth or cal["read_bandwidth"]["sum"]
    shape = ModelShape(**cal["model_shape"])
    weight_bytes = 2 * shape.n_params_linear  # bf16 weights a step streams
    kv_per_token = shape.kv_bytes_per_token(2)  # bf16 K and V
    fp32 = fp32 or {"points": {}}
    points = [q for q in bf16["points"].values() if "throughput" in q]
    rows = []
    for b, c in sorted({(q["batch"], q["context"]) for q in points}):
        ctx = next(q["context_used"] for q in points if (q["batch"], q["context"]) == (b, c))
        r = {"batch": b, "context": c}
        for mode in ("greedy", "sampling"):
            for draft, key in (("none", f"ar_{mode}"), ("auto", f"auto_{mode}")):
                r[key] = tok_s(bf16, b, c, mode, draft)
                runs = bf16["points"].get(f"B{b}-S{c}-{mode}-{draft}-K0-g0", {}).get("throughput_runs")
                if runs and len(runs) > 1:
                    r[f"{key}_range"] = (min(runs), max(runs))
            if r[f"ar_{mode}"] and r[f"auto_{mode}"]:
                r[f"auto_over_ar_{mode}"] = r[f"auto_{mode}"] / r[f"ar_{mode}"]
        r["fp32_ar_greedy"] = tok_s(fp32, b, c, "greedy", "none")
        if r["fp32_ar_greedy"] and r["ar_greedy"]:
            r["bf16_over_fp32"] = r["ar_greedy"] / r["fp32_ar_greedy"]
        r["floor_step_s"] = (weight_bytes + b * (ctx + 32) * kv_per_token) / bandwidth  # mid-run context
        if r["ar_greedy"]:
            r["ar_step_over_floor"] = (b / r["ar_greedy"]) / r["floor_step_s"]
        rows.append(r)
    return rows


def markdown(rows: list[dict], label: str = "bf16") -> str:
    """The grid as a markdown table (the fp32 columns only where fp32 points exist); `label` names the path that
    the AR and auto columns ran on."""
    fp32 = any(r.get("fp32_ar_greedy") for r in rows)

    def f(r: dict, key: str, fmt: str = "{:.1f}") -> str:
        text = fmt.format(r[key]) if r.get(key) is not None else "-"
        lo_hi = r.get(f"{key}_range")
        return text + (f" ({lo_hi[0]:.0f}-{lo_hi[1]:.0f})" if lo_hi else "")

    head = ["B", "S", f"{label} AR greedy", "auto greedy (x AR)", f"{label} AR sampled", "auto sampled (x AR)"]
    head += ["fp32 AR greedy", f"{label} / fp32 AR"] if fp32 else []
    lines = ["| " + " | ".join(head + ["AR step / floor"]) + " |", "|" + " ---: |" * (len(head) + 1)]
    for r in rows:
        cells = [str(r["batch"]), str(r["context"]), f(r, "ar_greedy"),
                 f"{f(r, 'auto_greedy')} ({f(r, 'auto_over_ar_greedy', '{:.2f}')})", f(r, "ar_sampling"),
                 f"{f(r, 'auto_sampling')} ({f(r, 'auto_over_ar_sampling', '{:.2f}')})"]
        cells += [f(r, "fp32_ar_greedy"), f(r, "bf16_over_fp32", "{:.2f}x")] if fp32 else []
        lines.append("| " + " | ".join(cells + [f(r, "ar_step_over_floor", "{:.2f}")]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16", type=Path, default=RESULTS / "cpu_grid.json")
    p.add_argument("--run", default="avx512bf16", help="the run of --bf16 to show, where it holds runs by label")
    p.add_argument("--fp32", type=Path, help="a fp32 run's AR points (default: none)")
    p.add_argument("--fp32-run", help="the run of --fp32, where it holds runs by label")
    p.add_argument("--calibration", type=Path, default=CALIBRATION)
    p.add_argument("--bandwidth", type=float, help="read bandwidth for the floor, GB/s (default: calibrated)")
    p.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = p.parse_args()
    bf16 = read_run(args.bf16, args.run)
    fp32 = read_run(args.fp32, args.fp32_run) if args.fp32 else None
    rows = grid_rows(bf16, fp32, args.bandwidth * 1e9 if args.bandwidth else None, args.calibration)
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps({"machine": bf16.get("machine"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
