"""Decode throughput of the paged KV layout against the per-slot layout it replaced, alternated in one run.

    PYTHONPATH=. python benchmarks/bench_layouts.py                      # SmolLM2, B=32 x 8k, none and auto
    PYTHONPATH=. python benchmarks/bench_layouts.py --model gemma3-270m --context 32k --distinct-prompts 2

Runs `magicdec bench` (one batch and context, `--drafters none,auto`, greedy and sampled) from a temporary worktree of
the commit before the paged cache (`--old-commit`, 8e2acd4: every slot a contiguous row of the whole context) and from
this tree (K/V in 32-token blocks read through block tables), alternately, `--rounds` times each, and compares their
decode throughput: the median over rounds of each layout, and new / old. The rows of a batch tile `--distinct-prompts`
prefilled prompts, as `magicdec bench` does; the old layout copies them into each slot, the new one maps the same
blocks into every row that shares them. Writes the run, with its load, into benchmarks/results/layouts.json (one run
per model and shape, the others kept) with the machine info; prints the file's table. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from bench_capacity import magicdec_command, old_checkout  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402
from tables import save_run  # noqa: E402

LAYOUTS = ("old", "new")


def bench_once(layout: str, root: Path | None, args, out: Path) -> dict[str, float]:
    """One `magicdec bench` run of a layout: decode tokens per second by "drafter mode"."""
    cmd, env = magicdec_command(root)
    out.unlink(missing_ok=True)
    cmd += ["bench", "--corpus", args.corpus, "--batch", str(args.batch), "--context", args.context,
            "--drafters", args.drafters, "--modes", args.modes, "--max-tokens", str(args.max_tokens),
            "--distinct-prompts", str(args.distinct_prompts), "--out", str(out)]
    if args.model:
        cmd += ["--model", args.model]
    subprocess.run(cmd, check=True, env={**os.environ, **env}, cwd=root or HERE.parent, stdout=subprocess.DEVNULL)
    points = json.loads(out.read_text())["points"].values()
    return {f"{p['draft']} {p['mode']}": p["throughput"] for p in points if "throughput" in p}


def table(doc: dict) -> str:
    """Every run of the results file: a row per drafter and mode."""
    rows = []
    for label, run in doc["runs"].items():
        for key, tok_s in run["results"].items():
            old, new = (statistics.median(tok_s[layout]) for layout in LAYOUTS)
            rows.append({"run": label, "decode": key, "old tok/s": f"{old:.1f}", "new tok/s": f"{new:.1f}",
                         "new / old": f"{new / old:.3f}", "rounds": len(tok_s["new"])})
    return format_table(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", default="8k")
    p.add_argument("--drafters", default="none,auto")
    p.add_argument("--modes", default="greedy,sampling")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--distinct-prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="runs of each layout, alternated")
    p.add_argument("--old-commit", default="8e2acd4", help="the per-slot layout's commit")
    p.add_argument("--corpus", default=str(HERE.parents[1] / "shared/data/pg19_dev.jsonl"))
    p.add_argument("--out", default=str(HERE / "results/layouts.json"),
                   help="results JSON (this model and shape's run replaces its last, other runs stay)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="magicdec-layouts-"))
    load = [os.getloadavg()]
    with old_checkout(args.old_commit) as old_root:
        for round_ in range(args.rounds):
            for layout in LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]:
                got = bench_once(layout, old_root if layout == "old" else None, args, scratch / f"{layout}.json")
                for key, tok_s in got.items():
                    results.setdefault(key, {name: [] for name in LAYOUTS})[layout].append(tok_s)
                print(f"round {round_} {layout}: {got}", flush=True)
    load.append(os.getloadavg())
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "corpus")}
    label = f"{args.model or 'smollm2-135m'} B={args.batch} x {args.context} ({args.distinct_prompts} prompts)"
    doc = save_run(Path(args.out), label, {"settings": settings, "load_avg": load, "results": results},
                   machine_info(torch.device("cpu")))
    print(table(doc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
