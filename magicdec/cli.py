"""`magicdec generate | bench | plan | calibrate | serve`.

Every expected failure (bad path, bad value, too-long prompt, not enough memory) prints one line,
`magicdec: error: ...`, and exits with status 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from magicdec import dtypes
from magicdec.errors import DistributedError, InvalidRequestError, MagicDecError, OutOfMemoryError
from magicdec.planner import (PRESETS, AcceptanceTable, HardwareProfile, Workload, format_table, get_model_shape,
                              get_profile, plan_table, plot_speedup)

EXIT_USAGE = 2
#: A tensor-parallel rank lost its peers (one died, hung past the timeout, or cannot be reached).
EXIT_DISTRIBUTED = 3


def parse_size(text: str) -> int:
    """'8k' -> 8192, '512' -> 512."""
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512, 4k)") from None


def size_list(text: str) -> list[int]:
    """'1,4k' -> [1, 4096]; every size must be >= 1 and there must be one at least."""
    sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r} (e.g. 1,8 or 1k,4k)")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1: {text!r}")
    return sizes


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def positive_size(text: str) -> int:
    v = parse_size(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def port_number(text: str) -> int:
    v = positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {text!r}")
    return v


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, `magicdec: error: ...`, and exit status 2, like the
    errors of the commands themselves (argparse's own print the usage first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"magicdec: error: {message} (see {self.prog} --help)\n")


# --- shared options ---------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weights, activations and KV dtype (default auto: bf16 on CUDA and on CPUs with AMX-BF16 "
                        "or AVX512-BF16, fp32 on other CPUs)")
    g.add_argument("--kv-dtype", choices=["fp32", "bf16", "fp16"], help="KV cache storage dtype (default: the compute dtype)")
    g.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens per prefill forward (default 512)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompt-file", help="a .txt file (one prompt) or .jsonl file (one prompt per line, key 'prompt' or 'text')")
    g.add_argument("--corpus", help="a text or .jsonl file to cut prompts from (e.g. ../shared/data/pg19_dev.jsonl)")
    g.add_argument("--num-prompts", type=positive_int, default=8, help="prompts to cut from --corpus (default 8)")
    g.add_argument("--prompt-tokens", type=parse_size, default=1024, help="tokens per prompt cut from --corpus (default 1024; 4k works)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens per prompt (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, help="random seed for sampling")
    g.add_argument("--n", type=positive_int, default=1,
                   help="completions per prompt, as OpenAI's n (default 1): sampled ones get seeds --seed, "
                        "--seed + 1, ... (or random ones); each prompt is prefilled once and copied")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default="none", choices=["none", "self-streaming", "self-snapkv", "model", "auto"],
                   help="drafter: none (plain decoding), the target over a StreamingLLM or SnapKV sparse cache, "
                        "a standalone draft model, or auto (the planner picks, or turns speculation off; "
                        "default %(default)s)")
    g.add_argument("--budget", type=positive_int, default=256, help="KV entries the draft reads per sequence (default 256)")
    g.add_argument("--gamma", type=positive_int, default=3, help="tokens drafted per verification (default 3)")
    g.add_argument("--draft-model", help="draft checkpoint for --draft model (same vocabulary as the target)")
    g.add_argument("--draft-cache", default="streaming", choices=["dense", "streaming", "snapkv"],
                   help="the draft model's cache for --draft model (default streaming)")
    g.add_argument("--positions", choices=["reindex", "original"],
                   help="positions of sparse-cache keys: re-indexed to slots (StreamingLLM) or original "
                        "(default: the better measured one per cache kind)")
    g.add_argument("--hardware", help="hardware profile for --draft auto: preset name or JSON from `magicdec calibrate`")


# --- generate ---------------------------------------------------------------------------------------
def collect_prompts(args, tok) -> tuple[list[str] | None, list[list[int]]]:
    from magicdec.corpus import cut_prompts, load_texts

    texts = list(args.prompt)
    if args.prompt_file:
        texts += load_texts(args.prompt_file)
    if args.corpus:
        if texts:
            raise InvalidRequestError("use either --corpus or --prompt/--prompt-file, not both")
        ids = cut_prompts(tok, load_texts(args.corpus), args.num_prompts, args.prompt_tokens)
        return None, ids
    if not texts:
        raise InvalidRequestError("no prompts: give --prompt, --prompt-file or --corpus")
    for i, t in enumerate(texts):
        if not t.strip():
            raise InvalidRequestError(f"prompt {i} is empty")
    return texts, tok.encode_batch(texts)


def speculative_from_args(args, llm, batch: int, context: int):
    """(SpeculativeConfig or None, the gamma policy or None, the plan of --draft auto or None)."""
    from magicdec.speculative import SpeculativeConfig

    if args.draft == "none":
        return None, None, None
    if args.draft == "auto":
        from magicdec.autoplan import choose
        from magicdec.profiles import model_key

        # `serve` has no temperature of its own (each request brings one) and plans for greedy requests.
        return choose(llm.model, batch, context, kv_dtype=llm.kv_dtype, model_name=model_key(llm.loaded.source),
                      profile=args.hardware, mode="greedy" if getattr(args, "temperature", 0) == 0 else "sampling")
    reindex = None if args.positions is None else args.positions == "reindex"
    return SpeculativeConfig(args.draft, budget=args.budget, gamma=args.gamma, draft_model=args.draft_model,
                             draft_cache=args.draft_cache, reindex=reindex), None, None


def progress_bar(desc: str, enabled: bool):
    """A tqdm bar on stderr fed with (done, total) calls; returns (callback, close)."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False, file=sys.stderr)
        bar.n = done
        bar.refresh()

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def format_stats(stats, label: str) -> str:
    gib = stats.peak_memory_bytes / 1024**3
    line = (f"[{label}] {stats.requests} requests ({stats.dtype}), at most {stats.max_batch} decoding together: "
            f"prefill {stats.prompt_tokens} tok in {stats.prefill_s:.2f}s ({stats.prefill_tok_s:.0f} tok/s); "
            f"decode {stats.decode_tokens} tok in {stats.decode_s:.2f}s ({stats.decode_tok_s:.1f} tok/s); "
            f"peak memory {gib:.2f} GiB")
    if stats.gamma:
        changes = ", ".join(f"{g or 'plain'} from round {r}" for r, g in stats.gamma_changes)
        line += (f"\n[{label}] draft length {changes}: acceptance {stats.acceptance_rate:.3f}, "
                 f"{stats.tokens_per_step:.2f} tokens/round, accepted-length histogram {stats.accepted_hist}, "
                 f"draft {stats.draft_s:.2f}s verify {stats.verify_s:.2f}s")
    return line


