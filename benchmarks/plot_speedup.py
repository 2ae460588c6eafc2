"""The README's picture: `--draft auto` over plain decoding against batch, one line per context, from a bench run.

    python benchmarks/plot_speedup.py      # results/gemma/auto_grid.json -> results/gemma/auto_grid_speedup.png

Each point is the measured throughput of `--draft auto` over that of plain decoding on the same prefill (the two
configurations of a cell run back to back), greedy and sampled side by side. Where the planner chose plain decoding
the point is drawn hollow: both runs did the same work, so its distance from 1 is the machine's run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def ratios(doc: dict) -> dict[tuple[str, int], list[tuple[int, float, bool]]]:
    """(mode, context) -> [(batch, auto / plain, whether auto drafted)] from a `magicdec bench` results file."""
    cells: dict[tuple, dict[str, dict]] = {}
    for p in doc["points"].values():
        if "throughput" in p:
            cells.setdefault((p["mode"], p["context"], p["batch"]), {})[p["draft"]] = p
    out: dict[tuple[str, int], list[tuple[int, float, bool]]] = {}
    for (mode, context, batch), by in sorted(cells.items()):
        if "none" in by and "auto" in by:
            auto = by["auto"]
            drafted = not str(auto.get("chosen", "")).startswith("ar")
            out.setdefault((mode, context), []).append((batch, auto["throughput"] / by["none"]["throughput"], drafted))
    return out


def plot(doc: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = ratios(doc)
    modes = sorted({m for m, _ in series}, key=lambda m: m != "greedy")
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (m, context), pts in sorted(series.items()):
            if m != mode:
                continue
            xs, ys = [b for b, _, _ in pts], [r for _, r, _ in pts]
            line, = ax.plot(xs, ys, "-", label=f"context {context // 1024}k" if context >= 1024 else str(context))
            for b, r, drafted in pts:
                ax.plot([b], [r], "o", color=line.get_color(), fillstyle="full" if drafted else "none")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({b for pts in series.values() for b, _, _ in pts}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch")
        ax.set_title("sampled (T 0.7, top-p 0.9)" if mode == "sampling" else mode)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("--draft auto / plain decoding")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS / "gemma" / "auto_grid.json")
    p.add_argument("--out", type=Path, default=RESULTS / "gemma" / "auto_grid_speedup.png")
    p.add_argument("--title", default="Gemma 3 270M, 2-core Intel Xeon (AMX-BF16): measured speedup of --draft auto")
    args = p.parse_args()
    plot(json.loads(args.results.read_text()), args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
