"""Autoregressive decode throughput: magicdec against transformers, side by side, on the default model.

For every (batch, context) point, `batch` prompts of exactly `context` tokens are cut from different
PG-19 books at offsets well inside them, and both engines decode `--new-tokens` tokens greedily (EOS
ignored, so every sequence has the same length). Only the decode phase is timed:

* magicdec: the engine (`LLMEngine`, every prompt in its own slot) reports `decode_s`, the wall time of its
  decode rounds (the first new token comes from the prefill logits). Decode tokens = batch x steps, steps = new_tokens - 1.
* transformers: `model.generate(...)` on the same prompts (left-padded with an attention mask; prompts
  of one point have equal length, so nothing is actually padded), greedy, fp32, the same threads. A
  logits processor stamps the time of every step; its first call happens once the prefill forward is
  done, so decode time = end of `generate` - first stamp (the separately measured prefill time is
  subtracted), covering the same new_tokens - 1 forwards.

The floor of a decode step is the bytes it must read (all fp32 weights once, plus every sequence's K/V
at the mean decode context) over this machine's read bandwidth, measured here with a large `.sum()`.

    PYTHONPATH=. python benchmarks/bench_ar.py                       # 1, 8, 32 x 1024, 4096 tokens
    PYTHONPATH=. python benchmarks/bench_ar.py --batches 1,8 --contexts 1024 --skip-hf

Writes benchmarks/results/ar.json (ar.partial.json while running), keeping the points of an earlier
run at other (batch, context) values, so one point can be rerun on its own. Run it alone on the
machine: on a small shared CPU, torch's threads spin against other processes and timings become
meaningless.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts  # noqa: E402
from magicdec.config import EngineConfig  # noqa: E402
from magicdec.engine import LLMEngine  # noqa: E402
from magicdec.loading import default_model_path, load_model, model_identity  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def data_path() -> Path:
    env = os.environ.get("MAGICDEC_DATA")
    return Path(env) if env else ROOT.parent / "shared/data/pg19_dev.jsonl"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: the best of a few `.sum()` passes over a large fp32 tensor."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    n = x.numel() * 4
    del x
    return n / best


def step_floor_bytes(model, batch: int, context: int, new_tokens: int) -> int:
    """Bytes one decode step reads in fp32: every weight once (embedding rows aside) + the K/V attended."""
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once (the LM head read)
    mean_ctx = context + new_tokens / 2
    return params * 4 + int(batch * mean_ctx * cfg.kv_bytes_per_token(4))


def bench_magicdec(model, prompts, new_tokens: int, prefill_chunk: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + new_tokens,
                                           prefill_chunk=prefill_chunk))
    outs, stats = engine.generate(prompts, params), engine.stats
    assert all(len(o.output_ids) == new_tokens for o in outs)
    tokens = len(prompts) * stats.steps
    return {
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_steps": stats.steps,
        "decode_tokens": tokens,
        "tok_s": tokens / stats.decode_s,
        "step_ms": 1e3 * stats.decode_s / stats.steps,
        "first_tokens": [o.output_ids[:8] for o in outs[:2]],
    }


def bench_hf(hf, prompts, new_tokens: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    B, T = len(prompts), max(map(len, prompts))
    ids = torch.full((B, T), 2, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    stamp = Stamp()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=2, logits_processor=LogitsProcessorList([stamp]))
    t_end = time.perf_counter()
    assert out.shape[1] - T == new_tokens and len(stamp.times) == new_tokens
    steps = new_tokens - 1
    decode_s = t_end - stamp.times[0]
    return {
        "prefill_s": stamp.times[0] - t0,
        "decode_s": decode_s,
        "decode_steps": steps,
        "decode_tokens": B * steps,
        "tok_s": B * steps / decode_s,
        "step_ms": 1e3 * decode_s / steps,
        "first_tokens": [out[i, T : T + 8].tolist() for i in range(min(2, B))],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    ap.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths (default 1024,4096)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true", help="time magicdec only")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--out", type=Path, default=RESULTS / "ar.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    with data_path().open() as f:
        books = [json.loads(line)["text"] for line in f if line.strip()]
    loaded = load_model(device="cpu", dtype=torch.float32)
    model = loaded.model
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        p = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # decode exactly new_tokens (min_new_tokens backs this up)

    info = machine_info("cpu")
    info["transformers"] = None if hf is None else transformers_version()
    bw = read_bandwidth()
    info["read_bandwidth_gb_s"] = bw / 1e9
    print(f"# {info['cpu']}, {info['cpu_count']} cores, {info['memory_bytes'] / 2**30:.1f} GiB, "
          f"torch {info['torch']}, {info['torch_threads']} threads, read bandwidth {bw / 1e9:.1f} GB/s, "
          f"load avg {info['loadavg'][0]:.2f}")

    # warm up both engines (first-call allocations, kernel selection)
    warm = cut_prompts(loaded.tokenizer, books, 2, 64)
    bench_magicdec(model, warm, 4, args.prefill_chunk)
    if hf is not None:
        bench_hf(hf, warm, 4)

    # Points of an earlier run at other (batch, context) are kept, so single points can be rerun.
    earlier = json.loads(args.out.read_text())["points"] if args.out.exists() else []
    rerun = {(b, c) for b in batches for c in contexts}
    results = {"machine": info, "model": model_identity(), "new_tokens": args.new_tokens, "prefill_chunk": args.prefill_chunk,
               "method": "decode phase only; see benchmarks/bench_ar.py docstring",
               "points": [p for p in earlier if (p["batch"], p["context"]) not in rerun]}
    partial = args.out.with_suffix(".partial.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for context in contexts:
        for batch in batches:
            prompts = cut_prompts(loaded.tokenizer, books, batch, context)
            point = {"batch": batch, "context": context, "loadavg_before": os.getloadavg()[0],
                     "threads": torch.get_num_threads()}
            gc.collect()
            point["magicdec"] = bench_magicdec(model, prompts, args.new_tokens, args.prefill_chunk)
            floor_bytes = step_floor_bytes(model, batch, context, args.new_tokens)
            point["floor_bytes"] = floor_bytes
            point["floor_ms"] = 1e3 * floor_bytes / bw
            point["magicdec"]["step_over_floor"] = point["magicdec"]["step_ms"] / point["floor_ms"]
            results["points"].append(point)
            partial.write_text(json.dumps(results, indent=1))  # keep magicdec's numbers if HF never returns
            if hf is not None:
                gc.collect()
                try:
                    point["hf"] = bench_hf(hf, prompts, args.new_tokens)
                    point["hf"]["step_over_floor"] = point["hf"]["step_ms"] / point["floor_ms"]
                    point["speedup"] = point["magicdec"]["tok_s"] / point["hf"]["tok_s"]
                    point["same_first_tokens"] = point["magicdec"]["first_tokens"] == point["hf"]["first_tokens"]
                except RuntimeError as e:  # e.g. out of memory
                    point["hf"] = {"error": str(e).splitlines()[0]}
            partial.write_text(json.dumps(results, indent=1))
            print_row(point)
    args.out.write_text(json.dumps(results, indent=1))
    partial.unlink(missing_ok=True)
    print()
    print(format_table(results))
    print(f"\nwrote {args.out}")


def print_row(pt: dict) -> None:
    m, h = pt["magicdec"], pt.get("hf", {})
    hf_txt = f"hf {h['tok_s']:8.1f} tok/s ({h['step_ms']:.1f} ms/step), x{pt['speedup']:.2f}" if "tok_s" in h else "hf -"
    print(f"B={pt['batch']:3d} T={pt['context']:5d}: magicdec {m['tok_s']:8.1f} tok/s ({m['step_ms']:.1f} ms/step, "
          f"{m['step_over_floor']:.2f}x floor) | {hf_txt}", flush=True)


def format_table(results: dict) -> str:
    """A Markdown table of the points."""
    rows = ["| batch | context | magicdec tok/s | transformers tok/s | speedup | magicdec ms/step | "
            "transformers ms/step | floor ms/step | magicdec / floor | transformers / floor |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pt in results["points"]:
        m, h = pt["magicdec"], pt.get("hf", {})
        has_hf = "tok_s" in h
        rows.append(
            f"| {pt['batch']} | {pt['context']} | {m['tok_s']:.1f} | {h['tok_s'] if has_hf else float('nan'):.1f} | "
            f"{pt.get('speedup', float('nan')):.2f} | {m['step_ms']:.1f} | {h.get('step_ms', float('nan')):.1f} | "
            f"{pt['floor_ms']:.1f} | {m['step_over_floor']:.2f} | {h.get('step_over_floor', float('nan')):.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
