"""Multi-turn long-context chat serving benchmark: conversations over a PG-19 excerpt, history re-sent every turn.

Each of --users conversations opens with a long excerpt of a PG-19 book (--excerpt-min to --excerpt-max tokens, cut
from inside the books of --corpus) and a short question about it, then goes on for --turns turns: every turn sends
the whole history (the excerpt, each question and each reply as the server returned it) plus a new question through
/v1/chat/completions, streamed, greedy, for exactly a reply length drawn in [--reply-min, --reply-max] (EOS ignored).
Users arrive as a Poisson process (--arrival-rate users per second, `inf`: all at once) and think between turns
(exponential, mean --think-s). With --shared-document every user reads the same excerpt and asks different
questions. Every configuration serves the same conversations on the same schedule, each rate on a fresh server:

    auto            `magicdec serve --draft auto` (prefix caching on, the default)
    none            `magicdec serve --draft none`
    auto:nocache    `magicdec serve --draft auto --no-prefix-caching` (any --draft value, `:nocache` turns it off)
    llama-server    llama.cpp's server (--llama-server PATH) on the same GGUF, `cache_prompt: true`, as many slots
                    (`-np`) of the same context (`-c` slots x --max-model-len, `-no-kvu`), --threads threads

Reported per configuration, rate and turn number: TTFT and TPOT p50/p99, output throughput (the turn's output
tokens over the span from its first request to its last answer), cache hit rate (cached prompt tokens over prompt
tokens, from `usage.prompt_tokens_details.cached_tokens`), the TTFT of a cold prefill of the same turn (the
--cold-config configuration's, same rate and turn; without it, the configuration's own turn-1 TTFT per prefilled
prompt token times this turn's prompt tokens) and the ratio to it, mean acceptance length and the share of engine
time in prefill. Those two come from the magicdec server's counters (spec_decode_*, prefill_seconds and
decode_seconds), sampled every half second and shared out among the turns by the time their requests spent
prefilling (sent to first token) or decoding (first token to the end) in each interval: exact per run, estimates per
turn where turns overlap. llama-server's prefill share is its per-request `timings` (prompt_ms, predicted_ms: slot
time, so concurrent slots both count a shared batch). Writes JSON with machine info (benchmarks/results/chat.json by
default) and beside it a plot (TTFT p50 by turn, output throughput per configuration); prints tables.

    PYTHONPATH=. python benchmarks/bench_chat.py --llama-server /work/llamacpp/build-avx512/bin/llama-server
    PYTHONPATH=. python benchmarks/bench_chat.py --users 2 --turns 2 --excerpt-min 600 --excerpt-max 800 \\
        --reply-min 16 --reply-max 16 --max-running 2 --threads 1 --out /tmp/chat_smoke.json    # a smoke test

Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (RESULTS, ROOT, RemoteTokenizer, RequestResult, Snapshots, free_port,  # noqa: E402
                           get, percentiles, post, read_stream, save_figure, serving, started_server, timed_run)

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.loading import default_model_path, model_identity  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402

QUESTIONS = ["Who is the main character in this passage?", "Summarise the last paragraph.",
             "Where does this scene take place?", "What does the narrator feel here, and why?",
             "List the people who are named in the text.", "What happens just before the end of the passage?",
             "Quote one sentence that sets the mood, and explain it.", "What might happen next?"]
#: Chat template tokens around the history (a system prompt, role headers) and around each turn's two messages: a
#: margin for checking that the longest conversation fits the context.
TEMPLATE_TOKENS, TURN_TEMPLATE_TOKENS = 64, 16
#: magicdec counters shared out among turns, by the phase they count.
PHASE_COUNTERS = {"magicdec:prefill_seconds_total": "prefill", "magicdec:decode_seconds_total": "decode",
                  "magicdec:spec_decode_num_drafts_total": "decode",
                  "magicdec:spec_decode_num_accepted_tokens_total": "decode"}
LLAMA = "llama-server"


@dataclass
class TurnResult(RequestResult):
    """One turn's request; `prompt_len` and `cached_tokens` are the server's usage counts."""

    user: int = 0
    turn: int = 1
    start: float = 0.0  # seconds after the run's start when it was sent
    cached_tokens: int | None = None
    prefill_ms: float | None = None  # llama-server's timings
    decode_ms: float | None = None

    def phases(self) -> dict[str, tuple[float, float]]:
        """When (seconds after the run's start) the request was prefilling and decoding."""
        first = self.start + self.ttft
        return {"prefill": (self.start, first), "decode": (first, self.start + self.e2e)}


@dataclass
class Workload:
    """What every configuration serves: per user the excerpt, per user and turn the reply length and the think time
    after it; arrival times follow from the rate."""

    excerpts: list[str]
    excerpt_tokens: list[int]
    replies: list[list[int]]
    think: list[list[float]]

    def arrivals(self, rate: float, seed: int) -> list[float]:
        """Seconds after the start at which each user sends its first turn (Poisson at `rate` users per second)."""
        rng, t, out = random.Random(seed), 0.0, []
        for _ in self.excerpts:
            out.append(t)
            t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
        return out


@dataclass
class Config:
    name: str
    draft: str | None  # None: llama-server
    caching: bool = True


def parse_configs(text: str, llama_server: str | None) -> list[Config]:
    """`auto,none,auto:nocache` -> Configs, llama-server last when its binary is given."""
    configs = []
    for name in text.split(","):
        draft, _, flag = name.partition(":")
        if flag not in ("", "nocache"):
            raise SystemExit(f"--configs takes DRAFT or DRAFT:nocache, got {name!r}")
        configs.append(Config(name, draft, caching=not flag))
    return configs + ([Config(LLAMA, None)] if llama_server else [])


# --- servers -----------------------------------------------------------------------------------------------------
def llama_gguf(args) -> str:
    """The GGUF llama-server runs: --llama-model, else magicdec's --model when it is a GGUF, else the default."""
    if args.llama_model:
        return args.llama_model
    return args.model if args.model and args.model.endswith(".gguf") else str(default_model_path())


def llama_server(args) -> ContextManager[str]:
    """llama.cpp's server on a free port with magicdec's slots, context per slot and threads."""
    port = free_port()
    cmd = [args.llama_server, "-m", llama_gguf(args), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-np", str(args.max_running), "-c", str(args.max_running * args.max_model_len),
           "-no-kvu", "--metrics", *shlex.split(args.llama_args)]
    log = Path(tempfile.gettempdir()) / f"bench_chat_llama-server_{port}.log"
    print(f"{' '.join(cmd)}  (log: {log})", file=sys.stderr)
    return serving(cmd, f"http://127.0.0.1:{port}", log=log)


def config_server(config: Config, args) -> ContextManager[str]:
    """The server of a configuration, started on entry (its base URL) and stopped on exit."""
    if config.draft is None:
        return llama_server(args)
    return started_server(config.draft, args, [] if config.caching else ["--no-prefix-caching"], args.max_model_len,
                          max(args.users, 1), {"OMP_NUM_THREADS": str(args.threads)})


def detokenize(base: str, tokens: list[int]) -> str:
    """Text of token ids through the server (vLLM-style servers answer `prompt`, llama-server `content`)."""
    body = post(f"{base}/detokenize", {"tokens": tokens})
    return body["prompt"] if "prompt" in body else body["content"]


# --- the workload ------------------------------------------------------------------------------------------------
def make_workload(base: str, args) -> Workload:
    """The conversations: excerpts cut with the server's tokenizer, reply lengths and think times (seeded)."""
    tok = RemoteTokenizer(base)
    rng = random.Random(args.seed)
    n = 1 if args.shared_document else args.users
    cut = cut_prompts(tok, load_texts(args.corpus), n, args.excerpt_max)
    excerpts = [detokenize(base, ids[: rng.randint(args.excerpt_min, args.excerpt_max)]) for ids in cut]
    excerpts = excerpts * args.users if args.shared_document else excerpts
    replies = [[rng.randint(args.reply_min, args.reply_max) for _ in range(args.turns)] for _ in range(args.users)]
    think = [[rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(args.turns)]
             for _ in range(args.users)]
    work = Workload(excerpts, [len(tok.encode(e)) for e in excerpts], replies, think)
    check_fits(work, max(len(tok.encode(q)) for q in QUESTIONS), args)
    return work


def check_fits(work: Workload, question_tokens: int, args) -> None:
    """Refuse a workload whose longest conversation (history and last reply) may not fit --max-model-len."""
    longest = max(work.excerpt_tokens) + TEMPLATE_TOKENS + args.turns * (question_tokens + TURN_TEMPLATE_TOKENS
                                                                         + args.reply_max)
    if longest > args.max_model_len:
        room = args.max_model_len - max(work.excerpt_tokens) - TEMPLATE_TOKENS
        turns = room // (question_tokens + TURN_TEMPLATE_TOKENS + args.reply_max)
        raise SystemExit(f"a conversation may reach {longest} tokens, over --max-model-len {args.max_model_len}: "
                         f"at most {turns} turns fit with these excerpts and replies")


def question(user: int, turn: int) -> str:
    """Users ask different questions at each turn (so a shared document's users differ after it)."""
    return QUESTIONS[(user + turn) % len(QUESTIONS)]


# --- the client --------------------------------------------------------------------------------------------------
async def chat_turn(client, model: str, messages: list[dict], max_tokens: int, result: TurnResult,
                    extra: dict) -> str:
    """Stream one turn into `result`; the reply text ("" on failure, recorded in result.error)."""
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra})
        text, last = await read_stream(stream, result, start)
    except Exception as e:  # a failed turn is counted and ends its conversation, not the run
        result.error = f"{type(e).__name__}: {e}"
        return ""
    if last is not None:
        result.prompt_len = last.usage.prompt_tokens
        details = last.usage.prompt_tokens_details
        result.cached_tokens = details.cached_tokens if details is not None else None
        timings = (last.model_extra or {}).get("timings")
        if timings:  # llama-server
            result.cached_tokens = timings.get("cache_n") if result.cached_tokens is None else result.cached_tokens
            result.prefill_ms, result.decode_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
    return text


