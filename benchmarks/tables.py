"""The tables of benchmarks/README.md, generated from the result files in benchmarks/results.

Each table sits between `<!-- table:NAME -->` and `<!-- /table -->` in the README and is rendered from the
current result file of its benchmark (TABLES below), so no number in a table is typed by hand.

    python benchmarks/tables.py            # rewrite the tables in place
    python benchmarks/tables.py --check    # exit 1 if the README differs, or the files and the README disagree
    python benchmarks/tables.py --add-run RUN.json RESULT.json LABEL   # keep a run's output under LABEL in RESULT

Both also keep benchmarks/results to what the README shows: they fail where the README names a file under
`results/` that does not exist, where a JSON file under results/ feeds no table, and where a PNG under results/ is
shown by neither this README nor the top-level one. A superseded run is deleted (git keeps it), not kept beside.

One file per benchmark: where a benchmark runs on several kernel paths, models or shapes, its file holds a run per
label under "runs" (`save_run`; the benchmark scripts take `--label`). A run written elsewhere (`magicdec bench
--out`, gpu_check.sh's gpu_check.json) goes in with `--add-run`; a run of the same label is replaced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import re
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from cpu_grid import grid_rows, markdown  # noqa: E402

from magicdec.planner.report import format_table  # noqa: E402

README = HERE / "README.md"
TOP_README = HERE.parent / "README.md"
RESULTS = HERE / "results"
BLOCK = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table -->)", re.S)
#: A result file or plot named in a README: `results/...` (or `benchmarks/results/...`), .json or .png.
RESULT_REF = re.compile(r"(?<![\w/.-])(?:benchmarks/)?results/([\w./-]+?\.(?:json|png))(?![\w/-])")
#: The result files the tables rendered so far have read.
USED: set[Path] = set()


def load(name: str, run: str | None = None) -> dict:
    """Result file `name`, or with `run` its run of that label (the runs layout of `save_run`)."""
    path = RESULTS / f"{name}.json"
    USED.add(path)
    doc = json.loads(path.read_text())
    return doc["runs"][run] if run is not None else doc


def saved_run(path: Path, label: str) -> dict | None:
    """The run of `label` in the result file `path`; None where there is none yet."""
    return json.loads(path.read_text()).get("runs", {}).get(label) if path.exists() else None


def save_run(path: Path, label: str, run: dict, machine: dict | None = None) -> dict:
    """Put `run` under `label` in the result file `path`, its other runs kept (one file per benchmark: a run per
    model, shape or kernel path); returns the file's document. `machine` goes at the top where all the file's runs
    come from one machine; without it the run carries its own."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    if machine is not None:
        doc["machine"] = machine
    doc.setdefault("runs", {})[label] = run
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def text(rows: list[dict]) -> str:
    """Rows as a fenced table, a column for every key of any row (in the order first met)."""
    return "```\n" + format_table(rows, list(dict.fromkeys(k for row in rows for k in row))) + "\n```"


def model(doc: dict) -> str:
    """The model a result file names (top level or in its settings), as `name (sha256 prefix)`."""
    m = doc.get("model") or doc.get("settings", {}).get("model")
    return f"`{m['name']}` (sha256 `{m['sha256']}`)" if isinstance(m, dict) else "the embedded default model"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms"


ATTENTION = {"SDPA, bias": "sdpa additive bias", "bf16 matmuls": "matmul, bf16 softmax",
             "native kernel": "native kernel (magicdec)", "kernel on AMX tiles": "native kernel on AMX tiles"}


def attention(prefill: bool, run: str = "smollm2-135m, avx512bf16") -> str:
    rows = []
    for p in sorted(load("attention", run)["points"], key=lambda p: (p["batch"], p["context"], p["q"])):
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


def linear(run: str, metric: str, base: str, new: str) -> str:
    """A run of the linear-layer benchmark by rows and layer: `metric` of `base` / of `new` (and new's speedup)."""
    rows: dict[int, dict] = {}
    for p in load("linear", run)["layers"]:
        v, fmt = p[metric], ".1f" if metric == "gb_per_s" else ".0f"
        rows.setdefault(p["rows"], {"rows": p["rows"]})[f"{p['layer']} {p['in']}->{p['out']}"] = (
            f"{v[base]:{fmt}} / {v[new]:{fmt}} ({p['seconds'][base] / p['seconds'][new]:.2f}x)")
    return text(list(rows.values()))


