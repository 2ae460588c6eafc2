"""Timing on a device, and the placeholder-weight models and filled caches that calibration and the benchmarks
time."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from magicdec.config import ModelConfig
from magicdec.kv import quant
from magicdec.kv.blocks import KVManager, blocks_for
from magicdec.kv.hybrid import HybridCache, paged_cache, paged_part
from magicdec.kv.paged import PagedKVCache
from magicdec.model import Transformer, pack_linears
from magicdec.planner import ModelShape
from magicdec.runner import synchronize


def times(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` runs of `fn` after `warmup` ones, the device synchronized around each."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def best_time(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Fastest of `reps` runs: the estimate of a peak rate least disturbed by other processes."""
    return min(times(fn, device, reps, warmup))


def read_rate(x: torch.Tensor, reps: int) -> float:
    """Bytes/s of the fastest of `reps` plain sums over x, its bytes read as fp32 (a 16-bit sum on CPU converts as it
    reads, at a fraction of the bandwidth): over a tensor well beyond the last-level cache, the memory's read rate."""
    x32 = x.view(torch.float32)
    return x.numel() * x.element_size() / best_time(lambda: x32.sum(), x.device, reps)


#: Bytes `memory_read_rate` sums: well past a last-level cache.
READ_PROBE_BYTES = 256 * 2**20


def memory_read_rate(device: torch.device) -> float:
    """The memory's read rate now, bytes/s (`read_rate` over READ_PROBE_BYTES, best of 3): a VM's moves by up to 2x
    within an hour, so runs record it beside what they measure."""
    return read_rate(torch.full((READ_PROBE_BYTES // 4,), 0.5, device=device), 3)


def median_time(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median of `reps` runs: the estimate of what a real run takes."""
    return statistics.median(times(fn, device, reps, warmup))


def model_config_from_shape(shape: ModelShape, max_seq_len: int = 1 << 17) -> ModelConfig:
    """A model config of a planner shape, to build a model of that shape for timing."""
    return ModelConfig(
        vocab_size=shape.vocab_size, dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads, ffn_dim=shape.ffn_dim, head_dim=shape.head_dim,
        max_seq_len=max_seq_len, tie_embeddings=shape.tie_embeddings,
    )


def synthetic_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                    random: bool = False, storage: torch.dtype | None = None) -> Transformer:
    """A Transformer of `cfg` with placeholder weights, for timing only (its outputs mean nothing).

    Weights are a constant (filling is much faster than drawing random numbers, and the speed of a dense forward does
    not depend on the values); `random=True` draws them uniformly instead."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif random:
                p.uniform_(-0.05, 0.05, generator=g)
            else:
                p.fill_(0.01)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    model.reset_rope(device)
    pack_linears(model, storage)  # weights in `storage` where the native kernels take it (default: `dtype`)
    return model


def filled_cache(cfg: ModelConfig, batch: int, length: int, slack: int, dtype: torch.dtype,
                 device: torch.device) -> PagedKVCache | HybridCache:
    """The engine's cache (`paged_cache`) of `batch` rows each holding `length` committed tokens, with room for
    forwards of `slack` tokens: each row's blocks a run of the pool's, as a prompt's prefill takes them, and values
    touched, so pages are real; a hybrid model's sliding layers' ring holds the last positions, as after a prefill.
    Attention through block tables costs what the engine's does: over contiguous rows the quick profile measured
    attention's rate at one token 22-24 GB/s where the engine's pool gives 17-22 (SmolLM2, 8 rows x 8k, Zen 4,
    alternated), and priced plain steps that much fast."""
    capacity = length + slack
    per_row = blocks_for(capacity)
    kv = KVManager(cfg, batch * per_row + 1, dtype, device, caching=False)
    cache = paged_cache(cfg, kv, batch, capacity, slack)
    for b in range(batch):
        paged_part(cache).set_blocks(b, 0, list(range(1 + b * per_row, 1 + (b + 1) * per_row)))
    row = quant.store(torch.full((cfg.head_dim,), 0.5, device=device), dtype)  # an int8 row: values and scale
    window = cache.window if isinstance(cache, HybridCache) else None
    for storage in (kv.k, kv.v) + ((window.k, window.v) if window is not None else ()):
        storage.copy_(row.expand_as(storage))  # attention's speed does not depend on the values; the pages must exist
    if window is not None:  # the ring holds the last positions before `length`
        window.hold(torch.arange(max(0, length - window.capacity), length, device=device))
    if length:
        cache.commit(length)
    return cache


def time_forward(model: Transformer, batch: int, q: int, kv_len: int, reps: int = 3,
                 kv_dtype: torch.dtype | None = None, best: bool = False) -> float:
    """Median (`best`: fastest) seconds of one forward of `batch` x `q` new tokens over a cache of `kv_len` tokens."""
    device, dtype = model.device, kv_dtype or model.dtype
    cache = filled_cache(model.cfg, batch, kv_len, q, dtype, device)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, q), device=device)
    with torch.inference_mode():
        t = (best_time if best else median_time)(lambda: model(tokens, cache), device, reps, warmup=2)
    del cache
    return t
