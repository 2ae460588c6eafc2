"""What a prefix-cache hit costs against the cold prefill it replaces.

    PYTHONPATH=. python benchmarks/bench_prefix_hit.py [--contexts 2048,4096,8160] [--repeats 3] [--threads N]
    PYTHONPATH=. python benchmarks/bench_prefix_hit.py --model gemma3-270m --contexts 30000 --readers 16 --repeats 1

For each context length, one PG-19 document of that many tokens is sent through `LLM.generate` for one token, cold
(prefix cache cleared first); then `--readers` requests for one token each, all at once, the document followed by a
question of their own (48 tokens of another text; with one reader, the document alone). Each reader's hit maps the
document's cached blocks into its block table (whole blocks, short of the observation window; no K/V is copied) and
prefills the rest. Cold and hit runs alternate `--repeats` times.
Reported: the median cold prefill, the readers' median and largest time to first token, and the hit's share of the
cold prefill (targets: at most 2% at 8k for one reader; at most 1/20 for 16 readers of a 30k document).
Writes the run, with the dtype and kernel path, into benchmarks/results/prefix_hit.json (one run per model and
reader count, the others kept) with the machine info; prints the file's table.
"""

from __future__ import annotations

import argparse
import os
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
from magicdec.loading import model_identity  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402
from tables import save_run  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def timed_generate(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], params=ONE_TOKEN)
    return time.perf_counter() - t0


def reader_ttfts(llm: LLM, prompts: list[list[int]]) -> tuple[list[float], int]:
    """Each prompt's time to first token, all sent at once; and the prompt tokens they found cached."""
    engine = llm.engine(max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + 1)
    stats = engine.reset_stats()
    requests = engine.generate(prompts, ONE_TOKEN)
    return [r.first_token_time - r.arrival_time for r in requests], stats.cached_tokens


def measure(llm: LLM, doc: list[int], questions: list[list[int]], repeats: int) -> dict:
    """Median cold seconds of the document and its readers' times to first token, timed in turns."""
    cold, hits = [], []
    for _ in range(repeats):
        llm.clear_prefix_cache()
        cold.append(timed_generate(llm, doc))
        ttfts, cached = reader_ttfts(llm, [doc + q for q in questions])
        hits += ttfts
    out = {"tokens": len(doc), "readers": len(questions), "cached_tokens": cached // len(questions),
           "cold_s": statistics.median(cold), "hit_s": statistics.median(hits), "hit_max_s": max(hits)}
    out["hit_share"] = out["hit_s"] / out["cold_s"]
    return out


def table(doc: dict) -> str:
    """Every run of the results file: a row per document length."""
    return format_table([{"model": run["model"]["name"], "tokens": r["tokens"], "readers": r["readers"],
                          "cached": r["cached_tokens"], "cold prefill s": f"{r['cold_s']:.2f}",
                          "hit TTFT s": f"{r['hit_s']:.3f}", "max": f"{r['hit_max_s']:.3f}",
                          "hit / cold": f"{r['hit_share']:.2%}"}
                         for run in doc["runs"].values() for r in run["results"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,4096,8160", help="prompt lengths, tokens, comma separated")
    p.add_argument("--repeats", type=int, default=3, help="cold and hit runs per length, in turns")
    p.add_argument("--readers", type=int, default=1, help="requests reading the cached document at once")
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_hit.json"),
                   help="results JSON (this model and reader count's run replaces theirs, other runs stay)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=args.readers)
    texts = load_texts(args.corpus)
    # 49 ids less the first (a BOS where the model uses one)
    questions = [q[1:] for q in cut_prompts(llm.tokenizer, texts[1:], args.readers, 49)] if args.readers > 1 else [[]]
    rows = [measure(llm, cut_prompts(llm.tokenizer, texts, 1, int(n))[0], questions, args.repeats)
            for n in args.contexts.split(",")]
    model = model_identity(llm.loaded.source)
    run = {"threads": torch.get_num_threads(), "dtype": str(llm.model.dtype), "kv_dtype": str(llm.kv_dtype),
           "attention": llm.attention, "kernels": llm.kernels, "model": model, "repeats": args.repeats,
           "load_avg": os.getloadavg(), "results": rows}
    doc = save_run(Path(args.out), f"{model['name']} x{args.readers}", run, machine_info(llm.model.device))
    print(table(doc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
