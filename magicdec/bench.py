"""`magicdec bench`: sweep batch x context x drafter x budget x gamma, with resumable JSON and plots.

The distinct prompts of a context are prefilled once, cold, into the LLM's prefix cache; every (batch, decode
configuration) then runs through the engine from copies of that prefill, the batch tiling the distinct prompts, side by
side with plain decoding in the same process, so speedups are ratios of measurements taken minutes apart on the same
machine state. With `repeats` > 1 the configurations of a point run in turn that many times (plain, auto, ..., plain,
auto, ...) and each keeps its median run: on a machine whose speed drifts, a ratio of medians of interleaved runs is
steadier than one of two single runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from magicdec.autoplan import Choice
from magicdec.calibrate.acceptance import sampling_params
from magicdec.calibrate.machine import machine_info
from magicdec.calibrate.quick import planning_profile
from magicdec.calibrate.timing import memory_read_rate
from magicdec.cli import llm_options
from magicdec.corpus import cut_prompts, load_texts
from magicdec.engine import LLM
from magicdec.errors import InvalidRequestError, OutOfMemoryError
from magicdec.jsonfile import read_json_object
from magicdec.kv.blocks import BLOCK_SIZE
from magicdec.loading import model_identity
from magicdec.memory import available_bytes, check_fits
from magicdec.phases import PhaseRecorder
from magicdec.planner import format_table
from magicdec.planner.report import save_figure
from magicdec.runner import ModelRunner
from magicdec.sampling import SamplingParams
from magicdec.speculative import MODES, SpeculativeConfig

DRAFTERS = ("none", "self-streaming", "self-snapkv", "self-vegas", "self-quant", "auto")
POSITIONS = (None, "reindex", "original")  # None: the default per cache kind


@dataclass
class BenchGrid:
    batches: list[int]
    contexts: list[int]
    drafters: list[str]
    budgets: list[int]
    gammas: list[int]
    modes: list[str]
    new_tokens: int
    n_texts: int = 14
    distinct_prompts: int | None = None  # prefill this many prompts and tile them up to the batch
    positions: list[str | None] = field(default_factory=lambda: [None])  # sparse-cache key positions; None: default
    draft_vocabs: list[int] = field(default_factory=lambda: [0])  # draft head sizes (0: the whole vocabulary)
    vocab_corpus: str | None = None  # the text draft heads count tokens in
    # per-row length thresholds (None: off; "auto": priced by the planner, for draft auto only)
    draft_stops: list[float | str | None] = field(default_factory=lambda: [None])
    repeats: int = 1  # runs of each configuration, interleaved; a point keeps its median run

    def __post_init__(self) -> None:
        """Refuse names and values the sweep cannot run, before it loads or prefills anything."""
        for name, values, allowed in (("mode", self.modes, MODES), ("drafter", self.drafters, DRAFTERS),
                                      ("positions", self.positions, POSITIONS)):
            unknown = [v for v in values if v not in allowed]
            if unknown or not values:
                choices = ", ".join("default" if v is None else v for v in allowed)
                raise InvalidRequestError(f"unknown {name} {', '.join(map(str, unknown)) or '(none given)'}; "
                                          f"choose from {choices}")
        for cfg in self.configs():
            if cfg["draft"] not in ("none", "auto"):
                speculative_config(cfg)  # checks budget and gamma

    def configs(self) -> list[dict]:
        """Decode configurations at one (batch, context) point; plain decoding first."""
        out = []
        for mode in self.modes:
            if "none" in self.drafters:
                out.append({"mode": mode, "draft": "none", "budget": 0, "gamma": 0})
            if "auto" in self.drafters:  # the planner picks drafter, budget, gamma and head (or plain decoding)
                out += [{"mode": mode, "draft": "auto", "budget": 0, "gamma": 0, **self._head(v),
                         **({"draft_stop": stop} if stop else {})}
                        for v, stop in itertools.product(self.draft_vocabs, self.draft_stops)]
            for d in self.drafters:
                if d in ("none", "auto"):
                    continue
                # a draft over the whole context has no budget (0); it and a Vegas draft (which reads keys at their
                # own positions) have no sparse-cache positions
                budgets = [0] if d == "self-quant" else self.budgets
                positions = [None] if d in ("self-quant", "self-vegas") else self.positions
                out += [{"mode": mode, "draft": d, "budget": b, "gamma": g, **({"positions": pos} if pos else {}),
                         **self._head(v), **({"draft_stop": stop} if stop else {})}
                        for b, g, pos, v, stop in itertools.product(budgets, self.gammas, positions,
                                                                    self.draft_vocabs, self.draft_stops)
                        if stop != "auto"]
        return out

    def _head(self, draft_vocab: int) -> dict:
        """A configuration's draft-head settings (none for the whole vocabulary)."""
        return {"draft_vocab": draft_vocab, "vocab_corpus": self.vocab_corpus} if draft_vocab else {}