def bf16_flips() -> str:
    rows: dict[tuple, dict] = {}
    for r in load("bf16_flips", "avx512bf16")["runs"]:
        rows.setdefault((r["batch"], r["dtype"]), {"rows per batch": r["batch"], "dtype": r["dtype"]})[
            f"q = {r['q']}"] = f"{r['flips']} / {r['compared']}"
    return text(list(rows.values()))




def distinct_grid(label: str) -> str:
    """A grid of 32 distinct prompts, its floor at the read rate the run measured."""
    run = load("cpu_grid", label)
    rate = statistics.median(p["read_bandwidth_gbs"] for p in run["points"].values()) * 1e9
    return markdown(grid_rows(run, bandwidth=rate))


def cpu_grid_amx() -> str:
    return distinct_grid("avx512bf16-amx, 32 distinct prompts")


def cpu_grid_zen4() -> str:
    return distinct_grid("avx512bf16, 32 distinct prompts")


def llamacpp() -> str:
    doc = load("llamacpp", "avx512bf16")
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
    speed = load("linear", "avx2")
    rows = []
    for r in load("bf16_flips", "avx2 storage")["runs"]:
        row = {"storage": r["storage"], "greedy flips vs fp32": f"{r['flips']} / {r['compared']}",
               "max logit error": f"{r['max_rel_logit_err']:.1e}"}
        for a in speed["attention"]:
            row[f"attention B={a['batch']} q={a['q']}"] = ms(a["seconds"][f"kernel {r['storage']}"])
        rows.append(row)
    return text(rows)


def avx2_grid() -> str:
    """The AVX2 kernels (fp16 storage) against fp32 torch limited to AVX2, with the AR step over its floor at the
    read bandwidth of the quick profile measured in the same run."""
    bandwidth = load("quick_profile_avx2_zen4")["mem_bandwidth"]
    return markdown(grid_rows(load("cpu_grid", "avx2"), load("cpu_grid", "torch fp32, capped to AVX2"), bandwidth),
                    label="AVX2")


def avx2_llamacpp() -> str:
    doc = load("llamacpp", "avx2")
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
    """bench_prefix_hit.py: prefix-cache hits against the cold prefill they replace."""
    from bench_prefix_hit import table

    return "```\n" + table(load("prefix_hit")) + "\n```"


def chat(name: str) -> str:
    """bench_chat.py's per-turn and per-run tables of results/NAME.json (a placeholder until it exists)."""
    if not (RESULTS / f"{name}.json").exists():
        return f"No results yet (`results/{name}.json`): run the command above."
    from bench_chat import summary_table, table

    doc = load(name)
    return f"```\n{table(doc['results'])}\n\n{summary_table(doc['results'])}\n```\n\nModel: {model(doc)}."


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




def _cells(doc: dict) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = {}
    for p in doc["points"].values():
        if "throughput" in p:
            cells.setdefault((p["batch"], p["context_used"], p["mode"]), []).append(p)
    return cells


def gemma_auto(name: str, *runs: str) -> str:
    """Gemma 3 per cell and mode (and run, where `runs` names several of the file's): plain decoding, then each other
    configuration of the run (`--draft auto`: what it chose, its predicted throughput and how far that was from the
    measurement)."""
    rows = []
    for run in runs or (None,):
        for (b, s, mode), pts in sorted(_cells(load(f"gemma/{name}", run)).items()):
            plain = next(p for p in pts if p["draft"] == "none")["throughput"]
            rows += [({"run": run} if len(runs) > 1 else {}) | _auto_row(b, s, mode, plain, p)
                     for p in pts if p["draft"] != "none"]
    return text(rows)


def _auto_row(b: int, s: int, mode: str, plain: float, p: dict) -> dict:
    """A drafting configuration's row of `gemma_auto` against plain decoding's `plain` tok/s in the same cell."""
    fixed = f"{p['draft']} K={p['budget']} g={p['gamma']}" + (f" V={p['draft_vocab']}" if p.get("draft_vocab") else "")
    predicted, learned = p.get("predicted_throughput"), p.get("predicted_throughput_learned")
    row = {"B": b, "context": s, "mode": mode, "plain tok/s": plain,
           "configuration": f"auto: {p['chosen']}" if "chosen" in p else fixed,
           "tok/s": p["throughput"], "x plain": f"{p['throughput'] / plain:.2f}x",
           "tokens/step": p["tokens_per_step"], "predicted tok/s": predicted,
           "predicted / measured": predicted and f"{predicted / p['throughput']:.2f}"}
    if learned is not None:  # predicted again at the acceptance the run learned
        row["learned alpha"] = p["learned_alpha"]
        row["at learned alpha / measured"] = f"{learned / p['throughput']:.2f}"
    return row


