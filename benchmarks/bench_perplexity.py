"""Perplexity and greedy agreement through the OpenAI API: `magicdec serve` per KV-cache dtype, against transformers.

    PYTHONPATH=. python benchmarks/bench_perplexity.py                                  # SmolLM2, 4 x 8000 tokens
    PYTHONPATH=. python benchmarks/bench_perplexity.py --model gemma3-270m --window 32000 --windows 1

`--windows` windows of `--window` token ids are cut from inside the corpus's books (magicdec.corpus.cut_prompts, one
book each), tokenized once here with the model's own tokenizer and sent as token ids, so every engine scores the
same ids. For each KV dtype a server is started (`magicdec serve --draft none --max-running 1`, the KV dtype as
`--kv-cache-dtype`) and each window is scored as lm-evaluation-harness's `local-completions` scores a text:
`/v1/completions` with `echo: true, logprobs: 0, max_tokens: 0`, the log-probability of every token after the first.
Then the window's first `--window` - `--greedy-tokens` ids are continued greedily for `--greedy-tokens` tokens
(temperature 0, EOS ignored; the tokens as the API shows them, each decoded alone). transformers (fp32, the same GGUF
dequantized by its own loader) computes the same log-probabilities and greedy continuations, prefilling in chunks
of `--chunk` tokens with its KV cache (a 32k window's logits at once would not fit in memory).

Reported per configuration: perplexity over all scored tokens (exp of their mean negative log-probability), its
change against the first KV dtype's (the reference, bf16 by default), the mean and largest difference of a token's
log-probability against the reference, and greedy agreement with the reference's continuations: the common prefix
(shortest and mean over windows) and the share of positions holding the same token. Writes the run into
benchmarks/results/perplexity.json under the model and window length (other runs kept) with the machine info;
prints the file's table.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_serving import RESULTS, free_port, serving  # noqa: E402
from tables import save_run  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import cut_prompts, load_texts  # noqa: E402
from magicdec.loading import model_identity, model_path  # noqa: E402
from magicdec.loading.cache import load_gguf  # noqa: E402
from magicdec.logprobs import compute_logprobs  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402


# --- the numbers -------------------------------------------------------------------------------------------------
def perplexity(windows: Sequence[Sequence[float]]) -> float:
    """exp of the mean negative log-probability over every token of every window."""
    n = sum(map(len, windows))
    return math.exp(-sum(map(math.fsum, windows)) / n)


def logprob_gap(windows: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> dict[str, float]:
    """The mean and largest absolute difference of a token's log-probability between two scorings of the windows."""
    gaps = [abs(a - b) for w, r in zip(windows, reference, strict=True) for a, b in zip(w, r, strict=True)]
    return {"mean": math.fsum(gaps) / len(gaps), "max": max(gaps)}


def agreement(tokens: Sequence, reference: Sequence) -> dict[str, float]:
    """Two greedy continuations of one prompt: their common prefix and the share of positions holding the same token
    (over the longer's length)."""
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    equal = sum(a == b for a, b in zip(tokens, reference)) / max(len(tokens), len(reference), 1)
    return {"prefix": prefix, "equal": equal}


def summarize(config: dict, reference: dict) -> dict:
    """A configuration's row: its perplexity and how it compares with the reference configuration's windows."""
    scored, ref = [w["logprobs"] for w in config["windows"]], [w["logprobs"] for w in reference["windows"]]
    agree = [agreement(w["greedy"], r["greedy"]) for w, r in zip(config["windows"], reference["windows"], strict=True)]
    ppl, ref_ppl = perplexity(scored), perplexity(ref)
    return {"config": config["config"], "windows": len(scored), "tokens": sum(map(len, scored)), "perplexity": ppl,
            "vs_reference": ppl / ref_ppl - 1, "logprob_gap": logprob_gap(scored, ref),
            "greedy_prefix_min": min(a["prefix"] for a in agree),
            "greedy_prefix_mean": sum(a["prefix"] for a in agree) / len(agree),
            "greedy_equal": sum(a["equal"] for a in agree) / len(agree),
            "score_s": sum(w["score_s"] for w in config["windows"]) / len(scored)}


