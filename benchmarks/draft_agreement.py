"""What a sparse draft's entries hold of the target's attention and how often its next token agrees with the
target's, by how the entries were chosen and how stale the choice is, and whether the attention the draft leaves out
can be put back from the step that chose.

    PYTHONPATH=. python benchmarks/draft_agreement.py --context 4096 --label "SmolLM2 4k"
    PYTHONPATH=. python benchmarks/draft_agreement.py --model gemma3-270m --context 32000 --texts 2,5 \
        --label "Gemma 3 32k"

For each of `--texts` books, `--context` tokens from a third of the way in are prefilled, then `--steps` of the book's
next tokens are read one at a time. Each is first read by the drafts, over the target's K/V of every earlier position
(as a round's first draft token is), then by the target. The drafts read each of `--budgets` entries a global layer:
`streaming` the sink and the most recent; `vegas` self-vegas's entries (the sink, a window of an eighth and the
positions of largest attention summed over the heads), chosen from the target's attention `lag` steps earlier (a
round's first draft token lags 1 + the tokens the last verification accepted, its last 1 + those + gamma - 1); `vegas
+ rest` adds back what vegas's entries leave out as that earlier step saw it, out = (1 - m) attn(q) + r, m the
probability and r the probability-weighted V outside the entries, per query head. In the global layers drafts and
target attend in fp32 in torch. Per budget and lag: the share of the target's attention that StreamingLLM's and
vegas's entries hold (averaged over the global layers and query heads), and per draft the greedy agreement (the same
argmax as the target) and 1 - the total variation between the two sampling distributions at T 0.7, top-p 0.9 (what
rejection sampling accepts). Writes the run under `--label` into benchmarks/results/draft_agreement.json and prints
the file's table.
"""

from __future__ import annotations

import argparse
import math
import sys
from itertools import product
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from tables import save_run, text  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.config import GLOBAL  # noqa: E402
from magicdec.corpus import load_texts  # noqa: E402
from magicdec.kv.hybrid import make_cache  # noqa: E402
from magicdec.kv.sparse import DEFAULT_SINK  # noqa: E402
from magicdec.kv.vegas import select, vegas_top, vegas_window  # noqa: E402
from magicdec.loading import load_model, model_identity  # noqa: E402
from magicdec.model import Attention, gather  # noqa: E402
from magicdec.sampling import RowParams, SamplingParams, probs_from_logits  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "draft_agreement.json"
CHUNK = 512  # prefill forward size
DRAFTS = ("streaming", "vegas", "vegas + rest")
CHOICES = ("streaming", "vegas")  # the drafts whose entries differ ("vegas + rest" reads vegas's)
SAMPLING = RowParams.of([SamplingParams(temperature=0.7, top_p=0.9)], [0], "cpu")
ORIGINAL = Attention.attend_cached


class Probe:
    """Stands in for the global layers' attention (`Attention.attend_cached`). As the target (`draft` None) it
    attends over every position, notes the share of its attention each draft's entries hold, and keeps, per budget,
    vegas's choice and what it leaves out; as a draft (`draft`: draft, budget, lag) it attends over that draft's
    entries."""

    def __init__(self, layers: list[int], budgets: list[int], lags: list[int]):
        self.layers, self.budgets, self.lags = set(layers), budgets, lags
        self.draft: tuple[str, int, int] | None = None
        self.step, self.pos = 0, 0
        self.top: dict[tuple[int, int, int], Tensor] = {}  # (budget, step, layer): vegas's chosen positions
        self.rest: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}  # m [KV, G], r [KV, G, hd]
        self.held: dict[tuple[str, int, int], list[float]] = {}  # (draft, budget, lag): per step and layer

    def kept(self, draft: str, budget: int, L: int, layer: int, step: int) -> Tensor:
        """The positions of [0, L) `draft` reads at self.pos over `budget` entries, chosen at `step`: [L] bool."""
        keep = torch.zeros(L, dtype=torch.bool)
        keep[:DEFAULT_SINK] = True
        if draft == "streaming":
            keep[max(0, self.pos + 1 - (budget - DEFAULT_SINK)) : self.pos + 1] = True
        else:
            keep[self.top[budget, step, layer]] = True
            keep[max(0, self.pos + 1 - vegas_window(budget)) : self.pos + 1] = True
        return keep

    def attend(self, module: Attention, xq, xk, xv, mask, bias, cache, observer, shares=None, ragged=None):
        if module.layer not in self.layers:
            return ORIGINAL(module, xq, xk, xv, mask, bias, cache, observer, shares, ragged)
        keys, values, table = cache.update(module.layer, xk, xv)
        L = mask.shape[-1]
        if table is not None:
            keys, values = gather(keys, table, L), gather(values, table, L)
        K, V = keys.float(), values.float()  # [1, KV, L, hd]
        q = xq.reshape(1, module.n_kv, -1, module.hd).float()  # [1, KV, G, hd]: one new token
        scores = q @ K.transpose(-1, -2) / math.sqrt(module.hd)
        if self.draft is None:
            p = scores.masked_fill(torch.arange(L) > self.pos, -math.inf).softmax(-1)
            self.measure(module.layer, p, V, L)
            return p @ V
        draft, budget, lag = self.draft
        step = self.step - lag
        out = scores.masked_fill(~self.kept(draft, budget, L, module.layer, step), -math.inf).softmax(-1) @ V
        if draft == "vegas + rest":
            m, r = self.rest[budget, step, module.layer]
            out = (1 - m)[None, ..., None] * out + r[None]
        return out

    def measure(self, layer: int, p: Tensor, V: Tensor, L: int) -> None:
        """The share of the target's attention p [1, KV, G, L] each earlier choice holds (averaged over the query
        heads); then, per budget, vegas's choice at this step (`magicdec.kv.vegas.select`, as after a verification)
        and the probability and weighted V outside it, per query head."""
        if self.step >= max(self.lags):
            for key in product(CHOICES, self.budgets, self.lags):
                keep = self.kept(*key[:2], L, layer, self.step - key[2])
                self.held.setdefault(key, []).append(float((p * keep).sum(-1).mean()))
        shares, lens = p.sum(2)[None], torch.tensor([self.pos + 1])  # [1 layer, 1 row, KV, L]: as a verification's
        for budget in self.budgets:
            self.top[budget, self.step, layer] = select(shares, lens, vegas_top(budget), vegas_window(budget))[0, 0]
            outside = p * ~self.kept("vegas", budget, L, layer, self.step)
            self.rest[budget, self.step, layer] = (outside.sum(-1)[0], (outside @ V)[0])



