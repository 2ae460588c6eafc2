"""Where a decode round's time goes on the CPU, per kind of forward, with a kernel switch on and off, side by side.

    PYTHONPATH=. python benchmarks/bench_phases.py --batch 32 --context 8000 --distinct 8                 # SmolLM2
    PYTHONPATH=. python benchmarks/bench_phases.py --model gemma3-270m --batch 32 --context 32000 --distinct 4
    PYTHONPATH=. python benchmarks/bench_phases.py --switch cascade --label "SmolLM2 32 x 8000, cascade"

`--distinct` prompts of `--context` tokens cut from the corpus are prefilled once into the prefix cache, and the batch
tiles them. Then, `--repeats` times, for each setting of `--switch` (`layer-ops`: MAGICDEC_FUSED on, then off, torch's
operators for the norms and RoPE, what ran before them; `sublayers`: MAGICDEC_FUSED=1, then `ops`, a layer's
operators in two calls around its attention or a call each; `cascade`: MAGICDEC_CASCADE on, then off, a pass over the
shared prompt's blocks per group of rows or per row) every configuration decodes the batch, sampled (T 0.7, top-p
0.9, a seed per row): plain decoding, self-speculation (`--draft`: StreamingLLM, or Vegas) at `--budget` and
`--gamma`, and `--draft auto`. Each run profiles its first `--rounds` decode rounds (`magicdec.phases`: each kind of
forward split into attention, linear layers, other operators, host time and sampling, against its floor); each
configuration keeps its median-throughput run. Writes the run into benchmarks/results/phases.json (a run per model
and shape, the others kept) with the machine info, and prints the file's table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import save_run  # noqa: E402

from magicdec.calibrate.acceptance import sampling_params  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.calibrate.quick import planning_profile  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.engine import LLM  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.phases import PhaseRecorder  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402
from magicdec.speculative import SpeculativeConfig  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "phases.json"
DATA = ROOT.parent / "shared" / "data" / "pg19_dev.jsonl"
#: Each switch's variable and settings, in the order they take turns.
SWITCHES = {"layer-ops": ("MAGICDEC_FUSED", {"native": "1", "torch": "0"}),
            "sublayers": ("MAGICDEC_FUSED", {"two calls": "1", "one by one": "ops"}),
            "cascade": ("MAGICDEC_CASCADE", {"grouped": "1", "per row": "0"})}


def configs(llm: LLM, draft: str, budget: int, gamma: int) -> dict[str, SpeculativeConfig | None]:
    return {"plain": None, f"{draft} K={budget} g={gamma}": SpeculativeConfig(draft, budget=budget, gamma=gamma),
            "auto": SpeculativeConfig("auto", hardware=planning_profile(llm.model, llm.kv_dtype), mode="sampling")}


def run_once(llm: LLM, rows: list[list[int]], params: list[SamplingParams], spec, rounds: int) -> dict:
    recorder = PhaseRecorder(rounds)
    llm.generate(prompt_token_ids=rows, params=params, speculative=spec, phases=recorder)
    stats = llm.last_stats
    auto = llm.last_auto
    chosen = auto.speculative if auto is not None else spec
    return {"throughput": stats.decode_tok_s, "acceptance": stats.acceptance_rate,
            "chosen": "plain" if chosen is None else f"{chosen.draft} K={chosen.budget} g={stats.gamma}",
            "phases": stats.phases}


def measure(llm: LLM, rows: list[list[int]], args) -> dict:
    """Every (setting, configuration)'s median-throughput run, the settings and configurations taking turns."""
    params = [sampling_params("sampling", args.max_tokens, seed=i) for i in range(len(rows))]
    runs: dict[str, list[dict]] = {}
    specs = configs(llm, args.draft, args.budget, args.gamma)
    variable, settings = SWITCHES[args.switch]
    for _ in range(args.repeats):
        for setting, value in settings.items():
            os.environ[variable] = value
            for name, spec in specs.items():
                runs.setdefault(f"{setting} | {name}", []).append(run_once(llm, rows, params, spec, args.rounds))
    os.environ.pop(variable, None)
    out = {}
    for key, rs in runs.items():
        median = statistics.median_low(r["throughput"] for r in rs)
        out[key] = next(r for r in rs if r["throughput"] == median) | {"throughputs": [r["throughput"] for r in rs]}
    return out


def table(doc: dict) -> str:
    """Per run and setting of its switch: each kind of forward of plain decoding and of the fixed draft, its parts in ms
    per forward against its floor; then the fixed draft's and auto's throughput against plain decoding's."""
    forwards, speeds = [], []
    for label, run in doc["runs"].items():
        for setting in SWITCHES[run.get("switch", "layer-ops")][1]:
            configs = {key.split(" | ")[1]: r for key, r in run["configs"].items() if key.startswith(setting + " |")}
            plain = configs["plain"]["throughput"]
            fixed = next(name for name in configs if name.startswith("self-"))
            for r in (configs["plain"], configs[fixed]):
                for kind, k in r["phases"]["kinds"].items():
                    forwards.append({"run": label, "setting": setting, "forward": kind, "ms": k["ms"],
                                     "attention": k["attention_ms"], "linear": k["linear_ms"], "other": k["other_ms"],
                                     "host": k["host_ms"], "sampling": k["sampling_ms"], "floor": k["floor_ms"],
                                     "x floor": k["ratio"]})
            speeds.append({"run": label, "setting": setting, "plain tok/s": plain, "draft": fixed,
                           "draft x plain": configs[fixed]["throughput"] / plain,
                           "auto x plain": configs["auto"]["throughput"] / plain,
                           "auto ran": configs["auto"]["chosen"]})
    if not forwards:
        return "no runs"
    return "\n\n".join(format_table(rows, list(dict.fromkeys(k for row in rows for k in row)))
                       for rows in (forwards, speeds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--corpus", default=str(DATA))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--distinct", type=int, default=8, help="distinct prompts the batch tiles")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--draft", choices=("self-streaming", "self-vegas"), default="self-streaming",
                   help="the fixed draft timed beside plain decoding and auto")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--gamma", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="decode rounds profiled per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--switch", choices=SWITCHES, default="layer-ops", help="what the two settings turn on and off")
    p.add_argument("--label", help="the run's label (default: model, batch x context)")
    args = p.parse_args()
    llm = LLM(args.model)
    prompts = cut_prompts(llm.tokenizer, load_texts(args.corpus), args.distinct, args.context)
    llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=1))  # into the prefix cache, once
    rows = [prompts[i % args.distinct] for i in range(args.batch)]
    name = model_identity(llm.loaded.source)["name"]
    label = args.label or f"{name}, B={args.batch} x {args.context}"
    run = {"model": model_identity(llm.loaded.source), "batch": args.batch, "context": args.context,
           "distinct_prompts": args.distinct, "max_tokens": args.max_tokens, "kernels": llm.kernels,
           "switch": args.switch, "machine": machine_info(llm.model.device), "configs": measure(llm, rows, args)}
    print(table(save_run(RESULT, label, run)))


if __name__ == "__main__":
    main()
