"""The sampler on a real model's logits: the CPU draw from the candidates, native and in torch's operators, against
the full-vocabulary path.

    PYTHONPATH=. python benchmarks/bench_sampler.py --model '' --label SmolLM2
    PYTHONPATH=. python benchmarks/bench_sampler.py --model gemma3-270m --label "Gemma 3"

The model reads the first 1024 tokens of the corpus's first text; its logits at those positions are cut into batches
of B rows x q positions (a decode step: q = 1; a verification of gamma = 2: q = 3) and each is sampled at T 0.7,
top-p 0.9 by `sample_tokens` (the CPU path: a row's 64 or 1024 most probable tokens, the whole vocabulary where a
nucleus is wider) with the native operator (`native`, MAGICDEC_FUSED=1) and with torch's operators (`torch`,
MAGICDEC_FUSED=0), and by the full path (`probs_from_logits` + `sample_probs`: a softmax and a sort over the whole
vocabulary, as on CUDA), timed in turns, median of `--repeats`. Also: how wide the nuclei are, over the first 2048
tokens of each of the corpus's first `--nucleus-texts` texts (1024 of the first text alone by default). Writes the
run under `--label` into benchmarks/results/sampler.json (the other runs kept) with the machine info, and prints the
file's table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from bench_dtype import interleaved  # noqa: E402
from tables import save_run, text  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import load_texts  # noqa: E402
from magicdec.engine import LLM  # noqa: E402
from magicdec.kv.hybrid import make_cache  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.sampling import (CPU_CANDIDATES, RowParams, SamplingParams, probs_from_logits,  # noqa: E402
                               sample_probs, sample_tokens)

RESULT = ROOT / "benchmarks" / "results" / "sampler.json"
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


def with_fused(setting: str, fn):
    """fn run under MAGICDEC_FUSED=setting (the native sampler: 1; torch's operators: 0)."""
    def run():
        os.environ["MAGICDEC_FUSED"] = setting
        return fn()
    return run


def measure(logits: torch.Tensor, B: int, q: int, repeats: int) -> dict:
    """The three ways to sample a batch of B x q positions: median seconds, and how many tokens equal the native's."""
    V = logits.shape[-1]
    batch = logits[: B * q].reshape(B, q, V).contiguous()
    rows = RowParams.of([PARAMS] * B, range(B), "cpu")
    position = torch.arange(q)[None].expand(B, q).contiguous()
    ways = {"native": with_fused("1", lambda: sample_tokens(batch, rows, position)),
            "torch": with_fused("0", lambda: sample_tokens(batch, rows, position)),
            "full": lambda: sample_probs(probs_from_logits(batch, rows), rows.seed, position)}
    tokens = {name: way() for name, way in ways.items()}
    seconds = interleaved(ways, repeats)
    os.environ["MAGICDEC_FUSED"] = "1"
    return {"batch": B, "q": q, "median_seconds": seconds,
            "same_tokens": {name: int((t == tokens["native"]).sum()) for name, t in tokens.items() if name != "native"}}


def table(doc: dict) -> str:
    """Per run and shape: the native operator's and torch's milliseconds (the full path's are in the file)."""
    rows = []
    for label, run in doc["runs"].items():
        for r in run["results"]:
            s = r["median_seconds"]
            rows.append({"run": label, "B x q": f"{r['batch']} x {r['q']}",
                         "native ms": round(1e3 * s["native"], 2), "torch ms": round(1e3 * s["torch"], 2),
                         "torch / native": round(s["torch"] / s["native"], 2),
                         "same tokens": f"{min(r['same_tokens'].values())}/{r['batch'] * r['q']}"})
    return text(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a model path or short name ('': the default, SmolLM2)")
    ap.add_argument("--label", default="Gemma 3", help="the run's name in the result file")
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"))
    ap.add_argument("--shapes", default="32x1,32x3", help="batches as BxQ (rows x positions)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--nucleus-texts", type=int, default=0,
                    help="texts whose first 2048 tokens give the nuclei's widths (0: the timed 1024 positions)")
    args = ap.parse_args()
    llm = LLM(args.model or None)
    logits = model_logits(llm, args.corpus)
    widths = nucleus_widths(llm, args.corpus, args.nucleus_texts or 1, 2048 if args.nucleus_texts else POSITIONS)
    results = [measure(logits, *map(int, shape.split("x")), args.repeats) for shape in args.shapes.split(",")]
    run = {"model": model_identity(args.model or None), "machine": machine_info("cpu"), "vocab": logits.shape[-1],
           "positions": POSITIONS, "sampling": {"temperature": PARAMS.temperature, "top_p": PARAMS.top_p},
           "nucleus": widths, "results": results}
    print(table(save_run(RESULT, args.label, run)))
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
