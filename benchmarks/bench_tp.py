"""Tensor parallelism against one process: decode throughput, the communication share of a step, the
planner's prediction beside each measurement, and the price of the replicated LM head.

Every configuration runs under torchrun (one process per rank; --tp 1 is a single process without a
group) and decodes the same batch of random prompts with the engine: plain decoding, then self-speculation
over a StreamingLLM cache. Only steps without prefill count. Per step, a rank's time inside the model's
all-reduces is its communication share (on CPU gloo's all-reduce blocks, so this includes waiting for the
slower rank). The planner's prediction uses the measured acceptance (tokens per round), so it checks the
cost model alone: `forward_cost` over the hardware profile (with the all-reduce latency and bandwidth
measured here between two local processes) for tp ranks of `threads` threads each.

On this 2-core CPU (defaults: the default model, batch 4, context 512, 24 new tokens; a few minutes):

    PYTHONPATH=. python benchmarks/bench_tp.py

On a multi-GPU machine, Llama-3.1-8B's shape with placeholder weights (see benchmarks/bench_tp_gpu.sh):

    PYTHONPATH=. python benchmarks/bench_tp.py --device cuda --shape llama-3.1-8b --runs 1:1,2:1,4:1,8:1 \
        --batch 32 --context 8192 --hardware h100 --out benchmarks/results/tp-gpu.json

Writes --out (JSON: machine, settings, all-reduce, every run with its predictions, LM-head timings).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from magicdec.calibrate.allreduce import measure_local_allreduce, with_allreduce  # noqa: E402
from magicdec.calibrate.hardware import measure_hardware  # noqa: E402
from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.calibrate.timing import median_time, model_config_from_shape, synthetic_model  # noqa: E402
from magicdec.config import ModelConfig  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.planner import HardwareProfile, Workload, draft_time, forward_cost, get_model_shape, get_profile  # noqa: E402
from magicdec.profiles import target_shape  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--shape", help="a planner model preset (e.g. llama-3.1-8b): placeholder weights of that shape")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--runs", default="1:1,1:2,2:1",
                   help="tp:threads per rank, comma separated (default 1:1,1:2,2:1: one process on one and on "
                        "two cores, and two ranks of one core)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--budget", type=int, default=64, help="StreamingLLM draft budget (default 64)")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--hardware", help="profile of one rank for the predictions: preset or JSON (default: a quick "
                                      "calibration of one rank's threads on this CPU)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/tp.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a rank's result file: run as one rank of a configuration
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one rank ------------------------------------------------------------------------------------------
def build_model(args):
    """This rank's model (sharded under torchrun) and its EOS ids."""
    from magicdec.distributed import add_all_reduces, init_tp, launched_world_size, local_config
    from magicdec.cpu import auto_dtype
    from magicdec.loading import load_model, resolve_device

    tp = init_tp(args.device) if launched_world_size() > 1 else None
    device = tp.device if tp is not None else resolve_device(args.device)
    if args.shape is None:
        return load_model(args.model, device=device, tp=tp).model, ()
    full = model_config_from_shape(get_model_shape(args.shape), args.context + args.max_tokens + 64)
    cfg = local_config(full, tp.world_size, tp.rank) if tp is not None else full
    choice = auto_dtype(device) if tp is None else tp.share(auto_dtype(device))  # the ranks must agree
    model = synthetic_model(cfg, device, choice.dtype)
    if tp is not None:
        add_all_reduces(model, tp, full)
    return model, ()