def acceptance_cells(points: list[dict], lead: Callable[[dict], dict], column: Callable[[dict], str]) -> list[dict]:
    """`magicdec bench` points as table rows: a row per distinct `lead(p)` (its leading cells), in their order, and in
    it a cell per `column(p)` holding the acceptances of its points joined by "/", in the points' order."""
    rows: dict[tuple, dict] = {}
    for p in points:
        cells = lead(p)
        row = rows.setdefault(tuple(cells.values()), cells)
        row[column(p)] = "/".join(filter(None, (row.get(column(p)), f"{p['acceptance']:.2f}")))
    return [rows[k] for k in sorted(rows)]


def vegas_acceptance() -> str:
    """`magicdec bench` acceptance sweeps, a run per model: each self-speculative drafter's per-token acceptance by
    model, context and mode, at each budget (self-quant reads the whole context, without a budget)."""
    runs = load("acceptance_vegas")["runs"].values()
    points = [p | {"model": doc["settings"]["model"]["name"].split("-")[0]}  # SmolLM2, gemma
              for doc in runs for p in sorted(doc["points"].values(),
                                              key=lambda p: (p["draft"] == "self-quant", p["budget"]))]
    rows = acceptance_cells(points, lambda p: {"model": p["model"], "context": p["context_used"], "mode": p["mode"]},
                            lambda p: p["draft"].removeprefix("self-"))
    budgets = sorted({p["budget"] for p in points if p["budget"]})
    return text(rows) + f"\n\nBudgets {' / '.join(map(str, budgets))}."


def vegas_budgets() -> str:
    """`magicdec bench` of StreamingLLM and Vegas self-speculation over one model's budgets: per context and mode,
    each budget's acceptance, StreamingLLM's / Vegas's."""
    points = sorted(load("gemma/vegas_budgets")["points"].values(), key=lambda p: (p["budget"], p["draft"]))
    return text(acceptance_cells(points, lambda p: {"context": p["context_used"], "mode": p["mode"]},
                                 lambda p: str(p["budget"])))


def vegas_e2e() -> str:
    """`magicdec bench` at one batch and context, sampled: StreamingLLM and Vegas self-speculation at each budget and
    gamma against plain decoding (each configuration's median run)."""
    points = load("vegas_e2e")["points"].values()
    plain = {p["mode"]: p["throughput"] for p in points if p["draft"] == "none"}
    rows: dict[tuple, dict] = {}
    for p in points:
        if p["draft"] == "none":
            continue
        row = rows.setdefault((p["mode"], p["budget"], p["gamma"]), {"budget": p["budget"], "gamma": p["gamma"]})
        name = p["draft"].removeprefix("self-")
        row[f"{name} tok/s (x plain)"] = f"{p['throughput']:.1f} ({p['throughput'] / plain[p['mode']]:.2f})"
        row[f"{name} accepted"] = round(p["acceptance"], 2)
    return text([rows[k] for k in sorted(rows)])


def draft_lengths() -> str:
    """`magicdec bench` at one batch and context with per-row draft lengths (`--draft-stop`) beside fixed ones: each
    configuration's median run against plain decoding, and the tokens its verifications ran per token produced."""
    points = load("draft_lengths")["points"].values()
    plain = {p["mode"]: p["throughput"] for p in points if p["draft"] == "none"}
    rows = [{"mode": p["mode"], "gamma": p["gamma"], "stop": p.get("draft_stop") or "-",
             "tok/s (x plain)": f"{p['throughput']:.1f} ({p['throughput'] / plain[p['mode']]:.2f})",
             "tokens/round": round(p["tokens_per_step"], 2), "accepted": round(p["acceptance"], 2),
             "verified/token": round(p["verified_per_token"], 2), "draft/verify s": f"{p['draft_s']:.1f}/{p['verify_s']:.1f}"}
            for p in points if p["draft"] != "none"]
    rows.sort(key=lambda r: (r["mode"], r["gamma"], str(r["stop"])))
    return text(rows)


def draft_agreement() -> str:
    """draft_agreement.py: a sparse draft's entries and first token against the target's, by how they were chosen."""
    from draft_agreement import table

    return table(load("draft_agreement"))


