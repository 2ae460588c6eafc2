"""The packed bf16 linear kernel (magicdec.kernels.linear) against torch's bf16 matmul (oneDNN) on this CPU.

    PYTHONPATH=. python benchmarks/bench_linear.py [--rows 1,2,4,...,512] [--batches 1,8,32] [--context 4096]
                                                  [--q 1,4] [--out PATH] [--label NAME]
    PYTHONPATH=. MAGICDEC_ISA=avx2 python benchmarks/bench_linear.py --avx2 [--rows ...] [--batches 8,32]

Layers: the default model's linear shapes (qkv 576->960, wo 576->576, gate+up 576->3072, down 1536->576,
LM head 576->49152) at 1..512 rows, each call over another copy of the weight (64 MiB of copies, so that
weights stream from memory as they do in a forward), torch and the kernel (on vector instructions, and on AMX tiles
where the CPU has them) timed interleaved (median of repeats), reported as weight bytes per second and GFLOP/s. Forwards: the real default model in bf16
loaded twice, with packed linear layers and with torch's, B sequences x q new tokens over a bf16 cache
of `context` tokens, interleaved. Writes its run, with the machine info, under --label (default: the kernel path,
e.g. "avx512bf16", "avx512bf16-amx" where the kernel has tiles to compare) in benchmarks/results/linear.json.

With `--avx2` (on the AVX2 kernels, forced with MAGICDEC_ISA=avx2 on a CPU with AVX-512), the fp32 kernels over
weights packed in fp16 and in bf16 against torch's fp32 matmul, the same layers and rows; and attention of B
sequences x q new tokens (3 query heads per KV head) over `context` cached tokens in fp16 and in bf16 against SDPA
over an fp32 cache: what the 16-bit storage costs to widen (the run "avx2" of the same file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import additive  # noqa: E402
from bench_dtype import LINEARS, interleaved  # noqa: E402
from magicdec import kernels  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.calibrate.timing import filled_cache  # noqa: E402
from magicdec.loading import load_model, model_identity  # noqa: E402
from tables import save_run  # noqa: E402

COPIES_BYTES = 64 << 20
STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def bench_layers(rows: list[int], repeats: int) -> list[dict]:
    out = []
    for name, (k, n) in LINEARS.items():
        copies = max(2, COPIES_BYTES // (2 * k * n))
        weights = [(torch.randn(n, k) * 0.02).bfloat16() for _ in range(copies)]
        packed = [kernels.pack_linear(w, torch.bfloat16) for w in weights]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            fns = {"torch": lambda: [F.linear(x, w) for w in weights],
                   "kernel": lambda: [kernels.linear(x, p, n, on_tiles=False) for p in packed]}
            if kernels.tiles():
                fns["tiles"] = lambda: [kernels.linear(x, p, n, on_tiles=True) for p in packed]
            t = {v: s / copies for v, s in interleaved(fns, repeats).items()}
            r = {"layer": name, "in": k, "out": n, "rows": m, "seconds": t, "speedup": t["torch"] / t["kernel"],
                 "gb_per_s": {v: 2 * k * n / s / 1e9 for v, s in t.items()},
                 "gflop_per_s": {v: 2 * m * k * n / s / 1e9 for v, s in t.items()}}
            out.append(r)
            g, f = r["gb_per_s"], r["gflop_per_s"]
            print(f"{name:6s} {k:4d}->{n:5d} x{m:4d}: " + " | ".join(
                f"{v} {g[v]:5.1f} GB/s {f[v]:4.0f} GF/s" for v in t) + f" | kernel {r['speedup']:.2f}x torch",
                flush=True)
    return out


def bench_avx2(rows: list[int], batches: list[int], context: int, qs: list[int], repeats: int) -> dict:
    """The AVX2 kernels over fp16 and bf16 storage against torch in fp32 (see the module docstring)."""
    layers, attention = [], []
    for name, (k, n) in LINEARS.items():
        copies = max(2, COPIES_BYTES // (2 * k * n))
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        packed = {s: [kernels.pack_linear(w, dt) for w in weights] for s, dt in STORAGE.items()}
        for m in rows:
            x = torch.randn(m, k)
            fns = {"torch fp32": lambda: [F.linear(x, w) for w in weights[: copies // 2]]}  # the same bytes
            fns.update({f"kernel {s}": lambda s=s: [kernels.linear(x, p, n) for p in packed[s]] for s in STORAGE})
            t = interleaved(fns, repeats)
            layers.append({"layer": name, "in": k, "out": n, "rows": m, "seconds_per_16bit_weight_copy":
                           {v: s / copies for v, s in t.items()}})
            print(f"{name:6s} {k:4d}->{n:5d} x{m:4d}: " + " | ".join(
                f"{v} {2 * k * n * copies / s / 1e9:5.1f} GB/s" for v, s in t.items()), flush=True)
    for b in batches:
        for q in qs:
            attention.append(_avx2_attention_point(b, context, q, repeats))
    return {"layers": layers, "attention": attention}


def _avx2_attention_point(batch: int, context: int, q: int, repeats: int) -> dict:
    """Attention of `batch` x 3 query heads x q rows per KV head (the default model's 3 KV heads, head dim 64)
    over `context` cached positions: SDPA over fp32 K/V, the kernel over fp16 and bf16 K/V."""
    xq = torch.randn(batch, 3, 3 * q, 64)
    k, v = torch.randn(batch, 3, context, 64), torch.randn(batch, 3, context, 64)
    mask = torch.ones(batch, 1, 3 * q, context, dtype=torch.bool)
    fns = {"sdpa fp32": lambda: F.scaled_dot_product_attention(xq, k, v, attn_mask=additive(mask, torch.float32))}
    for s, dt in STORAGE.items():
        ks, vs, bias = k.to(dt), v.to(dt), additive(mask, dt)
        fns[f"kernel {s}"] = lambda ks=ks, vs=vs, bias=bias: kernels.decode_attention(xq, ks, vs, bias)
    t = interleaved(fns, repeats)
    kv16 = 2 * batch * 3 * context * 64 * 2  # K and V bytes in 16 bits
    print(f"attention B={batch} x q={q} over {context}: " + " | ".join(
        f"{n} {1e3 * s:6.1f} ms ({kv16 * (2 if '32' in n else 1) / s / 1e9:4.1f} GB/s)" for n, s in t.items()),
        flush=True)
    return {"batch": batch, "context": context, "q": q, "seconds": t}


def bench_forwards(batches: list[int], context: int, qs: list[int], repeats: int) -> list[dict]:
    packed = load_model(dtype=torch.bfloat16).model
    with mock.patch("magicdec.loading.pack_linears", lambda *args: None):
        plain = load_model(dtype=torch.bfloat16).model
    out = []
    for b in batches:
        for q in qs:
            cache = filled_cache(packed.cfg, b, context, q, torch.bfloat16, torch.device("cpu"))
            tokens = torch.zeros(b, q, dtype=torch.long)
            with torch.inference_mode():
                t = interleaved({"torch": lambda: plain(tokens, cache), "kernel": lambda: packed(tokens, cache)},
                                repeats)
            r = {"batch": b, "context": context, "q": q, "seconds": t, "speedup": t["torch"] / t["kernel"]}
            out.append(r)
            print(f"forward B={b:3d} x q={q} over {context}: torch linears {t['torch'] * 1e3:7.1f} ms, "
                  f"packed {t['kernel'] * 1e3:7.1f} ms | {r['speedup']:.2f}x", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q", default="1,4")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--avx2", action="store_true", help="the AVX2 kernels over fp16 and bf16 storage")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "linear.json")
    p.add_argument("--label", default=None, help="this run's label in --out (default: the kernel path)")
    a = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    label = a.label or kernels.path_name()
    if a.avx2:
        if kernels.path_name() != "avx2":
            sys.exit("the AVX2 kernels do not run here (MAGICDEC_ISA=avx2 forces them on a CPU with AVX-512)")
        result = {"machine": machine_info(), **bench_avx2(ints(a.rows), ints(a.batches), a.context, ints(a.q),
                                                          a.repeats)}
    else:
        if not kernels.linear_supported(torch.device("cpu"), torch.bfloat16):
            sys.exit("the packed linear kernel does not run on this CPU (it needs AVX512-BF16)")
        result = {"machine": machine_info(), "model": model_identity(),
                  "layers": bench_layers(ints(a.rows), a.repeats),
                  "forwards": bench_forwards(ints(a.batches), a.context, ints(a.q), a.repeats)}
    save_run(a.out, label, result)
    print(f"wrote run {label!r} of {a.out}")


if __name__ == "__main__":
    main()
