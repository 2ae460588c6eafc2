"""bf16 against fp32 on this CPU: the default model's linear layers, and whole forwards over a cache.

    PYTHONPATH=. python benchmarks/bench_dtype.py [--threads 1] [--rows 1,2,4,...,512]
                                                 [--batches 1,8,32] [--contexts 1024,4096] [--q 1,4]

Linear layers: the shapes of SmolLM2-135M (qkv 576->960, wo 576->576, gate+up 576->3072, down
1536->576, LM head 576->49152) at 1..512 rows, fp32 and bf16 timed interleaved (median of repeats).
Forwards: the model with placeholder weights (`calibrate.timing.synthetic_model`) in fp32 (fp32 KV cache) and
in bf16 (bf16 KV cache), B sequences x q new tokens over a cache of `context` tokens, interleaved.
Writes benchmarks/results/dtype.json with the machine info (CPU flags included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.calibrate.timing import filled_cache, model_config_from_shape, synthetic_model  # noqa: E402
from magicdec.planner.models import MODEL_PRESETS  # noqa: E402

LINEARS = {"wqkv": (576, 960), "wo": (576, 576), "w13": (576, 3072), "w2": (1536, 576), "output": (576, 49152)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1,
                before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each function, timed in turns after one warm-up call each; `before` runs (untimed)
    before each timing."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[n].append((time.perf_counter() - t0) / inner)
    return {n: statistics.median(t) for n, t in times.items()}


def bench_linears(rows: list[int], repeats: int) -> list[dict]:
    out = []
    for name, (k, n) in LINEARS.items():
        w = torch.randn(n, k) * 0.02
        for m in rows:
            x = torch.randn(m, k)
            args = {d: (x.to(t), w.to(t)) for d, t in DTYPES.items()}
            inner = max(1, min(50, int(2e6 / (m * k * n))))  # calls per timing: about 1 ms or more each
            t = interleaved({d: (lambda a=a: F.linear(*a)) for d, a in args.items()}, repeats, inner)
            r = {"layer": name, "in": k, "out": n, "rows": m, "seconds": t, "bf16_over_fp32": t["bf16"] / t["fp32"]}
            out.append(r)
            print(f"linear {name:6s} {k}->{n} x{m:4d}: fp32 {t['fp32'] * 1e6:9.1f} us, bf16 {t['bf16'] * 1e6:9.1f} us,"
                  f" bf16/fp32 {r['bf16_over_fp32']:.2f}", flush=True)
    return out


def bench_forwards(batches: list[int], contexts: list[int], qs: list[int], repeats: int) -> list[dict]:
    cfg = model_config_from_shape(MODEL_PRESETS["smollm2-135m"], max(contexts) + max(qs) + 64)
    models = {d: synthetic_model(cfg, torch.device("cpu"), t) for d, t in DTYPES.items()}
    out = []
    for batch in batches:
        for context in contexts:
            for q in qs:
                caches = {d: filled_cache(cfg, batch, context, q, m.dtype, m.device) for d, m in models.items()}
                tokens = torch.randint(0, cfg.vocab_size, (batch, q))
                with torch.inference_mode():
                    t = interleaved({d: (lambda d=d: models[d](tokens, caches[d])) for d in models}, repeats)
                r = {"batch": batch, "context": context, "q": q, "seconds": t, "bf16_over_fp32": t["bf16"] / t["fp32"],
                     "loadavg": list(os.getloadavg())}
                out.append(r)
                print(f"forward B={batch:2d} L={context:5d} q={q}: fp32 {t['fp32'] * 1e3:8.1f} ms, "
                      f"bf16 {t['bf16'] * 1e3:8.1f} ms, bf16/fp32 {r['bf16_over_fp32']:.2f} "
                      f"(load {r['loadavg'][0]:.1f})", flush=True)
                del caches
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--q", default="1,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results/dtype.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    results = {"machine": machine_info("cpu"), "linear": bench_linears(ints(args.rows), 2 * args.repeats + 1)}
    results["forward"] = bench_forwards(ints(args.batches), ints(args.contexts), ints(args.q), args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
