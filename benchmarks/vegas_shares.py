"""How much of a step's attention a sparse draft's entries hold, by how they were chosen: StreamingLLM against Vegas's
selection and variants of its signal.

    PYTHONPATH=. python benchmarks/vegas_shares.py --model '' --context 4096 --label "SmolLM2 4k"
    PYTHONPATH=. python benchmarks/vegas_shares.py --model gemma3-270m --context 32000 --label "Gemma 3 32k"

For each of `--texts` books: `--context` tokens from a third of the way in are prefilled, then `--steps` one-token
forwards read the book's next tokens, each leaving its attention shares (`magicdec.kv.vegas.AttentionShares`: per
global layer and cached position, the probability the token's query heads give it). From the 8th step on, each way of
choosing keeps the sink, a recent window and positions chosen from what was known `--lag` steps earlier (a round
lags); it holds the share of the step's attention at the positions it keeps, averaged over the layers, steps and
texts. `streaming`: the sink and the most recent `budget - 4`; `vegas`: `self-vegas`'s choice (window budget / 8, the
rest by one token's shares); `sum of 3`: by the last three tokens' shares summed (what all of a verification's tokens
would give); `decayed 0.8`: by every earlier token's shares, each step's weighted 0.8 times the next's; `window 1/4`:
by one token's shares beside a window of a quarter of the budget. Writes the run under `--label` into
benchmarks/results/vegas_shares.json (the other runs kept) and prints the file's table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from tables import save_run, text  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.corpus import load_texts  # noqa: E402
from magicdec.kv.hybrid import make_cache  # noqa: E402
from magicdec.kv.sparse import DEFAULT_SINK  # noqa: E402
from magicdec.kv.vegas import AttentionShares, vegas_window  # noqa: E402
from magicdec.loading import load_model, model_identity  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "vegas_shares.json"
CHUNK = 512  # prefill forward size
FIRST = 8  # steps before the first measured one
DECAY = 0.8


def step_shares(model, ids: list[int], context: int, steps: int) -> list[Tensor]:
    """Per decode step: its shares [layers, L] (summed over KV heads), over the L positions known at that step."""
    cache = make_cache(model.cfg, 1, context + steps, model.dtype, "cpu", max_q=CHUNK)
    out = []
    with torch.inference_mode():
        for start in range(0, context, CHUNK):
            chunk = torch.tensor([ids[start : min(start + CHUNK, context)]])
            model(chunk, cache, logits_at=torch.zeros(1, 1, dtype=torch.long))
            cache.commit(chunk.shape[1])
        for k in range(steps):
            shares = AttentionShares(model.cfg, model.device)
            model(torch.tensor([[ids[context + k]]]), cache, shares=shares)
            cache.commit(1)
            out.append(shares.shares[:, 0, :, : context + k + 1].sum(1))
    return out


def held(step: Tensor, scores: Tensor | None, window: int, top: int) -> float:
    """The share of `step`'s attention [layers, L] at the sink, the last `window` positions and the `top` positions of
    largest `scores` [layers, L'] before its own window (L' <= L: chosen earlier), averaged over the layers."""
    L = step.shape[1]
    keep = torch.zeros_like(step, dtype=torch.bool)
    keep[:, :DEFAULT_SINK] = True
    keep[:, L - window :] = True
    if top:
        chosen = scores.clone()
        chosen[:, :DEFAULT_SINK] = -1
        chosen[:, scores.shape[1] - window :] = -1
        keep.scatter_(1, chosen.topk(top, dim=-1).indices, True)
    return float(((step * keep).sum(-1) / step.sum(-1)).mean())


def padded(x: Tensor, length: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, length - x.shape[1]))


def measure(steps: list[Tensor], budget: int, lag: int) -> dict[str, float]:
    """Each way of choosing's held share, averaged over the steps from FIRST on."""
    window, quarter = vegas_window(budget), budget // 4
    decayed, by_step = [], None
    for s in steps:  # decayed[t]: sum over j <= t of DECAY^(t - j) shares[j]
        by_step = s if by_step is None else DECAY * padded(by_step, s.shape[1]) + s
        decayed.append(by_step)
    ways = {
        "streaming": lambda t: held(steps[t], None, budget - DEFAULT_SINK, 0),
        "vegas": lambda t: held(steps[t], steps[t - lag], window, budget - DEFAULT_SINK - window),
        "sum of 3": lambda t: held(steps[t], sum(padded(steps[t - lag - j], steps[t - lag].shape[1]) for j in range(3)),
                                   window, budget - DEFAULT_SINK - window),
        f"decayed {DECAY}": lambda t: held(steps[t], decayed[t - lag], window, budget - DEFAULT_SINK - window),
        "window 1/4": lambda t: held(steps[t], steps[t - lag], quarter, budget - DEFAULT_SINK - quarter),
    }
    points = range(FIRST, len(steps))
    return {name: sum(way(t) for t in points) / len(points) for name, way in ways.items()}


def table(doc: dict) -> str:
    """Per run and budget: the share of a step's attention each way of choosing holds."""
    rows = []
    for label, run in doc["runs"].items():
        for budget, ways in run["held"].items():
            rows.append({"run": label, "budget": int(budget), **{k: round(v, 3) for k, v in ways.items()}})
    return text(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model path or short name ('': the default, SmolLM2)")
    ap.add_argument("--label", required=True, help="the run's name in the result file")
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lag", type=int, default=3, help="steps between a selection and the steps it drafts")
    ap.add_argument("--texts", default="2,5,9", help="the corpus's texts to read, by index")
    ap.add_argument("--budgets", default="256,512")
    args = ap.parse_args()
    loaded = load_model(args.model or None, device="cpu", dtype=torch.bfloat16)
    texts = load_texts(args.corpus)
    per_text = []
    for i in map(int, args.texts.split(",")):
        ids = loaded.tokenizer.encode(texts[i][len(texts[i]) // 3 :])[: args.context + args.steps]
        steps = step_shares(loaded.model, ids, args.context, args.steps)
        per_text.append({b: measure(steps, b, args.lag) for b in map(int, args.budgets.split(","))})
    held_mean = {str(b): {k: sum(t[b][k] for t in per_text) / len(per_text) for k in per_text[0][b]}
                 for b in per_text[0]}
    run = {"model": model_identity(args.model or None), "machine": machine_info("cpu"), "context": args.context,
           "steps": args.steps, "lag": args.lag, "texts": args.texts, "held": held_mean,
           "held_per_text": [{str(b): v for b, v in t.items()} for t in per_text]}
    print(table(save_run(RESULT, args.label, run)))
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
