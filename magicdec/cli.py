"""`magicdec generate | bench | plan | calibrate | serve`: the parser and `main`, which imports only the chosen
command's module (`magicdec.commands.<command>`, its `run(args)`), so `--help` and `plan` load no torch.

Every expected failure (bad path, bad value, too-long prompt, not enough memory) prints one line, `magicdec: error:
...`, and exits with status 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

from magicdec.errors import DistributedError, MagicDecError
from magicdec.planner import PRESETS

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


def size_list(text: str, least: int = 1) -> list[int]:
    """'1,4k' -> [1, 4096]; every size must be >= `least` and there must be one at least."""
    sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r} (e.g. 1,8 or 1k,4k)")
    if min(sizes) < least:
        raise argparse.ArgumentTypeError(f"sizes must be >= {least}: {text!r}")
    return sizes


def size_list_with_zero(text: str) -> list[int]:
    """`size_list` where 0 is a size too."""
    return size_list(text, least=0)


def at_least_1(value: int, text: str) -> int:
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        return at_least_1(int(text), text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive_size(text: str) -> int:
    return at_least_1(parse_size(text), text)


def _unit_size(text: str, unit: str, unit_bytes: int, least: int) -> int:
    """A number of `unit`s (`unit_bytes` each) -> bytes, at least `least` and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in {unit}: {text!r} (e.g. 4 or 0.5)") from None
    if not least <= value * unit_bytes < float("inf"):  # nan too
        raise argparse.ArgumentTypeError(f"a size in {unit} must be finite and {least / unit_bytes:g} or more, "
                                         f"got {text!r}")
    return int(value * unit_bytes)


def kv_size(text: str) -> float:
    """'1.5' (GiB) -> 1.5; a MiB at least."""
    return _unit_size(text, "GiB", 2**30, 2**20) / 2**30


def megabytes(text: str) -> int:
    """'5' or '0.5' (MB) -> bytes; a byte at least."""
    return _unit_size(text, "MB", 1_000_000, 1)


def probability(text: str) -> float:
    """'0.3' -> 0.3: a probability strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 1:  # nan too
        raise argparse.ArgumentTypeError(f"a probability in (0, 1) expected, got {text!r}")
    return value


def draft_stop(text: str) -> float | str:
    """'0.3' -> 0.3, 'auto' -> 'auto': a per-row draft length threshold."""
    return "auto" if text == "auto" else probability(text)


def draft_stop_list(text: str) -> list[float | str | None]:
    """'0,0.3,auto' -> [None, 0.3, 'auto']: `draft_stop` values, 0 standing for none; one at least."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no values in {text!r} (e.g. 0,0.3)")
    return [None if x in ("0", "0.0") else draft_stop(x) for x in values]


def port_number(text: str) -> int:
    if (v := positive_int(text)) > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {text!r}")
    return v


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, `magicdec: error: ...`, and exit status 2, like the errors of
    the commands themselves (argparse's own print the usage first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"magicdec: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="Hugging Face model folder, .gguf file, or gemma3-270m (the packaged Gemma 3 270M, "
                                   "32k context) (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weights, activations and KV dtype (default auto: bf16 on CUDA and on CPUs with AMX-BF16 "
                        "or AVX512-BF16, fp32 on other CPUs)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp32", "bf16", "fp16", "int8", "fp8"], default="auto",
                   help="KV cache storage (default auto: the compute dtype, or the 16-bit storage of the AVX2 "
                        "kernels); int8 (a scale per cached row, read by the native CPU kernel) and fp8 (e4m3) "
                        "halve the bytes of bf16 at the cost of their rounding")
    g.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens per prefill forward (default 512)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt in full instead of reusing the K/V of an earlier request's shared prefix "
                        "(prefix caching is on by default)")
    g.add_argument("--kv-cache-gb", type=kv_size,
                   help="memory of the KV cache's blocks in GiB, shared by the running requests as they grow and by "
                        "the cached prefixes; it sets how many requests fit at once (default: half the memory "
                        "available after the model loads). A sparse draft's budget is taken from them for each running "
                        "request; a --draft-model's K/V take a share of each block on top, in proportion to its K/V "
                        "bytes per token")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, launch every forward's kernels from Python instead of replaying decode, "
                        "verification and draft forwards from CUDA graphs (captured on first use of each shape)")


