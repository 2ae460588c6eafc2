"""Serving capacity at the same KV memory: the paged KV pool (this tree) against the slot layout it replaced.

Before commit caa5bc1 (`--old-commit`, 8e2acd4) `magicdec serve` reserved `--max-model-len` tokens of K/V per request
slot at start, so a KV memory of M bytes held floor(M / ((max_model_len + 18) x KV bytes per token)) requests (18: the
slack each slot keeps for a verify round), however short the prompts. Now K/V lives in a pool of 32-token blocks
(`--kv-cache-gb M`) that requests take as they grow, and `--max-running` only caps how many run at once. This script
starts both servers with the same M, one after the other, on 127.0.0.1 (the old one from a temporary
`git worktree` of the old commit, removed afterwards) and sends both the same requests: PG-19 prompts of lengths
log-uniform in [--prompt-min, --prompt-max] tokens, replies of exactly uniform [--reply-min, --reply-max] tokens
(`ignore_eos`). Per layout:

1. saturation: every request at once; concurrency = the requests running (/metrics `num_requests_running`, sampled
   every 0.5 s: max and median over the run), output throughput, and the new pool's preemptions;
2. one Poisson arrival rate (default --rate-fraction x the old layout's request throughput at saturation: a rate it
   only just sustains), on other prompts of the same lengths (no prefix hits from run 1): TTFT p50 / p90.

The old server's prefix cache is memory beyond M (`--old-prefix-cache-gb`, kept small); the new pool holds the
cached prefixes inside M.

    PYTHONPATH=. python benchmarks/bench_capacity.py                         # M = 1 GiB, 24 requests, --draft none
    PYTHONPATH=. python benchmarks/bench_capacity.py --num-prompts 4 --prompt-max 1024 --reply-max 64 \\
        --kv-mem-gb 0.1 --out /tmp/capacity.json                             # a smoke test

Writes JSON with machine info and load (benchmarks/results/capacity.json by default) and, beside it, a plot of the
requests running over time at saturation and the three measures side by side; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from bench_serving import (RemoteTokenizer, free_port, get, one_request, percentiles, save_figure,  # noqa: E402
                           serving, timed_run)

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.cpu import auto_dtype  # noqa: E402
from magicdec.loading import default_model_path, model_identity  # noqa: E402
from magicdec.loading.gguf_file import config_from_gguf, gguf_metadata, read_gguf  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"
OLD_SLACK = 18  # cache entries each slot of the old layout kept beyond max_model_len (runner.CACHE_SLACK there)
GIB = 2**30


# --- what M buys each layout ------------------------------------------------------------------------------------
def kv_bytes_per_token() -> tuple[int, str]:
    """K and V bytes of one token of the default model, in the KV dtype the server picks here (its compute dtype)."""
    cfg = config_from_gguf(gguf_metadata(read_gguf(default_model_path())))
    dtype = auto_dtype(torch.device("cpu")).dtype
    return cfg.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()), str(dtype).removeprefix("torch.")


@contextmanager
def old_checkout(commit: str) -> Iterator[Path]:
    """A detached worktree of `commit` for the block (a fixed path: later runs reuse its compiled kernels)."""
    path = Path(tempfile.gettempdir()) / f"magicdec-capacity-{commit}"
    git = ["git", "-C", str(ROOT)]
    if path.exists():
        subprocess.run([*git, "worktree", "remove", "--force", str(path)], capture_output=True)
    subprocess.run([*git, "worktree", "prune"], check=True)
    subprocess.run([*git, "worktree", "add", "--detach", str(path), commit], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)


def magicdec_command(root: Path | None) -> tuple[list[str], dict]:
    """`python -m magicdec` of the checkout `root` (None: this tree) and its environment."""
    if root is None:
        return [sys.executable, "-m", "magicdec"], {"PYTHONPATH": os.pathsep.join([str(ROOT),
                                                                                   os.environ.get("PYTHONPATH", "")])}
    # sys.path[0] is the working directory (this tree) under -m: the old checkout goes before it
    boot = f"import runpy, sys; sys.path.insert(0, {str(root)!r}); runpy.run_module('magicdec', " \
           "run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", boot], {"PYTHONPATH": str(root)}


def server_command(layout: str, draft: str, port: int, args, old_root: Path | None) -> tuple[list[str], dict]:
    """The `magicdec serve` command line of a layout and its environment."""
    common = ["serve", "--port", str(port), "--draft", draft, "--max-model-len", str(args.max_model_len),
              "--max-queued", str(2 * args.num_prompts + 8), "--log-level", "warning"]
    if layout == "old":
        cmd, env = magicdec_command(old_root)
        return [*cmd, *common, "--max-running", str(args.old_slots), "--prefix-cache-gb",
                str(args.old_prefix_cache_gb)], env
    cmd, env = magicdec_command(None)
    return [*cmd, *common, "--max-running", str(args.new_max_running), "--kv-cache-gb", str(args.kv_mem_gb)], env


def pool_tokens(rows: list[dict]) -> int | None:
    """The new pool's size in tokens, as its server's startup line gives it ("KV blocks for N tokens")."""
    for r in rows:
        m = re.search(r"KV blocks for (\d+) tokens", r.get("ready_line") or "")
        if r["layout"] == "new" and m:
            return int(m.group(1))
    return None


def log_lines(path: Path, pattern: str = "", tail: int = 60) -> list[str]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if pattern in line] if pattern else lines[-tail:]


# --- the requests -------------------------------------------------------------------------------------------------
def make_requests(base: str, args) -> dict[str, list[tuple[list[int], int]]]:
    """Two sets of --num-prompts (prompt ids, reply tokens): `saturated` and `poisson`, with the same lengths and
    different text (so the second run hits no prefix the first one cached)."""
    n = args.num_prompts
    full = cut_prompts(RemoteTokenizer(base), load_texts(args.corpus), 2 * n, args.prompt_max)
    rng = random.Random(args.seed)
    lo, hi = math.log(args.prompt_min), math.log(args.prompt_max)
    lengths = [min(args.prompt_max, round(math.exp(rng.uniform(lo, hi)))) for _ in range(n)]
    replies = [rng.randint(args.reply_min, args.reply_max) for _ in range(n)]
    return {"saturated": [(p[:k], r) for p, k, r in zip(full[:n], lengths, replies)],
            "poisson": [(p[:k], r) for p, k, r in zip(full[n:], lengths, replies)]}


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank), as bench_serving.percentiles takes it."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else None


async def run_point(base: str, model: str, requests: list[tuple[list[int], int]], rate: float, seed: int) -> dict:
    """Send `requests` (all at once where rate is inf, else Poisson arrivals) and summarize."""

    async def work(client, t0: float):
        rng = random.Random(seed)
        tasks = []
        for prompt, reply in requests:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, reply)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    snapshots: list = []
    results, duration, before, after, samples = await timed_run(base, work, snapshots)
    ok = [r for r in results if r.error is None]
    running = [s[1] for s in samples]
    busy = [s[1] for s in samples if s[1] + s[2] > 0]  # while any request was in the server

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    usage = [m.get("magicdec:kv_cache_usage_perc") for _, m in snapshots]
    output = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    return {
        "rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "input_tokens": sum(r.prompt_len for r in ok), "output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "running_max": max(running, default=0.0), "running_median": statistics.median(busy) if busy else 0.0,
        "waiting_max": max((s[2] for s in samples), default=0.0),
        "kv_usage_max": max((u for u in usage if u is not None), default=None),
        "preemptions": delta("magicdec:num_preemptions_total"),
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5) if ttft else None, "ttft_p90_ms": 1e3 * pct(ttft, 0.9) if ttft else None,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
        "batch_over_time": [[round(t, 2), run, wait] for t, run, wait in samples],
        "kv_usage_over_time": [[round(t, 2), m.get("magicdec:kv_cache_usage_perc")] for t, m in snapshots],
    }


def bench_layout(layout: str, draft: str, args, requests: dict | None, old_root: Path | None,
                 rate: float | None) -> tuple[dict, dict]:
    """One server of `layout`: the saturated run, then the Poisson run at `rate` (None: --rate-fraction x this run's
    request throughput). Returns the row and the requests (cut with the first server's tokenizer)."""
    port = free_port()
    cmd, env = server_command(layout, draft, port, args, old_root)
    log = Path(args.log_dir) / f"{layout}-{draft}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    row: dict = {"layout": layout, "draft": draft, "command": cmd[:1] + ["..."] + cmd[cmd.index("serve"):],
                 "log": str(log)}
    started = time.perf_counter()
    print(f"[{layout}, draft {draft}] starting the server (log {log})", file=sys.stderr, flush=True)
    try:
        with serving(cmd, f"http://127.0.0.1:{port}", env, log) as base:
            row["startup_s"] = time.perf_counter() - started
            row["ready_line"] = next(iter(log_lines(log, "ready on")), None)
            model = json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
            requests = requests or make_requests(base, args)
            warm_up = [(list(range(1000, 1016)), 2)]  # no prefix of a measured prompt
            asyncio.run(run_point(base, model, warm_up, math.inf, 0))
            for point in ("saturated", "poisson"):
                point_rate = math.inf if point == "saturated" else rate
                if point_rate is None:
                    point_rate = args.rate_fraction * row["saturated"]["request_throughput"]
                print(f"[{layout}, draft {draft}] {point} run, rate {point_rate:.4g} req/s", file=sys.stderr,
                      flush=True)
                row[point] = asyncio.run(run_point(base, model, requests[point], point_rate, args.seed))
                print(f"[{layout}, draft {draft}] {point}: {summary(row[point])}", file=sys.stderr, flush=True)
    except SystemExit as e:  # the server did not start, or exited
        row["server_error"] = str(e)
    failed = "server_error" in row or any(row.get(p, {}).get("failed") for p in ("saturated", "poisson"))
    if failed:
        row["log_tail"] = log_lines(log)
    row["log_warnings"] = [line for line in log_lines(log, tail=10**9)
                           if any(w in line for w in ("Traceback", "Error", "error", "warning", " 500"))][:40]
    return row, requests