async def converse(client, model: str, user: int, work: Workload, arrival: float, t0: float, extra: dict,
                   results: list[TurnResult]) -> None:
    """One user's conversation: arrive, then ask, read the reply, think, ask again with the whole history."""
    await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - t0)))
    messages: list[dict] = []
    for turn, max_tokens in enumerate(work.replies[user]):
        ask = question(user, turn)
        messages.append({"role": "user", "content": f"{work.excerpts[user]}\n\n{ask}" if turn == 0 else ask})
        result = TurnResult(0, user=user, turn=turn + 1, start=time.perf_counter() - t0)
        reply = await chat_turn(client, model, messages, max_tokens, result, extra)
        results.append(result)
        if result.error is not None:
            return
        messages.append({"role": "assistant", "content": reply})
        if turn + 1 < len(work.replies[user]):
            await asyncio.sleep(work.think[user][turn])


async def run_point(base: str, config: Config, rate: float, work: Workload, args) -> dict:
    """Every conversation against one server at one arrival rate; the point's summary."""
    model = json.loads(get(f"{base}/v1/models"))["data"][0]["id"]
    post(f"{base}/v1/chat/completions", {"model": model, "max_tokens": 2,  # the first request, not measured
                                         "messages": [{"role": "user", "content": "Hello."}]})
    extra = {"cache_prompt": True} if config.draft is None else {}
    snapshots: Snapshots = []
    arrivals = work.arrivals(rate, args.seed)

    async def conversations(client, t0: float) -> list[TurnResult]:
        """Every user's conversation, concurrently; their turns as they finished."""
        results: list[TurnResult] = []
        await asyncio.gather(*(converse(client, model, user, work, arrivals[user], t0, extra, results)
                               for user in range(len(work.excerpts))))
        return results

    results, duration, before, after, samples = await timed_run(base, conversations, snapshots)
    snapshots = [(0.0, before), *snapshots, (duration, after)]
    return summarize_point(config.name, rate, results, duration, snapshots, samples)


