"""The Triton kernels (magicdec.kernels.triton_attention, triton_linear) on a GPU, for benchmarks/gpu_check.py.

`check`: the compiled kernels against attention over the gathered K/V in fp32 (paged and dense K/V, a bias and
lengths, a sliding window, GQA, head sizes 64-256, fp16/bf16/fp32), and the exactness they claim: a row's bits alone
and in a batch of other lengths (a failure raises), and whether a verification's rows equal the one-token steps'
(recorded: it depends on the GPU's dot products). `timings`: the kernels against the torch path `magicdec.model.
attend` takes without them (the blocks gathered, then SDPA) and against a plain sum of the same K/V (the read
floor), per model shape, batch, context and query tokens. The linear kernel: against torch's (cuBLAS) in fp32, a row's
bits alone and among 256 rows (a failure raises), and its time against cuBLAS's at a decode step's, a verification's
and a large batch's rows (`linear_rows`), per weight shape (`LINEARS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from magicdec.calibrate.timing import median_time
from magicdec.kernels import triton_attention as ta
from magicdec.kernels import triton_linear
from magicdec.kv import quant
from magicdec.kv.paged import gather
from magicdec.model import CUDA_ATTENTION

BS = 32  # positions per block (magicdec.kv.blocks.BLOCK_SIZE)
#: (KV heads, query heads per KV head, head size) of the timed models.
SHAPES = {"gemma3-270m": (1, 4, 256), "llama-3.1-8b": (8, 4, 128)}
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.int8: 1.6e-2}
#: (out, in) features of the timed linear layers: Gemma 3 270M's fused gate/up and down, Llama-3.1-8B's.
LINEARS = {"gemma3-270m w13": (4096, 640), "gemma3-270m w2": (640, 2048),
           "llama-3.1-8b w13": (28672, 4096), "llama-3.1-8b w2": (4096, 14336)}


def print_row(row: dict) -> None:
    """One measured row as key=value pairs on a line (floats to 3 significant digits)."""
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def paged(B: int, L: int, KV: int, hd: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
          nan: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """K, V pools [NB, KV, BS, hd] (stored head-major, as magicdec.kv.blocks) and a table [B, L / BS] of shuffled
    block ids; block 0, the null block, is never named (`nan`: it holds NaN, which no kernel may read)."""
    nblk = -(-L // BS)
    pools = []
    for _ in range(2):
        store = torch.randn(KV, B * nblk + 1, BS, hd, generator=gen, device=device, dtype=dtype)
        store[:, 0] = float("nan") if nan else 0.0
        pools.append(store.transpose(0, 1))
    ids = torch.randperm(B * nblk, generator=gen, device=device) + 1
    return pools[0], pools[1], ids.view(B, nblk).int()


def bias_of(lens: Tensor, q: int, L: int, window: int, dtype: torch.dtype) -> Tensor:
    """[B, 1, q, L] 0 / -inf: token t of row b sees (lens[b] + t - window, lens[b] + t] (window 0: all before)."""
    at = (lens[:, None] + torch.arange(q, device=lens.device))[..., None]
    pos = torch.arange(L, device=lens.device)
    seen = (pos <= at) & ((pos > at - window) if window else True)
    return torch.zeros(seen.shape, dtype=dtype, device=lens.device).masked_fill_(~seen, float("-inf"))[:, None]


def reference(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """Attention in fp32 over contiguous K/V [B, KV, L, hd]; query row m takes bias row m % R."""
    rows = bias[:, :, torch.arange(xq.shape[2], device=xq.device) % bias.shape[2]].float()
    scores = xq.float() @ keys.float().transpose(-1, -2) * xq.shape[-1] ** -0.5 + rows
    return scores.softmax(-1) @ values.float()


CASES = [  # (lens, q, G, KV, hd, dtype, window)
    ([3, 40, 530], 1, 1, 2, 64, torch.bfloat16, 0),
    ([17, 300, 1100], 4, 3, 2, 64, torch.float16, 0),
    ([5, 2000], 5, 4, 1, 256, torch.bfloat16, 0),
    ([700, 4000, 96], 5, 4, 8, 128, torch.bfloat16, 0),
    ([20, 600], 4, 4, 1, 128, torch.float32, 0),
    ([20, 300, 610], 4, 4, 1, 256, torch.bfloat16, 512),
    ([3, 40, 530], 4, 4, 2, 64, torch.int8, 0),  # int8 rows with their scale, bf16 queries
    ([5, 2000], 5, 4, 1, 256, torch.int8, 0),
]


def check_case(lens: list[int], q: int, G: int, KV: int, hd: int, dtype: torch.dtype, window: int,
               device: torch.device) -> float:
    """Max error of the kernels against `reference` on one case, by bias and by lengths (raises past TOL, relative
    and absolute)."""
    gen = torch.Generator(device).manual_seed(len(lens) * 1000 + hd)
    L, quantized = max(lens) + q, dtype == torch.int8
    compute = torch.bfloat16 if quantized else dtype
    kp, vp, table = paged(len(lens), L, KV, hd, torch.float32 if quantized else dtype, device, gen)
    if quantized:  # rows carrying their scale, as an int8 cache stores them (the null block: zeros)
        kp, vp = (quant.store(pool.nan_to_num(), torch.int8) for pool in (kp, vp))
    xq = torch.randn(len(lens), KV, G * q, hd, generator=gen, device=device, dtype=compute)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    bias = bias_of(lengths, q, L, window, compute)
    keys, values = (quant.load(gather(pool, table, L), torch.float32) for pool in (kp, vp))
    expected = reference(xq, keys, values.nan_to_num(), bias)
    worst = 0.0
    for out in (ta.attention(xq, kp, vp, table, bias=bias),
                ta.attention(xq, kp, vp, table, lens=lengths, tokens=q, window=window)):
        err = (out.float() - expected).abs().max().item()
        if not torch.allclose(out.float(), expected, rtol=TOL[dtype], atol=TOL[dtype]):
            raise AssertionError(f"Triton attention off by {err} (lens {lens}, q {q}, G {G}, hd {hd}, {dtype})")
        worst = max(worst, err)
    return worst


def invariance(device: torch.device) -> dict[str, bool]:
    """Whether a row's output is bit-identical alone and among rows of other lengths, and whether a verification's
    rows equal the one-token steps' at the same positions (Gemma 3 270M's head shape)."""
    gen = torch.Generator(device).manual_seed(7)
    lens, q, G, hd = [37, 5, 3000, 64, 900], 5, 4, 256
    L = max(lens) + q
    kp, vp, table = paged(len(lens), L, 1, hd, torch.bfloat16, device, gen)
    xq = torch.randn(len(lens), 1, G * q, hd, generator=gen, device=device, dtype=torch.bfloat16)
    lengths = torch.tensor(lens, dtype=torch.int32, device=device)
    crowd = ta.attention(xq, kp, vp, table, bias=bias_of(lengths, q, L, 0, torch.bfloat16))
    one = ta.attention(xq[:1], kp, vp, table[:1], bias=bias_of(lengths[:1], q, lens[0] + q, 0, torch.bfloat16))
    steps = [ta.attention(xq[:, :, t::q].contiguous(), kp, vp, table,
                          bias=bias_of(lengths + t, 1, L, 0, torch.bfloat16)) for t in range(q)]
    return {"batch_invariant": torch.equal(one[0], crowd[0]),
            "verify_equals_decode": all(torch.equal(s, crowd[:, :, t::q]) for t, s in enumerate(steps))}


def linear_check(device: torch.device) -> dict:
    """The linear kernel in bf16 against fp32 sums, and whether rows alone equal the same rows among 256."""
    gen = torch.Generator(device).manual_seed(3)
    x = torch.randn(256, 640, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(2048, 640, generator=gen, device=device) / 640**0.5).to(torch.bfloat16)
    full = triton_linear.linear(x, w)
    error = (full.float() - x.float() @ w.float().T).abs().max().item()
    invariant = all(torch.equal(triton_linear.linear(x[rows], w), full[rows])
                    for rows in (slice(0, 1), slice(3, 8), slice(60, 70), slice(0, 64)))
    return {"linear_max_error": error, "linear_batch_invariant": invariant}


@torch.inference_mode()
def check(device: torch.device) -> dict:
    """The kernels against the reference, and their exactness (raises where one that must hold does not)."""
    errors = [check_case(*case, device=device) for case in CASES]
    exact = {**invariance(device), **linear_check(device)}
    if not (exact["batch_invariant"] and exact["linear_batch_invariant"]):
        raise AssertionError(f"Triton kernels: a row's output changed with the batch ({exact})")
    print(f"triton kernels: max errors {', '.join(f'{e:.2g}' for e in errors)}; {exact}", flush=True)
    return {"max_errors": errors, **exact}


@torch.inference_mode()
def linear_timings(device: torch.device, linear_rows: tuple[int, ...] = (1, 5, 64, 256)) -> list[dict]:
    """ms of the batch-invariant linear kernel and of torch's (cuBLAS) per weight shape and rows, bf16."""
    rows = []
    for name, (N, K) in LINEARS.items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        for M in linear_rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            row = {"layer": name, "M": M,
                   "triton_ms": median_time(lambda: triton_linear.linear(x, w), device, reps=20, warmup=3) * 1e3,
                   "torch_ms": median_time(lambda: F.linear(x, w), device, reps=20, warmup=3) * 1e3}
            row["over_torch"] = row["triton_ms"] / row["torch_ms"]
            print_row(row)
            rows.append(row)
    return rows