def summary(p: dict) -> str:
    return (f"{p['completed']} done, {p['failed']} failed, {p['duration_s']:.0f} s, running max "
            f"{p['running_max']:.0f} median {p['running_median']:.1f}, {p['output_throughput']:.1f} out tok/s, "
            f"TTFT p50/p90 {p['ttft_p50_ms'] or 0:.0f}/{p['ttft_p90_ms'] or 0:.0f} ms, preemptions "
            f"{p['preemptions']:.0f}")


# --- the numbers ----------------------------------------------------------------------------------------------------
def ratios(rows: list[dict]) -> list[dict]:
    """new over old per draft: concurrency, output throughput (higher is better), TTFT p90 old / new (lower)."""
    out = []
    for draft in dict.fromkeys(r["draft"] for r in rows):
        by = {r["layout"]: r for r in rows if r["draft"] == draft}
        old, new = by.get("old"), by.get("new")
        if not (old and new and "poisson" in old and "poisson" in new):
            continue
        s_old, s_new, p_old, p_new = old["saturated"], new["saturated"], old["poisson"], new["poisson"]

        def div(a, b):
            return a / b if a is not None and b else None

        r = {"draft": draft,
             "concurrency_max_x": div(s_new["running_max"], s_old["running_max"]),
             "concurrency_median_x": div(s_new["running_median"], s_old["running_median"]),
             "output_throughput_x": div(s_new["output_throughput"], s_old["output_throughput"]),
             "ttft_p90_lower_x": div(p_old["ttft_p90_ms"], p_new["ttft_p90_ms"])}
        r["targets_met"] = {"concurrency >= 3x": (r["concurrency_max_x"] or 0) >= 3,
                            "output throughput >= 1.3x": (r["output_throughput_x"] or 0) >= 1.3,
                            "TTFT p90 >= 3x lower": (r["ttft_p90_lower_x"] or 0) >= 3}
        out.append(r)
    return out