def speculative_config(cfg: dict) -> SpeculativeConfig:
    """The speculative settings of one fixed-drafter configuration of `BenchGrid.configs`."""
    reindex = {"reindex": True, "original": False}.get(cfg.get("positions"))
    return SpeculativeConfig.drafting(cfg["draft"], cfg["budget"], gamma=cfg["gamma"], reindex=reindex,
                                      draft_vocab=cfg.get("draft_vocab", 0), vocab_corpus=cfg.get("vocab_corpus"),
                                      draft_stop=cfg.get("draft_stop"))


def point_key(batch: int, context: int, cfg: dict) -> str:
    pos = f"-{cfg['positions']}" if cfg.get("positions") else ""
    vocab = f"-V{cfg['draft_vocab']}" if cfg.get("draft_vocab") else ""
    stop = f"-stop{cfg['draft_stop']}" if cfg.get("draft_stop") else ""
    return f"B{batch}-S{context}-{cfg['mode']}-{cfg['draft']}-K{cfg['budget']}-g{cfg['gamma']}{pos}{vocab}{stop}"


def _save(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def run_bench(args, grid: BenchGrid) -> dict:
    """Run every point of the grid not already in args.out; write results after each point; plot."""
    if grid.distinct_prompts and any(b % min(b, grid.distinct_prompts) for b in grid.batches):
        raise InvalidRequestError(f"every batch size must be a multiple of --distinct-prompts {grid.distinct_prompts}")
    out = Path(args.out)
    texts = load_texts(args.corpus)[: grid.n_texts]
    doc = load_results(out)  # a bad results file stops the run before the model loads
    llm = LLM(args.model, **llm_options(args))
    doc, save = _open_results(doc, llm, grid)
    configs = grid.configs()
    bar = tqdm(total=len(grid.batches) * len(grid.contexts) * len(configs) * grid.repeats, desc="bench", unit="run",
               file=sys.stderr)
    prefilled = None  # (context, distinct prompts, the prompts, prefill seconds), held in the prefix cache
    for context, batch in itertools.product(grid.contexts, grid.batches):
        todo = [c for c in configs if point_key(batch, context, c) not in doc["points"]]
        bar.update((len(configs) - len(todo)) * grid.repeats)
        if not todo:
            continue
        # A context the model cannot hold with the new tokens (8192 + 128 on an 8k model) is shortened to the longest
        # that fits; the point keeps its nominal name and records the length used.
        ctx = min(context, llm.max_model_len - grid.new_tokens)
        distinct = min(batch, grid.distinct_prompts or batch)
        try:
            _check_fits(llm, batch, ctx + grid.new_tokens, ctx, distinct)
            if prefilled is None or prefilled[:2] != (ctx, distinct):
                bar.set_postfix_str(f"prefill {distinct} x {ctx}")
                prefilled = (ctx, distinct, *_prefill(llm, texts, distinct, ctx))
        except (OutOfMemoryError, InvalidRequestError) as e:
            doc["points"].update({point_key(batch, context, c): {"skipped": str(e)} for c in todo})
            bar.update(len(todo) * grid.repeats)
            save(out, doc)
            continue
        point = {"batch": batch, "context": context, "context_used": ctx, "distinct_prompts": distinct,
                 "prefill_s": prefilled[3]}
        rows = [prefilled[2][i % distinct] for i in range(batch)]
        runs: dict[str, list[dict]] = {point_key(batch, context, c): [] for c in todo}
        for repeat, cfg in itertools.product(range(grid.repeats), todo):
            key = point_key(batch, context, cfg)
            bar.set_postfix_str(key)
            runs[key].append(point | cfg | _run_config(llm, args, grid, rows, ctx, cfg))
            if repeat == grid.repeats - 1:
                doc["points"][key] = median_run(runs[key])
                save(out, doc)
            bar.update(1)
    llm.clear_prefix_cache()
    bar.close()
    add_speedups(doc)
    save(out, doc)
    if llm.model.tp is None or llm.model.tp.is_main:
        _report(doc, out, args.plots)
    return doc


def _open_results(doc: dict, llm: LLM, grid: BenchGrid) -> tuple[dict, Callable[[Path, dict], None]]:
    """The results so far (`doc`, a resumed run's points kept) with this run's machine and settings, and the function
    that saves them. Under tensor parallelism every rank runs the points left in rank 0's file, and only rank 0
    writes."""
    tp = llm.model.tp
    if tp is not None:
        doc = tp.gather(doc if tp.is_main else None)[0]
    sampled = sampling_params("sampling", 1)
    doc["machine"] = machine_info(llm.model.device)
    doc["settings"] = {**asdict(grid), "model": model_identity(llm.loaded.source), "dtype": str(llm.model.dtype),
                       "dtype_choice": str(llm.loaded.dtype_choice), "kv_dtype": str(llm.kv_dtype),
                       "attention": llm.attention, "linear": llm.linear, "kernels": llm.kernels,
                       "layer_ops": llm.layer_ops, "cascade": llm.cascade,
                       "sampling": {k: getattr(sampled, k) for k in ("temperature", "top_p", "top_k")}}
    return doc, _save if tp is None or tp.is_main else lambda path, doc: None


def _check_fits(llm: LLM, batch: int, max_model_len: int, ctx: int, distinct: int) -> None:
    """Raise OutOfMemoryError unless `batch` slots of `max_model_len` tokens fit, on every rank under tensor
    parallelism: their state beside the KV blocks, and in the blocks the `distinct` prefilled prompts of `ctx` tokens
    (shared by the rows that decode them) with every row's new tokens."""
    llm.free_engine()  # the previous point's caches do not stay beside this one's
    config = dataclasses.replace(llm.config, max_num_seqs=batch, max_model_len=max_model_len)
    needed = ModelRunner.memory_bytes(llm.model, config, None)
    tokens = distinct * ctx + batch * (max_model_len - ctx + BLOCK_SIZE)
    tp = llm.model.tp
    if tp is not None and not tp.min_int(needed <= available_bytes(llm.model.device)):
        raise OutOfMemoryError(f"batch {batch} x {max_model_len} tokens does not fit on every rank")  # skip on all
    if tokens > llm.kv.capacity_tokens:
        raise OutOfMemoryError(f"batch {batch} x {max_model_len} tokens needs {tokens} tokens of KV blocks; the KV "
                               f"cache holds {llm.kv.capacity_tokens} (--kv-cache-gb)")
    check_fits(needed, llm.model.device, f"batch {batch} x {max_model_len} tokens")


def _prefill(llm: LLM, texts: list[str], distinct: int, ctx: int) -> tuple[list[list[int]], float]:
    """`distinct` prompts of `ctx` tokens, prefilled cold into the LLM's prefix cache; and the seconds it took."""
    prompts = cut_prompts(llm.tokenizer, texts, distinct, ctx)
    llm.clear_prefix_cache()  # a shorter context's prompts are prefixes of these
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=1))
    return prompts, time.perf_counter() - t0