# --- the numbers ------------------------------------------------------------------------------------------------
def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of two intervals."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def per_turn_counters(snapshots: Snapshots, results: list[TurnResult]) -> dict[int, dict]:
    """Each interval's counter increments shared out among the turns in proportion to the time their requests spent
    in the counter's phase in that interval: turn -> counter -> estimated total."""
    out: dict[int, dict[str, float]] = {r.turn: dict.fromkeys(PHASE_COUNTERS, 0.0) for r in results}
    ok = [r for r in results if r.error is None]
    for (ta, a), (tb, b) in zip(snapshots, snapshots[1:]):
        for phase in ("prefill", "decode"):
            weights: dict[int, float] = {}
            for r in ok:
                weights[r.turn] = weights.get(r.turn, 0.0) + overlap(r.phases()[phase], (ta, tb))
            total = sum(weights.values())
            for name in (n for n, p in PHASE_COUNTERS.items() if p == phase and total > 0):
                delta = b.get(name, 0.0) - a.get(name, 0.0)
                for turn, w in weights.items():
                    out[turn][name] += delta * w / total
    return out


def shares(counters: dict[str, float]) -> tuple[float | None, float | None]:
    """(mean acceptance length, prefill share of engine time) from magicdec counter totals (None: not measured)."""
    drafts = counters["magicdec:spec_decode_num_drafts_total"]
    accepted = counters["magicdec:spec_decode_num_accepted_tokens_total"]
    prefill, decode = counters["magicdec:prefill_seconds_total"], counters["magicdec:decode_seconds_total"]
    return (1 + accepted / drafts if drafts else None), (prefill / (prefill + decode) if prefill + decode else None)


