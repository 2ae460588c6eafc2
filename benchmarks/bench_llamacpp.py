"""llama.cpp's `llama-batched-bench` on the same model and cells as magicdec's CPU grid, as a ratio.

    python benchmarks/bench_llamacpp.py --bin PATH/llama-batched-bench [--batches 1,8,32]
        [--contexts 1024,4096,8192] [--new-tokens 32] [--threads 2] [--magicdec benchmarks/results/cpu_grid.json]
        [--label avx512bf16]

llama.cpp runs two GGUFs of the default model: a BF16 copy of the shipped Q4_1 (`gguf_bf16.py`: the weights
magicdec computes with) with flash attention on and off and BF16 and F16 KV caches, and the Q4_1 file itself
(what a llama.cpp user would run) with flash attention and an F16 cache. Every sequence gets its own KV stream (`-no-kvu`), and the
prompt is prefilled once and copied into every stream (`-pps`), so the decode of B sequences reads B full
caches as magicdec's does, without B prefills. Decode throughput is llama.cpp's S_TG (generated tokens per
second over the batch). Writes its run, machine info included, under --label (magicdec's kernel path) in
benchmarks/results/llamacpp.json and prints, per cell, llama.cpp's best configuration against magicdec's plain (AR)
and `--draft auto` decoding, greedy, read from the run of the same label in --magicdec (`magicdec bench` runs; see
cpu_grid.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import save_run, saved_run  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.loading import default_model_path, model_identity  # noqa: E402

HERE = Path(__file__).resolve().parent
#: (weights, flash attention, KV cache type): BF16 weights in every attention / KV setting, and the shipped
#: Q4_1 file (a quarter of the weight bytes) with flash attention and an F16 cache (0-4); for CPUs without
#: AVX512-BF16 (an AVX2 build), F16 weights with flash attention on and off, and Q4_1 with it off (5-7).
CONFIGS = ([("bf16", fa, kv) for fa in ("on", "off") for kv in ("bf16", "f16")] + [("q4_1", "on", "f16")]
           + [("f16", "on", "f16"), ("f16", "off", "f16"), ("q4_1", "off", "f16")])


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run_batched_bench(binary: str, gguf: str, batches: list[int], contexts: list[int], new_tokens: int,
                      threads: int, flash: str, kv: str) -> list[dict]:
    n_ctx = max(batches) * (max(contexts) + new_tokens + 64)
    cmd = [binary, "-m", gguf, "-c", str(n_ctx), "-npp", ",".join(map(str, contexts)), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, batches)), "-pps", "-no-kvu", "-t", str(threads), "-fa", flash,
           "-ctk", kv, "-ctv", kv, "--output-format", "jsonl"]
    print(" ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def magicdec_cells(run: dict) -> dict[tuple[int, int], dict[str, float]]:
    """(batch, context) -> decode tok/s of plain and auto decoding, greedy, from a `magicdec bench` run."""
    cells: dict[tuple[int, int], dict[str, float]] = {}
    for r in run["points"].values():
        if r["mode"] == "greedy" and r["draft"] in ("none", "auto"):
            cells.setdefault((r["batch"], r["context"]), {})[r["draft"]] = r["throughput"]
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True, help="llama-batched-bench binary")
    p.add_argument("--batches", type=sizes, default=[1, 8, 32])
    p.add_argument("--contexts", type=sizes, default=[1024, 4096, 8192])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--build", default="", help="how the binary was built (recorded in the JSON)")
    p.add_argument("--configs", type=sizes, default=list(range(len(CONFIGS))),
                   help="indices into CONFIGS to run (default: all; each takes minutes: one prefill per cell)")
    p.add_argument("--magicdec", type=Path, default=HERE / "results" / "cpu_grid.json")
    p.add_argument("--out", type=Path, default=HERE / "results" / "llamacpp.json")
    p.add_argument("--label", default="avx512bf16",
                   help="this run's label in --out, and the run of --magicdec to compare with: magicdec's kernel path")
    args = p.parse_args()

    # resumable: configurations already in this run of --out are kept, the others run and are saved one by one
    runs = (saved_run(args.out, args.label) or {}).get("runs", [])
    ggufs = {"q4_1": default_model_path()}
    for weights in {CONFIGS[i][0] for i in args.configs} - {"q4_1"}:
        ggufs[weights] = Path(f"/tmp/magicdec-smollm2-{weights}.gguf")
        if not ggufs[weights].exists():
            flag = ["--f16"] if weights == "f16" else []
            subprocess.run([sys.executable, str(HERE / "gguf_bf16.py"), *flag, str(ggufs[weights])], check=True)
    for weights, flash, kv in [CONFIGS[i] for i in args.configs]:
        if any((r["weights"], r["flash_attn"], r["kv"]) == (weights, flash, kv) for r in runs):
            continue
        t0 = time.perf_counter()
        for r in run_batched_bench(args.bin, str(ggufs[weights]), args.batches, args.contexts, args.new_tokens,
                                   args.threads, flash, kv):
            runs.append({**r, "weights": weights, "flash_attn": flash, "kv": kv})  # ours over its 0/1 flash_attn
        save_run(args.out, args.label, {"runs": runs})
        print(f"  {weights} fa={flash} kv={kv}: {time.perf_counter() - t0:.0f} s", flush=True)
    ours = magicdec_cells(saved_run(args.magicdec, args.label) or {"points": {}})
    table = []
    for b in args.batches:
        for s in args.contexts:
            cell = [r for r in runs if r["pl"] == b and r["pp"] == s]
            best = max(cell, key=lambda r: r["speed_tg"])
            row = {"batch": b, "context": s, "llamacpp_best_tok_s": best["speed_tg"],
                   "llamacpp_best": f"{best['weights']} weights, fa {best['flash_attn']}, {best['kv']} kv",
                   "llamacpp_16bit_best_tok_s": max(r["speed_tg"] for r in cell if r["weights"] != "q4_1"),
                   "llamacpp_prefill_tok_s": max(r["speed_pp"] for r in cell)}
            for draft in ("none", "auto"):
                if draft in ours.get((b, s), {}):
                    row[f"magicdec_{draft}_tok_s"] = ours[(b, s)][draft]
                    row[f"magicdec_{draft}_over_llamacpp"] = ours[(b, s)][draft] / best["speed_tg"]
            table.append(row)
    save_run(args.out, args.label, {"machine": machine_info("cpu"), "build": args.build,
                                    "models": {w: model_identity(p) for w, p in ggufs.items()},
                                    "new_tokens": args.new_tokens, "threads": args.threads, "runs": runs,
                                    "table": table})
    print("\n| B | S | llama.cpp best tok/s (config) | magicdec AR | magicdec auto | auto / llama.cpp |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for r in table:
        print(f"| {r['batch']} | {r['context']} | {r['llamacpp_best_tok_s']:.1f} ({r['llamacpp_best']}) | "
              f"{r.get('magicdec_none_tok_s', float('nan')):.1f} | {r.get('magicdec_auto_tok_s', float('nan')):.1f} | "
              f"{r.get('magicdec_auto_over_llamacpp', float('nan')):.2f}x |")
    print(f"wrote run {args.label!r} of {args.out}")


if __name__ == "__main__":
    main()
