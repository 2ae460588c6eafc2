"""Plain decoding's throughput with a kernel switch's settings taking turns in one process, by batch size.

    PYTHONPATH=. python benchmarks/bench_switch.py --switch MAGICDEC_FUSED=1,ops --label "SmolLM2, Zen 4"
    PYTHONPATH=. python benchmarks/bench_switch.py --model gemma3-270m --switch MAGICDEC_FUSED=1,ops \
        --label "Gemma 3, Zen 4"

For each of `--batches`, that many prompts of `--context` tokens cut from the corpus are prefilled once into the
prefix cache; then, `--repeats` times, each setting of the environment variable (`--switch VAR=A,B,...`, read by the
kernels at each call) decodes `--max-tokens` greedy tokens a row, the settings' order reversed every other repeat so
that neither always runs first. A run's decode throughput is `generate`'s (prefill of the cached prompts' last
tokens excluded); the median per setting is kept with every repeat's. Where bench_phases.py profiles a few rounds to
split a forward's time, this times whole unprofiled decodes: the profiler's cost per operator is what the layer's
two sublayer calls (MAGICDEC_FUSED=1 against `ops`) save most of. Writes the run into
benchmarks/results/switch.json (the other runs kept) with the machine info, and prints the file's table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from tables import save_run, text  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.engine import LLM  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "switch.json"


def parse_switch(spec: str) -> tuple[str, list[str]]:
    """"VAR=A,B" -> ("VAR", ["A", "B"])."""
    variable, _, values = spec.partition("=")
    settings = values.split(",")
    if not variable or len(settings) < 2 or "" in settings:
        raise SystemExit(f"--switch: VAR=A,B (two settings or more), got {spec!r}")
    return variable, settings


def measure(llm: LLM, prompts: list[list[int]], variable: str, settings: list[str], max_tokens: int,
            repeats: int) -> dict[str, list[float]]:
    """Each setting's decode throughput (tok/s) in every repeat, the settings taking turns."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs: dict[str, list[float]] = {s: [] for s in settings}
    before = os.environ.get(variable)
    for repeat in range(repeats):
        for setting in settings if repeat % 2 == 0 else settings[::-1]:
            os.environ[variable] = setting
            llm.generate(prompt_token_ids=prompts, params=params)
            runs[setting].append(llm.last_stats.decode_tok_s)
    if before is None:
        os.environ.pop(variable)
    else:
        os.environ[variable] = before
    return runs


def table(doc: dict) -> str:
    """Per run and batch: each setting's median tok/s, and the first setting's against the second (the switch's
    variable and the context are in the file)."""
    rows = []
    for label, run in doc["runs"].items():
        first, second = run["settings"][:2]
        for r in run["results"]:
            med = {s: statistics.median(v) for s, v in r["tok_s"].items()}
            rows.append({"run": label, "B": r["batch"], **{f"{s} tok/s": round(med[s], 1) for s in run["settings"]},
                         f"{first} / {second}": round(med[first] / med[second], 3)})
    return text(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--label", required=True, help="the run's name in the result file")
    ap.add_argument("--switch", default="MAGICDEC_FUSED=1,ops", help="VAR=A,B: the settings that take turns")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"))
    args = ap.parse_args()
    variable, settings = parse_switch(args.switch)
    llm = LLM(args.model)
    texts = load_texts(args.corpus)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = cut_prompts(llm.tokenizer, texts, batch, args.context)
        llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=1))  # into the prefix cache
        runs = measure(llm, prompts, variable, settings, args.max_tokens, args.repeats)
        results.append({"batch": batch, "tok_s": runs})
        print(f"B={batch}: " + ", ".join(f"{s} {statistics.median(v):.1f} tok/s" for s, v in runs.items()), flush=True)
    run = {"model": model_identity(llm.loaded.source), "variable": variable, "settings": settings,
           "context": args.context, "max_tokens": args.max_tokens, "repeats": args.repeats, "kernels": llm.kernels,
           "machine": machine_info(llm.model.device), "results": results}
    print(table(save_run(RESULT, args.label, run)))


if __name__ == "__main__":
    main()
