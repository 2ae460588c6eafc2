"""Attention over a paged pool where rows share a prompt's blocks: one pass per row against one per group of rows
(`kernels.groups`, MAGICDEC_CASCADE), and against rows of their own, at SmolLM2's shape.

    PYTHONPATH=. python benchmarks/bench_shared_prefix.py --label "Xeon AMX"

B rows over L positions of blocks of 16, the rows tiling `--distinct` prompts: each row's first L - 64 positions are
its prompt's blocks, the last 64 its own (the tokens it generated). For each (distinct, q: new tokens a row) the
kernel runs over three tables in turns, `--layers` layers a call, median of `--repeats`: `own` (every row its own
copy of its prompt's blocks: distinct prompts), `per row` (the shared blocks, MAGICDEC_CASCADE=0: each row reads them
in its own pass, from the cache where they stay) and `grouped` (the shared blocks, MAGICDEC_CASCADE=1: one pass per
group of rows). On vector instructions and, where the CPU has them, on AMX tiles. Writes the run under `--label` into
benchmarks/results/shared_prefix.json (the other runs kept) with the machine info and the outputs' agreement (the
grouped pass gives each row the bits of its own), and prints the file's table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from bench_dtype import interleaved  # noqa: E402
from tables import save_run, text  # noqa: E402

from magicdec import kernels  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "shared_prefix.json"
KV, G, HD, BS, OWN = 3, 3, 64, 16, 64  # SmolLM2's KV heads, query heads per KV head, head dim; blocks; own positions


def tables(batch: int, context: int, distinct: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [B, nblk]: every row's blocks its own, and the rows of a prompt sharing its blocks."""
    nblk = -(-context // BS)
    own = torch.arange(batch * nblk, dtype=torch.int32).view(batch, nblk)
    shared = own.clone()
    prompt = (context - OWN) // BS
    for b in range(batch):
        shared[b, :prompt] = own[b % distinct, :prompt]
    return own, shared


def cell(batch: int, context: int, distinct: int, q: int, tiles: bool, layers: int, repeats: int) -> dict:
    nblk = -(-context // BS)
    pools = [(torch.randn(batch * nblk, KV, BS, HD).bfloat16(), torch.randn(batch * nblk, KV, BS, HD).bfloat16())
             for _ in range(layers)]
    own, shared = tables(batch, context, distinct)
    xq = torch.randn(batch, KV, G * q, HD).bfloat16()
    visible = torch.arange(context)[None, None, None, :] <= (context - q + torch.arange(q))[None, None, :, None]
    bias = torch.zeros(batch, 1, q, context).masked_fill(~visible, float("-inf")).bfloat16()
    outs: dict[str, torch.Tensor] = {}

    def run(name: str, table: torch.Tensor, cascade: str):
        def call():
            os.environ["MAGICDEC_CASCADE"] = cascade
            outs[name] = [kernels.decode_attention(xq, k, v, bias, table, on_tiles=tiles) for k, v in pools][0]
        return call

    times = interleaved({"own": run("own", own, "1"), "per row": run("per row", shared, "0"),
                         "grouped": run("grouped", shared, "1")}, repeats)
    os.environ.pop("MAGICDEC_CASCADE", None)
    return {"distinct": distinct, "q": q, "tiles": tiles, **{f"{n} ms": 1e3 * t / layers for n, t in times.items()},
            "same bits": torch.equal(outs["per row"], outs["grouped"])}


def table(doc: dict) -> str:
    rows = []
    for label, run in doc["runs"].items():
        for c in run["cells"]:
            rows.append({**({"run": label} if len(doc["runs"]) > 1 else {}), "prompts": c["distinct"],
                         "q": c["q"], "products": "AMX tiles" if c["tiles"] else "vector",
                         "own blocks": round(c["own ms"], 2), "shared, per row": round(c["per row ms"], 2),
                         "shared, grouped": round(c["grouped ms"], 2),
                         "per row / grouped": f"{c['per row ms'] / c['grouped ms']:.2f}x",
                         "own / grouped": f"{c['own ms'] / c['grouped ms']:.2f}x", "same bits": c["same bits"]})
    return text(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--distinct", default="1,8", help="prompts the rows tile, comma-separated")
    p.add_argument("--q", default="1,3", help="new tokens a row (3: a verification of gamma 2), comma-separated")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--label", required=True)
    args = p.parse_args()
    if not kernels.supported(torch.device("cpu"), torch.bfloat16):
        sys.exit("bench_shared_prefix.py: no native bf16 attention kernel on this CPU")
    products = [False, True] if kernels.tiles() else [False]
    cells = [cell(args.batch, args.context, int(d), int(q), t, args.layers, args.repeats)
             for d in args.distinct.split(",") for q in args.q.split(",") for t in products]
    run = {"batch": args.batch, "context": args.context, "kernels": kernels.path_name(),
           "machine": machine_info(torch.device("cpu")), "cells": cells}
    print(table(save_run(RESULT, args.label, run)))


if __name__ == "__main__":
    main()