def _run_config(llm: LLM, args, grid: BenchGrid, rows: list[list[int]], ctx: int, cfg: dict) -> dict:
    """Decode `rows` (prefilled prompts of `ctx` tokens) with one configuration; the run's record."""
    batch = len(rows)
    params = [sampling_params(cfg["mode"], grid.new_tokens, seed=i) for i in range(batch)]
    spec = None
    if cfg["draft"] == "auto":
        # planned for these rows: greedy rows of one prompt decode alike and count once (`LLM.plan`)
        hardware = getattr(args, "hardware", None) or planning_profile(llm.model, llm.kv_dtype)
        spec = SpeculativeConfig("auto", hardware=hardware, mode=cfg["mode"], draft_vocab=cfg.get("draft_vocab", 0),
                                 vocab_corpus=cfg.get("vocab_corpus"), draft_stop=cfg.get("draft_stop"))
    elif cfg["draft"] != "none":
        spec = speculative_config(cfg)
    phases = getattr(args, "phases", None)
    recorder = PhaseRecorder(phases) if phases else None
    llm.generate(prompt_token_ids=rows, params=params, speculative=spec, phases=recorder)
    stats = llm.last_stats
    # the memory's read rate right after the run: a VM's moves by up to 2x within an hour, and this places the run
    read_gbs = memory_read_rate(llm.model.device) / 1e9
    return _auto_record(llm.last_auto) | {
        "throughput": stats.decode_tok_s, "tokens_per_step": stats.tokens_per_step,
        "acceptance": stats.acceptance_rate, "accepted_hist": stats.accepted_hist,
        "drafted_tokens": stats.drafted_tokens, "verified_per_token": stats.verified_per_token,
        "steps": stats.steps, "gamma_changes": stats.gamma_changes, "decode_s": stats.decode_s,
        "draft_s": stats.draft_s, "verify_s": stats.verify_s, "max_batch": stats.max_batch,
        "peak_memory_gib": stats.peak_memory_bytes / 1024**3, "read_bandwidth_gbs": read_gbs,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **({"phases": stats.phases} if stats.phases else {}),
    }


