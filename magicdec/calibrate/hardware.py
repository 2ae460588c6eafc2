"""Measure this machine for the planner: a hardware profile.

`measure_hardware` times, in the compute dtype:

- a plain read (reduction of a tensor larger than the last-level cache), for the peak bandwidth, and a large square
  matmul, for the peak FLOP rate;
- whole forwards of a tiny-dim Transformer with 30 and with 4 layers at batch 1, one token, a short cache: what they
  take beyond their (negligible) roofline is the fixed and the per-layer overhead;
- whole forwards of a real-sized model (the one passed in, or a randomly initialised one with the default model's
  shape): at m = 1..384 tokens over a short cache, the linear layers' weight bytes per second against m; at q = 1..8
  new tokens per sequence over a long cache, less the same forward over a short one, attention's KV bytes per second
  against q (enough rows that the long cache's bytes outweigh the rest of the forward). Each of these takes the
  fastest of a few runs (FASTEST_OF); times that still fall as the work grows are noise and are pooled
  (`nondecreasing`) before rates are derived from them.

Those measured rates make the profile (`HardwareProfile.linear_rates`, `attention_rates`): small matrices do not
follow a roofline on CPUs (a few rows can cost twice one row), so one efficiency per group cannot predict both a
draft step and a verification. Forwards over a batch x new tokens x cache length grid then check the profile
(`measurements["check"]`). Everything measured is kept in `HardwareCalibration.measurements` for inspection.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from magicdec import dtypes
from magicdec.calibrate.acceptance import CalibrationProgress, sampling_params
from magicdec.calibrate.cascade import measure_shared_attention
from magicdec.calibrate.machine import device_memory_bytes, machine_info
from magicdec.calibrate.timing import (best_time, median_time, model_config_from_shape, read_rate, synthetic_model,
                                      time_forward)
from magicdec.calibrate.vegas import measure_vegas
from magicdec.config import EngineConfig, ModelConfig
from magicdec.cpu import cpu_kind, dtype_name
from magicdec.engine import LLMEngine
from magicdec.kernels import auto_kernel_dtype
from magicdec.kv import quant
from magicdec.memory import available_bytes
from magicdec.model import Transformer, attention_path, linear_path, weight_dtype
from magicdec.planner import HardwareProfile, ModelShape, Workload, forward_cost
from magicdec.planner.models import MODEL_PRESETS
from magicdec.profiles import default_profile_path, kv_suffix, target_shape
from magicdec.sampling import RowParams, SamplingParams, sample_tokens

GiB = 1024**3
#: Stages `measure_hardware` reports progress over.
STAGES = 8
#: Cache length of the forwards whose attention is negligible.
SHORT = 16
#: KV bytes the attention measurement's long cache holds at least, in up to ATTENTION_MAX_ROWS rows.
ATTENTION_BYTES = 1 << 30
ATTENTION_MAX_ROWS = 64
#: Runs of each forward the linear layers' and attention's rates take the fastest of, at least: on a shared machine
#: a forward's time varies by 2x from run to run (a 262k-vocabulary model's forwards allocate B x q x 262144 logits,
#: and page faults come and go), and the median of two is as likely to hold a slow run as not.
FASTEST_OF = 4


@dataclass
class HardwareCalibration:
    """A calibrated profile, with everything that was measured to make it."""

    profile: HardwareProfile
    measurements: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the profile to `path` (default: `default_profile_path`) and the measurements beside it."""
        if path is None:
            dtype = self.profile.dtype or "fp32"
            path = default_profile_path(self.measurements.get("device", "cpu"), dtype,
                                        self.measurements.get("kv_dtype", dtype))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.to_json(path)
        path.with_suffix(".measurements.json").write_text(json.dumps(self.measurements, indent=1) + "\n")
        return path