def table(doc: dict) -> str:
    """Every run of the results file: a row per configuration, against its run's reference."""
    rows = []
    for run in doc["runs"].values():
        for r in run["rows"]:
            rows.append({"model": run["model"]["name"], "window": run["window"], "config": r["config"],
                         "windows x tokens": f"{r['windows']} x {r['tokens'] // r['windows']}",
                         "perplexity": f"{r['perplexity']:.4f}", f"vs {run['reference']}": f"{r['vs_reference']:+.3%}",
                         "|dlogprob| mean / max": f"{r['logprob_gap']['mean']:.4f} / {r['logprob_gap']['max']:.3f}",
                         "greedy prefix min / mean": f"{r['greedy_prefix_min']} / {r['greedy_prefix_mean']:.0f}",
                         "greedy equal": f"{r['greedy_equal']:.1%}", "s / window": f"{r['score_s']:.0f}"})
    return format_table(rows)


def notes(doc: dict) -> str:
    """Per run of the results file: its servers' commands, the transformers version, the greedy tokens."""
    lines = []
    for label, run in doc["runs"].items():
        served = [c for c in run["configs"] if "command" in c]
        dtypes = "{" + ",".join(c["kv_dtype"] for c in served) + "}"  # the commands differ in their KV dtype alone
        one = {c["command"].replace(f"--kv-cache-dtype {c['kv_dtype']}", f"--kv-cache-dtype {dtypes}") for c in served}
        parts = [f"`{c}`" for c in (one if len(one) == 1 else [c["command"] for c in served])]
        parts += [f"transformers {c['transformers']}" for c in run["configs"] if "transformers" in c]
        lines.append(f"{label}: {', '.join(parts)}; {run['greedy_tokens']} greedy tokens a window.")
    return "\n".join(lines)


# --- magicdec, through the API --------------------------------------------------------------------------------------
def score_on_server(base: str, windows: list[list[int]], greedy_tokens: int) -> list[dict]:
    """Each window's token log-probabilities (echo, max_tokens 0) and the greedy continuation of its first
    len - greedy_tokens ids (the tokens' texts), from the server at `base`."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    out = []
    for ids in windows:
        t0 = time.perf_counter()
        scored = client.completions.create(model=model, prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                           temperature=0).choices[0].logprobs.token_logprobs
        score_s = time.perf_counter() - t0
        if len(scored) != len(ids) or scored[0] is not None:
            raise SystemExit(f"the server scored {len(scored)} positions of a {len(ids)}-token prompt")
        greedy = client.completions.create(model=model, prompt=ids[: len(ids) - greedy_tokens], logprobs=0,
                                           max_tokens=greedy_tokens, temperature=0, extra_body={"ignore_eos": True})
        out.append({"logprobs": scored[1:], "greedy": greedy.choices[0].logprobs.tokens, "score_s": score_s})
    client.close()
    return out


def magicdec_config(args, kv_dtype: str, windows: list[list[int]]) -> dict:
    flags = [*(["--model", args.model] if args.model else []), "--dtype", args.dtype, "--kv-cache-dtype", kv_dtype, "--draft",
             "none", "--max-running", "1"]
    port = free_port()
    cmd = [sys.executable, "-m", "magicdec", "serve", *flags, "--port", str(port), "--log-level", "warning"]
    with serving(cmd, f"http://127.0.0.1:{port}", {"PYTHONPATH": str(ROOT)}) as base:
        scored = score_on_server(base, windows, args.greedy_tokens)
    return {"config": f"magicdec {kv_dtype} KV", "kv_dtype": kv_dtype, "command": " ".join(["magicdec serve", *flags]),
            "windows": scored}


# --- transformers -----------------------------------------------------------------------------------------------
def chunk_bounds(n: int, split: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) chunks of at most `chunk` positions over [0, n), one of them ending at `split`."""
    cuts = sorted({*range(0, n, chunk), split, n} - {0})
    return list(zip([0, *cuts[:-1]], cuts))