def _auto_record(auto: Choice | None) -> dict:
    """What `auto` chose and predicted, and where it drafted the prediction again at the acceptance the run learned
    (the cost model's error alone); nothing for other drafters."""
    if auto is None:
        return {}
    plan, spec = auto.plan, auto.speculative
    head = f" V={plan.draft_vocab}" if plan.draft_vocab else ""
    record = {"chosen": f"{spec.draft} K={spec.budget} g={plan.gamma}{head}" if spec else "ar",
              "predicted_speedup": plan.predicted_speedup, "predicted_throughput": plan.predicted_throughput}
    if auto.replanner is not None:
        live, context = auto.replanner.planned
        record |= {"learned_alpha": auto.replanner.alpha(context), "time_scale": auto.replanner.spec_time_scale(),
                   "predicted_throughput_learned": auto.replanner.plan_at(live, context).predicted_throughput}
    return record


def _report(doc: dict, out: Path, plots: str | None) -> None:
    print(format_results(doc))
    for p in plot_results(doc, Path(plots) if plots else out.parent, out.stem):
        print(f"plot written to {p}", file=sys.stderr)


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle one of an even count), with every run's throughput."""
    median = statistics.median_low(r["throughput"] for r in runs)
    point = next(r for r in runs if r["throughput"] == median)
    return {**point, "throughput_runs": [r["throughput"] for r in runs]} if len(runs) > 1 else point


def load_results(path: Path) -> dict:
    """The results file of an earlier run, to resume (a fresh one when `path` does not exist)."""
    if not path.exists():
        return {"points": {}}
    try:
        doc = read_json_object(path, "bench results file")
    except ValueError as e:
        raise InvalidRequestError(f"--out {e}: move it away or choose another --out") from None
    points = doc.setdefault("points", {})
    if not (isinstance(points, dict) and all(isinstance(p, dict) for p in points.values())):
        raise InvalidRequestError(f"--out {path}: not a bench results file ('points' must map names to objects)")
    return doc


def add_speedups(doc: dict) -> None:
    """Speedup of each speculative point over plain decoding at the same batch, context and mode."""
    pts = doc["points"]
    for p in pts.values():
        if "throughput" not in p or p["draft"] == "none":
            continue
        ar = pts.get(point_key(p["batch"], p["context"], {"mode": p["mode"], "draft": "none", "budget": 0, "gamma": 0}))
        if ar and "throughput" in ar:
            p["speedup"] = p["throughput"] / ar["throughput"]


