"""The serving benchmark's shape offline, round by round: where a policy's decode time goes.

`--num-prompts` PG-19 prompts of `--prompt-min`..`--prompt-max` tokens are admitted at once into one
`LLMEngine` with the server's prefill budget (512 tokens a step, interleaved with the decode rounds of the
running requests), as `bench_serving.py` at an infinite request rate does, without HTTP. The
configurations (`auto`: `--draft auto`; `none`: plain decoding) run one after the other in one process,
`--order` alternating them against the machine's drift. Every decode round is recorded (rows decoded,
live rows, draft length, seconds, tokens), and a table gives each configuration's decode seconds and
milliseconds per token by rows decoded, split into rounds beside a prefill chunk (the ramp, while
prompts are still being prefilled) and the tail after the last prefill.

    PYTHONPATH=. python benchmarks/serving_trace.py --order auto,none,auto,none

Writes benchmarks/results/serving_trace.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magicdec import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402


def trace(llm: LLM, prompts: list[list[int]], config: str, max_tokens: int, slots: int) -> dict:
    """One run of every prompt through the LLM's engine; its totals and one record per decode round."""
    spec = SpeculativeConfig("auto") if config == "auto" else None  # planned for the engine's slots and context
    engine = llm.engine(spec, max_num_seqs=slots, max_prefill_tokens=512)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduled, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    rounds, s, t0 = [], engine.reset_stats(), time.perf_counter()
    while engine.has_unfinished():
        decode_s, tokens = s.decode_s, s.decode_tokens
        live = len(engine.scheduler.running)
        engine.step()
        step = scheduled[-1]
        if s.decode_tokens > tokens:
            rounds.append(dict(rows=step.n_rows, live=live, gamma=step.gamma, prefill=bool(step.prefills),
                               seconds=s.decode_s - decode_s, tokens=s.decode_tokens - tokens))
    return dict(config=config, wall_s=time.perf_counter() - t0, prefill_s=s.prefill_s, decode_s=s.decode_s,
                decode_tokens=s.decode_tokens, rounds=rounds)


def table(runs: list[dict]) -> str:
    lines = ["| run | config | prefill s | decode s | tok/s | ramp: rounds, drafted, ms/token | tail: rounds, "
             "drafted, ms/token |", "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for i, r in enumerate(runs):
        part = collections.defaultdict(lambda: [0, 0, 0.0, 0])
        for x in r["rounds"]:
            p = part["ramp" if x["prefill"] else "tail"]
            p[0] += 1
            p[1] += x["gamma"] > 0
            p[2] += x["seconds"]
            p[3] += x["tokens"]
        cells = [f"{n}, {d}, {1e3 * sec / max(tok, 1):.1f}" for n, d, sec, tok in (part["ramp"], part["tail"])]
        lines.append(f"| {i + 1} | {r['config']} | {r['prefill_s']:.1f} | {r['decode_s']:.1f} | "
                     f"{r['decode_tokens'] / r['decode_s']:.1f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--order", default="auto,none,auto,none", help="configurations in run order (auto, none)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=6144)
    ap.add_argument("--prompt-max", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "pg19_dev.jsonl"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving_trace.json"))
    args = ap.parse_args()
    order = args.order.split(",")
    if not set(order) <= {"auto", "none"}:
        ap.error("--order takes auto and none")
    llm = LLM()
    full = cut_prompts(llm.tokenizer, load_texts(args.corpus), args.num_prompts, args.prompt_max)
    rng = random.Random(0)
    prompts = [p[: rng.randint(args.prompt_min, args.prompt_max)] for p in full]
    runs = []
    for config in order:
        runs.append(trace(llm, prompts, config, args.max_tokens, args.num_prompts))
        print(f"{config}: prefill {runs[-1]['prefill_s']:.1f} s, decode {runs[-1]['decode_s']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(dict(machine=machine_info(), model=model_identity(), settings=vars(args), runs=runs),
                                               indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
