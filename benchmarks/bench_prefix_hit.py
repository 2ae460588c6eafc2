"""What a prefix-cache hit costs against the cold prefill it replaces, on the default model.

    PYTHONPATH=. python benchmarks/bench_prefix_hit.py [--contexts 2048,4096,8160] [--repeats 3] [--threads N]

For each context length, one PG-19 prompt of that many tokens is sent through `LLM.generate` for one token:
cold (prefix cache cleared first) and then as a hit (its blocks cached by the cold run), in turns, `--repeats`
times; the hit maps all but the last 32-63 tokens' blocks into the request's block table (whole blocks, short of the
observation window; no K/V is copied) and prefills the rest.
Reported: the median seconds of each and the hit's share of the cold prefill (the target: at most 2% at 8k).
Writes benchmarks/results/prefix_hit.json with the machine info, dtype and kernel path; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.engine import LLM  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def timed_generate(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], params=ONE_TOKEN)
    return time.perf_counter() - t0


def measure(llm: LLM, prompt: list[int], repeats: int) -> dict:
    """Median cold and hit seconds of one prompt, timed in turns."""
    cold, hit = [], []
    for _ in range(repeats):
        llm.clear_prefix_cache()
        cold.append(timed_generate(llm, prompt))
        hit.append(timed_generate(llm, prompt))
    cached = llm.last_stats.cached_tokens
    out = {"tokens": len(prompt), "cached_tokens": cached, "cold_s": statistics.median(cold),
           "hit_s": statistics.median(hit)}
    out["hit_share"] = out["hit_s"] / out["cold_s"]
    return out


def table(rows: list[dict]) -> str:
    return format_table([{"tokens": r["tokens"], "cached": r["cached_tokens"], "cold prefill s": f"{r['cold_s']:.2f}",
                          "hit s": f"{r['hit_s']:.3f}", "hit / cold": f"{r['hit_share']:.2%}"}
                         for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,4096,8160", help="prompt lengths, tokens, comma separated")
    p.add_argument("--repeats", type=int, default=3, help="cold and hit runs per length, in turns")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_hit.json"), help="results JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=1)
    texts = load_texts(args.corpus)
    rows = [measure(llm, cut_prompts(llm.tokenizer, texts, 1, int(n))[0], args.repeats)
            for n in args.contexts.split(",")]
    doc = {"machine": machine_info(llm.model.device), "threads": torch.get_num_threads(),
           "dtype": str(llm.model.dtype), "kv_dtype": str(llm.kv_dtype), "attention": llm.attention,
           "kernels": llm.kernels, "repeats": args.repeats, "results": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