@torch.inference_mode()
def hf_window(hf, ids: list[int], greedy_tokens: int, chunk: int) -> tuple[list[float], list[int]]:
    """transformers' log-probability of each token after the first, prefilling in chunks over its KV cache, and its
    greedy continuation of the first len - greedy_tokens ids (from a copy of the cache at that point)."""
    from transformers import DynamicCache

    x, split = torch.tensor([ids]), len(ids) - greedy_tokens
    cache, logprobs = DynamicCache(config=hf.config), []
    for start, end in chunk_bounds(len(ids), split, chunk):
        logits = hf(input_ids=x[:, start:end], past_key_values=cache, use_cache=True).logits[0]
        targets = x[0, start + 1 : end + 1]
        logprobs += compute_logprobs(logits[: len(targets)], targets, 0).chosen.tolist()
        if end == split:
            fork, token = copy.deepcopy(cache), logits[-1].argmax()
    greedy = []
    for _ in range(greedy_tokens):
        greedy.append(int(token))
        token = hf(input_ids=token.view(1, 1), past_key_values=fork, use_cache=True).logits[0, -1].argmax()
    return logprobs, greedy


def transformers_config(args, windows: list[list[int]], tokenizer) -> dict:
    """The windows scored and continued by transformers (fp32) from the same GGUF; greedy tokens as the API shows
    them (each decoded alone)."""
    from transformers import AutoModelForCausalLM, __version__

    path = model_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for ids in windows:
        t0 = time.perf_counter()
        logprobs, greedy = hf_window(hf, ids, args.greedy_tokens, args.chunk)
        out.append({"logprobs": logprobs, "greedy": [tokenizer.decode([t]) for t in greedy],
                    "score_s": time.perf_counter() - t0})
    return {"config": "transformers fp32", "transformers": __version__, "windows": out}


# --- main -------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M; gemma3-270m for Gemma 3 270M)")
    p.add_argument("--window", type=int, default=8000, help="tokens per window (default 8000)")
    p.add_argument("--windows", type=int, default=4, help="windows, each from another book (default 4)")
    p.add_argument("--kv-dtypes", default="bf16,int8", help="KV-cache dtypes to serve, comma separated; the first is the "
                                                       "reference (default bf16,int8)")
    p.add_argument("--dtype", default="auto", help="the servers' --dtype (compute dtype; default auto)")
    p.add_argument("--greedy-tokens", type=int, default=256, help="greedy tokens after each window's start")
    p.add_argument("--chunk", type=int, default=512, help="transformers' prefill chunk, tokens")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers reference")
    p.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"), help="PG-19 JSON lines")
    p.add_argument("--out", default=str(RESULTS / "perplexity.json"),
                   help="results JSON (this model and window's run replaces theirs, other runs stay)")
    args = p.parse_args(argv)
    if not 0 < args.greedy_tokens < args.window:
        p.error("need 0 < --greedy-tokens < --window")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = load_gguf(model_path(args.model)).tokenizer
    windows = cut_prompts(tokenizer, load_texts(args.corpus), args.windows, args.window)
    kv_dtypes = args.kv_dtypes.split(",")
    configs = [magicdec_config(args, kv, windows) for kv in kv_dtypes]
    if not args.no_transformers:
        configs.append(transformers_config(args, windows, tokenizer))
    model = model_identity(args.model)
    run = {"model": model, "window": args.window, "greedy_tokens": args.greedy_tokens, "dtype": args.dtype,
           "reference": configs[0]["config"], "rows": [summarize(c, configs[0]) for c in configs],
           "configs": [{k: v for k, v in c.items() if k != "windows"} for c in configs],
           "greedy": {c["config"]: [w["greedy"] for w in c["windows"]] for c in configs}}
    doc = save_run(Path(args.out), f"{model['name']} x {args.window}", run, machine_info())
    print(table(doc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
