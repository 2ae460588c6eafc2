"""How often verifying gamma+1 tokens in one forward picks a different greedy token than one-token steps.

    PYTHONPATH=. python benchmarks/bf16_flips.py [--rows 8] [--batch 8] [--prompt 1024] [--positions 96] [--q 2,4,9]
    PYTHONPATH=. MAGICDEC_ISA=avx2 python benchmarks/bf16_flips.py --storage fp16,bf16 [--rows 8]
                                                                   [--prompt 512] [--positions 256]

Greedy speculative decoding is lossless only as far as the target's verify forward (q = gamma+1 new
tokens per row) and its plain step (q = 1) compute the same argmax. In fp32 they agree; in bf16 the
matmuls round differently for different row counts, and a near-tie between the two most likely
tokens can flip. This measures it teacher-forced on real text: `--rows` PG-19 excerpts of `--prompt`
tokens are prefilled, `--batch` of them per batch; then, for each block of q true next tokens, one forward of the block (not
committed, as a verification) and q one-token steps over the same tokens (committed, as plain decoding)
each give the argmax at every position, and the two are compared. For every flip the fp32 model's logit
gap between the two tokens is recorded (how close to a tie it was). Writes its run, with the machine info, under
--label (default: the kernel path) in benchmarks/results/bf16_flips.json; a run of another --batch stays beside this
one's in it.

With `--storage`, it measures instead how often 16-bit storage under fp32 arithmetic (the AVX2 kernels: weights
packed and KV cached in fp16 or bf16) changes the greedy token against the fp32 model: teacher-forced on the same
text, each `--positions` block is one forward after the prompt, and the argmax at every position is compared with
the fp32 model's (with the fp32 logit gap of each flip, and the largest logit error). Its run's label defaults to the
kernel path and "storage" ("avx2 storage").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import save_run, saved_run  # noqa: E402

from magicdec import kernels  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.kv import KVCache  # noqa: E402
from magicdec.loading import load_model, model_identity  # noqa: E402
from magicdec.model import pack_linears  # noqa: E402
from magicdec.prefill import prefill_row  # noqa: E402


def excerpts(tok, path: Path, rows: int, n_tokens: int) -> list[list[int]]:
    """`rows` runs of n_tokens ids from the middle of different books."""
    books = [json.loads(line)["text"] for line in path.open() if line.strip()]
    out = []
    for text in books[:rows]:
        start = text.find(" ", int(len(text) * 0.5)) + 1
        out.append(tok.tok.encode(text[start : start + 8 * n_tokens + 1000], add_special_tokens=False).ids[:n_tokens])
    return out


def prefilled(model, prompts: list[list[int]], room: int, kv_dtype: torch.dtype | None = None
              ) -> tuple[KVCache, torch.Tensor]:
    """A cache (of `kv_dtype`, default the model's) holding each prompt in its own row, with `room` more slots, and
    each prompt's last logits."""
    cache = KVCache(model.cfg, len(prompts), max(map(len, prompts)) + room, kv_dtype or model.dtype, "cpu")
    with torch.inference_mode():
        logits = [prefill_row(model, cache.row(i), torch.tensor(p), 512) for i, p in enumerate(prompts)]
    return cache.head(len(prompts)), torch.cat(logits)  # the view sees the rows' lengths


def flips(model, ref, texts: list[list[int]], prompt: int, positions: int, q: int) -> dict:
    """Teacher-forced verify-vs-step argmax comparison over `positions` tokens after `prompt` tokens."""
    cache, _ = prefilled(model, [t[:prompt] for t in texts], positions + q)
    B = len(texts)
    true = torch.tensor([t[prompt : prompt + positions] for t in texts])
    found, compared = [], 0
    with torch.inference_mode():
        for start in range(0, positions - q + 1, q):
            block = true[:, start : start + q]
            verify = model(block, cache).argmax(-1)  # [B, q], nothing committed
            for j in range(q):
                step = model(block[:, j : j + 1], cache)[:, 0].argmax(-1)
                cache.commit(1)
                for b in torch.nonzero(step != verify[:, j]).flatten().tolist():
                    found.append({"row": b, "position": prompt + start + j,
                                  "tokens": [int(step[b]), int(verify[b, j])]})
            compared += B * q
    for f in found:  # how close to a tie the two tokens are in fp32, on the same true prefix
        ids = texts[f["row"]][: f["position"] + 1]
        with torch.inference_mode():
            logits = one_shot_last(ref, ids)
        a, b = f["tokens"]
        f["fp32_gap"] = float(logits[a] - logits[b])
    return {"compared": compared, "cases": found}


def teacher_forced(model, texts: list[list[int]], prompt: int, positions: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits [B, positions, vocab] of one forward over each text's `positions` tokens after its `prompt` tokens."""
    cache, _ = prefilled(model, [t[:prompt] for t in texts], positions, kv_dtype)
    with torch.inference_mode():
        return model(torch.tensor([t[prompt : prompt + positions] for t in texts]), cache).float()


def storage_flips(args, ref, texts: list[list[int]]) -> list[dict]:
    """For each 16-bit storage: greedy tokens that differ from the fp32 model's, teacher-forced (see the module
    docstring)."""
    expect = teacher_forced(ref.model, texts, args.prompt, args.positions, torch.float32)
    runs = []
    for name in args.storage.split(","):
        storage = {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
        model = load_model(device="cpu", dtype=torch.float32).model  # fp32, not packed: a model asked for as fp32
        pack_linears(model, storage)
        logits = teacher_forced(model, texts, args.prompt, args.positions, storage)
        flipped = torch.nonzero(logits.argmax(-1) != expect.argmax(-1)).tolist()
        gaps = [float(expect[b, i].max() - expect[b, i, int(logits[b, i].argmax())]) for b, i in flipped]
        err = float((logits - expect).abs().max() / expect.abs().max())
        runs.append({"storage": name, "kernels": kernels.path_name(), "compared": expect.shape[0] * expect.shape[1],
                     "flips": len(flipped), "rate": len(flipped) / (expect.shape[0] * expect.shape[1]),
                     "fp32_gaps": gaps, "max_rel_logit_err": err, "loadavg": list(os.getloadavg())})
        print(f"{name} storage: {len(flipped)} flips in {runs[-1]['compared']} tokens; fp32 gaps "
              f"{[round(g, 3) for g in sorted(gaps)]}; max logit error {err:.2e} of the largest", flush=True)
    return runs


def one_shot_last(model, ids: list[int]) -> torch.Tensor:
    """The last position's logits of one prefill of `ids`."""
    return prefilled(model, [ids], 1)[1][0].float()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="rows per batch (1: each text alone)")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--positions", type=int, default=96)
    p.add_argument("--q", default="2,4,9", help="tokens per verification (gamma + 1)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/pg19_dev.jsonl"))
    p.add_argument("--storage", default=None, help="16-bit storages under fp32 arithmetic to compare with fp32")
    p.add_argument("--out", default=str(Path(__file__).parent / "results/bf16_flips.json"))
    p.add_argument("--label", default=None, help="this run's label in --out (default: the kernel path, and "
                                                 "\"storage\" with --storage)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out, label = Path(args.out), args.label or kernels.path_name() + (" storage" if args.storage else "")
    ref = load_model(device="cpu", dtype=torch.float32)
    texts = excerpts(ref.tokenizer, Path(args.data), args.rows, args.prompt + args.positions)
    if args.storage:
        save_run(out, label, {"machine": machine_info("cpu"), "model": model_identity(), "rows": args.rows,
                              "prompt": args.prompt, "positions": args.positions,
                              "runs": storage_flips(args, ref, texts)})
        return
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    # the run's measurements at other batch sizes stay beside this one's (each measurement names its batch)
    kept = [r for r in (saved_run(out, label) or {}).get("runs", []) if r.get("batch") != args.batch]
    results = {"machine": machine_info("cpu"), "model": model_identity(), "rows": args.rows,
               "batches": sorted({r["batch"] for r in kept} | {args.batch}, reverse=True), "prompt": args.prompt,
               "positions": args.positions, "runs": kept}
    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    for name in args.dtypes.split(","):
        model = ref.model if name == "fp32" else load_model(device="cpu", dtype=dtypes[name]).model
        for q in map(int, args.q.split(",")):
            parts = [flips(model, ref.model, b, args.prompt, args.positions, q) for b in batches]
            compared, cases = sum(r["compared"] for r in parts), [c for r in parts for c in r["cases"]]
            r = {"dtype": name, "q": q, "compared": compared, "flips": len(cases), "rate": len(cases) / compared,
                 "cases": cases, "loadavg": list(os.getloadavg()), "batch": args.batch}
            results["runs"].append(r)
            gaps = sorted(abs(c["fp32_gap"]) for c in r["cases"])
            print(f"{name} q={q}: {r['flips']} flips in {r['compared']} tokens ({100 * r['rate']:.2f}%); "
                  f"fp32 logit gaps of the flipped pairs: {[round(g, 3) for g in gaps]}", flush=True)
    save_run(out, label, results)


if __name__ == "__main__":
    main()