def llm_options(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments of the model options (add_model_args)."""
    return {"device": args.device, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "prefill_chunk": args.prefill_chunk,
            "enable_prefix_caching": args.prefix_caching, "kv_cache_gb": args.kv_cache_gb,
            "enforce_eager": args.enforce_eager}


def add_draft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default="none",
                   choices=["none", "self-streaming", "self-snapkv", "self-vegas", "self-quant", "model", "auto"],
                   help="drafter: none (plain decoding), the target over a StreamingLLM or SnapKV sparse cache, "
                        "the target over the entries its last verification attended to most, per layer, read in "
                        "place (self-vegas), the target over its whole cache rounded to 4 bits (self-quant), a "
                        "standalone draft model, or auto (the planner picks among the self-speculative ones but "
                        "self-vegas, or turns speculation off; default %(default)s)")
    g.add_argument("--budget", type=positive_int, default=256, help="KV entries the draft reads per sequence (default 256)")
    g.add_argument("--gamma", type=positive_int, default=3, help="tokens drafted per verification (default 3)")
    g.add_argument("--draft-stop", type=draft_stop, metavar="P",
                   help="per-row draft lengths: a row stops drafting before the token that would bring the product of "
                        "its draft's confidences (1 - runner-up / winner of the race that drew each token) below P, "
                        "and verification runs each row's own tokens only; 'auto' (with --draft auto): P priced by "
                        "the planner's cost model against the acceptance learned per confidence (default: every row "
                        "drafts --gamma tokens; no faster than the best fixed --gamma at B = 32 x 8k on a Zen 4)")
    g.add_argument("--draft-model", help="draft checkpoint for --draft model (same vocabulary as the target)")
    g.add_argument("--draft-cache", default="streaming", choices=["dense", "streaming", "snapkv"],
                   help="the draft model's cache for --draft model (default streaming)")
    g.add_argument("--positions", choices=["reindex", "original"],
                   help="positions of sparse-cache keys: re-indexed to slots (StreamingLLM) or original "
                        "(default: the better measured one per cache kind)")
    g.add_argument("--hardware", help="hardware profile for --draft auto: preset name or JSON from `magicdec calibrate`")
    g.add_argument("--draft-vocab", type=parse_size, default=0,
                   help="the draft proposes among only the N tokens most frequent in --vocab-corpus, through an LM "
                        "head of N rows (FR-Spec; e.g. 32k of Gemma 3's 262k): cheaper draft steps, the same output; "
                        "with --draft auto the planner drafts through it where it pays (default 0: the whole "
                        "vocabulary)")
    g.add_argument("--vocab-corpus", help="text or .jsonl file whose token counts pick --draft-vocab's tokens")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="magicdec",
               description="Fast long-context, large-batch generation with sparse-KV speculative decoding (MagicDec).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate completions (optionally speculative)",
                       description="Generate completions for prompts, or for prompts cut from a corpus, in batches. "
                                   "Prints the completions and final stats (prefill/decode tok/s, peak memory, "
                                   "acceptance).")
    add_model_args(g)
    a = g.add_argument_group("prompts")
    a.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    a.add_argument("--prompt-file", help="a .txt file (one prompt) or .jsonl file (one prompt per line, key 'prompt' or 'text')")
    a.add_argument("--corpus", help="a text or .jsonl file to cut prompts from (e.g. ../shared/data/pg19_dev.jsonl)")
    a.add_argument("--num-prompts", type=positive_int, default=8, help="prompts to cut from --corpus (default 8)")
    a.add_argument("--prompt-tokens", type=parse_size, default=1024, help="tokens per prompt cut from --corpus (default 1024; 4k works)")
    a = g.add_argument_group("sampling")
    a.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    a.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    a.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    a.add_argument("--seed", type=int, help="random seed for sampling")
    a.add_argument("--n", type=positive_int, default=1,
                   help="completions per prompt, as OpenAI's n (default 1): sampled ones get seeds --seed, "
                        "--seed + 1, ... (or random ones); each prompt is prefilled once and copied")
    a.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    a.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_draft_args(g)
    g.add_argument("--batch-size", type=positive_int, help="most prompts decoded together; the rest queue for a free slot (default: all)")
    g.add_argument("--compare-ar", action="store_true", help="also run plain decoding first (its prefill is reused) and report the speedup")
    g.add_argument("--phases", type=positive_int, metavar="ROUNDS",
                   help="profile this many decode rounds once the prompts are prefilled: each kind of forward (plain, "
                        "draft, verify) split into attention, linear layers, other operators, host time and sampling, "
                        "against its floor (bytes at the memory's read rate, or multiply-adds at a matmul's rate, both "
                        "measured after the rounds)")
    g.add_argument("--json", action="store_true",
                   help="print outputs and stats as JSON on stdout; each output carries the index of its prompt "
                        "(--prompt ones first, then the lines of --prompt-file, in order)")

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
                   help="comma separated: none, self-streaming, self-snapkv, self-vegas, self-quant (no budget), "
                        "auto (the planner's choice per point)")
    b.add_argument("--hardware", help="hardware profile for the auto drafter (default: calibrated, else preset)")
    b.add_argument("--budget", type=size_list, default=[256], help="draft budgets, comma separated")
    b.add_argument("--gamma", type=size_list, default=[1, 2, 3], help="gammas, comma separated")
    b.add_argument("--positions", default="default",
                   help="sparse-cache key positions to compare: default, reindex, original (comma separated)")
    b.add_argument("--draft-vocab", type=size_list_with_zero, default=[0],
                   help="draft head sizes to compare, comma separated: the N tokens most frequent in --vocab-corpus "
                        "(FR-Spec), 0 the whole vocabulary (default 0)")
    b.add_argument("--vocab-corpus", help="text or .jsonl file draft heads count tokens in (default --corpus)")
    b.add_argument("--draft-stop", type=draft_stop_list, default=[None],
                   help="per-row draft length thresholds to compare, comma separated (see `generate --draft-stop`; "
                        "0: every row drafts gamma tokens; auto: priced by the planner, for --drafters auto; default 0)")
    b.add_argument("--modes", default="greedy", help="greedy and/or sampling (temperature 0.7, top-p 0.9)")
    b.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per sequence (default 128)")
    b.add_argument("--distinct-prompts", type=positive_int,
                   help="prefill this many prompts and tile them up to the batch size: the same decode work "
                        "for far less prefill (default: every row its own prompt)")
    b.add_argument("--repeats", type=positive_int, default=1,
                   help="run each configuration of a point this many times, interleaved with the others, and keep "
                        "its median run: steadier ratios on a machine whose speed drifts (default 1)")
    b.add_argument("--phases", type=positive_int, metavar="ROUNDS",
                   help="profile this many decode rounds of each run: its forwards' time split by kind and part, "
                        "against their floors (see `generate --phases`), in each point's 'phases'")
    b.add_argument("--out", default="bench.json", help="results JSON (resumed if it exists)")
    b.add_argument("--plots", help="folder for PNG plots (default: beside --out)")

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
    c.add_argument("--kv-cache-dtype", choices=["auto", "fp32", "bf16", "fp16", "int8", "fp8"], default="auto",
                   help="KV cache to measure attention over (default auto: as `generate` stores it); an 8-bit one "
                        "saves a profile of its own, which --draft auto uses over such a cache")

    s = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming, metrics) over HTTP",
                       description="An OpenAI-compatible server as vLLM serves it: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics. "
                                   "Slots x max-model-len tokens of KV cache are allocated up front.")
    add_model_args(s)
    add_draft_args(s)
    s.set_defaults(draft="auto")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    s.add_argument("--max-running", type=positive_int, default=8, help="most requests running at once; each holds KV blocks only for its tokens (default 8)")
    s.add_argument("--max-queued", type=positive_int, default=256,
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    s.add_argument("--max-model-len", type=positive_size, help="prompt + output tokens per request (default: the model's context)")
    s.add_argument("--max-request-mb", dest="max_request_bytes", type=megabytes, metavar="MB",
                   help="largest request body in MB; a larger one gets 413 before it is read (default: room for a "
                        "prompt of --max-model-len of the model's longest tokens, 5 MB for the default model at 8k)")
    s.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes")
    s.add_argument("--served-model-name", help="the model name clients send (default: --model, or the default model's name)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="uvicorn's log level")
    return p


def print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the command line: one line, `magicdec: warning: ...`."""
    print(f"magicdec: warning: {message}", file=sys.stderr)


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was when the handler was made: `main` may run
    again in the same process with another stderr (a test's capture, a rank's devnull)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Under torchrun every rank runs the same command; only rank 0 prints results and writes files, the others keep
    # their errors, which name the rank (torchrun interleaves the ranks' output).
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    err, prefix = sys.stderr, f"[rank {rank}] " if rank else ""
    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    # the library's notices (a native kernel being compiled, server errors) on stderr
    logger = logging.getLogger("magicdec")
    if not logger.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("magicdec: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = print_warning
            status = importlib.import_module(f"magicdec.commands.{args.command}").run(args)
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
    if launched and (group := sys.modules.get("magicdec.distributed.group")) is not None:
        group.shutdown_tp()  # the group, if a command joined one (importing this module first)
    return status


if __name__ == "__main__":
    sys.exit(main())