@dataclass(frozen=True)
class _Run:
    """Where `measure_hardware` measures, in which dtype (and which the weights and KV cache are stored in: 16-bit
    under fp32 arithmetic on the AVX2 kernels; `kv`: the KV cache's, where it differs, as an 8-bit one), and how many
    repetitions it times."""

    device: torch.device
    dtype: torch.dtype
    quick: bool
    storage: torch.dtype
    kv: torch.dtype

    def kv_bytes(self, head_dim: int) -> float:
        """Bytes per stored K or V value (an int8 row's scale included)."""
        return quant.element_bytes(self.kv, head_dim)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    @property
    def stored(self) -> int:
        """Bytes per stored weight and KV element."""
        return self.storage.itemsize

    @property
    def reps(self) -> int:
        return 2 if self.quick else 7


def _run(device: torch.device, quick: bool, model: Transformer | None, dtype: torch.dtype | None,
         kv_dtype: torch.dtype | None = None) -> _Run:
    """What `measure_hardware` measures in: the model's dtype (and its weights' storage) unless `dtype` is another,
    else `dtype` (stored as such), else what `dtype="auto"` picks here; the KV cache in `kv_dtype` (None: as the
    weights)."""
    if model is not None and dtype in (None, model.dtype):
        compute, storage = model.dtype, weight_dtype(model)
    elif dtype is not None:
        compute, storage = dtype, dtype
    else:
        choice = auto_kernel_dtype(device)
        compute, storage = choice.dtype, choice.storage or choice.dtype
    return _Run(device, compute, quick, storage, kv_dtype or storage)


