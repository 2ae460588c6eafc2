"""Decode and verification forwards over a bf16 and an int8 KV cache, side by side.

    PYTHONPATH=. python benchmarks/bench_kv_dtype.py --batch 32 --context 8192                       # SmolLM2
    PYTHONPATH=. python benchmarks/bench_kv_dtype.py --model gemma3-270m --batch 32 --context 32768

The real model (bf16, its weights packed for the native kernels) runs whole forwards of `--batch` rows over caches
holding `--context` tokens each: a decode step (1 new token a row) and a verification of `--verify` tokens a row, in
each KV dtype of `--kv-dtypes` in turn, `--repeats` times (dtype after dtype, so both see the same machine state);
each keeps its median. Reported per dtype: the decode step, the verification, the verification's cost in decode
steps, and the decode step against bf16's (the issue's targets: int8 decode >= 1.5x bf16; a 4-token verification
<= 1.5 decode steps on a CPU without AMX). Writes the run into benchmarks/results/kv_dtype.json (one run per model
and shape, the others kept) with the machine info and kernel path; prints the file's table.

With `--llamacpp BIN` (a `llama-batched-bench`), llama.cpp then decodes the same cell from the same GGUF in the
same process, flash attention on, with an F16 and a Q8_0 KV cache (`-ctk q8_0 -ctv q8_0 -fa on`, its 8-bit
cache): the prompt prefilled once and copied to every sequence's own cache (`-pps`), `--new-tokens` steps timed. Its
decode step is the batch over its S_TG (tokens a second), set beside ours: forwards only on both sides (neither
samples). `--llamacpp-args` adds flags (Gemma 3 at 32k: `-kvu --swa-full`, one unified cache in which the batch shares
the prompt's cells, as llama.cpp needs to fit 32 sequences of 32k; its sliding layers then keep the whole context).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import save_run  # noqa: E402

from magicdec import kernels  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.calibrate.timing import time_forward  # noqa: E402
from magicdec.engine import parse_kv_dtype  # noqa: E402
from magicdec.kv.hybrid import cache_bytes  # noqa: E402
from magicdec.loading import load_model, model_identity  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "kv_dtype.json"


def measure(model, batch: int, context: int, verify: int, dtypes: list[str], repeats: int) -> dict[str, dict]:
    """Median decode and verification forward seconds per KV dtype, the dtypes taking turns."""
    times: dict[str, dict[str, list[float]]] = {d: {"decode": [], "verify": []} for d in dtypes}
    for _ in range(repeats):
        for name in dtypes:
            dtype = parse_kv_dtype(name)
            times[name]["decode"].append(time_forward(model, batch, 1, context, reps=3, kv_dtype=dtype))
            times[name]["verify"].append(time_forward(model, batch, verify, context, reps=3, kv_dtype=dtype))
    return {name: {kind: statistics.median(runs) for kind, runs in t.items()} for name, t in times.items()}


def llamacpp_steps(binary: str, gguf: str, batch: int, context: int, new_tokens: int, extra: str) -> dict:
    """llama.cpp's decode step seconds over `batch` sequences of `context` tokens, per KV cache type (F16, Q8_0)."""
    steps, flags = {}, shlex.split(extra)
    # a unified cache (-kvu) holds the shared prompt once; separate streams (the default) hold it per sequence
    n_ctx = context + batch * (new_tokens + 64) if "-kvu" in flags else batch * (context + new_tokens + 64)
    for kv in ("f16", "q8_0"):
        cmd = [binary, "-m", gguf, "-c", str(n_ctx), "-npp", str(context),
               "-ntg", str(new_tokens), "-npl", str(batch), "-pps", "-fa", "on", "-ctk", kv, "-ctv", kv,
               "-t", str(torch.get_num_threads()), "--output-format", "jsonl", *flags]
        print(" ".join(cmd), flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        steps[kv] = {"command": shlex.join(cmd), "speed_tg": row["speed_tg"], "speed_pp": row["speed_pp"],
                     "decode": batch / row["speed_tg"]}
    return steps


def kv_gib(model, batch: int, context: int, dtype: str) -> float:
    """GiB of the cache a decode step reads (a hybrid model's rings included, for one new token)."""
    return cache_bytes(model.cfg, batch, context, parse_kv_dtype(dtype), 1) / 2**30


def table(doc: dict) -> str:
    """One row per run and KV dtype."""
    rows = []
    for label, run in doc["runs"].items():
        base = run["times"][run["dtypes"][0]]["decode"]
        for name in run["dtypes"]:
            t = run["times"][name]
            rows.append({"run": label, "KV": name, "KV GiB": f"{run['kv_gib'][name]:.2f}",
                         "decode": f"{1e3 * t['decode']:.0f} ms", f"verify {run['verify']}": f"{1e3 * t['verify']:.0f} ms",
                         "verify / decode": f"{t['verify'] / t['decode']:.2f}",
                         "decode speedup": f"{base / t['decode']:.2f}x", "kernels": run["kernels"]})
        for kv, step in run.get("llamacpp", {}).items():
            rows.append({"run": label, "KV": f"llama.cpp {kv}", "decode": f"{1e3 * step['decode']:.0f} ms"})
            ours = {"f16": run["dtypes"][0], "q8_0": "int8"}[kv]
            rows[-1]["ours / llama.cpp"] = f"{ours} {step['decode'] / run['times'][ours]['decode']:.2f}x"
    return format_table(rows, list(dict.fromkeys(k for row in rows for k in row)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder, .gguf or gemma3-270m (default: the embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--verify", type=int, default=4, help="tokens a row of the verification forward (default 4)")
    p.add_argument("--kv-dtypes", default="bf16,int8", help="KV dtypes, the first the baseline (default bf16,int8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llamacpp", metavar="BIN", help="a llama-batched-bench to run on the same GGUF and cell")
    p.add_argument("--llamacpp-args", default="", help="extra llama-batched-bench flags (Gemma 3: -kvu --swa-full)")
    p.add_argument("--new-tokens", type=int, default=32, help="llama.cpp's timed decode steps (default 32)")
    p.add_argument("--out", default=str(RESULT))
    args = p.parse_args()
    loaded = load_model(args.model, device="cpu", dtype=torch.bfloat16)
    model, dtypes = loaded.model, args.kv_dtypes.split(",")
    times = measure(model, args.batch, args.context, args.verify, dtypes, args.repeats)
    identity = model_identity(loaded.source)
    run = {"model": identity, "batch": args.batch, "context": args.context, "verify": args.verify, "dtypes": dtypes,
           "repeats": args.repeats, "threads": torch.get_num_threads(), "kernels": kernels.path_name(),
           "times": times,
           "kv_gib": {d: kv_gib(model, args.batch, args.context, d) for d in dtypes}}
    if args.llamacpp:
        run["llamacpp"] = llamacpp_steps(args.llamacpp, str(loaded.source), args.batch, args.context,
                                         args.new_tokens, args.llamacpp_args)
    label = f"{identity['name']} B={args.batch} x {args.context}"
    doc = save_run(Path(args.out), label, run, machine_info(model.device))
    print(table(doc))


if __name__ == "__main__":
    main()
