"""Attention over a bf16 KV cache on CPU: formulations side by side, in GB/s of K/V read.

    PYTHONPATH=. python benchmarks/bench_attention.py [--batches 1,8,32,64] [--contexts 1024,4096,8192]
                                                     [--q 1,4,9] [--threads 1] [--shape NAME] [--native-only]
                                                     [--orders shuffled,inorder,interleaved] [--block-sizes 16,32]
                                                     [--head-major both] [--layers N] [--out PATH] [--label NAME]

The shapes are a planner preset's (`--shape`; default the default model's, SmolLM2-135M: 9 query heads over 3 KV heads
of 64, 30 layers; `gemma3-270m`: 4 query heads over 1 KV head of 256, and its 3 global layers). A cache of all those
layers is allocated as magicdec's KVCache stores it ([layers, B, KV, capacity, hd], so no layer's K/V sits in cache
when it is read), and one "step" runs attention once per layer, as a forward does. Where the CPU has AMX tiles the
native kernel runs on them and on vector instructions, side by side. Every row has its own length (the last row is 64
tokens short), so masks are real. The native kernel also runs paged: the same K/V copied into per-layer pools of
blocks of 32 positions in a shuffled order, read through a block table (`paged / contiguous` is its time's ratio;
`--native-only` times just the kernel, contiguous and paged, beside the read baseline). `--orders` and
`--block-sizes` time more paged layouts side by side (each a pool as large as the cache: `--layers` caps the layers
a step reads): the pool's blocks handed to the rows `shuffled`, `inorder` (each row's ids consecutive, as a fresh
pool hands out a prefill's blocks) or `interleaved` (row 0's first block, row 1's first, ..., as decode growth takes
them one at a time), in blocks of each size; `--head-major` stores the pools [layers, KV, NB, BS, hd] (each KV head's
blocks side by side, consecutive ids adjacent) and hands the kernel the same [NB, KV, BS, hd] view of them.
Each variant is timed interleaved with the others (median of --repeats; before each timing a read of --flush-mib
of other memory evicts the last-level cache, so that no variant starts on the bytes its predecessor read: the `.sum()`
baseline reads the contiguous cache right before the native kernel's turn) and reported as K/V bytes per
second, beside a `.sum()` over the same bytes (the read-bandwidth baseline). Results go, with the machine info, to
the run of --label (default: the shape and the kernel path, "smollm2-135m, avx512bf16") in
benchmarks/results/attention.json; the run's points at other (batch, context, q) stay in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magicdec import kernels  # noqa: E402
from magicdec.model import matmul_attend  # noqa: E402
from bench_dtype import interleaved  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.planner import MODEL_PRESETS  # noqa: E402
from tables import save_run, saved_run  # noqa: E402



@dataclass(frozen=True)
class Shape:
    """What the attention of one forward reads: `layers` over the whole context, KV heads of `hd`, G queries each."""

    layers: int
    kv: int
    g: int
    hd: int

    @classmethod
    def of(cls, name: str) -> Shape:
        m = MODEL_PRESETS[name]
        return cls(m.n_layers - m.sliding_layers, m.n_kv_heads, m.n_heads // m.n_kv_heads, m.head_dim)


def make_case(shape: Shape, batch: int, context: int, q: int, dtype: torch.dtype):
    """Queries per layer [B, KV, G*q, hd], the cache's K/V [layers, B, KV, L, hd] and the visibility mask."""
    LAYERS, KV, G, HD = shape.layers, shape.kv, shape.g, shape.hd
    L = context + q
    k = torch.randn(LAYERS, batch, KV, L, HD).to(dtype)
    v = torch.randn(LAYERS, batch, KV, L, HD).to(dtype)
    xq = torch.randn(batch, KV, G * q, HD).to(dtype)
    lens = torch.full((batch,), context)
    lens[-1] -= min(64, context // 2)  # ragged rows
    slots = lens[:, None] + torch.arange(q)  # [B, q]
    mask = torch.arange(L)[None, None, None, :] <= slots[:, None, :, None]  # [B, 1, q, L]
    return xq, k, v, mask.repeat(1, 1, G, 1)  # [B, 1, G*q, L], one row per grouped query


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def paged(k: torch.Tensor, bs: int, table: torch.Tensor, head_major: bool = False) -> torch.Tensor:
    """The cache's K or V [layers, B, KV, L, hd] as per-layer pools [layers, B * nblk, KV, bs, hd], row b's j-th
    block of bs positions at block table[b, j] (the last one padded); `head_major`: a view of pools stored
    [layers, KV, B * nblk, bs, hd]."""
    layers, B, KV, L, hd = k.shape
    nblk = table.shape[1]
    if head_major:
        pool = torch.empty(layers, KV, B * nblk, bs, hd, dtype=k.dtype).transpose(1, 2)
    else:
        pool = torch.empty(layers, B * nblk, KV, bs, hd, dtype=k.dtype)
    for i in range(layers):  # a layer at a time: no second whole copy in between
        rows = F.pad(k[i], (0, 0, 0, nblk * bs - L)).view(B, KV, nblk, bs, hd)
        pool[i, table.flatten().long()] = rows.transpose(1, 2).flatten(0, 1)
    return pool


def matmul_attention(xq, k, v, bias):
    """Scores, softmax and the weighted sum as three ops; scores and softmax in fp32."""
    s = torch.matmul(xq, k.transpose(-1, -2)).float().mul_(1 / math.sqrt(xq.shape[-1])).add_(bias)
    return torch.matmul(s.softmax(-1).to(v.dtype), v)


PAGED_BLOCK = 32
NATIVE, NATIVE_TILES, PAGED = "native kernel (magicdec)", "native kernel on AMX tiles", ", paged"
ORDERS = ("shuffled", "inorder", "interleaved")


def block_table(batch: int, nblk: int, order: str) -> torch.Tensor:
    """Row b's j-th block's id in a pool of batch * nblk blocks, handed out in `order` (one of ORDERS)."""
    ids = torch.arange(batch * nblk, dtype=torch.int32)
    if order == "shuffled":
        return ids[torch.randperm(batch * nblk)].view(batch, nblk)
    if order == "inorder":  # a fresh pool's FIFO free list, each row's blocks taken at once
        return ids.view(batch, nblk)
    assert order == "interleaved", order  # the rows grow a block each in turn
    return ids.view(nblk, batch).t().contiguous()


def layouts(orders: tuple[str, ...], block_sizes: tuple[int, ...],
            head_major: tuple[bool, ...] = (False,)) -> dict[str, tuple[str, int, bool]]:
    """The paged variants' name suffixes and (order, block size, head-major pool): plain `, paged` for the one
    default layout."""
    if (orders, block_sizes, head_major) == (("shuffled",), (PAGED_BLOCK,), (False,)):
        return {PAGED: ("shuffled", PAGED_BLOCK, False)}
    return {f"{PAGED} {order} {bs}{' head-major' * hm}": (order, bs, hm)
            for hm in head_major for bs in block_sizes for order in orders}


def contiguous_of(name: str) -> str:
    """The contiguous variant a paged one is compared with."""
    return name.split(PAGED)[0]


def variants(xq, k, v, mask, dtype, skip: tuple[str, ...] = (), paged_layouts: dict | None = None):
    bias = additive(mask, dtype)
    bias32 = additive(mask, torch.float32)
    out = {} if "torch" in skip else {
        "sdpa additive bias": lambda i: F.scaled_dot_product_attention(xq, k[i], v[i], attn_mask=bias),
        "sdpa bool mask": lambda i: F.scaled_dot_product_attention(xq, k[i], v[i], attn_mask=mask),
        "sdpa no mask (not ragged-correct)": lambda i: F.scaled_dot_product_attention(xq, k[i], v[i]),
        "matmul, fp32 softmax": lambda i: matmul_attention(xq, k[i], v[i], bias32),
    }
    if dtype == torch.bfloat16:
        if "torch" not in skip:
            out["matmul, bf16 softmax"] = lambda i: matmul_attend(xq, k[i], v[i], bias)
        if kernels.takes(xq, k[0], v[0], bias):
            B, L = k.shape[1], k.shape[3]
            pools = {}
            for suffix, (order, bs, hm) in (paged_layouts or layouts(("shuffled",), (PAGED_BLOCK,))).items():
                table = block_table(B, -(-L // bs), order)
                pools[suffix] = (paged(k, bs, table, hm), paged(v, bs, table, hm), table)
            for name, on_tiles in ((NATIVE, False), (NATIVE_TILES, True))[: 1 + kernels.tiles()]:
                out[name] = lambda i, t=on_tiles: kernels.decode_attention(xq, k[i], v[i], bias, on_tiles=t)
                for suffix, (pk, pv, table) in pools.items():
                    out[name + suffix] = lambda i, t=on_tiles, pk=pk, pv=pv, table=table: kernels.decode_attention(
                        xq, pk[i], pv[i], bias, table, on_tiles=t)
    if "torch" in skip:
        return out
    if "compile" not in skip:
        compiled = torch.compile(matmul_attention, dynamic=False)
        out["torch.compile(matmul)"] = lambda i: compiled(xq, k[i], v[i], bias32)
    if "flex" in skip:
        return out
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        B, _, Gq, L = mask.shape
        lens = mask[:, 0].sum(-1)  # [B, Gq] visible keys per query row
        block = create_block_mask(lambda b, h, qi, ki: ki < lens[b, qi], B, None, Gq, L, device="cpu")
        flex = torch.compile(flex_attention, dynamic=False)
        out["flex_attention (inductor)"] = lambda i: flex(xq, k[i], v[i], block_mask=block)
    except Exception as e:  # noqa: BLE001 - report any reason flex attention is unavailable
        print(f"  flex_attention unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    return out


def check(fns, reference: str, atol: float) -> list[str]:
    """Names of variants whose output differs from the reference's (layer 0) by more than atol."""
    ref = fns[reference](0).float()
    return [n for n, f in fns.items() if "not ragged" not in n and (f(0).float() - ref).abs().max() > atol]


def bench_point(shape: Shape, batch: int, context: int, q: int, dtype: torch.dtype, repeats: int,
                skip: tuple[str, ...], paged_layouts: dict | None = None, flush_mib: int = 0) -> dict:
    torch._dynamo.reset()  # past 8 shapes dynamo stops compiling and the compiled variants would run eagerly
    xq, k, v, mask = make_case(shape, batch, context, q, dtype)
    fns = variants(xq, k, v, mask, dtype, skip, paged_layouts)
    # bf16 .sum() converts as it reads and runs far below bandwidth: sum the same bytes seen as fp32
    kf, vf = (k, v) if dtype == torch.float32 else (k.view(torch.float32), v.view(torch.float32))
    fns["read baseline: .sum() of K and V"] = lambda i: (kf[i].sum(), vf[i].sum())
    wrong = [] if "torch" in skip else check({n: f for n, f in fns.items() if not n.startswith("read")},
                                             "matmul, fp32 softmax", 0.05)
    wrong += [n for n in fns if PAGED in n  # the paged kernel gives the contiguous one's bits
              and not torch.equal(fns[n](0), fns[contiguous_of(n)](0))]
    scratch = torch.ones(flush_mib * 2**18)  # fp32
    with torch.inference_mode():  # one step: every layer once (the first call also compiles)
        times = interleaved({n: (lambda f=f: [f(i) for i in range(shape.layers)]) for n, f in fns.items()}, repeats,
                            before=(lambda: scratch.sum()) if flush_mib else None)
    kv_bytes = 2 * k[0].numel() * k.element_size() * shape.layers
    res = {n: {"seconds": t, "gb_per_s": kv_bytes / t / 1e9} for n, t in times.items()}
    for n in res:
        if PAGED in n:
            res[n]["paged_over_contiguous"] = times[n] / times[contiguous_of(n)]
    return {"batch": batch, "context": context, "q": q, "dtype": str(dtype).removeprefix("torch."),
            "kv_bytes": kv_bytes, "variants": res, "mismatched": wrong, "loadavg": list(os.getloadavg())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--q", default="1,4,9", help="query tokens per row: 1 (decode), gamma+1 (verification)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-flex", action="store_true", help="skip flex_attention (slow to compile and to run)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the matmuls")
    p.add_argument("--native-only", action="store_true",
                   help="only the native kernel, contiguous and paged, beside the read baseline")
    p.add_argument("--orders", default="shuffled",
                   help=f"the paged variants' block orders, of {', '.join(ORDERS)}")
    p.add_argument("--block-sizes", default=str(PAGED_BLOCK),
                   help="the paged variants' block sizes (powers of two, at least 16)")
    p.add_argument("--head-major", default="no", choices=["no", "yes", "both"],
                   help="paged pools stored [layers, KV, NB, BS, hd] (yes), as the engine stores them (no), or both")
    p.add_argument("--layers", type=int, default=0,
                   help="layers a step reads (default: the shape's; fewer keep several paged copies in memory)")
    p.add_argument("--flush-mib", type=int, default=256,
                   help="memory read before each timing to evict the last-level cache (0: none)")
    p.add_argument("--max-gib", type=float, default=4.0,
                   help="skip points whose cache exceeds this (each paged layout's copy takes as much again)")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(MODEL_PRESETS),
                   help="the model whose attention shapes to use (its global layers)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results/attention.json")
    p.add_argument("--label", default=None, help="this run's label in --out (default: the shape and the kernel path)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shape = Shape.of(args.shape)
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    orders = tuple(args.orders.split(","))
    assert all(o in ORDERS for o in orders), f"--orders: choose from {', '.join(ORDERS)}"
    paged_layouts = layouts(orders, tuple(map(int, args.block_sizes.split(","))),
                            {"no": (False,), "yes": (True,), "both": (False, True)}[args.head_major])
    label = args.label or f"{args.shape}, {kernels.path_name()}"
    grid = [(b, c, q) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))
            for q in map(int, args.q.split(","))
            if 2 * shape.layers * b * shape.kv * c * shape.hd * dtype.itemsize <= args.max_gib * 2**30]
    kept = [pt for pt in (saved_run(args.out, label) or {}).get("points", [])
            if (pt["batch"], pt["context"], pt["q"]) not in grid]  # other commands' points of this run
    results = {"machine": machine_info("cpu"), "shape": {"name": args.shape, **dataclasses.asdict(shape)},
               "kernels": kernels.path_name(), "points": kept}
    for batch, context, q in grid:
        skip = ("flex",) * args.no_flex + ("compile",) * args.no_compile + ("torch",) * args.native_only
        pt = bench_point(shape, batch, context, q, dtype, args.repeats, skip, paged_layouts,
                         args.flush_mib)
        results["points"].append(pt)
        base = pt["variants"]["read baseline: .sum() of K and V"]["gb_per_s"]
        print(f"B={batch} L={context} q={q} (load {pt['loadavg'][0]:.1f}, read {base:.1f} GB/s)"
              + (f" mismatched: {pt['mismatched']}" if pt["mismatched"] else ""), flush=True)
        width = max(36, *map(len, pt["variants"]))
        for n, r in pt["variants"].items():
            ratio = r.get("paged_over_contiguous")
            ratio = f"  paged / contiguous {ratio:.3f}" if ratio else ""
            print(f"  {n:{width}s} {r['seconds'] * 1e3:8.1f} ms {r['gb_per_s']:6.1f} GB/s{ratio}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_run(args.out, label, results)  # after every point


if __name__ == "__main__":
    main()
