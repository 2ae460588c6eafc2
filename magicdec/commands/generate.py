"""`magicdec generate`: completions for prompts or corpus cuts, optionally speculative, and the runs' stats."""

import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from magicdec.autoplan import describe, describe_learned
from magicdec.calibrate.quick import planning_profile
from magicdec.cli import llm_options
from magicdec.corpus import cut_prompts, load_texts
from magicdec.engine import LLM
from magicdec.errors import InvalidRequestError
from magicdec.phases import PhaseRecorder, format_phases
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig


def speculative_from_args(args, llm: LLM) -> SpeculativeConfig | None:
    """The drafter the arguments ask for (None: plain decoding); `serve` too. `--draft auto` plans with --hardware,
    else the profile `planning_profile` gives (measured now on an uncalibrated CPU)."""
    if args.draft_vocab:
        _check_draft_head(args)
    if args.draft == "none":
        return None
    head = {"draft_vocab": args.draft_vocab, "vocab_corpus": args.vocab_corpus, "draft_stop": args.draft_stop}
    if args.draft == "auto":
        # `serve` has no temperature of its own (each request brings one) and plans for greedy requests.
        return SpeculativeConfig("auto", hardware=args.hardware or planning_profile(llm.model, llm.kv_dtype),
                                 mode="greedy" if getattr(args, "temperature", 0) == 0 else "sampling", **head)
    return SpeculativeConfig(args.draft, budget=args.budget, gamma=args.gamma, draft_model=args.draft_model,
                             draft_cache=args.draft_cache,
                             reindex=None if args.positions is None else args.positions == "reindex", **head)


def _check_draft_head(args) -> None:
    """Refuse --draft-vocab's companions before any planning (a first `--draft auto` measures the machine)."""
    if args.draft == "none":
        raise InvalidRequestError("--draft-vocab is a drafter's head: give --draft too")
    if not args.vocab_corpus:
        raise InvalidRequestError("--draft-vocab counts its tokens in a text: give --vocab-corpus")
    if not Path(args.vocab_corpus).is_file():
        raise InvalidRequestError(f"corpus file not found: {args.vocab_corpus}")


def dtype_line(llm) -> str:
    """The dtypes a run computes and caches in, and why (printed with the run's stats; `calibrate` too)."""
    kv = str(llm.kv_dtype).removeprefix("torch.")
    return (f"dtype {llm.loaded.dtype_choice}; KV cache {kv}; attention {llm.attention}; linear {llm.linear}; "
            f"kernels {llm.kernels}; layer ops {llm.layer_ops}; cascade {llm.cascade}")


def collect_prompts(args, tok) -> tuple[list[str] | None, list[list[int]]]:
    texts = list(args.prompt)
    if args.prompt_file:
        texts += load_texts(args.prompt_file)
    if args.corpus:
        if texts:
            raise InvalidRequestError("use either --corpus or --prompt/--prompt-file, not both")
        return None, cut_prompts(tok, load_texts(args.corpus), args.num_prompts, args.prompt_tokens)
    if not texts:
        raise InvalidRequestError("no prompts: give --prompt, --prompt-file or --corpus")
    for i, t in enumerate(texts):
        if not t.strip():
            raise InvalidRequestError(f"prompt {i} is empty")
    return texts, tok.encode_batch(texts)


def progress_bar(desc: str, enabled: bool):
    """A tqdm bar on stderr fed with (done, total) calls; returns (callback, close)."""
    bar = tqdm(desc=desc, unit="tok", disable=not enabled, leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.total, bar.n = total, done
        bar.refresh()

    return update, bar.close


def format_stats(stats, label: str) -> str:
    gib = stats.peak_memory_bytes / 1024**3
    line = (f"[{label}] {stats.requests} requests ({stats.dtype}), at most {stats.max_batch} decoding together: "
            f"prefill {stats.prompt_tokens} tok ({stats.cached_tokens} reused from the prefix cache) in "
            f"{stats.prefill_s:.2f}s ({stats.prefill_tok_s:.0f} tok/s computed); "
            f"decode {stats.decode_tokens} tok in {stats.decode_s:.2f}s ({stats.decode_tok_s:.1f} tok/s); "
            f"peak memory {gib:.2f} GiB")
    if stats.preemptions:
        line += f"; {stats.preemptions} preemptions (the KV blocks ran out; see --kv-cache-gb)"
    if stats.cuda_graphs:
        line += (f"; {stats.cuda_graphs} CUDA graphs captured in {stats.graph_capture_s:.2f}s "
                 f"({stats.graph_memory_bytes / 2**20:.0f} MiB; --enforce-eager for none)")
    if stats.gamma:
        changes = ", ".join(f"{g or 'plain'} from round {r}" for r, g in stats.gamma_changes)
        line += (f"\n[{label}] draft length {changes}: acceptance {stats.acceptance_rate:.3f}, "
                 f"{stats.tokens_per_step:.2f} tokens/round, {stats.verified_per_token:.2f} tokens verified per "
                 f"token, accepted-length histogram {stats.accepted_hist}, "
                 f"draft {stats.draft_s:.2f}s verify {stats.verify_s:.2f}s")
    return line


def run(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **llm_options(args), max_num_seqs=args.batch_size or 256)
    texts, ids = collect_prompts(args, llm.tokenizer)
    if args.n > 1:  # row i is sample i % n of prompt i // n
        ids = [p for p in ids for _ in range(args.n)]
        texts = texts and [t for t in texts for _ in range(args.n)]
        params = [dataclasses.replace(params, seed=None if args.seed is None else args.seed + i % args.n)
                  for i in range(len(ids))]
    spec = speculative_from_args(args, llm)
    drafts = spec is not None
    if drafts and spec.draft == "auto":
        # planned here to say what it chose and whether there is a plain run to compare with; `generate` plans the
        # same prompts alike
        choice = llm.plan(spec, ids, params)
        print(describe(choice.plan), file=sys.stderr)
        drafts = choice.speculative is not None
    modes = [("ar", None)] if args.compare_ar and drafts else []
    modes.append(("spec" if drafts else "ar", spec))
    results, runs = {}, []
    for label, cfg in modes:
        update, close = progress_bar(label, sys.stderr.isatty() and not args.json)
        phases = PhaseRecorder(args.phases) if args.phases else None
        try:
            results[label] = llm.generate(prompt_token_ids=ids, params=params, speculative=cfg, progress=update,
                                          phases=phases)
        finally:
            close()
        auto = llm.last_auto
        if not args.json:
            print(f"{format_stats(llm.last_stats, label)}\n[{label}] {dtype_line(llm)}", file=sys.stderr)
            if llm.last_stats.phases:
                print(format_phases(llm.last_stats.phases, label), file=sys.stderr)
            if auto is not None and auto.replanner is not None:
                print(f"[{label}] {describe_learned(auto.replanner)}", file=sys.stderr)
        ran = auto.speculative if auto is not None else cfg
        runs.append({"mode": label, "stats": llm.last_stats.as_dict(), "speculative": ran and dataclasses.asdict(ran)
                     | {"replanned": auto is not None and auto.replanner is not None}})
    if len(runs) == 2:
        runs.append(_compare(results["ar"], results["spec"], runs, quiet=args.json))
    outputs = results[modes[-1][0]]
    if args.json:
        docs = [{"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                 "prompt_tokens": len(o.prompt_token_ids)} for o in outputs]
        json.dump({"outputs": docs, "runs": runs, "dtype": dtype_line(llm)}, sys.stdout, indent=1)
        print()
    else:
        for o in outputs:
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
