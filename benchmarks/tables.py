"""The tables of benchmarks/README.md, generated from the result files in benchmarks/results.

Each table sits between `<!-- table:NAME -->` and `<!-- /table -->` in the README and is rendered from the
current result file of its benchmark (TABLES below), so no number in a table is typed by hand.

    python benchmarks/tables.py            # rewrite the tables in place
    python benchmarks/tables.py --check    # exit 1 (naming the stale tables) if the README differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from cpu_grid import grid_rows, markdown  # noqa: E402

from magicdec.planner.report import format_table  # noqa: E402

README = HERE / "README.md"
RESULTS = HERE / "results"
BLOCK = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def text(rows: list[dict]) -> str:
    """Rows as a fenced table, a column for every key of any row (in the order first met)."""
    return "```\n" + format_table(rows, list(dict.fromkeys(k for row in rows for k in row))) + "\n```"


def model(doc: dict) -> str:
    """The model a result file names (top level or in its settings), as `name (sha256 prefix)`."""
    m = doc.get("model") or doc.get("settings", {}).get("model")
    return f"`{m['name']}` (sha256 `{m['sha256']}`)" if isinstance(m, dict) else "the embedded default model"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms"


def ar() -> str:
    return text([{"batch": p["batch"], "context": p["context"], "threads": p.get("threads"),
                  "magicdec tok/s": p["magicdec"]["tok_s"], "transformers tok/s": p.get("hf", {}).get("tok_s"),
                  "ratio": f"{p['speedup']:.2f}x" if "speedup" in p else None,
                  "magicdec / floor": p["magicdec"]["step_over_floor"],
                  "transformers / floor": p.get("hf", {}).get("step_over_floor")} for p in load("ar")["points"]])


def dtype_linear() -> str:
    doc, rows = load("dtype"), {}
    for p in doc["linear"]:
        rows.setdefault(f"{p['layer']} {p['in']}->{p['out']}", {})[f"{p['rows']} rows"] = p["bf16_over_fp32"]
    return text([{"bf16 / fp32 time": layer, **cells} for layer, cells in rows.items()])


def dtype_forward() -> str:
    return text([{"B": p["batch"], "L": p["context"], "q": p["q"], "fp32": ms(p["seconds"]["fp32"]),
                  "bf16": ms(p["seconds"]["bf16"]), "bf16 / fp32": p["bf16_over_fp32"]} for p in load("dtype")["forward"]])


ATTENTION = {"SDPA, bias": "sdpa additive bias", "bf16 matmuls": "matmul, bf16 softmax",
             "native kernel": "native kernel (magicdec)", "kernel on AMX tiles": "native kernel on AMX tiles"}


def attention(prefill: bool, name: str = "attention") -> str:
    rows = []
    for p in load(name)["points"]:
        if (p["q"] >= 128) != prefill:
            continue
        v = p["variants"]
        row = {"B": p["batch"], "L": p["context"], "q": p["q"]}
        for label, key in ATTENTION.items():
            if key in v:  # tiles: where the CPU has AMX
                row[label] = ms(v[key]["seconds"]) + ("" if prefill else f" ({v[key]['gb_per_s']:.1f} GB/s)")
        row["matmuls / kernel"] = f"{v[ATTENTION['bf16 matmuls']]['seconds'] / v[ATTENTION['native kernel']]['seconds']:.2f}x"
        if not prefill:
            row[".sum()"] = f"{v['read baseline: .sum() of K and V']['gb_per_s']:.0f} GB/s"
        rows.append(row)
    return text(rows)


def linear(result: str, metric: str, base: str, new: str) -> str:
    """A linear-layer benchmark by rows and layer: `metric` of `base` / of `new` (and new's speedup)."""
    rows: dict[int, dict] = {}
    for p in load(result)["layers"]:
        v, fmt = p[metric], ".1f" if metric == "gb_per_s" else ".0f"
        rows.setdefault(p["rows"], {"rows": p["rows"]})[f"{p['layer']} {p['in']}->{p['out']}"] = (
            f"{v[base]:{fmt}} / {v[new]:{fmt}} ({p['seconds'][base] / p['seconds'][new]:.2f}x)")
    return text(list(rows.values()))


def bf16_flips() -> str:
    rows: dict[tuple, dict] = {}
    for r in load("bf16_flips")["runs"]:
        rows.setdefault((r["batch"], r["dtype"]), {"rows per batch": r["batch"], "dtype": r["dtype"]})[
            f"q = {r['q']}"] = f"{r['flips']} / {r['compared']}"
    return text(list(rows.values()))


def cpu_grid() -> str:
    return markdown(grid_rows(load("cpu_grid")))


def llamacpp() -> str:
    doc = load("llamacpp")
    rows = []
    for t in doc["table"]:
        cell = [r for r in doc["runs"] if (r["pl"], r["pp"]) == (t["batch"], t["context"]) and r["weights"] == "bf16"]
        best = {fa: max((r["speed_tg"] for r in cell if r["flash_attn"] == fa), default=None) for fa in ("on", "off")}
        rows.append({"B": t["batch"], "S": t["context"], "llama.cpp fa on": best["on"], "llama.cpp fa off": best["off"],
                     "magicdec AR": t.get("magicdec_none_tok_s"), "magicdec auto": t.get("magicdec_auto_tok_s"),
                     "AR / llama.cpp": t.get("magicdec_none_over_llamacpp"),
                     "auto / llama.cpp": t.get("magicdec_auto_over_llamacpp")})
    return text(rows)


def avx2_storage() -> str:
    """fp16 and bf16 storage under fp32 arithmetic (the AVX2 kernels): greedy flips against fp32, and speed."""
    speed = load("linear_avx2")
    rows = []
    for r in load("avx2_storage_flips")["runs"]:
        row = {"storage": r["storage"], "greedy flips vs fp32": f"{r['flips']} / {r['compared']}",
               "max logit error": f"{r['max_rel_logit_err']:.1e}"}
        for a in speed["attention"]:
            row[f"attention B={a['batch']} q={a['q']}"] = ms(a["seconds"][f"kernel {r['storage']}"])
        rows.append(row)
    return text(rows)


def avx2_grid(suffix: str = "") -> str:
    """The AVX2 kernels (fp16 storage) against fp32 torch limited to AVX2, with the AR step over its floor at the
    read bandwidth of the quick profile measured in the same run (`suffix`: of the result files)."""
    bandwidth = load(f"quick_profile_avx2{suffix}")["mem_bandwidth"]
    return markdown(grid_rows(load(f"cpu_grid_avx2{suffix}"), load(f"cpu_grid_avx2_fp32{suffix}"), bandwidth),
                    label="AVX2")


def avx2_llamacpp(suffix: str = "") -> str:
    doc = load(f"llamacpp_avx2{suffix}")
    rows = []
    for t in doc["table"]:
        cell = {(r["weights"], r["flash_attn"]): r for r in doc["runs"]
                if (r["pl"], r["pp"]) == (t["batch"], t["context"])}
        row = {"B": t["batch"], "S": t["context"]}
        row.update({f"llama.cpp {w} fa {fa}": r["speed_tg"] for (w, fa), r in sorted(cell.items())})
        row.update({"magicdec AR": t.get("magicdec_none_tok_s"), "magicdec auto": t.get("magicdec_auto_tok_s"),
                    "AR / llama.cpp": t.get("magicdec_none_over_llamacpp"),
                    "auto / llama.cpp": t.get("magicdec_auto_over_llamacpp")})
        rows.append(row)
    return text(rows)


def serving_8k() -> str:
    from bench_serving import table

    return "```\n" + table(load("serving_8k")["results"]) + "\n```"


def prefix_hit() -> str:
    """bench_prefix_hit.py: a prefix-cache hit against the cold prefill it replaces."""
    from bench_prefix_hit import table

    return "```\n" + table(load("prefix_hit")["results"]) + "\n```"


def chat(name: str) -> str:
    """bench_chat.py's per-turn and per-run tables of results/NAME.json (a placeholder until it exists)."""
    if not (RESULTS / f"{name}.json").exists():
        return f"No results yet (`results/{name}.json`): run the command above."
    from bench_chat import summary_table, table

    doc = load(name)
    return f"```\n{table(doc['results'])}\n\n{summary_table(doc['results'])}\n```\n\nModel: {model(doc)}."


def serving_trace() -> str:
    from serving_trace import table

    return table(load("serving_trace")["runs"])


def tp() -> str:
    rows = []
    for r in load("tp")["runs"]:
        for mode in ("ar", "spec"):
            m, p = r[mode], r["predicted"][mode]
            rows.append({"TP": r["tp"], "threads/rank": r["threads_per_rank"], "mode": mode,
                         "tok/s": m["decode_tok_s"], "predicted": p["decode_tok_s"], "step": ms(m["step_s"]),
                         "predicted step": ms(p["step_s"]), "communication": f"{m['comm_share']:.0%}",
                         "predicted comm": f"{p['comm_s_per_step'] / p['step_s']:.0%}"})
    return text(rows)


def validate_planner() -> str:
    s = load("validate_planner")["summary"]
    parts = [("seconds per round (the cost model)", "round_time_rel_error"), ("rounds (the acceptance model)",
             "rounds_rel_error"), ("throughput (both)", "throughput_rel_error"), ("speedup over AR", "speedup_rel_error")]
    return text([{"measure": label, "median error": f"{s[k]['median']:.1%}", "worst": f"{s[k]['worst']:.1%}"}
                 for label, k in parts]) + f"\n\n{s['n_points']} points; the planner's choice within 10% of the best " \
                                          f"measured configuration in {s['choice_within_10pct']} cells."


def _cells(doc: dict) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = {}
    for p in doc["points"].values():
        if "throughput" in p:
            cells.setdefault((p["batch"], p["context_used"], p["mode"]), []).append(p)
    return cells


def throughput() -> str:
    rows = []
    for (b, s, mode), pts in sorted(_cells(load("throughput")).items(), key=lambda c: (-c[0][1], -c[0][0])):
        ar_ = next(p for p in pts if p["draft"] == "none")
        spec = [p for p in pts if p["draft"] not in ("none", "auto")]
        best = max(spec, key=lambda p: p["throughput"])
        auto = next((p for p in pts if p["draft"] == "auto"), None)
        rows.append({"batch": b, "prompt": s, "AR tok/s": ar_["throughput"],
                     "best speculative": f"{best['draft']} K={best['budget']} g={best['gamma']}",
                     "tok/s": best["throughput"], "tokens/step": best["tokens_per_step"],
                     "speedup": f"{best['throughput'] / ar_['throughput']:.2f}x",
                     "auto speedup": f"{auto['throughput'] / ar_['throughput']:.2f}x" if auto else None})
    return text(rows)


def draft_vocab() -> str:
    """Gemma 3 self-speculation with its whole LM head against a draft head over the 32k most frequent tokens, beside
    plain decoding, per context and mode (`magicdec bench --draft-vocab 0,32k`)."""
    rows = []
    for path in sorted(RESULTS.glob("gemma/draft_vocab_*.json")):
        for (b, s, mode), pts in sorted(_cells(json.loads(path.read_text())).items()):
            plain = next(p for p in pts if p["draft"] == "none")
            row = {"B": b, "context": s, "mode": mode, "plain tok/s": plain["throughput"]}
            for p in sorted((p for p in pts if p["draft"] != "none"), key=lambda p: p.get("draft_vocab", 0)):
                head = f"head {p.get('draft_vocab') or 'all'}"
                row.update({f"{head} tok/s": p["throughput"], f"{head} x plain": p["throughput"] / plain["throughput"],
                            f"{head} tokens/step": p["tokens_per_step"], f"{head} draft s": p["draft_s"]})
            rows.append(row)
    return text(rows) if rows else "No results yet (`results/gemma/draft_vocab_*.json`): run the command above."


def gemma_auto(name: str) -> str:
    """Gemma 3 per cell and mode: plain decoding, then each other configuration of the run (`--draft auto`: what it
    chose, its predicted throughput and how far that was from the measurement)."""
    rows = []
    for (b, s, mode), pts in sorted(_cells(load(f"gemma/{name}")).items()):
        plain = next(p for p in pts if p["draft"] == "none")["throughput"]
        for p in (p for p in pts if p["draft"] != "none"):
            fixed = f"{p['draft']} K={p['budget']} g={p['gamma']}" + (f" V={p['draft_vocab']}" if p.get("draft_vocab")
                                                                       else "")
            predicted, learned = p.get("predicted_throughput"), p.get("predicted_throughput_learned")
            row = {"B": b, "context": s, "mode": mode, "plain tok/s": plain,
                   "configuration": f"auto: {p['chosen']}" if "chosen" in p else fixed,
                   "tok/s": p["throughput"], "x plain": f"{p['throughput'] / plain:.2f}x",
                   "tokens/step": p["tokens_per_step"], "predicted tok/s": predicted,
                   "predicted / measured": predicted and f"{predicted / p['throughput']:.2f}"}
            if learned is not None:  # predicted again at the acceptance the run learned
                row["learned alpha"] = p["learned_alpha"]
                row["at learned alpha / measured"] = f"{learned / p['throughput']:.2f}"
            rows.append(row)
    return text(rows)


def gemma_ab(before: str, after: str) -> str:
    """Two runs of the same Gemma 3 bench command, before and after a change, one after the other."""
    rows = []
    for name, label in ((before, "before"), (after, "after")):
        for (b, s, mode), pts in sorted(_cells(load(f"gemma/{name}")).items()):
            by = {p["draft"]: p for p in pts}
            plain, auto = by["none"]["throughput"], by["auto"]
            rows.append({"run": label, "B": b, "context": s, "mode": mode, "plain tok/s": plain,
                         "plain runs": " / ".join(f"{t:.1f}" for t in by["none"]["throughput_runs"]),
                         "auto": auto["chosen"], "auto tok/s": auto["throughput"],
                         "auto runs": " / ".join(f"{t:.1f}" for t in auto["throughput_runs"]),
                         "auto x plain": f"{auto['throughput'] / plain:.2f}x",
                         "gamma from round": " ".join(f"{g}@{r}" for r, g in auto["gamma_changes"])})
    return text(rows)


def auto() -> str:
    rows: dict[tuple, dict] = {}
    for (b, s, mode), pts in sorted(_cells(load("auto")).items(), key=lambda c: (-c[0][1], -c[0][0])):
        by = {p["draft"]: p["throughput"] for p in pts}
        row = rows.setdefault((b, s), {"batch": b, "prompt": s})
        row[f"{mode} AR tok/s"] = by["none"]
        row[f"{mode} auto"] = f"{by['auto'] / by['none']:.2f}x"
    return text(list(rows.values()))


def positions() -> str:
    rows: dict[tuple, dict] = {}
    for p in load("acceptance")["points"].values():
        if p.get("positions") and p.get("budget") == 256 and "tokens_per_step" in p:
            row = rows.setdefault((p["draft"], p["context_used"]), {"drafter": p["draft"], "context": p["context_used"]})
            row[f"{p['mode']} {p['positions']}"] = p["tokens_per_step"]
    return text([rows[k] for k in sorted(rows)])


def gpu_check(*runs: tuple[str, str]) -> str:
    """gpu_check.py on one GPU, runs as (result name, label): forward times per shape (eager; replayed from a CUDA
    graph where the run timed it), then the engine's rounds of the runs that timed them."""
    steps = ("decode", "verify", "draft")
    rows = [{"run": label, "model": r["model"], "B": r["B"], "S": r["S"], **{k: r[f"{k}_ms"] for k in steps},
             **{f"graph {k}": r[f"graph_{k}_ms"] for k in steps if f"graph_{k}_ms" in r},
             "pred decode": r["pred_decode_ms"]}
            for name, label in runs for r in load(name)["rows"]]
    engine = [{"run": label, **{k: v for k, v in doc["engine"].items() if "prefill" not in k}}
              for name, label in runs if "engine" in (doc := load(name))]
    return text(rows) + "\n\n" + text(engine)


TABLES = {"ar": ar, "dtype_linear": dtype_linear, "dtype_forward": dtype_forward,
          "attention": lambda: attention(False), "attention_prefill": lambda: attention(True), "linear": lambda: linear("linear", "gb_per_s", "torch", "kernel"),
          "linear_tiles": lambda: linear("linear_amx", "gflop_per_s", "kernel", "tiles"),           "bf16_flips": bf16_flips, "cpu_grid": cpu_grid, "llamacpp": llamacpp, "throughput": throughput,
          "auto": auto, "positions": positions, "validate_planner": validate_planner, "serving_8k": serving_8k,
          "serving_trace": serving_trace, "chat": lambda: chat("chat"), "chat_shared": lambda: chat("chat_shared"), "prefix_hit": prefix_hit,
          "tp": tp, "draft_vocab": draft_vocab,
          "gemma_auto_32k": lambda: gemma_auto("auto_32k"), "gemma_auto_grid": lambda: gemma_auto("auto_grid"),
          "gemma_auto_32k_sampler": lambda: gemma_auto("auto_32k_sampler"),
          "gemma_auto_grid_sampler": lambda: gemma_auto("auto_grid_sampler"),
          "gemma_auto_grid_overhead": lambda: gemma_auto("auto_grid_overhead"),
          "gemma_auto_32k_learned": lambda: gemma_auto("auto_32k_learned"),
          "gemma_auto_32k_repeats": lambda: gemma_auto("auto_32k_repeats"),
          "gemma_auto_32k_llamacpp_hour2": lambda: gemma_auto("auto_32k_llamacpp_hour2"),
          "gemma_auto_32k_llamacpp_hour3": lambda: gemma_auto("auto_32k_llamacpp_hour3"),
          "gemma_auto_32k_ab": lambda: gemma_ab("auto_32k_ab_before", "auto_32k_ab_after"),
          "gemma_auto_32k_malloc": lambda: gemma_ab("auto_32k_malloc_default", "auto_32k_malloc_kept"),
          "gemma_zen4_32k": lambda: gemma_ab("zen4_32k_before", "zen4_32k_after"),
          "gemma_zen4_32k_hour": lambda: gemma_auto("zen4_32k_hour"),
          "gemma_zen4_32k_rows": lambda: gemma_auto("zen4_32k_rows"),
          "gemma_zen4_32k_q23": lambda: gemma_auto("zen4_32k_q23"),
          "gemma_zen4_32k_dims": lambda: gemma_auto("zen4_32k_dims"),
          "gemma_zen4_32k_pv": lambda: gemma_auto("zen4_32k_pv"),
          "gemma_zen4_32k_spread": lambda: gemma_auto("zen4_32k_spread"),
          "gemma_zen4_32k_softmax": lambda: gemma_auto("zen4_32k_softmax"),
          "gemma_zen4_32k_quads": lambda: gemma_auto("zen4_32k_quads"),
          "gemma_zen4_32k_blocks": lambda: gemma_auto("zen4_32k_blocks"),
          "gemma_zen4_32k_sampler": lambda: gemma_auto("zen4_32k_sampler"),
          "gemma_zen4_32k_sampler2": lambda: gemma_auto("zen4_32k_sampler2"),
          "gemma_zen4_32k_prefix": lambda: gemma_auto("zen4_32k_prefix"),
          "gemma_attention": lambda: attention(False, "gemma/attention_32k"),
          "avx2_storage": avx2_storage, "avx2_grid": avx2_grid, "avx2_llamacpp": avx2_llamacpp,
          "avx2_grid_2t": lambda: avx2_grid("_2t"), "avx2_llamacpp_2t": lambda: avx2_llamacpp("_2t"),
          "avx2_grid_zen4": lambda: avx2_grid("_zen4"), "avx2_llamacpp_zen4": lambda: avx2_llamacpp("_zen4"),
          "avx2_grid_zen4_regs": lambda: avx2_grid("_zen4_regs"),
          "avx2_llamacpp_zen4_regs": lambda: avx2_llamacpp("_zen4_regs"),
          "avx2_grid_zen4_quads": lambda: avx2_grid("_zen4_quads"),
          "avx2_llamacpp_zen4_quads": lambda: avx2_llamacpp("_zen4_quads"),
          "avx2_llamacpp_zen4_prefix": lambda: avx2_llamacpp("_zen4_prefix"),
          "avx2_grid_zen4_blocks": lambda: avx2_grid("_zen4_blocks"),
          "avx2_llamacpp_zen4_blocks": lambda: avx2_llamacpp("_zen4_blocks"),
          "avx2_grid_zen4_sampler": lambda: avx2_grid("_zen4_sampler"),
          "avx2_llamacpp_zen4_sampler": lambda: avx2_llamacpp("_zen4_sampler"),
          "gpu_check_h200": lambda: gpu_check(("gpu_check_h200_cudnn", "cuDNN"), ("gpu_check_h200", "no cuDNN"),
                                               ("gpu_check_h200_again", "no cuDNN, again"),
                                               ("gpu_check_h200_graphs", "no cuDNN, graphs"))}
MODELS = {"cpu_grid": "cpu_grid", "throughput": "throughput", "auto": "auto", "positions": "acceptance"}


def render(readme: str) -> tuple[str, list[str]]:
    """The README with every marked table regenerated, and the names of the tables that changed."""
    changed = []

    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"README names an unknown table {name!r} (known: {', '.join(TABLES)})")
        body = TABLES[name]()
        if name in MODELS:
            body += f"\n\nModel: {model(load(MODELS[name]))}."
        if m.group(3) != body + "\n":
            changed.append(name)
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return BLOCK.sub(fill, readme), changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only report whether the README's tables are current")
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args()
    old = args.readme.read_text()
    new, changed = render(old)
    if args.check:
        if changed:
            print(f"{args.readme}: stale tables: {', '.join(changed)} (run python benchmarks/tables.py)")
        return 1 if changed else 0
    args.readme.write_text(new)
    print(f"{args.readme}: {len(changed)} tables rewritten" + (f" ({', '.join(changed)})" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
