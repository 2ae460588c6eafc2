"""What a Vegas round costs beside the forwards a StreamingLLM round runs, measured for the planner: the selection's
seconds per attention share (`HardwareProfile.selection_s_per_share`) and how much slower a draft's attention reads
positions through a token table than block by block (`HardwareProfile.table_read_factor`)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from magicdec import kernels
from magicdec.calibrate.timing import median_time, times
from magicdec.kv.blocks import BLOCK_SIZE
from magicdec.kv.vegas import select, vegas_top, vegas_window
from magicdec.model import attend
from magicdec.planner import ModelShape

#: The draft budget and context both measurements take: the budget `--draft auto` picks most on CPUs, and a context
#: long enough that a row's shares and a pool's positions fall out of the caches.
BUDGET, CONTEXT = 256, 8192
#: Bytes of K/V the reads measurement's pool holds: beyond any last-level cache, so that neither kind of read finds
#: positions an earlier repetition left there.
POOL_BYTES = 256 << 20
#: Rows each measurement takes.
ROWS = 16


def measure_vegas(shape: ModelShape, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                  reps: int) -> dict[str, Any]:
    """The selection's seconds per share, over `ROWS` rows of softmax-like shares at `CONTEXT` positions, and the
    attention's time through token tables over its time through block tables (at least 1), one token's queries in
    `dtype` per row over `BUDGET` positions of a pool of `shape`'s K/V heads stored in `kv_dtype` (16-bit); medians of
    `reps` (at least 10) runs each, the two kinds of read alternated."""
    reps = max(reps, 10)
    generator = torch.Generator().manual_seed(0)
    layers = max(1, shape.n_layers - shape.sliding_layers)
    shares = torch.randn(layers, ROWS, shape.n_kv_heads, CONTEXT, generator=generator).mul_(2).softmax(-1).to(device)
    lens = torch.full((ROWS,), CONTEXT, device=device)
    t_select = median_time(lambda: select(shares, lens, vegas_top(BUDGET), vegas_window(BUDGET)), device, reps)
    t_blocks, t_tokens = _reads(shape, device, dtype, kv_dtype, reps, generator)
    return {"rows": ROWS, "layers": layers, "context": CONTEXT, "budget": BUDGET, "seconds_select": t_select,
            "seconds_per_share": t_select / shares.numel(), "seconds_block_table": t_blocks,
            "seconds_token_table": t_tokens, "table_read_factor": max(1.0, t_tokens / t_blocks)}


def _reads(shape: ModelShape, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, reps: int,
           generator: torch.Generator) -> tuple[float, float]:
    """Median seconds of a draft's attention over `BUDGET` positions a row, read through block tables (a window of
    whole blocks, another one each repetition) and through token tables (positions drawn anew each repetition)."""
    kv, hd, group = shape.n_kv_heads, shape.head_dim, shape.n_heads // shape.n_kv_heads
    blocks = max(BUDGET // BLOCK_SIZE, POOL_BYTES // (2 * ROWS * kv * hd * kv_dtype.itemsize * BLOCK_SIZE))
    k, v = (torch.randn(ROWS * blocks, kv, BLOCK_SIZE, hd, generator=generator).to(device, kv_dtype)
            for _ in range(2))
    per_row = torch.arange(ROWS)[:, None] * blocks
    xq = torch.randn(ROWS, kv, group, hd, generator=generator).to(device, dtype)
    bias = torch.zeros(ROWS, 1, 1, BUDGET, dtype=kv_dtype, device=device)
    (k_tokens, step), (v_tokens, _) = kernels.token_view(k), kernels.token_view(v)
    windows = blocks * BLOCK_SIZE // BUDGET
    t_blocks, t_tokens = [], []
    for r in range(reps):
        window = r % windows * (BUDGET // BLOCK_SIZE) + torch.arange(BUDGET // BLOCK_SIZE)
        block_table = (per_row + window).to(device, torch.int32)
        positions = torch.rand(ROWS, blocks * BLOCK_SIZE, generator=generator).topk(BUDGET).indices.sort().values
        block = per_row + positions // BLOCK_SIZE
        token_table = (block * step + positions % BLOCK_SIZE).to(device, torch.int32)
        t_blocks += times(lambda: attend(xq, k, v, bias, block_table), device, 1, warmup=0)
        t_tokens += times(lambda: attend(xq, k_tokens, v_tokens, bias, token_table), device, 1, warmup=0)
    return statistics.median(t_blocks), statistics.median(t_tokens)
