"""GPU readiness check (run by benchmarks/gpu_check.sh on a CUDA machine; a few minutes).

1. Greedy speculative output equals autoregressive output on a tiny random model, on the GPU, for the
   self-speculative StreamingLLM and SnapKV drafters.
2. Step times at Llama-3.1-8B shapes with random bf16 weights: a decode step (q=1 over S), a verify
   step (q=gamma+1 over S) and a self-speculative draft step (q=1 over a 512-entry sparse cache), for
   B in {32, 64, 128} and S in {8k, 16k, 32k} where the KV cache fits, with the cost model's prediction
   (H200 preset) beside each measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from magicdec.config import EngineConfig, ModelConfig
from magicdec.drafters import SelfSpecDrafter
from magicdec.engine import LLMEngine
from magicdec.errors import OutOfMemoryError
from magicdec.kv import KVCache
from magicdec.memory import check_fits
from magicdec.model import Transformer
from magicdec.planner import Workload, forward_cost, get_model_shape, get_profile
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma
from magicdec.speculative import Speculation

LLAMA31_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         rope_theta=500000.0, max_seq_len=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for layer in model.layers:  # RMSNorm weights near 1
        layer.attention_norm.weight.data.fill_(1.0)
        layer.ffn_norm.weight.data.fill_(1.0)
    model.norm.weight.data.fill_(1.0)
    inv_freq = model.inv_freq
    model = model.to(dtype).eval().requires_grad_(False)
    model.inv_freq = inv_freq.float()
    return model


def check_lossless(device: str) -> bool:
    cfg = ModelConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=2048)
    model = random_model(cfg, device, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (300, 120, 700, 45)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + params.max_tokens)
    ar = LLMEngine(model, config).generate(prompts, params)
    ok = True
    for kind in ("streaming", "snapkv"):
        drafter = SelfSpecDrafter(model, kind, budget=64, gamma=3, reindex=kind == "streaming")
        engine = LLMEngine(model, config, speculation=Speculation(drafter, FixedGamma(3)))
        spec, stats = engine.generate(prompts, params), engine.stats
        same = all(a.output_ids == s.output_ids for a, s in zip(ar, spec))
        print(f"lossless greedy, self-{kind}: {'OK' if same else 'MISMATCH'} (acceptance {stats.acceptance_rate:.2f})")
        ok &= same
    return ok


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


@torch.inference_mode()
def step_times(device: str, batches, contexts, gamma: int, budget: int) -> list[dict]:
    model = random_model(LLAMA31_8B, device, torch.bfloat16)
    shape, hw = get_model_shape("llama-3.1-8b"), get_profile("h200")
    rows = []
    for S in contexts:
        for B in batches:
            cap = S + gamma + 2
            try:
                check_fits(KVCache.nbytes(LLAMA31_8B, B, cap, torch.bfloat16) + 2 * 1024**3, torch.device(device),
                           f"B={B} S={S}")
            except OutOfMemoryError as e:
                print(f"skip: {e}")
                continue
            dense = KVCache(LLAMA31_8B, B, cap, torch.bfloat16, device)
            dense.k.normal_(std=0.5)
            dense.v.normal_(std=0.5)
            dense.lens.fill_(S)
            dense.next_pos.fill_(S)
            dense.max_len = S
            sparse = KVCache(LLAMA31_8B, B, budget + gamma + 2, torch.bfloat16, device)
            sparse.lens.fill_(budget)
            sparse.next_pos.fill_(S)
            sparse.max_len = budget
            tok1 = torch.randint(0, 1000, (B, 1), device=device)
            tokv = torch.randint(0, 1000, (B, gamma + 1), device=device)
            t_dec = timed(lambda: model(tok1, dense))
            t_ver = timed(lambda: model(tokv, dense))
            t_dra = timed(lambda: model(tok1, sparse))
            pred = {k: forward_cost(Workload(shape, hw, B, S), q, L).time
                    for k, q, L in (("decode", 1, S), ("verify", gamma + 1, S), ("draft", 1, budget))}
            row = {"B": B, "S": S, "decode_ms": t_dec * 1e3, "verify_ms": t_ver * 1e3, "draft_ms": t_dra * 1e3,
                   "verify/decode": t_ver / t_dec, "draft/decode": t_dra / t_dec,
                   **{f"pred_{k}_ms": v * 1e3 for k, v in pred.items()}}
            rows.append(row)
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            del dense, sparse
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    device = "cuda"
    print(torch.cuda.get_device_name(0), torch.__version__)
    ok = check_lossless(device)
    rows = step_times(device, [int(x) for x in args.batches.split(",")], [int(x) for x in args.contexts.split(",")],
                      args.gamma, args.budget)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "lossless": ok, "rows": rows}, f, indent=1)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
