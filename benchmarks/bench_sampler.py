"""The sampler on a real model's logits: the CPU candidate path against the full-vocabulary path.

    PYTHONPATH=. python benchmarks/bench_sampler.py [--model gemma3-270m] [--corpus ../shared/data/pg19_dev.jsonl]
                                                   [--shapes 32x1,32x4] [--repeats 7] [--nucleus-texts 1]

The model reads the first 1024 tokens of the corpus's first text; its logits at those positions are cut into batches
of B rows x q positions (a decode step: q = 1; a verification of gamma = 3: q = 4) and each is sampled at T 0.7,
top-p 0.9 by `sample_tokens` (the CPU path: a few dozen candidates per position, the whole vocabulary where a nucleus
is wider) and by the full path (`probs_from_logits` + `sample_probs`: a softmax and a sort over the whole vocabulary,
as on CUDA), timed in turns, median of `--repeats`. Also: how wide the nuclei are, over the first 2048 tokens of
each of the corpus's first `--nucleus-texts` texts (1024 of the first text alone by default). Writes
benchmarks/results/sampler.json with the machine info and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_dtype import interleaved  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import load_texts  # noqa: E402
from magicdec.engine import LLM  # noqa: E402
from magicdec.kv.hybrid import make_cache  # noqa: E402
from magicdec.sampling import (CPU_CANDIDATES, RowParams, SamplingParams, probs_from_logits,  # noqa: E402
                               sample_probs, sample_tokens)

POSITIONS = 1024
PARAMS = SamplingParams(temperature=0.7, top_p=0.9)


def model_logits(llm: LLM, corpus: str) -> torch.Tensor:
    """fp32 logits [POSITIONS, V] of the model over the first POSITIONS tokens of the corpus's first text."""
    ids = llm.tokenizer.encode(load_texts(corpus)[0])[:POSITIONS]
    model = llm.model
    cache = make_cache(model.cfg, 1, len(ids), model.dtype, model.device, max_q=len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device), cache)[0].float()


def nucleus_widths(llm: LLM, corpus: str, texts: int, tokens: int) -> dict[str, int]:
    """How many positions of the first `tokens` tokens of the corpus's first `texts` texts (read in forwards of 512)
    have a nucleus at the sampling settings wider than each of the CPU sampler's candidate counts."""
    model, counts, total = llm.model, dict.fromkeys(CPU_CANDIDATES, 0), 0
    for text in load_texts(corpus)[:texts]:
        ids = llm.tokenizer.encode(text)[:tokens]
        cache = make_cache(model.cfg, 1, len(ids), model.dtype, model.device, max_q=512)
        for start in range(0, len(ids), 512):
            chunk = torch.tensor([ids[start : start + 512]], device=model.device)
            with torch.inference_mode():
                logits = model(chunk, cache)[0].float()
            cache.commit(chunk.shape[1])
            for rows in logits.split(128):  # a sort of a few rows at a time: [rows, V] in fp32 and int64
                p = (rows / PARAMS.temperature).softmax(-1).sort(-1, descending=True).values
                width = ((p.cumsum(-1) - p) < PARAMS.top_p).sum(-1)
                for k in counts:
                    counts[k] += int((width > k).sum())
            total += chunk.shape[1]
    return {"positions": total, **{f"past {k}": c for k, c in counts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a model path or short name ('': the default, SmolLM2)")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/data/pg19_dev.jsonl"))
    ap.add_argument("--shapes", default="32x1,32x4", help="batches as BxQ (rows x positions)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nucleus-texts", type=int, default=0,
                    help="texts whose first 2048 tokens give the nuclei's widths (0: the timed 1024 positions)")
    ap.add_argument("--out", default="benchmarks/results/sampler.json")
    args = ap.parse_args()
    llm = LLM(args.model or None)
    logits = model_logits(llm, args.corpus)
    V = logits.shape[-1]
    widths = nucleus_widths(llm, args.corpus, args.nucleus_texts or 1, 2048 if args.nucleus_texts else POSITIONS)
    results = []
    for shape in args.shapes.split(","):
        B, q = map(int, shape.split("x"))
        batch = logits[: B * q].reshape(B, q, V).contiguous()
        rows = RowParams.of([PARAMS] * B, range(B), "cpu")
        position = torch.arange(q)[None].expand(B, q).contiguous()
        candidates = sample_tokens(batch, rows, position)
        full = sample_probs(probs_from_logits(batch, rows), rows.seed, position)
        t = interleaved({"candidates": lambda: sample_tokens(batch, rows, position),
                         "full": lambda: sample_probs(probs_from_logits(batch, rows), rows.seed, position)},
                        args.repeats)
        results.append({"batch": B, "q": q, "median_seconds": t, "same_tokens": int((candidates == full).sum()),
                        "full_over_candidates": t["full"] / t["candidates"]})
    out = {"machine": machine_info("cpu"), "model": args.model or "default", "vocab": V, "positions": POSITIONS,
           "sampling": {"temperature": PARAMS.temperature, "top_p": PARAMS.top_p}, "nucleus": widths,
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{out['model']}: vocabulary {V}; of {widths['positions']} positions, nuclei wider than "
          + ", ".join(f"{k}: {widths[f'past {k}']}" for k in CPU_CANDIDATES))
    print(f"{'B x q':>8} {'candidates ms':>14} {'full ms':>8} {'full / candidates':>18} {'same tokens':>12}")
    for r in results:
        s = r["median_seconds"]
        print(f"{r['batch']:>4} x {r['q']:<2} {s['candidates'] * 1e3:>14.1f} {s['full'] * 1e3:>8.1f} "
              f"{r['full_over_candidates']:>18.2f} {r['same_tokens']:>7}/{r['batch'] * r['q']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