def decode(model, eos, args, spec) -> dict:
    """Run the batch through the engine; time the steps without prefill and the all-reduces inside them."""
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine
    from magicdec.sampling import SamplingParams
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation

    speculation = Speculation(spec.build(model), FixedGamma(spec.gamma)) if spec is not None else None
    engine = LLMEngine(model, EngineConfig(max_num_seqs=args.batch, max_model_len=args.context + args.max_tokens),
                       eos_ids=eos, speculation=speculation)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(3, model.cfg.vocab_size, (args.context,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    tp, steps, seconds, comm = model.tp, 0, 0.0, 0.0
    while engine.has_unfinished():
        prefilling = bool(engine.scheduler.waiting or engine.scheduler.prefilling)
        c0, t0 = tp.comm_s if tp else 0.0, time.perf_counter()
        engine.step()
        if not prefilling:
            steps += 1
            seconds += time.perf_counter() - t0
            comm += (tp.comm_s if tp else 0.0) - c0
    s = engine.stats
    return {"decode_steps": steps, "step_s": seconds / steps, "comm_s_per_step": comm / steps,
            "comm_share": comm / seconds, "tokens_per_step": s.tokens_per_step if spec else 1.0,
            "decode_tok_s": s.decode_tok_s, "acceptance": s.acceptance_rate if spec else None}


def lm_head_costs(model, tokens: int, reps: int = 10) -> dict:
    """Seconds of the replicated LM head for `tokens` rows, against a vocab-parallel one: this rank's
    1/tp of the vocabulary plus the all-gather of the logits every rank would need to sample."""
    import torch.distributed as dist

    tp, dev = model.tp, model.device
    x = torch.randn(tokens, model.cfg.dim, device=dev, dtype=model.dtype)
    w = model.output.weight
    part = w[: w.shape[0] // tp.world_size]
    logits = torch.empty(tokens, part.shape[0], device=dev, dtype=torch.float32)
    gathered = [torch.empty_like(logits) for _ in range(tp.world_size)]
    return {"tokens": tokens,
            "replicated_s": median_time(lambda: model.output(x).float(), dev, reps),
            "vocab_parallel_matmul_s": median_time(lambda: torch.nn.functional.linear(x, part).float(), dev, reps),
            "all_gather_logits_s": median_time(lambda: dist.all_gather(gathered, logits), dev, reps)}


def worker(args) -> None:
    from magicdec.speculative import SpeculativeConfig

    torch.set_num_threads(args.threads)
    model, eos = build_model(args)
    spec = SpeculativeConfig("self-streaming", budget=args.budget, gamma=args.gamma)
    result = {"ar": decode(model, eos, args, None), "spec": decode(model, eos, args, spec),
              "full_config": {k: getattr(model.full_cfg, k) for k in
                              ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim")}}
    if model.tp is not None:
        result["lm_head"] = [lm_head_costs(model, n) for n in (args.batch, args.batch * (args.gamma + 1))]
    if model.tp is None or model.tp.is_main:
        Path(args.worker).write_text(json.dumps(result))


# --- the launcher ---------------------------------------------------------------------------------------
def run_config(args, tp: int, threads: int) -> dict:
    """One configuration under torchrun; its rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "result.json"
        forwarded = [a for flag in ("model", "shape") if getattr(args, flag) for a in (f"--{flag}", getattr(args, flag))]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), __file__,
               "--worker", str(part), "--threads", str(threads), "--device", args.device, "--batch", str(args.batch),
               "--context", str(args.context), "--max-tokens", str(args.max_tokens), "--budget", str(args.budget),
               "--gamma", str(args.gamma), *forwarded]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, env=env, check=True)
        return json.loads(part.read_text())


def one_rank_profile(args, threads: int) -> HardwareProfile:
    if args.hardware:
        return get_profile(args.hardware)
    torch.set_num_threads(threads)
    return measure_hardware("cpu", quick=True).profile


def predict(shape, hw: HardwareProfile, args, tp: int, tokens_per_step: float) -> dict:
    """The planner's step times for plain decoding and one speculative round at the measured acceptance."""
    es = 4 if args.device == "cpu" else 2
    context = args.context + args.max_tokens // 2
    w = Workload(shape, hw, args.batch, context, es, es, tp)
    ar = forward_cost(w, 1, context)
    verify = forward_cost(w, args.gamma + 1, context)
    draft = draft_time(w, args.budget, args.gamma, first_tokens=1)
    drafts = forward_cost(w, 1, min(args.budget, context))
    spec_round = draft + verify.time
    return {"ar": {"step_s": ar.time, "comm_s_per_step": ar.t_comm, "decode_tok_s": args.batch / ar.time},
            "spec": {"step_s": spec_round, "comm_s_per_step": verify.t_comm + args.gamma * drafts.t_comm,
                     "decode_tok_s": args.batch * tokens_per_step / spec_round}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    runs = [tuple(map(int, r.split(":"))) for r in args.runs.split(",")]
    device = torch.device(args.device)
    allreduce = measure_local_allreduce(device, max(t for t, _ in runs))
    profiles = {threads: one_rank_profile(args, threads) for threads in sorted({th for _, th in runs})}
    doc = {"machine": machine_info(device), "model": None if args.shape else model_identity(args.model),
           "settings": {k: v for k, v in vars(args).items()
                                                                    if k not in ("worker", "threads")},
           "allreduce": allreduce, "profiles": {th: p.name for th, p in profiles.items()}, "runs": []}
    for tp, threads in runs:
        result = run_config(args, tp, threads)
        shape = target_shape(ModelConfig(**result.pop("full_config")))
        hw = profiles[threads] if allreduce is None else with_allreduce(profiles[threads], allreduce)
        predicted = predict(shape, hw, args, tp, result["spec"]["tokens_per_step"])
        doc["runs"].append({"tp": tp, "threads_per_rank": threads, **result, "predicted": predicted})
        for mode in ("ar", "spec"):
            m, p = result[mode], predicted[mode]
            print(f"tp={tp} threads={threads} {mode:4s}: {m['decode_tok_s']:7.1f} tok/s (predicted "
                  f"{p['decode_tok_s']:7.1f}), step {1e3 * m['step_s']:6.1f} ms (predicted {1e3 * p['step_s']:6.1f}), "
                  f"communication {100 * m['comm_share']:4.1f}% (predicted "
                  f"{100 * p['comm_s_per_step'] / p['step_s']:4.1f}%)", file=sys.stderr)
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
