"""What attention over a prompt prefix that several rows share costs, measured for the planner
(`HardwareProfile.shared_attention_factor`): the native kernels attend over blocks rows share once for all of them
(cascade attention, `magicdec.kernels.groups`), and the blocks stay in the caches between the rows that read them."""

from __future__ import annotations

import statistics

import torch

from magicdec.calibrate.timing import times
from magicdec.kv.blocks import BLOCK_SIZE
from magicdec.model import attend
from magicdec.planner import ModelShape
from magicdec.planner.cost import SHARED_ROWS

#: Rows and positions of the measurement: four whole chunks of the kernels' (1024 positions), all shared (over two,
#: the calls' fixed work weighed as much as the rows' second passes: factor 0.50-0.57 against 0.36-0.43 over four).
ROWS, CONTEXT = 8, 4096


def measure_shared_attention(shape: ModelShape, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                             reps: int) -> float:
    """Seconds of a plain step's attention where each `SHARED_ROWS` of `ROWS` rows share their CONTEXT positions'
    blocks, over its seconds where every row reads blocks of its own (each repetition new blocks, as
    distinct prompts read); one token's queries in `dtype` per row, a pool of `shape`'s K/V heads in `kv_dtype`;
    medians of `reps` (at least 10), the two alternated, each over blocks the other has not read. At most 1."""
    reps = max(reps, 10)
    generator = torch.Generator().manual_seed(0)
    kv, hd, group = shape.n_kv_heads, shape.head_dim, shape.n_heads // shape.n_kv_heads
    nblk = CONTEXT // BLOCK_SIZE
    prompts = ROWS // SHARED_ROWS
    per_rep = (ROWS + prompts) * nblk  # each repetition's blocks: every row's own, then each prompt's
    k, v = (torch.randn(reps * per_rep, kv, BLOCK_SIZE, hd, generator=generator).to(device, kv_dtype)
            for _ in range(2))
    xq = torch.randn(ROWS, kv, group, hd, generator=generator).to(device, dtype)
    bias = torch.zeros(ROWS, 1, 1, CONTEXT, dtype=kv_dtype, device=device)
    t_own, t_shared = [], []
    for r in range(reps):
        own = torch.arange(ROWS * nblk).view(ROWS, nblk) + r * per_rep
        shared = (torch.arange(prompts * nblk).view(prompts, nblk) + r * per_rep + ROWS * nblk)[
            torch.arange(ROWS) // SHARED_ROWS]
        own, shared = own.to(device, torch.int32), shared.to(device, torch.int32)
        t_own += times(lambda: attend(xq, k, v, bias, own), device, 1, warmup=0)
        t_shared += times(lambda: attend(xq, k, v, bias, shared), device, 1, warmup=0)
    return min(1.0, statistics.median(t_shared) / statistics.median(t_own))