def agreement(probe: Probe, model, ids: list[int], context: int, steps: int) -> dict[tuple, list]:
    """Per (draft, budget, lag): per measured step, (same argmax, 1 - total variation)."""
    cache = make_cache(model.cfg, 1, context + steps + 1, model.dtype, "cpu", max_q=CHUNK)
    out: dict[tuple, list] = {key: [] for key in product(DRAFTS, probe.budgets, probe.lags)}
    with torch.inference_mode():
        for start in range(0, context, CHUNK):
            chunk = torch.tensor([ids[start : min(start + CHUNK, context)]])
            model(chunk, cache, logits_at=torch.zeros(1, 1, dtype=torch.long))
            cache.commit(chunk.shape[1])
        Attention.attend_cached = lambda module, *rest: probe.attend(module, *rest)
        try:
            for k in range(steps):
                probe.step, probe.pos = k, context + k
                token = torch.tensor([[ids[context + k]]])
                drafted = {}
                for key in out if k >= max(probe.lags) else ():
                    probe.draft = key
                    drafted[key] = model(token, cache)[0, -1]
                probe.draft = None
                target = model(token, cache)[0, -1]
                cache.commit(1)
                p = probs_from_logits(target[None, None], SAMPLING)
                for key, logits in drafted.items():
                    tv = 0.5 * float((probs_from_logits(logits[None, None], SAMPLING) - p).abs().sum())
                    out[key].append((float(logits.argmax() == target.argmax()), 1 - tv))
        finally:
            Attention.attend_cached = ORIGINAL
    return out


def name(key: tuple) -> str:
    draft, budget, lag = key
    return f"{draft} {budget} lag {lag}"


def table(doc: dict) -> str:
    """Per run, budget and lag: the attention StreamingLLM's / vegas's entries hold, then each draft's greedy
    agreement / 1 - total variation."""
    rows = []
    for label, run in doc["runs"].items():
        for budget, lag in product(run["budgets"], run["lags"]):
            held = "/".join(f"{run['held'][name((d, budget, lag))]:.2f}" for d in CHOICES)
            rows.append({"run": label, "budget": budget, "lag": lag, "held": held,
                         **{d: "{:.3f}/{:.3f}".format(*run["agreement"][name((d, budget, lag))]) for d in DRAFTS}})
    return text(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model path or short name ('': the default, SmolLM2)")
    ap.add_argument("--label", required=True, help="the run's name in the result file")
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/data/pg19_dev.jsonl"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lags", default="1,3", help="steps between a choice and the draft token it serves")
    ap.add_argument("--texts", default="2,5,9", help="the corpus's texts to read, by index")
    ap.add_argument("--budgets", default="256,512")
    args = ap.parse_args()
    loaded = load_model(args.model or None, device="cpu", dtype=torch.bfloat16)
    model, texts = loaded.model, load_texts(args.corpus)
    budgets, lags = [int(b) for b in args.budgets.split(",")], [int(n) for n in args.lags.split(",")]
    points: dict[tuple, list] = {}
    held: dict[tuple, list] = {}
    for i in map(int, args.texts.split(",")):
        ids = loaded.tokenizer.encode(texts[i][len(texts[i]) // 3 :])[: args.context + args.steps]
        probe = Probe(model.cfg.layers_of(GLOBAL), budgets, lags)
        for key, got in agreement(probe, model, ids, args.context, args.steps).items():
            points.setdefault(key, []).extend(got)
        for key, got in probe.held.items():
            held.setdefault(key, []).extend(got)
    run = {"model": model_identity(args.model or None), "machine": machine_info("cpu"), "context": args.context,
           "steps": args.steps, "texts": args.texts, "budgets": budgets, "lags": lags,
           "measured": len(next(iter(points.values()))),
           "held": {name(key): sum(got) / len(got) for key, got in held.items()},
           "agreement": {name(key): [sum(x[j] for x in got) / len(got) for j in (0, 1)] for key, got in points.items()}}
    print(table(save_run(RESULT, args.label, run)))
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