def table(doc: dict) -> str:
    """One line per layout and draft: both runs' measures (bench_capacity's results), then new / old."""
    lines = []
    for r in doc["results"]:
        s, p = r.get("saturated"), r.get("poisson")
        if s is None:
            lines.append({"layout": r["layout"], "draft": r["draft"], "KV": r.get("server_error", "failed")})
            continue
        lines.append({
            "layout": {"old": "slots (8e2acd4)", "new": "paged pool"}.get(r["layout"], r["layout"]),
            "draft": r["draft"], "max running": r["max_running"],
            "running max/median": f"{s['running_max']:.0f} / {s['running_median']:.1f}",
            "done": f"{s['completed']}/{s['completed'] + s['failed']}",
            "out tok/s": f"{s['output_throughput']:.1f}", "req/s": f"{s['request_throughput']:.3f}",
            "preempted": f"{s['preemptions']:.0f}",
            "rate": f"{p['rate']:.3f}" if p else "-",
            "TTFT p50/p90 s": f"{p['ttft_p50_ms'] / 1e3:.1f} / {p['ttft_p90_ms'] / 1e3:.1f}" if p and p["completed"]
            else "-",
            "done @rate": f"{p['completed']}/{p['completed'] + p['failed']}" if p else "-",
            "preempted @rate": f"{p['preemptions']:.0f}" if p else "-"})
    text = format_table(lines, list(dict.fromkeys(k for line in lines for k in line)))
    for r in doc.get("ratios", []):
        def x(v):
            return f"{v:.2f}x" if v is not None else "-"

        text += (f"\n\nnew / old, draft {r['draft']}: concurrency {x(r['concurrency_max_x'])} (max), "
                 f"{x(r['concurrency_median_x'])} (median); output throughput {x(r['output_throughput_x'])}; "
                 f"TTFT p90 at the fixed rate old / new {x(r['ttft_p90_lower_x'])}")
    return text