def torch_path(xq: Tensor, kp: Tensor, vp: Tensor, table: Tensor, bias: Tensor) -> Tensor:
    """What `magicdec.model.attend` runs on CUDA without the kernels: the blocks gathered, then SDPA."""
    L = bias.shape[-1]
    with sdpa_kernel(CUDA_ATTENTION):
        return F.scaled_dot_product_attention(xq, gather(kp, table, L), gather(vp, table, L), attn_mask=bias)


def time_cell(model: str, B: int, S: int, q: int, device: torch.device) -> dict:
    """ms of the kernels (a bias of G*q rows; of q rows, as the model passes it, with and without a Vegas draft's
    attention shares; lengths), of the torch path and of a plain sum over the same K/V bytes, at one cell (every row
    S positions)."""
    KV, G, hd = SHAPES[model]
    gen = torch.Generator(device).manual_seed(0)
    kp, vp, table = paged(B, S, KV, hd, torch.bfloat16, device, gen, nan=False)  # the sum reads the whole pool
    xq = torch.randn(B, KV, G * q, hd, generator=gen, device=device, dtype=torch.bfloat16)
    lengths = torch.full((B,), S - q, dtype=torch.int32, device=device)
    tokens_bias = bias_of(lengths, q, S, 0, torch.bfloat16)
    bias = tokens_bias.repeat(1, 1, G, 1)
    shares = torch.empty(B, KV, S, device=device)
    ms = {
        "triton_bias_ms": lambda: ta.attention(xq, kp, vp, table, bias=bias),
        "triton_token_bias_ms": lambda: ta.attention(xq, kp, vp, table, bias=tokens_bias),
        "triton_shares_ms": lambda: ta.attention(xq, kp, vp, table, bias=tokens_bias, shares=shares),
        "triton_lens_ms": lambda: ta.attention(xq, kp, vp, table, lens=lengths, tokens=q),
        "torch_ms": lambda: torch_path(xq, kp, vp, table, bias),
        "kv_sum_ms": lambda: (kp.sum(), vp.sum()),
    }
    row = {"model": model, "B": B, "S": S, "q": q, "kv_gb": 2 * kp.numel() * kp.element_size() / 1e9}
    for name, fn in ms.items():
        row[name] = median_time(fn, device, reps=10, warmup=2) * 1e3
    row["speedup_over_torch"] = row["torch_ms"] / row["triton_lens_ms"]
    row["over_floor"] = row["triton_lens_ms"] / row["kv_sum_ms"]
    row["shares_over_attention"] = row["triton_shares_ms"] / row["triton_token_bias_ms"]
    print_row(row)
    return row


@torch.inference_mode()
def timings(device: torch.device, cells: list[tuple[str, int, int]], qs: tuple[int, ...] = (1, 5)) -> list[dict]:
    """`time_cell` for each (model, B, S) whose K/V fit three times in free memory (the torch path copies them)."""
    rows = []
    for model, B, S in cells:
        KV, _, hd = SHAPES[model]
        need = 3 * 2 * B * S * KV * hd * 2
        if need > torch.cuda.mem_get_info(device)[0]:
            print(f"skip triton timing {model} B={B} S={S}: {need / 1e9:.0f} GB", flush=True)
            continue
        rows += [time_cell(model, B, S, q, device) for q in qs]
        torch.cuda.empty_cache()
    return rows