def best_points(doc: dict) -> list[dict]:
    """Per (mode, batch, context): plain decoding and the best speculative configuration."""
    groups: dict[tuple, list[dict]] = {}
    for p in doc["points"].values():
        if "throughput" in p:
            groups.setdefault((p["mode"], p["batch"], p["context"]), []).append(p)
    rows = []
    for (mode, batch, context), ps in sorted(groups.items()):
        ar = next((p for p in ps if p["draft"] == "none"), None)
        auto = next((p for p in ps if p["draft"] == "auto"), None)
        spec = [p for p in ps if p["draft"] not in ("none", "auto")]
        best = max(spec, key=lambda p: p["throughput"], default=None)
        rows.append({"mode": mode, "batch": batch, "context": context,
                     "ar_tok_s": ar["throughput"] if ar else None,
                     "best": f"{best['draft']} K={best['budget']} g={best['gamma']}" if best else None,
                     "best_tok_s": best["throughput"] if best else None,
                     "tokens_per_step": best["tokens_per_step"] if best else None,
                     "speedup": best.get("speedup") if best else None,
                     **({"auto": auto["chosen"], "auto_speedup": auto.get("speedup")} if auto else {})})
    return rows


def format_results(doc: dict) -> str:
    """The best configuration per cell against plain decoding, then the range of the memory's read rate after the runs
    (where recorded): a spread that wide between runs of a VM also spreads their throughputs."""
    rows = best_points(doc)
    if not rows:
        return "no results"
    rates = [p["read_bandwidth_gbs"] for p in doc["points"].values() if "read_bandwidth_gbs" in p]
    spread = f"\nmemory read rate after the runs: {min(rates):.1f}-{max(rates):.1f} GB/s" if rates else ""
    return format_table(rows) + spread


def plot_results(doc: dict, folder: Path, stem: str) -> list[Path]:
    """Throughput and speedup against batch (a line per context), acceptance against budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in best_points(doc) if r["ar_tok_s"]]
    if not rows:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, context) in sorted({(r["mode"], r["context"]) for r in rows}):
        rs = sorted((r for r in rows if r["mode"] == mode and r["context"] == context), key=lambda r: r["batch"])
        xs = [r["batch"] for r in rs]
        axes[0].plot(xs, [r["ar_tok_s"] for r in rs], "--", marker="o", label=f"AR S={context} {mode}")
        if any(r["best_tok_s"] for r in rs):
            axes[0].plot(xs, [r["best_tok_s"] or 0 for r in rs], marker="s", label=f"spec S={context} {mode}")
            axes[1].plot(xs, [r["speedup"] or 0 for r in rs], marker="s", label=f"S={context} {mode}")
    axes[0].set(xscale="log", xlabel="batch", ylabel="tokens/s", title="decode throughput")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(xscale="log", xlabel="batch", ylabel="speedup over AR", title="best speculative config")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # a grid of plain decoding and auto alone draws no speedup lines
            ax.legend(fontsize=7)
    written.append(save_figure(fig, folder / f"{stem}_throughput.png", dpi=110))

    acc = [p for p in doc["points"].values() if p.get("draft", "none") not in ("none", "auto") and "tokens_per_step" in p]
    if acc:
        fig, ax = plt.subplots(figsize=(6, 4))
        batch = max(p["batch"] for p in acc)  # one line per setting, at one batch size
        acc = [p for p in acc if p["batch"] == batch]
        for key in sorted({(p["draft"], p["mode"], p["gamma"], p["context"]) for p in acc}):
            ps = sorted((p for p in acc if (p["draft"], p["mode"], p["gamma"], p["context"]) == key
                         and not p.get("positions")), key=lambda p: p["budget"])
            if not ps:
                continue
            ax.plot([p["budget"] for p in ps], [p["tokens_per_step"] for p in ps], marker="o",
                    label=f"{key[0]} {key[1]} g={key[2]} S={key[3]}")
        ax.set(xscale="log", xlabel="draft budget (KV entries)", ylabel="tokens per verify step",
               title="acceptance against budget")
        ax.legend(fontsize=6)
        written.append(save_figure(fig, folder / f"{stem}_acceptance.png", dpi=110))
    return written
