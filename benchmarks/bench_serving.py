"""Online serving benchmark of `magicdec serve`, in the style of vLLM's benchmarks/benchmark_serving.py.

For each server configuration (by default `--draft auto` and `--draft none`, side by side in one run) and
each request rate (Poisson arrivals; `inf` sends everything at once), `--num-prompts` requests stream
completions of PG-19 prompts (token ids cut from inside books, lengths uniform in
[--prompt-min, --prompt-max]) for exactly --max-tokens new tokens each (`ignore_eos`). Measured per
point: request and output throughput; TTFT, TPOT, inter-token latency (between streamed chunks; a
speculative step can deliver several tokens in one chunk) and end-to-end latency, mean / p50 / p99;
goodput (requests per second meeting every SLO given with --goodput); mean acceptance length (tokens per
verify round, from the server's spec_decode counters); and the batch size over time (running and
waiting requests, sampled from /metrics).

    PYTHONPATH=. python benchmarks/bench_serving.py                                  # the full sweep
    PYTHONPATH=. python benchmarks/bench_serving.py --num-prompts 6 --prompt-min 512 --prompt-max 512 \\
        --max-tokens 16 --request-rates inf --max-running 4 --out /tmp/smoke.json    # a smoke test
    PYTHONPATH=. python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --configs external
    PYTHONPATH=. python benchmarks/bench_serving.py --external llama-server=http://127.0.0.1:8080  # and a peer

Each configuration's server is started here (`python -m magicdec serve` on 127.0.0.1, extra flags via
--server-args) unless --base-url points at a running one. Writes JSON with machine info
(benchmarks/results/serving.json by default) and, beside it, plots of output throughput and TPOT
against request rate; prints a table. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterator, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SAMPLE_EVERY_S = 0.5  # batch-size sampling period
STARTUP_S = 900  # a large model on a slow disk


@dataclass
class RequestResult:
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    e2e: float = 0.0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# --- the server ---------------------------------------------------------------------------------------------
def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


#: Running and waiting requests as /metrics names them: magicdec (vLLM's names), llama-server (--metrics).
RUNNING = ("magicdec:num_requests_running", "llamacpp:requests_processing")
WAITING = ("magicdec:num_requests_waiting", "llamacpp:requests_deferred")


def scrape(base: str) -> dict[str, float]:
    """Sum of each /metrics sample by name (labels folded); empty where the server has no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = get(f"{base}/metrics")
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(cmd: list[str], base: str, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[str]:
    """Run the server command `cmd` until the block ends, once `base`/health answers (within STARTUP_S); `env` is
    added to this process's environment, the server's output goes to `log` when given."""
    with open(log, "w") if log is not None else nullcontext() as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT if out is not None else None)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server ({' '.join(cmd)}) exited with status {proc.returncode}")
            try:
                get(f"{base}/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the server did not become healthy in {STARTUP_S} s") from None
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@contextmanager
def started_server(draft: str, args, extra: Sequence[str] = (), max_model_len: int | None = None,
                   max_queued: int | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """`magicdec serve --draft <draft>` on a free 127.0.0.1 port, until the block ends: args.max_running slots,
    args.model, args.server_args and `extra` flags; the context and queue fit this benchmark's requests unless
    `max_model_len` / `max_queued` say otherwise; `env` adds to the environment (e.g. OMP_NUM_THREADS)."""
    port = free_port()
    max_model_len = max_model_len or args.prompt_max + args.max_tokens
    cmd = [sys.executable, "-m", "magicdec", "serve", "--port", str(port), "--draft", draft,
           "--max-running", str(args.max_running), "--max-model-len", str(max_model_len),
           "--max-queued", str(max_queued or args.num_prompts), "--log-level", "warning",
           *shlex.split(args.server_args), *extra]
    if args.model:
        cmd += ["--model", args.model]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    with serving(cmd, f"http://127.0.0.1:{port}", {"PYTHONPATH": path, **(env or {})}) as base:
        yield base


class RemoteTokenizer:
    """The server's own tokenizer through /tokenize: cuts prompts for any model without loading it here.
    vLLM-style servers (magicdec's) take {"prompt": text}, llama.cpp's llama-server {"content": text}."""

    def __init__(self, base: str):
        self.base = base
        self.field = "prompt"

    def encode(self, text: str) -> list[int]:
        try:
            tokens = post(f"{self.base}/tokenize", {self.field: text})["tokens"]
        except (OSError, KeyError):
            tokens = []
        if tokens or not text or self.field == "content":
            return tokens
        self.field = "content"  # llama-server answers {"prompt": ...} with no tokens
        return self.encode(text)


def make_prompts(base: str, args) -> list[list[int]]:
    """--num-prompts token-id prompts from the corpus, of lengths uniform in [prompt_min, prompt_max]."""
    full = cut_prompts(RemoteTokenizer(base), load_texts(args.corpus), args.num_prompts, args.prompt_max)
    rng = random.Random(args.seed)
    return [p[: rng.randint(args.prompt_min, args.prompt_max)] for p in full]


# --- the client -----------------------------------------------------------------------------------------------
def chunk_text(chunk) -> str | None:
    """The text a streamed completion or chat completion chunk carries (None: none)."""
    if not chunk.choices:
        return None
    choice = chunk.choices[0]
    delta = getattr(choice, "delta", None)
    return delta.content if delta is not None else choice.text


async def read_stream(stream, result: RequestResult, start: float):
    """Fill `result` (TTFT at the first text, ITL, output tokens, e2e) from a stream sent at perf_counter `start`;
    returns the streamed text and the chunk that carried the usage (None when the server sent none)."""
    last, pieces, usage = start, [], None
    async for chunk in stream:
        now = time.perf_counter()
        text = chunk_text(chunk)
        if text:
            pieces.append(text)
            if result.ttft == 0.0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        if chunk.usage is not None:
            usage = chunk
            result.output_tokens = chunk.usage.completion_tokens
    result.output_tokens = result.output_tokens or len(pieces)  # a server without usage streams a token a chunk
    result.e2e = time.perf_counter() - start
    return "".join(pieces), usage


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(len(prompt))
    start = time.perf_counter()
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        await read_stream(stream, result, start)
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


Snapshots = list[tuple[float, dict[str, float]]]  # (seconds since the start, /metrics totals)


async def sample_batch(base: str, t0: float, samples: list[tuple[float, float, float]], done: asyncio.Event,
                       snapshots: Snapshots | None = None) -> None:
    """(seconds since t0, running, waiting) every SAMPLE_EVERY_S until `done`; with the whole scrape in
    `snapshots` when given."""
    while not done.is_set():
        m = await asyncio.to_thread(scrape, base)
        t = time.perf_counter() - t0
        samples.append((t, sum(m.get(n, 0.0) for n in RUNNING), sum(m.get(n, 0.0) for n in WAITING)))
        if snapshots is not None:
            snapshots.append((t, m))
        try:
            await asyncio.wait_for(done.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


async def timed_run(base: str, work: Callable[..., Awaitable[list]],
                    snapshots: Snapshots | None = None) -> tuple[list, float, dict, dict, list]:
    """Run `await work(client, t0)` (an AsyncOpenAI client on `base`, the perf_counter start) while /metrics is
    sampled (sample_batch): (its results, seconds, /metrics before, /metrics after, the batch samples)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=3600)
    before = scrape(base)
    samples: list[tuple[float, float, float]] = []
    done = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_batch(base, t0, samples, done, snapshots))
    try:
        results = await work(client, t0)
    finally:
        duration = time.perf_counter() - t0
        done.set()
        await sampler
        await client.close()
    return results, duration, before, scrape(base), samples


async def run_rate(base: str, model: str, prompts: list[list[int]], rate: float, args) -> dict:
    async def work(client, t0: float) -> list[RequestResult]:
        rng = random.Random(args.seed)
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, args.max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    results, duration, before, after, samples = await timed_run(base, work)
    return summarize(results, duration, before, after, samples, args.goodput)


# --- the numbers -----------------------------------------------------------------------------------------------
def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float | None]:
    """mean, p50, p99 (milliseconds by default)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = sorted(values)

    def pct(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] * scale

    return {"mean": sum(v) / len(v) * scale, "p50": pct(0.50), "p99": pct(0.99)}


def parse_slo(items: list[str]) -> dict[str, float]:
    """["ttft:2000", "tpot:100"] -> {"ttft": 2.0, "tpot": 0.1} (milliseconds in, seconds out)."""
    slo = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slo[name] = float(ms) / 1e3
    return slo


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict,
              samples: list[tuple[float, float, float]], slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.error is None]
    output = sum(r.output_tokens for r in ok)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("magicdec:spec_decode_num_drafts_total")
    accepted = delta("magicdec:spec_decode_num_accepted_tokens_total")
    good = [r for r in ok if r.ttft <= slo.get("ttft", math.inf) and (r.tpot or 0.0) <= slo.get("tpot", math.inf)
            and r.e2e <= slo.get("e2el", math.inf)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "goodput": len(good) / duration if slo else None,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "spec_drafts": drafts,
        "mean_running": sum(s[1] for s in samples) / len(samples) if samples else None,
        "batch_over_time": [[round(t, 2), run, wait] for t, run, wait in samples],
    }


TABLE = [("config", "config"), ("rate", "rate"), ("done", "completed"), ("out tok/s", "output_throughput"),
         ("goodput", "goodput"), ("accept len", "mean_acceptance_length"), ("mean batch", "mean_running")]
LATENCIES = [("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2e", "e2el_ms")]


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        line = {label: row[key] for label, key in TABLE}
        for label, key in LATENCIES:
            line[f"{label} p50/p99 ms"] = (f"{row[key]['p50']:.0f}/{row[key]['p99']:.0f}"
                                           if row[key]["p50"] is not None else "-")
        lines.append(line)
    return format_table(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Output throughput and TPOT p50 against request rate, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate"] for r in rows}, key=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = {r["rate"]: r for r in rows if r["config"] == config}
        xs = [i for i, rate in enumerate(rates) if rate in mine]
        axes[0].plot(xs, [mine[rates[i]]["output_throughput"] for i in xs], "o-", label=config)
        axes[1].plot(xs, [mine[rates[i]]["tpot_ms"]["p50"] or float("nan") for i in xs], "o-", label=config)
    for ax, ylabel in zip(axes, ("output throughput (tok/s)", "TPOT p50 (ms)")):
        ax.set_xticks(range(len(rates)), [str(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out a pyplot figure, write it to `path` (120 dpi) and close it; the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="auto,none",
                   help="comma-separated --draft values to start servers with (or `external` with --base-url)")
    p.add_argument("--base-url", help="benchmark a running server instead of starting one per config")
    p.add_argument("--external", action="append", default=[], metavar="NAME=URL",
                   help="also benchmark a running OpenAI-compatible server (e.g. llama.cpp's llama-server) "
                        "after the configs, with the same requests; repeatable")
    p.add_argument("--model", help="--model for the servers started here (default: the embedded SmolLM2)")
    p.add_argument("--server-args", default="", help="extra flags for `magicdec serve`, e.g. '--budget 512'")
    p.add_argument("--max-running", type=int, default=16, help="--max-running of the servers started here")
    p.add_argument("--request-rates", default="1,2,4,inf", help="requests per second, comma separated; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--prompt-min", type=int, default=2048, help="shortest prompt, tokens")
    p.add_argument("--prompt-max", type=int, default=8064,
                   help="longest prompt, tokens (default 8k less the output: SmolLM2's context is 8192)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="SLO",
                   help="SLOs for goodput in milliseconds: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths and arrival times")
    p.add_argument("--out", default=str(RESULTS / "serving.json"), help="results JSON (plots beside it)")
    args = p.parse_args(argv)
    args.goodput = parse_slo(args.goodput)
    args.rates = [float(r) for r in args.request_rates.split(",")]
    if not 1 <= args.prompt_min <= args.prompt_max:
        p.error("need 1 <= --prompt-min <= --prompt-max")
    return args


def bench_config(base: str, config: str, args, prompts: list[list[int]] | None) -> tuple[list[dict], list]:
    model = json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
    prompts = prompts or make_prompts(base, args)
    rows = []
    for rate in args.rates:
        row = {"config": config, "rate": rate, **asyncio.run(run_rate(base, model, prompts, rate, args))}
        print(table([row]), file=sys.stderr)
        rows.append(row)
    return rows, prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict] = []
    prompts = None  # cut once, with the first server's tokenizer, so every config serves the same requests
    for config in args.configs.split(","):
        if args.base_url:
            new, prompts = bench_config(args.base_url.rstrip("/"), config, args, prompts)
        else:
            with started_server(config, args) as base:
                new, prompts = bench_config(base, config, args, prompts)
        rows += new
    for item in args.external:
        name, _, url = item.partition("=")
        if not url:
            raise SystemExit(f"--external takes NAME=URL, got {item!r}")
        new, prompts = bench_config(url.rstrip("/"), name, args, prompts)
        rows += new
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the model the servers started here ran (an external or --base-url server names its own in `results`)
    model = None if args.base_url else model_identity(args.model)
    doc = {"machine": machine_info(device), "model": model, "args": vars(args), "results": rows}
    out.write_text(json.dumps(doc, indent=1))
    print(table(rows))
    print(f"results: {out}; plot: {plot(rows, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