def measure_hardware(
    device: str | torch.device = "cpu", quick: bool = False, progress: CalibrationProgress | None = None, *,
    model: Transformer | None = None, dtype: torch.dtype | None = None, name: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> HardwareCalibration:
    """Run the microbenchmarks and forward timings; return the profile and all measurements.

    `model`: a magicdec Transformer to time whole forwards of (default: a randomly initialised model with the default
    model's shape, SmolLM2-135M). `dtype`: the compute dtype (default: the model's, else what `dtype="auto"` picks on
    this device); the profile records it. `kv_dtype`: the KV cache's (default: as the weights are stored), which
    attention's rates are measured over. Quick mode takes seconds; the full one a few minutes."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    run = _run(dev, quick, model, dtype, kv_dtype)
    report = progress or (lambda done, total, label: None)
    m: dict[str, Any] = {"device": str(device), "dtype": dtype_name(run.storage),
                         "kv_dtype": dtypes.kv_short_name(run.kv), "quick": quick, "machine": machine_info(dev)}
    report(0, STAGES, "read bandwidth")
    m["read_bandwidth"] = measure_read_bandwidth(run)
    report(1, STAGES, "matmul")
    m["square_matmul"] = measure_matmul(run)
    report(2, STAGES, "per-forward overhead")
    m["overhead"] = measure_overhead(run, model.cfg if model is not None else None)
    report(3, STAGES, "sampling")
    default = MODEL_PRESETS["smollm2-135m"]
    vocab = model.cfg.vocab_size if model is not None else default.vocab_size
    m["sampling"] = measure_sampling(vocab, dev, reps=5 if quick else 15)
    if model is None:
        model, shape = synthetic_model(model_config_from_shape(default), dev, run.dtype, storage=run.storage), default
    else:
        shape = target_shape(model.cfg)
    t_overhead = m["overhead"]["fixed_s"] + m["overhead"]["per_layer_s"] * shape.n_layers
    report(4, STAGES, "Vegas, shared prefixes")
    m["vegas"] = measure_vegas(shape, dev, run.dtype, run.storage, reps=10 if quick else 30)
    m["shared_attention_factor"] = measure_shared_attention(shape, dev, run.dtype, run.storage,
                                                            reps=10 if quick else 30)
    # Attention in two sweeps with the linear layers' measurement between them, the faster of each forward kept: a
    # burst of other work on the machine during one sweep would price every forward's attention slow (measured: 7.4
    # against an idle 14-16 GB/s on the AVX2 path, and `--draft auto` drafted where plain decoding was faster).
    report(5, STAGES, "attention")
    first = time_attention(run, model, shape)
    report(6, STAGES, "linear layers")
    m["linear"] = measure_linear(run, model, shape, t_overhead)
    m["attention"] = attention_rates(run, shape, first, time_attention(run, model, shape))
    report(7, STAGES, "check")
    profile = profile_from(m, shape, name or _default_name(dev, run.storage, run.kv), dev, run.storage)
    m["forwards"] = check_forwards(run, model, shape, profile, m["overhead"]["decode_loop_extra_s"])
    m["model_shape"] = dataclasses.asdict(shape)
    errors = [abs(f["predicted"] / f["seconds"] - 1) for f in m["forwards"]]
    m["check"] = {"median_relative_error": statistics.median(errors), "worst_relative_error": max(errors)}
    report(8, STAGES, "done")
    return HardwareCalibration(profile, m)


def measure_read_bandwidth(run: _Run) -> dict[str, float]:
    """Plain read bandwidth, bytes/s: reductions over a tensor well beyond the last-level cache."""
    nbytes = (2 * GiB if run.gpu else 512 * 2**20) if run.quick else (4 * GiB if run.gpu else 1 * GiB)
    x = torch.empty(nbytes // run.es, dtype=run.dtype, device=run.device).fill_(0.5)  # values do not change the speed
    cols = 4096
    xm = x[: x.numel() // cols * cols].view(-1, cols)
    ones = torch.ones(cols, dtype=run.dtype, device=run.device)
    t_mv = best_time(lambda: torch.mv(xm, ones), run.device, run.reps)
    return {"sum": read_rate(x, run.reps), "mv": xm.numel() * run.es / t_mv, "bytes": nbytes}


def measure_matmul(run: _Run) -> list[dict[str, float]]:
    """Peak matmul rate: large square products."""
    squares = []
    for n in ((2048,) if not run.gpu else (8192,)) if run.quick else ((2048, 4096) if not run.gpu else (8192, 16384)):
        a = torch.randn(n, n, dtype=run.dtype, device=run.device)
        b = torch.randn(n, n, dtype=run.dtype, device=run.device)
        t = best_time(lambda: a @ b, run.device, 2 if n >= 4096 and not run.gpu else run.reps)
        squares.append({"n": n, "flops_per_s": 2 * n**3 / t, "seconds": t})
        del a, b
    return squares


def tiny_like(cfg: ModelConfig | None, layers: int) -> ModelConfig:
    """A tiny-dim model of `layers` layers built like `cfg` (None: a Llama): its norms and activation, and the kinds of
    its last `layers` layers (repeated where it has fewer), so that a hybrid model's global layers are among them.
    Its forward costs what a forward of `cfg` costs beside the arithmetic and the memory it reads."""
    tiny = dict(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, head_dim=16,
                max_seq_len=4096)
    if cfg is None:
        return ModelConfig(**tiny)
    n = len(cfg.layer_types)
    kinds = tuple(cfg.layer_types[(i - layers) % n] for i in range(layers)) if n else ()
    return dataclasses.replace(cfg, **tiny, layer_types=kinds, bos_token_id=None, eos_token_ids=())


def measure_overhead(run: _Run, cfg: ModelConfig | None = None) -> dict[str, Any]:
    """Fixed and per-layer seconds of a forward, from a tiny-dim model built like `cfg` (`tiny_like`: a hybrid
    model's layers do more small operations than a Llama's, two norms more and masks of two kinds) with 30 and with 4
    layers, batch 1, one token, 16 cached; and the decode loop's own work per step (sampling, bookkeeping, the host
    sync) beyond the forward."""
    overhead = []
    for layers in (4, 30):
        tiny = synthetic_model(tiny_like(cfg, layers), run.device, run.dtype, storage=run.storage)
        overhead.append({"n_layers": layers, "seconds": time_forward(tiny, 1, 1, SHORT, reps=15 if run.quick else 40,
                                                                    kv_dtype=run.kv)})
    loop_step = _decode_step_time(tiny, steps=16 if run.quick else 48)  # with the 30-layer model
    per_layer = max(0.0, (overhead[1]["seconds"] - overhead[0]["seconds"]) / (30 - 4))
    fixed = max(0.0, overhead[1]["seconds"] - 30 * per_layer)
    loop_extra = max(0.0, loop_step - overhead[1]["seconds"])
    return {"tiny_forwards": overhead, "fixed_s": fixed, "per_layer_s": per_layer,
            "decode_loop_step_s": loop_step, "decode_loop_extra_s": loop_extra}


def measure_linear(run: _Run, model: Transformer, shape: ModelShape, t_overhead: float) -> list[dict[str, Any]]:
    """The linear layers' rate against tokens per forward: batch m, one new token each, over a cache too short for
    attention to count."""
    if run.quick:
        tokens = (1, 4, 16, 64) if not run.gpu else (1, 64, 512)
    else:
        tokens = ((1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384) if not run.gpu
                  else (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
    reps = max(run.reps, FASTEST_OF)
    linear = [{"tokens": n, "seconds": time_forward(model, n, 1, SHORT, reps=reps, kv_dtype=run.kv, best=True)}
              for n in tokens]
    for r, t in zip(linear, nondecreasing([r["seconds"] for r in linear])):
        r["weight_bytes_per_s"] = shape.n_params_linear * run.stored / max(t - t_overhead, 0.05 * t)
    return linear


def time_attention(run: _Run, model: Transformer, shape: ModelShape) -> list[dict[str, Any]]:
    """Per number of new tokens q, the fastest forward over a long cache and over a short one (`attention_rates` takes
    attention's rate from the difference)."""
    # the longest context the model takes (the score rows per query grow with it and fall out of cache), and rows
    # enough that the cache's bytes outweigh the rest of the forward (a hybrid model's few global layers hold little
    # per row: 8 rows of Gemma 3 270M at 8k read 200 MB, a fifth of a forward's time, and the difference of two
    # forwards timed attention 30% slow)
    att_len = min(8192 if not run.gpu else 16384, model.cfg.max_seq_len - 16)
    per_row = att_len * shape.kv_bytes_per_token(run.kv_bytes(shape.head_dim))
    att_batch = min(ATTENTION_MAX_ROWS, max(8 if not run.gpu else 32, math.ceil(ATTENTION_BYTES / per_row)))
    attention = []
    reps = max(run.reps, FASTEST_OF)  # the fastest runs: a slow run of either forward would be taken for attention
    # the quick sweep keeps q = 2 and 3 (gamma 1 and 2, what CPUs draft most): the rate is flat from one token until
    # the kernels turn compute-bound, which log-log interpolation between 1 and 4 tokens does not follow (a Zen 4,
    # SmolLM2 at 8k: 17.2, 18.3, 13.9, 11.7 GB/s at 1-4 tokens, where 1 and 4 alone put q = 2 at 12)
    for q in ((1, 2, 3, 4) if run.quick else (1, 2, 3, 4, 5, 6, 8) if not run.gpu else (1, 2, 4, 8, 16)):
        t_long = time_forward(model, att_batch, q, att_len, reps=reps, kv_dtype=run.kv, best=True)
        t_short = time_forward(model, att_batch, q, SHORT, reps=reps, kv_dtype=run.kv, best=True)
        attention.append({"q": q, "batch": att_batch, "kv_len": att_len, "seconds": t_long, "seconds_short": t_short})
    return attention


def attention_rates(run: _Run, shape: ModelShape, *sweeps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attention's rate against new tokens per sequence from sweeps of `time_attention` (the fastest of each forward
    across them): a long cache less the same forward over a short one."""
    attention = [dict(rows[0], seconds=min(r["seconds"] for r in rows),
                      seconds_short=min(r["seconds_short"] for r in rows)) for rows in zip(*sweeps)]
    # the KV bytes the long cache adds (a hybrid model's sliding layers: a window against 16 positions) over the
    # time it adds to the short one's
    extra = nondecreasing([max(r["seconds"] - r["seconds_short"], 0.05 * r["seconds"]) for r in attention])
    kv = run.kv_bytes(shape.head_dim)
    for r, t in zip(attention, extra):
        window = shape.window_kv_bytes(r["kv_len"], kv) - shape.window_kv_bytes(SHORT, kv)
        r["kv_bytes_per_s"] = r["batch"] * (r["kv_len"] * shape.kv_bytes_per_token(kv) + window) / t
    return attention


def profile_from(m: dict[str, Any], shape: ModelShape, name: str, device: torch.device,
                 dtype: torch.dtype) -> HardwareProfile:
    """The profile of the measurements `m`: measured rates, and the roofline numbers they imply (for reports and for
    work beyond the measured shapes)."""
    linear, attention, overhead = m["linear"], m["attention"], m["overhead"]
    t_overhead = overhead["fixed_s"] + overhead["per_layer_s"] * shape.n_layers
    linear_rates = tuple((r["tokens"], r["weight_bytes_per_s"]) for r in linear)
    attention_rates = tuple((r["q"], r["kv_bytes_per_s"]) for r in attention)
    # the overhead taken off as `measure_linear` takes it off its rates: at most 95% of a forward (tiny forwards timed
    # under other work once gave an overhead longer than every linear forward, and an FLOP rate of 1e18)
    best_linear_flops = max(2 * r["tokens"] * shape.n_params_linear
                            / max(r["seconds"] - t_overhead, 0.05 * r["seconds"]) for r in linear)
    att_flops = max(4 * r["batch"] * r["q"] * r["kv_len"] * shape.n_layers * shape.n_heads * shape.head_dim
                    / max(r["seconds"] - r["seconds_short"], 1e-9) for r in attention)
    flops = max(max(r["flops_per_s"] for r in m["square_matmul"]), best_linear_flops, att_flops)
    # Read rates that time bytes alone: plain reads, and attention over a long cache less a short one. Not the
    # one-row linear rate: it subtracts an overhead estimated from tiny models, and came out above the memory's rate
    # (86 GB/s on a VM that streams 38), which made every "step over its floor" report meaningless.
    bandwidth = max(m["read_bandwidth"]["sum"], m["read_bandwidth"]["mv"], attention_rates[0][1])
    return HardwareProfile(
        name=name, dtype=dtype_name(dtype), flops_per_s=flops, mem_bandwidth=bandwidth,
        mem_bytes=device_memory_bytes(device), matmul_efficiency=best_linear_flops / flops,
        bandwidth_efficiency=min(1.0, linear_rates[0][1] / bandwidth), attention_efficiency=att_flops / flops,
        # a decode step is a forward plus the loop's own work: the planner sees it as fixed overhead
        fixed_overhead_s=overhead["fixed_s"] + overhead["decode_loop_extra_s"],
        per_layer_overhead_s=overhead["per_layer_s"],
        linear_rates=linear_rates, attention_rates=attention_rates,
        sampling_s_per_logit=m["sampling"]["seconds_per_logit"], selection_s_per_share=m["vegas"]["seconds_per_share"],
        table_read_factor=m["vegas"]["table_read_factor"], attention=attention_path(device, dtype),
        shared_attention_factor=m.get("shared_attention_factor", 1.0),
        linear=linear_path(device, dtype),
    )


def check_forwards(run: _Run, model: Transformer, shape: ModelShape, profile: HardwareProfile,
                   loop_extra: float) -> list[dict[str, Any]]:
    """Forwards over a batch x q x context grid, timed and as `profile` predicts them (less the decode loop's own
    work, which a forward does not do)."""
    if run.quick:
        grid = [(1, 1, 2048), (1, 5, 2048), (8, 3, 1024)]
    else:
        grid = [(b, q, L) for b in (1, 8, 32) for q in (1, 3, 5) for L in (256, 2048, 8192)]
        if run.gpu:
            grid = [(b * 4, q, L * 4) for b, q, L in grid]
    avail = available_bytes(run.device)
    forwards, kv_token = [], model.cfg.kv_bytes_per_token(run.kv_bytes(model.cfg.head_dim))
    for b, q, L in grid:
        if b * (L + q) * kv_token > min(0.3 * avail, (64 if run.gpu else 4) * GiB):
            continue
        t = time_forward(model, b, q, L, reps=run.reps, kv_dtype=run.kv)
        work = Workload(shape, profile, b, L, run.stored, run.kv_bytes(shape.head_dim))
        pred = forward_cost(work, q, L).time - loop_extra
        forwards.append({"batch": b, "q": q, "kv_len": L, "seconds": t, "predicted": pred})
    return forwards


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares closest non-decreasing sequence (pool adjacent violators).

    More work per forward cannot take less time, so where a measured time falls as the work grows, the pair is noise:
    both get their mean. Rates derived from the pooled times keep the planner's cost monotone in the number of
    tokens."""
    blocks: list[list[float]] = []  # [sum, count] of runs pooled so far
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measure_sampling(vocab: int, device: torch.device, reps: int, batch: int = 32) -> dict[str, Any]:
    """Seconds per logit that drawing with the sampling preset (T 0.7, top-p 0.9) adds to a greedy argmax.

    The logits are shaped like a language model's on text at these settings (PG-19, benchmarks/bench_sampler.py:
    SmolLM2's nucleus past 64 tokens at 9% of 28,672 positions, past 1024 at 2; Gemma 3 270M's past 64 at 10% of
    12,288, never past 1024): `batch - 3` rows of N(0, 6^2) (a nucleus of a few tokens) and 3 of N(0, 3^2) (100-260
    tokens), none wider than the CPU sampler's candidates. (A row of N(0, 1) in every batch, as this measure once
    had, forced a pass over the whole vocabulary each time and priced sampling at 2.3x (SmolLM2) and 4x (Gemma 3)
    what real logits cost.)"""
    scale = torch.tensor([6.0] * (batch - 3) + [3.0] * 3)[:, None, None]
    logits = (torch.randn(batch, 1, vocab, generator=torch.Generator().manual_seed(0)) * scale).to(device)
    position = torch.zeros(batch, 1, dtype=torch.long, device=device)
    sampled = RowParams.of([sampling_params("sampling", 1)] * batch, range(batch), device)
    t_sampled = median_time(lambda: sample_tokens(logits, sampled, position), device, reps)
    t_greedy = median_time(lambda: sample_tokens(logits, RowParams(batch, device), position), device, reps)
    return {"batch": batch, "vocab": vocab, "seconds_sampled": t_sampled, "seconds_greedy": t_greedy,
            "seconds_per_logit": max(0.0, t_sampled - t_greedy) / (batch * vocab)}


def _decode_step_time(model: Transformer, steps: int) -> float:
    """Median seconds per step of autoregressive decoding (batch 1, short prompt) with the real engine."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    times = []
    for _ in range(3):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=16 + steps + 1))
        engine.generate([[1] * 16], params)
        times.append(engine.stats.decode_s / engine.stats.steps)
    return statistics.median(times)


def _default_name(device: torch.device, dtype: torch.dtype, kv: torch.dtype) -> str:
    """calibrated-<GPU>-<dtype>, or calibrated-cpu-<matmul hardware>-<threads>t-<dtype> (as CPU presets), and
    -kv-<kv> where the KV cache is stored otherwise than the weights."""
    suffix = kv_suffix(dtype_name(dtype), dtypes.kv_short_name(kv))
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip().replace(" ", "-")
        return f"calibrated-{gpu}-{dtype_name(dtype)}{suffix}"
    return f"calibrated-cpu-{cpu_kind()}-{torch.get_num_threads()}t-{dtype_name(dtype)}{suffix}"

