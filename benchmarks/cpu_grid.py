"""The CPU grid: plain (AR) and `--draft auto` decoding in bf16 against fp32 AR, from two `magicdec bench` runs.

    magicdec bench --dtype bf16 --batch 1,8,32 --context 1k,4k,8k --drafters none,auto --modes greedy,sampling \\
        --max-tokens 64 --distinct-prompts 8 --corpus ../shared/data/pg19_dev.jsonl --out benchmarks/results/cpu_grid_bf16.json
    magicdec bench --dtype fp32 ... --drafters none --modes greedy --out benchmarks/results/cpu_grid_fp32.json
    python benchmarks/cpu_grid.py [--bandwidth GB/s]

Prints one markdown row per batch x context: decode tok/s of bf16 AR and auto (greedy and sampled), auto's
speedups, fp32 AR and the bf16/fp32 ratio, and the bf16 AR step against its floor (the step's weight and
KV bytes at the read bandwidth `magicdec calibrate` measured, `--bandwidth` to override).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magicdec.planner.models import ModelShape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def tok_s(doc: dict, batch: int, context: int, mode: str, draft: str) -> float | None:
    p = doc["points"].get(f"B{batch}-S{context}-{mode}-{draft}-K0-g0", {})
    return p.get("throughput")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16", type=Path, default=RESULTS / "cpu_grid_bf16.json")
    p.add_argument("--fp32", type=Path, default=RESULTS / "cpu_grid_fp32.json", help="fp32 AR points ('-': none)")
    p.add_argument("--calibration", type=Path, default=RESULTS / "hardware-cpu-avx512bf16-2t-bf16.measurements.json")
    p.add_argument("--bandwidth", type=float, help="read bandwidth for the floor, GB/s (default: calibrated)")
    p.add_argument("--out", type=Path, default=RESULTS / "cpu_grid.json")
    args = p.parse_args()
    bf16 = json.loads(args.bf16.read_text())
    fp32 = json.loads(args.fp32.read_text()) if str(args.fp32) != "-" else {"points": {}}
    cal = json.loads(args.calibration.read_text())
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else cal["read_bandwidth"]["sum"]
    shape = ModelShape(**cal["model_shape"])
    weight_bytes = 2 * shape.n_params_linear  # bf16 weights a step streams
    kv_per_token = shape.kv_bytes_per_token(2)  # bf16 K and V
    points = [q for q in bf16["points"].values() if "throughput" in q]
    cells = sorted({(q["batch"], q["context"]) for q in points})
    rows = []
    print(f"floor: bf16 weights {weight_bytes / 1e6:.0f} MB + KV at {bandwidth / 1e9:.1f} GB/s read bandwidth\n")
    print("| B | S | bf16 AR greedy | auto greedy (x) | bf16 AR sampled | auto sampled (x) | fp32 AR greedy | "
          "bf16 / fp32 AR | AR step / floor |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, c in cells:
        ctx = next(q["context_used"] for q in points if (q["batch"], q["context"]) == (b, c))
        r = {"batch": b, "context": c}
        for mode in ("greedy", "sampling"):
            r[f"ar_{mode}"], r[f"auto_{mode}"] = tok_s(bf16, b, c, mode, "none"), tok_s(bf16, b, c, mode, "auto")
            if r[f"ar_{mode}"] and r[f"auto_{mode}"]:
                r[f"auto_over_ar_{mode}"] = r[f"auto_{mode}"] / r[f"ar_{mode}"]
        r["fp32_ar_greedy"] = tok_s(fp32, b, c, "greedy", "none")
        if r["fp32_ar_greedy"] and r["ar_greedy"]:
            r["bf16_over_fp32"] = r["ar_greedy"] / r["fp32_ar_greedy"]
        floor_s = (weight_bytes + b * (ctx + 32) * kv_per_token) / bandwidth  # mid-run context
        r["floor_step_s"] = floor_s
        if r["ar_greedy"]:
            r["ar_step_over_floor"] = (b / r["ar_greedy"]) / floor_s
        rows.append(r)

        def f(key: str, fmt: str = "{:.1f}") -> str:
            return fmt.format(r[key]) if r.get(key) is not None else "-"

        print(f"| {b} | {c} | {f('ar_greedy')} | {f('auto_greedy')} ({f('auto_over_ar_greedy', '{:.2f}')}) | "
              f"{f('ar_sampling')} | {f('auto_sampling')} ({f('auto_over_ar_sampling', '{:.2f}')}) | "
              f"{f('fp32_ar_greedy')} | {f('bf16_over_fp32', '{:.2f}x')} | {f('ar_step_over_floor', '{:.2f}')} |")
    args.out.write_text(json.dumps({"bandwidth": bandwidth, "weight_bytes": weight_bytes,
                                    "machine": bf16.get("machine"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