def gpu_check(name: str) -> str:
    """gpu_check.py on one GPU, its runs by label: the last run's forward times per shape (eager; replayed from a CUDA
    graph where the run timed it: it times every shape the earlier runs did), then the engine's rounds of the runs that
    timed them."""
    steps = ("decode", "verify", "draft")
    runs = load(name)["runs"]
    label, last = list(runs.items())[-1]
    rows = [{"run": label, "model": r["model"], "B": r["B"], "S": r["S"], **{k: r[f"{k}_ms"] for k in steps},
             **{f"graph {k}": r[f"graph_{k}_ms"] for k in steps if f"graph_{k}_ms" in r},
             "pred decode": r["pred_decode_ms"]}
            for r in last["rows"]]
    engine = [{"run": label, **{k: v for k, v in doc["engine"].items() if "prefill" not in k}}
              for label, doc in runs.items() if "engine" in doc]
    return text(rows) + "\n\n" + text(engine)


def kv_dtype() -> str:
    """bench_kv_dtype.py: decode and verification forwards over bf16 and int8 KV caches, alternated."""
    from bench_kv_dtype import table

    return "```\n" + table(load("kv_dtype")) + "\n```"


def phases() -> str:
    """bench_phases.py: each kind of forward's parts against its floor, with the layer operators on and off."""
    from bench_phases import table

    return "```\n" + table(load("phases")) + "\n```"


def shared_prefix() -> str:
    """bench_shared_prefix.py: attention over a shared prompt's blocks, a pass per row against one per group."""
    from bench_shared_prefix import table

    return table(load("shared_prefix"))


def switch() -> str:
    """bench_switch.py: plain decoding with a kernel switch's settings taking turns, by batch size."""
    from bench_switch import table

    return table(load("switch"))


def sampler() -> str:
    """bench_sampler.py: the draw from the candidates, native and in torch's operators, against the full path."""
    from bench_sampler import table

    return table(load("sampler"))




def server_limits() -> str:
    """bench_server_limits.py: a 40 MB prompt against `magicdec serve`, per server configuration."""
    doc = load("server_limits")
    return text([{"server": r["config"], "answer": r["status"], "refused in": f"{r['refusal_s']:.2f} s",
                  "4-token request, three huge ones in flight": f"{r['small_with_three_s']:.2f} s",
                  "resident MB before -> after": f"{r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f}"}
                 for r in doc["rows"]]) + f"\n\nModel: {model(doc)}; --max-model-len {doc['max_model_len']}."


def llamacpp_32k(*paths: str) -> str:
    """Gemma 3 at B = 32 x 32k per kernel path (its run in gemma/auto_32k.json) against llama.cpp's run beside it (the
    run of the same label in gemma/llamacpp_32k.json: `llama-batched-bench`, the shared prompt prefilled once): plain
    decoding and `--draft auto` per mode over llama.cpp's generation, and prefill over llama.cpp's."""
    rows = []
    for path in paths:
        run = next(r for r in load("gemma/llamacpp_32k", path)["runs"] if "speed_tg" in r)
        ours = load("gemma/auto_32k", path)
        for (b, s, mode), pts in sorted(_cells(ours).items()):
            by = {p["draft"]: p for p in pts}
            for draft, label in (("none", "plain decoding"), ("auto", "--draft auto")):
                if draft in by:
                    t = by[draft]["throughput"]
                    rows.append({"run": path, "magicdec": f"{label}, {mode}", "tok/s": t,
                                 "llama.cpp tok/s": run["speed_tg"], "x llama.cpp": f"{t / run['speed_tg']:.2f}x"})
        plain = next(p for p in ours["points"].values() if p["draft"] == "none")
        prefill = plain["context_used"] / plain["prefill_s"]
        rows.append({"run": path, "magicdec": f"prefill of the {plain['context_used']}-token prompt", "tok/s": prefill,
                     "llama.cpp tok/s": run["speed_pp"], "x llama.cpp": f"{prefill / run['speed_pp']:.2f}x"})
    return text(rows)


def perplexity() -> str:
    """bench_perplexity.py: perplexity and greedy agreement through the API, per KV dtype and against transformers."""
    from bench_perplexity import notes, table

    doc = load("perplexity")
    return f"```\n{table(doc)}\n```\n\n{notes(doc)}"


def paper_comparison() -> str:
    """The cost model against the speedups the MagicDec paper measured (benchmarks/paper_analysis.py)."""
    doc = load("paper_analysis")
    rows = [{"GPUs": r["gpu"], "target": r["target"], "draft": r["draft"], "context": r["context"], "B": r["batch"],
             "paper": r["paper_speedup"], "preset": r["preset_speedup"], "fitted": r["fitted_speedup"],
             "in fit": "yes" if r["in_fit"] else ""} for r in doc["paper_comparison"]]
    e = doc["paper_comparison_errors"]
    return text(rows) + (f"\n\nMean absolute relative error on the points held out of the fit: presets "
                         f"{e['preset_mean_abs_rel_error_held_out']:.1%}, fitted overhead "
                         f"{e['fitted_mean_abs_rel_error_held_out']:.1%}.")