def plot(doc: dict, path: Path) -> Path:
    """Requests running over time at saturation per layout, and bars: max concurrency, output throughput, TTFT p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["results"] if "saturated" in r]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), gridspec_kw={"width_ratios": [2.2, 1, 1, 1]})
    labels = [f"{'slots' if r['layout'] == 'old' else 'pool'}\n{r['draft']}" for r in rows]
    colors = ["tab:gray" if r["layout"] == "old" else "tab:blue" for r in rows]
    for r, label in zip(rows, labels):
        t = [b[0] for b in r["saturated"]["batch_over_time"]]
        axes[0].step(t, [b[1] for b in r["saturated"]["batch_over_time"]], where="post",
                     label=label.replace("\n", ", draft "), color="tab:gray" if r["layout"] == "old" else None)
    axes[0].set_xlabel("seconds since all requests were sent")
    axes[0].set_ylabel("requests running")
    axes[0].set_title(f"saturation: {doc['args']['num_prompts']} requests at once, {doc['kv_mem_gib']} GiB of KV")
    axes[0].legend()
    bars = [("max requests running", [r["saturated"]["running_max"] for r in rows]),
            ("output tok/s (saturated)", [r["saturated"]["output_throughput"] for r in rows]),
            ("TTFT p90 (s) at the fixed rate", [(r.get("poisson") or {}).get("ttft_p90_ms", float("nan")) / 1e3
                                                 for r in rows])]
    for ax, (title, values) in zip(axes[1:], bars):
        ax.bar(range(len(rows)), values, color=colors)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title(title)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom")
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


# --- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-mem-gb", type=float, default=1.0, help="KV memory M of both layouts, GiB (default 1.0)")
    p.add_argument("--drafts", default="none", help="comma-separated --draft values, each on both layouts")
    p.add_argument("--num-prompts", type=int, default=24, help="requests per run (default 24)")
    p.add_argument("--prompt-min", type=int, default=256, help="shortest prompt, tokens")
    p.add_argument("--prompt-max", type=int, default=7936, help="longest prompt, tokens (8192 less the longest reply)")
    p.add_argument("--reply-min", type=int, default=64, help="fewest new tokens (EOS ignored)")
    p.add_argument("--reply-max", type=int, default=256, help="most new tokens")
    p.add_argument("--max-model-len", type=int, default=8192, help="--max-model-len of both servers")
    p.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (default: --rate-fraction x the old "
                                              "layout's request throughput at saturation)")
    p.add_argument("--rate-fraction", type=float, default=0.9, help="see --rate (default 0.9)")
    p.add_argument("--old-commit", default="8e2acd4", help="the commit of the slot layout")
    p.add_argument("--old-prefix-cache-gb", type=float, default=0.05,
                   help="the old server's prefix cache, GiB (memory beyond M)")
    p.add_argument("--new-max-running", type=int, default=256, help="--max-running of the new server")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths, replies and arrival times")
    p.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "magicdec-capacity-logs"),
                   help="the servers' logs")
    p.add_argument("--out", default=str(RESULTS / "capacity.json"), help="results JSON (the plot beside it)")
    args = p.parse_args(argv)
    if not 1 <= args.prompt_min <= args.prompt_max or not 1 <= args.reply_min <= args.reply_max:
        p.error("need 1 <= --prompt-min <= --prompt-max and 1 <= --reply-min <= --reply-max")
    if args.prompt_max + args.reply_max > args.max_model_len:
        p.error("--prompt-max + --reply-max exceeds --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    per_token, kv_dtype = kv_bytes_per_token()
    mem = args.kv_mem_gb * GIB
    args.old_slots = int(mem // ((args.max_model_len + OLD_SLACK) * per_token))
    if args.old_slots < 1:
        raise SystemExit(f"--kv-mem-gb {args.kv_mem_gb} holds no slot of {args.max_model_len} tokens")
    load_before = os.getloadavg()
    started = time.time()
    rows: list[dict] = []
    requests = None
    with old_checkout(args.old_commit) as old_root:
        for draft in args.drafts.split(","):
            rate = args.rate
            for layout in ("old", "new"):
                row, requests = bench_layout(layout, draft, args, requests, old_root, rate)
                row["max_running"] = args.old_slots if layout == "old" else args.new_max_running
                rows.append(row)
                if layout == "old" and rate is None and "saturated" in row:
                    rate = args.rate_fraction * row["saturated"]["request_throughput"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": {**machine_info("cpu"), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "model": model_identity(None),
        "kv_mem_gib": args.kv_mem_gb, "kv_dtype": kv_dtype, "kv_bytes_per_token": per_token,
        "old_slots": args.old_slots, "old_slot_tokens": args.max_model_len + OLD_SLACK,
        "old_prefix_cache_gib_beyond_kv_mem": args.old_prefix_cache_gb,
        "new_pool_tokens": pool_tokens(rows),
        "wall_s": time.time() - started, "args": vars(args), "results": rows,
    }
    doc["ratios"] = ratios(rows)
    out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"results: {out}; plot: {plot(doc, out.with_suffix('.png'))}")
    return 0 if all("poisson" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