def cache_and_time(rs: list[TurnResult], counters: dict[str, float]) -> dict:
    """Hit rate, mean acceptance length and prefill share of a set of requests (`counters`: their magicdec totals)."""
    prompt = sum(r.prompt_len for r in rs)
    known = [r for r in rs if r.cached_tokens is not None]
    acceptance, prefill_share = shares(counters)
    timed = [r for r in rs if r.prefill_ms is not None and r.decode_ms is not None]
    if timed:  # llama-server: its own per-request timings
        slot_s = sum(r.prefill_ms + r.decode_ms for r in timed)
        prefill_share = sum(r.prefill_ms for r in timed) / slot_s if slot_s else None
    return {"prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in known) if known else None,
            "hit_rate": sum(r.cached_tokens for r in known) / prompt if known and prompt else None,
            "mean_acceptance_length": acceptance, "prefill_share": prefill_share}


def turn_row(turn: int, results: list[TurnResult], counters: dict[str, float]) -> dict:
    """One turn number's numbers over every conversation."""
    rs = [r for r in results if r.turn == turn]
    ok = [r for r in rs if r.error is None]
    span = max((r.start + r.e2e for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    return {"turn": turn, "completed": len(ok), "failed": len(rs) - len(ok),
            "mean_prompt_tokens": sum(r.prompt_len for r in ok) / len(ok) if ok else None,
            "ttft_ms": percentiles([r.ttft for r in ok]),
            "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
            "output_throughput": sum(r.output_tokens for r in ok) / span if span > 0 else None,
            **cache_and_time(ok, counters)}


def summarize_point(config: str, rate: float, results: list[TurnResult], duration: float,
                    snapshots: Snapshots, samples: list[tuple[float, float, float]]) -> dict:
    """A point's numbers: over the whole run, per turn (`turns`) and per request (`requests`)."""
    ok = [r for r in results if r.error is None]
    before, after = snapshots[0][1], snapshots[-1][1]
    totals = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in PHASE_COUNTERS}
    by_turn = per_turn_counters(snapshots, results)
    return {"config": config, "rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": duration,
            "total_output_tokens": sum(r.output_tokens for r in ok),
            "output_throughput": sum(r.output_tokens for r in ok) / duration,
            "mean_running": sum(s[1] for s in samples) / len(samples) if samples else None,
            **cache_and_time(ok, totals), "turns": [turn_row(t, results, by_turn[t]) for t in sorted(by_turn)],
            "requests": [{"user": r.user, "turn": r.turn, "start_s": r.start, "prompt_tokens": r.prompt_len,
                          "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "ttft_s": r.ttft,
                          "e2e_s": r.e2e, "error": r.error} for r in results]}


def cold_ms_per_token(point: dict) -> float | None:
    """The median over a point's turn-1 requests that were mostly prefilled (under half their prompt cached) of TTFT
    per prefilled prompt token, in milliseconds."""
    per_token = sorted(1e3 * r["ttft_s"] / (r["prompt_tokens"] - (r["cached_tokens"] or 0)) for r in point["requests"]
                       if r["turn"] == 1 and r["error"] is None and 2 * (r["cached_tokens"] or 0) < r["prompt_tokens"])
    return per_token[len(per_token) // 2] if per_token else None


def add_cold_reference(points: list[dict], reference: str) -> None:
    """Each turn row's `cold_ttft_ms`: the TTFT p50 of the `reference` configuration (no prefix cache) at the same
    rate and turn; without one, the point's turn-1 TTFT per prefilled token (cold_ms_per_token) times the turn's mean
    prompt tokens. `ttft_over_cold`: the row's TTFT p50 over it (the target for follow-up turns: <= 0.1)."""
    refs = {(p["rate"], t["turn"]): t["ttft_ms"]["p50"] for p in points if p["config"] == reference
            for t in p["turns"]}
    for p in points:
        per_token = cold_ms_per_token(p)
        for t in p["turns"]:
            cold, source = refs.get((p["rate"], t["turn"])), reference
            if cold is None and per_token is not None and t["mean_prompt_tokens"]:
                cold, source = per_token * t["mean_prompt_tokens"], "turn-1 TTFT per prefilled token"
            ttft = t["ttft_ms"]["p50"]
            t.update(cold_ttft_ms=cold, cold_source=source if cold is not None else None,
                     ttft_over_cold=ttft / cold if cold and ttft is not None else None)


# --- the report ---------------------------------------------------------------------------------------------------
def pct(x: float | None) -> str:
    """A share as a percentage, "-" when not measured."""
    return f"{x:.0%}" if x is not None else "-"


def p50_p99(d: dict) -> str:
    """p50/p99 of a percentiles() dict, in whole units."""
    return f"{d['p50']:.0f}/{d['p99']:.0f}" if d["p50"] is not None else "-"


def table(points: list[dict]) -> str:
    """Per configuration, rate and turn."""
    rows = []
    for p in points:
        for t in p["turns"]:
            rows.append({"config": p["config"], "rate": p["rate"], "turn": t["turn"], "done": t["completed"],
                         "prompt": round(t["mean_prompt_tokens"] or 0), "hit": pct(t["hit_rate"]),
                         "ttft p50/p99 ms": p50_p99(t["ttft_ms"]),
                         "cold ms": round(t["cold_ttft_ms"]) if t.get("cold_ttft_ms") else "-",
                         "/cold": f"{t['ttft_over_cold']:.2f}" if t.get("ttft_over_cold") is not None else "-",
                         "tpot p50/p99 ms": p50_p99(t["tpot_ms"]), "out tok/s": t["output_throughput"],
                         "accept len": t["mean_acceptance_length"], "prefill": pct(t["prefill_share"])})
    return format_table(rows)


def summary_table(points: list[dict]) -> str:
    """Per configuration and rate, over the whole run."""
    return format_table([{"config": p["config"], "rate": p["rate"], "done": p["completed"], "failed": p["failed"],
                          "seconds": round(p["duration_s"]), "out tok/s": p["output_throughput"],
                          "hit": pct(p["hit_rate"]), "accept len": p["mean_acceptance_length"],
                          "prefill": pct(p["prefill_share"]), "mean batch": p["mean_running"]} for p in points])


def plot(points: list[dict], path: Path) -> Path:
    """TTFT p50 by turn, one line per configuration (and rate), and each one's output throughput."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    several = len({p["rate"] for p in points}) > 1
    labels = [f"{p['config']} @ {p['rate']}" if several else p["config"] for p in points]
    for p, label in zip(points, labels):
        turns = [t for t in p["turns"] if t["ttft_ms"]["p50"] is not None]
        axes[0].plot([t["turn"] for t in turns], [t["ttft_ms"]["p50"] for t in turns], "o-", label=label)
    axes[0].set(xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[1].bar(range(len(points)), [p["output_throughput"] for p in points])
    axes[1].set_xticks(range(len(points)), labels, rotation=20, ha="right")
    axes[1].set(ylabel="output throughput (tok/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    return save_figure(fig, path)


# --- main ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; `rates` holds --arrival-rate as floats."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="auto,none,auto:nocache",
                   help="comma-separated --draft values of magicdec servers; DRAFT:nocache adds --no-prefix-caching")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary: also run it (skipped when not given)")
    p.add_argument("--llama-model", help="GGUF for llama-server (default: magicdec's model, e.g. a BF16 copy)")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. '-ctk bf16 -ctv bf16 -fa off'")
    p.add_argument("--model", help="--model for the magicdec servers (default: the embedded SmolLM2)")
    p.add_argument("--server-args", default="", help="extra flags for `magicdec serve`, e.g. '--kv-cache-gb 2'")
    p.add_argument("--max-running", type=int, default=4, help="slots of every server (magicdec --max-running, -np)")
    p.add_argument("--max-model-len", type=int, default=8192, help="context per slot (SmolLM2's is 8192)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    p.add_argument("--users", type=int, default=5, help="conversations per rate")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--excerpt-min", type=int, default=4000, help="shortest opening excerpt, tokens")
    p.add_argument("--excerpt-max", type=int, default=6400, help="longest opening excerpt, tokens")
    p.add_argument("--reply-min", type=int, default=128, help="shortest reply, tokens (EOS ignored)")
    p.add_argument("--reply-max", type=int, default=256, help="longest reply, tokens")
    p.add_argument("--think-s", type=float, default=10.0, help="mean think time between turns, seconds (0: none)")
    p.add_argument("--arrival-rate", default="0.05",
                   help="users per second (Poisson), comma separated; inf = all at once")
    p.add_argument("--shared-document", action="store_true", help="every user reads the same excerpt")
    p.add_argument("--cold-config", default="auto:nocache", help="the configuration whose TTFT is the cold reference")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--seed", type=int, default=0, help="excerpts, reply lengths, think and arrival times")
    p.add_argument("--out", default=str(RESULTS / "chat.json"), help="results JSON (the plot beside it)")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.arrival_rate.split(",")]
    if not (1 <= args.excerpt_min <= args.excerpt_max and 1 <= args.reply_min <= args.reply_max):
        p.error("need 1 <= --excerpt-min <= --excerpt-max and 1 <= --reply-min <= --reply-max")
    if min(args.users, args.turns, args.max_running, args.threads) < 1 or min(args.rates) <= 0:
        p.error("--users, --turns, --max-running and --threads must be >= 1, rates > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Every configuration at every rate on a fresh server; then the JSON, the plot and the tables."""
    args = parse_args(argv)
    points: list[dict] = []
    work = None  # made once, with the first server's tokenizer: every configuration serves the same conversations
    for config in parse_configs(args.configs, args.llama_server):
        for rate in args.rates:
            with config_server(config, args) as base:
                work = work or make_workload(base, args)
                points.append(asyncio.run(run_point(base, config, rate, work, args)))
            print(summary_table(points[-1:]), file=sys.stderr)
    add_cold_reference(points, args.cold_config)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llama = {"binary": args.llama_server, "model": model_identity(llama_gguf(args))} if args.llama_server else None
    doc = {"machine": machine_info(device), "model": model_identity(args.model), "llama_server": llama,
           "args": vars(args), "workload": {"questions": QUESTIONS, "excerpt_tokens": work.excerpt_tokens,
                                            "excerpt_starts": [e[:80] for e in work.excerpts],
                                            "replies": work.replies, "think_s": work.think},
           "results": points}
    out.write_text(json.dumps(doc, indent=1))
    print(table(points))
    print(summary_table(points))
    print(f"results: {out}; plot: {plot(points, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