TABLES = {"attention": lambda: attention(False), "attention_prefill": lambda: attention(True),
          "linear": lambda: linear("avx512bf16", "gb_per_s", "torch", "kernel"),
          "linear_tiles": lambda: linear("avx512bf16-amx", "gflop_per_s", "kernel", "tiles"),
          "gemma_attention": lambda: attention(False, "gemma3-270m, avx512bf16-amx"),
          "bf16_flips": bf16_flips, "avx2_storage": avx2_storage,
          "cpu_grid_amx": cpu_grid_amx, "cpu_grid_zen4": cpu_grid_zen4, "llamacpp": llamacpp,
          "avx2_grid_zen4": avx2_grid, "avx2_llamacpp_zen4": avx2_llamacpp,
          "gemma_auto_32k": lambda: gemma_auto("auto_32k", "avx512bf16-amx", "avx512bf16"),
          "gemma_llamacpp_32k": lambda: llamacpp_32k("avx512bf16-amx", "avx512bf16"),
          "gemma_auto_32k_int8": lambda: gemma_auto("auto_32k", "avx512bf16, int8 KV"),
          "gemma_auto_grid": lambda: gemma_auto("auto_grid"),
          "paper_comparison": paper_comparison,
          "serving_8k": serving_8k, "chat": lambda: chat("chat"), "chat_shared": lambda: chat("chat_shared"),
          "prefix_hit": prefix_hit, "server_limits": server_limits,
          "vegas_acceptance": vegas_acceptance, "vegas_budgets": vegas_budgets,
          "vegas_e2e": vegas_e2e, "draft_lengths": draft_lengths, "draft_agreement": draft_agreement,
          "kv_dtype": kv_dtype, "phases": phases, "switch": switch, "sampler": sampler,
          "shared_prefix": shared_prefix,
          "tp": tp, "perplexity": perplexity,
          "gpu_check_h200": lambda: gpu_check("gpu_check_h200")}
#: Tables followed by the model of a result file (or of a run of one).
MODELS = {"cpu_grid_zen4": ("cpu_grid", "avx512bf16, 32 distinct prompts")}


def render(readme: str) -> tuple[str, list[str]]:
    """The README with every marked table regenerated, and the names of the tables that changed."""
    changed = []

    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"README names an unknown table {name!r} (known: {', '.join(TABLES)})")
        body = TABLES[name]()
        if name in MODELS:
            body += f"\n\nModel: {model(load(*MODELS[name]))}."
        if m.group(3) != body + "\n":
            changed.append(name)
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return BLOCK.sub(fill, readme), changed


def file_problems(readmes: list[str]) -> list[str]:
    """Where benchmarks/results and the READMEs disagree (call after `render`, which records the files it read):
    a referenced result file or plot that is missing, a JSON file no table reads, a PNG no README shows."""
    problems = []
    named = {RESULTS / m.group(1) for text_ in readmes for m in RESULT_REF.finditer(text_)}
    problems += [f"names a missing file: results/{p.relative_to(RESULTS)}" for p in sorted(named) if not p.exists()]
    for path in sorted(RESULTS.rglob("*")):
        rel = path.relative_to(RESULTS)
        if path.suffix == ".json" and path not in USED and not path.name.endswith(".partial.json"):
            problems.append(f"results/{rel} feeds no table (delete it: git keeps superseded runs)")
        elif path.suffix == ".png" and path not in named:
            problems.append(f"results/{rel} is shown by no README")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="only report whether the README's tables are current and its files all there and all used")
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--add-run", nargs=3, metavar=("RUN", "RESULT", "LABEL"),
                   help="put the JSON document RUN under LABEL in the result file RESULT (its other runs kept), and "
                        "nothing else")
    args = p.parse_args()
    if args.add_run:
        run, result, label = args.add_run
        save_run(Path(result), label, json.loads(Path(run).read_text()))
        print(f"{result}: {run} kept as its run {label!r}")
        return 0
    old = args.readme.read_text()
    new, changed = render(old)
    tops = [TOP_README.read_text()] if TOP_README.exists() else []
    problems = file_problems([new, *tops])
    for problem in problems:
        print(f"{args.readme}: {problem}")
    if args.check:
        if changed:
            print(f"{args.readme}: stale tables: {', '.join(changed)} (run python benchmarks/tables.py)")
        return 1 if changed or problems else 0
    args.readme.write_text(new)
    print(f"{args.readme}: {len(changed)} tables rewritten" + (f" ({', '.join(changed)})" if changed else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