def dtype_line(llm) -> str:
    """The dtypes a run computes and caches in, and why (printed with the run's stats)."""
    kv = str(llm.kv_dtype).removeprefix("torch.")
    return f"dtype {llm.loaded.dtype_choice}; KV cache {kv}; attention {llm.attention}; linear {llm.linear}"


def cmd_generate(args) -> int:
    from magicdec.engine import LLM
    from magicdec.kv.prompt_cache import PromptCache
    from magicdec.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk,
              max_num_seqs=args.batch_size or 256)
    texts, ids = collect_prompts(args, llm.tokenizer)
    unique = ids
    if args.n > 1:  # row i is sample i % n of prompt i // n
        ids = [p for p in ids for _ in range(args.n)]
        texts = texts and [t for t in texts for _ in range(args.n)]
        params = [dataclasses.replace(params, seed=None if args.seed is None else args.seed + i % args.n)
                  for i in range(len(ids))]
    show = sys.stderr.isatty() and not args.json
    batch = min(args.batch_size or len(ids), len(ids))
    spec, policy, plan = speculative_from_args(args, llm, batch, max(map(len, ids)) + args.max_tokens // 2)
    if plan is not None:
        from magicdec.autoplan import describe

        print(describe(plan), file=sys.stderr)
    modes = [("spec" if spec else "ar", spec)]
    if args.compare_ar and spec is not None:
        modes.insert(0, ("ar", None))
    if len(modes) > 1 or args.n > 1:
        # every prompt is prefilled once: its repeats (--n) and the second run copy that prefill
        llm.prompt_cache.resize(PromptCache.bytes_for(llm.model.cfg, [len(p) for p in unique], llm.kv_dtype))
    results, runs = {}, []
    for label, cfg in modes:
        update, close = progress_bar(f"{label}", show)
        try:
            results[label] = llm.generate(prompt_token_ids=ids, params=params, speculative=cfg,
                                          gamma_policy=policy, progress=update)
        finally:
            close()
        stats = llm.last_stats
        if not args.json:
            print(format_stats(stats, label), file=sys.stderr)
            print(f"[{label}] {dtype_line(llm)}", file=sys.stderr)
        runs.append({"mode": label, "stats": stats.as_dict(), "speculative": cfg and dataclasses.asdict(cfg)
                     | {"replanned": policy is not None}})
    final = results[modes[-1][0]]
    if len(runs) == 2:
        runs.append(_compare(results["ar"], results["spec"], runs, quiet=args.json))
    if args.json:
        doc = {"outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                            "prompt_tokens": len(o.prompt_token_ids)} for o in final], "runs": runs,
               "dtype": dtype_line(llm)}
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        for o in final:
            head = texts[o.index][-60:] if texts else f"<{len(o.prompt_token_ids)} corpus tokens>"
            print(f"--- [{o.index}] {head!r} ({o.finish_reason})\n{o.text}")
    return 0


def _compare(ar: list, spec: list, runs: list[dict], quiet: bool) -> dict:
    """The speedup of the speculative run over plain decoding and how many outputs are identical."""
    ar_tok_s, sp_tok_s = runs[0]["stats"]["decode_tok_s"], runs[1]["stats"]["decode_tok_s"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(ar, spec))
    speedup = sp_tok_s / ar_tok_s if ar_tok_s and sp_tok_s else None  # None: no decode rounds (max_tokens 1)
    if not quiet:
        measured = (f"{speedup:.2f}x ({sp_tok_s:.1f} vs {ar_tok_s:.1f} decode tok/s)" if speedup is not None
                    else "none measured (no decode rounds: every token came from the prefill)")
        print(f"speedup over autoregressive decoding: {measured}; identical outputs: {same}/{len(spec)}",
              file=sys.stderr)
    return {"speedup": speedup, "identical": same}


# --- bench ------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from magicdec.bench import BenchGrid, run_bench

    grid = BenchGrid(batches=args.batch, contexts=args.context, drafters=args.drafters.split(","),
                     budgets=args.budget, gammas=args.gamma, modes=args.modes.split(","),
                     new_tokens=args.max_tokens, n_texts=args.num_texts, distinct_prompts=args.distinct_prompts,
                     positions=[None if p == "default" else p for p in args.positions.split(",")],
                     repeats=args.repeats)
    run_bench(args, grid)
    return 0


# --- plan -------------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    try:
        target = get_model_shape(args.model)
        draft = get_model_shape(args.draft_model) if args.draft_model else None
        hw = get_profile(args.hardware)
        acceptance = AcceptanceTable.from_json(args.acceptance) if args.acceptance else AcceptanceTable.paper_default()
    except ValueError as e:  # the planner is torch-free and raises ValueError; OSError is main's
        raise InvalidRequestError(str(e)) from None
    nbytes = dtypes.BYTES[args.dtype]
    grid = [Workload(target, hw, b, c, nbytes, nbytes, args.tp) for c in args.context for b in args.batch]
    rows = plan_table(grid, acceptance, draft=draft, mode="greedy" if args.mode == "greedy" else "sampling",
                      rows=1 if args.steady_state else None)
    cols = ["batch", "context", "strategy", "budget", "gamma", "predicted_speedup", "predicted_throughput",
            "verify_dominant", "draft_dominant"]
    print(format_table(rows, [c for c in cols if c in rows[0]]))
    if args.plot:
        plot_speedup(rows, args.plot, x="batch", y="predicted_speedup", group="context",
                     title=f"{target.name} on {hw.name}: planned speedup", ylabel="speedup over AR", logx=True)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


# --- calibrate --------------------------------------------------------------------------------------
def cmd_calibrate(args) -> int:
    from magicdec.calibrate.acceptance import calibrate_acceptance
    from magicdec.calibrate.allreduce import measure_local_allreduce, with_allreduce
    from magicdec.calibrate.hardware import measure_hardware
    from magicdec.corpus import load_texts
    from magicdec.engine import LLM
    from magicdec.profiles import default_acceptance_path, model_key

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return calibrate_allreduce(args)
    texts = load_texts(args.corpus) if args.acceptance else []  # checked before minutes of measuring
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    print(dtype_line(llm), file=sys.stderr)

    def progress(done: int, total: int, label: str) -> None:
        print(f"[{done}/{total}] {label}", file=sys.stderr)

    cal = measure_hardware(llm.model.device, quick=args.quick, progress=progress, model=llm.model)
    print("all-reduce between local processes (for tensor parallelism)", file=sys.stderr)
    allreduce = measure_local_allreduce(llm.model.device)
    if allreduce is not None:
        cal.profile = with_allreduce(cal.profile, allreduce)
        cal.measurements["allreduce"] = allreduce
    path = cal.save(args.output)
    print(json.dumps(cal.profile.__dict__, indent=1, default=str))
    check = cal.measurements["check"]
    print(f"profile check: {len(cal.measurements['forwards'])} forwards predicted within "
          f"{100 * check['median_relative_error']:.0f}% (median), {100 * check['worst_relative_error']:.0f}% (worst)",
          file=sys.stderr)
    print(f"hardware profile written to {path}", file=sys.stderr)
    if args.acceptance:
        quick = dict(contexts=(1024, 2048), budgets=(64, 256), n_prompts=2, new_tokens=32) if args.quick else {}
        table = calibrate_acceptance(llm, texts, progress=progress, **quick)
        out = default_acceptance_path(model_key(llm.loaded.source))
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_json(out)
        print(f"acceptance table written to {out}", file=sys.stderr)
    return 0


def calibrate_allreduce(args) -> int:
    """`calibrate` under torchrun: measure the all-reduce of the launched ranks (any number of nodes) and
    write its latency and bandwidth into the profile that `magicdec calibrate` made on one process."""
    from magicdec.calibrate.allreduce import measure_allreduce, with_allreduce
    from magicdec.distributed import init_tp
    from magicdec.profiles import default_profile_path

    tp = init_tp(args.device)
    path = Path(args.output) if args.output else default_profile_path(tp.device.type)
    if not path.is_file():
        raise InvalidRequestError(f"no hardware profile at {path}: run `magicdec calibrate` as one process first")
    result = measure_allreduce(tp)
    if tp.is_main:
        try:
            profile = with_allreduce(HardwareProfile.from_json(path), result)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        profile.to_json(path)
        print(json.dumps(result, indent=1))
        print(f"all-reduce over {tp.world_size} ranks ({tp.backend}): {result['latency_s'] * 1e6:.0f} us + "
              f"{result['bus_bandwidth'] / 1e9:.2f} GB/s bus bandwidth, written to {path}", file=sys.stderr)
    return 0


# --- serve ------------------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from magicdec.autoplan import describe
    from magicdec.engine import LLM
    from magicdec.loading import chat_template
    from magicdec.server.app import build_app, run_server
    from magicdec.server.async_engine import AsyncEngine
    from magicdec.server.metrics import ServerMetrics

    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk,
              max_num_seqs=args.max_running, max_model_len=args.max_model_len)
    max_len = llm.max_model_len
    # Planned where the KV cache weighs most (every slot full at the longest context): if drafting pays
    # anywhere within the server's limits it pays there; each step then re-plans for its live batch and
    # context (plain decoding where drafting does not pay).
    spec, policy, plan = speculative_from_args(args, llm, args.max_running, max_len)
    draft = describe(plan) if plan is not None else spec.draft if spec is not None else "none"
    try:
        engine = llm.engine(spec, policy, max_prefill_tokens=args.prefill_chunk, max_queued=args.max_queued)
    except OutOfMemoryError as e:
        raise OutOfMemoryError(f"{e} (or lower --max-running / --max-model-len)") from None
    tp = llm.model.tp
    if tp is not None and not tp.is_main:  # rank 0 serves; the others follow its engine turn by turn
        from magicdec.distributed.serving import follow

        follow(engine, tp)
        return 0
    source = llm.loaded.source
    name = args.served_model_name or args.model or Path(source).name.split(".")[0]
    metrics = ServerMetrics(name, spec.draft if spec is not None else "none", spec.budget if spec is not None else None)

    def ready() -> None:
        print(f"magicdec serve: ready on http://{args.host}:{args.port}/v1 (model {name}; {args.max_running} slots "
              f"x {max_len} tokens; draft {draft})", file=sys.stderr, flush=True)

    def stopped() -> None:
        print("magicdec serve: stopped", file=sys.stderr, flush=True)

    mirror = None
    if tp is not None:
        from magicdec.distributed.serving import StepMirror

        mirror = StepMirror(tp)
    app = build_app(AsyncEngine(engine, metrics, mirror), llm.tokenizer, metrics, model_name=name, model_root=source,
                    chat_template=chat_template(source), api_key=args.api_key, on_ready=ready, on_stopped=stopped)
    run_server(app, args.host, args.port, log_level=args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="magicdec",
        description="Fast long-context, large-batch generation with sparse-KV speculative decoding (MagicDec).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate completions (optionally speculative)",
                       description="Generate completions for prompts, or for prompts cut from a corpus, in batches. "
                                   "Prints the completions and final stats (prefill/decode tok/s, peak memory, "
                                   "acceptance).")
    add_model_args(g)
    add_prompt_args(g)
    add_sampling_args(g, max_tokens=64)
    add_draft_args(g)
    g.add_argument("--batch-size", type=positive_int, help="most prompts decoded together; the rest queue for a free slot (default: all)")
    g.add_argument("--compare-ar", action="store_true", help="also run plain decoding first (its prefill is reused) and report the speedup")
    g.add_argument("--json", action="store_true",
                   help="print outputs and stats as JSON on stdout; each output carries the index of its prompt "
                        "(--prompt ones first, then the lines of --prompt-file, in order)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="sweep batch, context, drafter, budget and gamma; write JSON and plots",
                       description="Throughput and acceptance sweep on prompts cut from a corpus. Each (batch, "
                                   "context) is prefilled once and every drafter configuration decodes from it. "
                                   "Results are appended to --out after every point; rerunning resumes.")
    add_model_args(b)
    b.add_argument("--corpus", required=True, help="text or .jsonl corpus (e.g. ../shared/data/pg19_dev.jsonl)")
    b.add_argument("--num-texts", type=positive_int, default=14, help="documents of the corpus to cycle through")
    b.add_argument("--batch", type=size_list, default=[1, 8], help="batch sizes, comma separated (default 1,8)")
    b.add_argument("--context", type=size_list, default=[1024], help="prompt lengths, e.g. 1k,4k,8k (default 1k)")
    b.add_argument("--drafters", default="none,self-streaming,self-snapkv",
                   help="comma separated: none, self-streaming, self-snapkv, auto (the planner's choice per point)")
    b.add_argument("--hardware", help="hardware profile for the auto drafter (default: calibrated, else preset)")
    b.add_argument("--budget", type=size_list, default=[256], help="draft budgets, comma separated")
    b.add_argument("--gamma", type=size_list, default=[1, 2, 3], help="gammas, comma separated")
    b.add_argument("--positions", default="default",
                   help="sparse-cache key positions to compare: default, reindex, original (comma separated)")
    b.add_argument("--modes", default="greedy", help="greedy and/or sampling (temperature 0.7, top-p 0.9)")
    b.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per sequence (default 128)")
    b.add_argument("--distinct-prompts", type=positive_int,
                   help="prefill this many prompts and tile them up to the batch size: the same decode work "
                        "for far less prefill (default: every row its own prompt)")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="run each configuration of a point this many times, interleaved with the others, and keep "
                        "its median run: steadier ratios on a machine whose speed drifts (default 1)")
    b.add_argument("--out", default="bench.json", help="results JSON (resumed if it exists)")
    b.add_argument("--plots", help="folder for PNG plots (default: beside --out)")
    b.set_defaults(func=cmd_bench)

    pl = sub.add_parser("plan", help="predict the best drafting strategy with the cost model (no weights needed)",
                        description="Roofline model of draft, verify and decode cost over batch and context; "
                                    "prints strategy, budget, gamma and predicted speedup per point.")
    pl.add_argument("--model", default="llama-3.1-8b", help="model preset name, config.json or HF folder (default llama-3.1-8b)")
    pl.add_argument("--draft-model", help="standalone draft model preset or config (e.g. tinyllama-1.1b)")
    pl.add_argument("--hardware", default="h100", help=f"hardware preset ({', '.join(PRESETS)}) or profile JSON")
    pl.add_argument("--batch", type=size_list, default=[1, 8, 32, 128], help="batch sizes (default 1,8,32,128)")
    pl.add_argument("--context", type=size_list, default=[1024, 8192, 32768, 131072], help="contexts (default 1k,8k,32k,128k)")
    pl.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="weight and KV dtype (default bf16, as on GPUs and CPUs with AMX-BF16 or AVX512-BF16; "
                         "fp32 as magicdec runs on other CPUs)")
    pl.add_argument("--mode", choices=["greedy", "sampling"], default="greedy", help="acceptance regime")
    pl.add_argument("--acceptance", help="acceptance table JSON (default: the paper's StreamingLLM numbers)")
    pl.add_argument("--steady-state", action="store_true",
                    help="plan for a continuously refilled batch (mean acceptance) instead of a static batch, "
                         "which runs until its slowest sequence is done (needs a table with a per-sequence "
                         "spread, as `magicdec calibrate --acceptance` writes)")
    pl.add_argument("--plot", help="write a speedup-vs-batch PNG here")
    pl.add_argument("--json", help="write the table as JSON here")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("calibrate", help="measure this machine (and acceptance) for the planner",
                       description="Measures peak FLOP/s and read bandwidth, the fixed per-forward overhead, and the "
                                   "model's linear-layer and attention rates against batch x new tokens (the shapes "
                                   "draft and verify steps take), checks the result on a grid of forwards, measures the "
                                   "all-reduce between local processes (gloo on CPU, NCCL between GPUs) for "
                                   "tensor parallelism, and saves a hardware profile the planner loads. Under "
                                   "torchrun it measures only the all-reduce of the launched ranks (across nodes "
                                   "too) and writes it into the saved profile.")
    c.add_argument("--device", help="cpu or cuda (default cpu)")
    c.add_argument("--quick", action="store_true", help="a few seconds instead of a few minutes")
    c.add_argument("--output", help="profile JSON path (default: the user cache folder)")
    c.add_argument("--acceptance", action="store_true", help="also measure draft acceptance on --corpus")
    c.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/data/pg19_dev.jsonl"),
                   help="corpus for --acceptance")
    c.add_argument("--model", help="model for --acceptance (default: the embedded model)")
    c.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="dtype to measure in (default auto, as `generate` picks it)")
    c.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming, metrics) over HTTP",
                       description="An OpenAI-compatible server as vLLM serves it: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics. "
                                   "Slots x max-model-len tokens of KV cache are allocated up front.")
    add_model_args(s)
    add_draft_args(s)
    s.set_defaults(draft="auto")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    s.add_argument("--max-running", type=positive_int, default=8, help="requests decoded together: KV slots (default 8)")
    s.add_argument("--max-queued", type=positive_int, default=256,
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    s.add_argument("--max-model-len", type=positive_size, help="prompt + output tokens per request (default: the model's context)")
    s.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes")
    s.add_argument("--served-model-name", help="the model name clients send (default: --model, or the default model's name)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="uvicorn's log level")
    s.set_defaults(func=cmd_serve)
    return p


def print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the command line: one line, `magicdec: warning: ...`."""
    print(f"magicdec: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Under torchrun every rank runs the same command; only rank 0 prints results and writes files, the
    # others keep their errors, which name the rank (torchrun interleaves the ranks' output).
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    err, prefix = sys.stderr, f"[rank {rank}] " if rank else ""
    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    # the library's notices (a native kernel being compiled, server errors) on stderr
    logger = logging.getLogger("magicdec")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("magicdec: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = print_warning
            status = args.func(args)
    except DistributedError as e:  # its message names the rank
        print(f"magicdec: error: {e}", file=err, flush=True)
        os._exit(EXIT_DISTRIBUTED)  # without tearing the process group down: with a dead peer that can block
    except MagicDecError as e:
        print(f"magicdec: error: {prefix}{e}", file=err)
        status = EXIT_USAGE
    except OSError as e:
        print(f"magicdec: error: {prefix}{e.strerror or e}: {e.filename or ''}".rstrip(": "), file=err)
        status = EXIT_USAGE
    except KeyboardInterrupt:
        print("magicdec: interrupted", file=err)
        status = 130
    if launched:
        from magicdec.distributed import shutdown_tp

        shutdown_tp()
    return status


if __name__ == "__main__":
    sys.exit(main())
