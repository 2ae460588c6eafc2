"""Measure this machine for the planner: a hardware profile and a table of acceptance rates.

`measure_hardware` times, in the compute dtype:

- a plain read (reduction of a tensor larger than the last-level cache), for the peak bandwidth,
  and a large square matmul, for the peak FLOP rate;
- whole forwards of a tiny-dim Transformer with 30 and with 4 layers at batch 1, one token, a short
  cache: what they take beyond their (negligible) roofline is the fixed and the per-layer overhead;
- whole forwards of a real-sized model (the one passed in, or a randomly initialised one with the
  default model's shape): at m = 1..384 tokens over a short cache, the linear layers' weight bytes
  per second against m; at q = 1..8 new tokens per sequence over a long cache, less the same
  forward over a short one, attention's KV bytes per second against q. Times that fall as the
  work grows are noise and are pooled (`nondecreasing`) before rates are derived from them.

Those measured rates make the profile (`HardwareProfile.linear_rates`, `attention_rates`): small
matrices do not follow a roofline on CPUs (a few rows can cost twice one row), so one efficiency
per group cannot predict both a draft step and a verification. Forwards over a batch x new tokens
x cache length grid then check the profile (`measurements["check"]`). Everything measured is kept
in `HardwareCalibration.measurements` for inspection.

`calibrate_acceptance` measures per-token acceptance rates of the self-speculative drafters on real
text: prompts cut from inside long books, prefilled once per context length, decoded with every
(drafter, budget, mode) from the same prefill; the rate is the maximum-likelihood estimate from the
histogram of accepted draft counts (`acceptance_mle`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from magicdec.config import ModelConfig
from magicdec.cpu import auto_dtype, cpu_kind, dtype_name, reported_flags
from magicdec.memory import available_bytes
from magicdec.runner import synchronize
from magicdec.model import attention_path, linear_path
from magicdec.planner import AcceptanceTable, HardwareProfile, ModelShape, Workload, forward_cost
from magicdec.planner.models import MODEL_PRESETS
from magicdec.profiles import default_profile_path, target_shape

#: progress(done, total, label): `done` of `total` units of the current stage, described by `label`.
CalibrationProgress = Callable[[int, int, str], None]

GiB = 1024**3


# --- timing helpers ----------------------------------------------------------------------------------
def _times(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> list[float]:
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


def _best(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Fastest of `reps` runs: the estimate of a peak rate least disturbed by other processes."""
    return min(_times(fn, device, reps, warmup))


def _median(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median of `reps` runs: the estimate of what a real run takes."""
    return statistics.median(_times(fn, device, reps, warmup))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def device_memory_bytes(device: torch.device) -> float:
    """Device memory (CUDA) or physical memory (CPU), bytes."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What the measurements were taken on: device, threads, CPU model and the flags that pick its kernels
    (AMX, AVX512-BF16, ...), memory, load, versions."""
    dev = torch.device(device)
    info: dict[str, Any] = {
        "device": str(dev),
        "cpu": _cpu_model(),
        "cpu_flags": reported_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": device_memory_bytes(torch.device("cpu")),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg"] = list(os.getloadavg())
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["gpu_memory_bytes"] = device_memory_bytes(dev)
    return info


# --- models for timing ---------------------------------------------------------------------------------
def model_config_from_shape(shape: ModelShape, max_seq_len: int = 1 << 17) -> ModelConfig:
    return ModelConfig(
        vocab_size=shape.vocab_size, dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads, ffn_dim=shape.ffn_dim, head_dim=shape.head_dim,
        max_seq_len=max_seq_len, tie_embeddings=shape.tie_embeddings,
    )


def synthetic_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0, random: bool = False):
    """A Transformer of `cfg` with placeholder weights, for timing only (its outputs mean nothing).

    Weights are a constant (filling is much faster than drawing random numbers, and the speed of a
    dense forward does not depend on the values); `random=True` draws them uniformly instead.
    """
    from magicdec.model import Transformer, pack_linears, rope_inv_freq

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
    model.inv_freq = rope_inv_freq(cfg).to(device=device, dtype=torch.float32)
    pack_linears(model)
    return model


def _filled_cache(cfg: ModelConfig, batch: int, length: int, slack: int, dtype: torch.dtype, device: torch.device):
    """A dense cache holding `length` committed tokens per row (values touched, so pages are real)."""
    from magicdec.kv import KVCache

    cache = KVCache(cfg, batch, length + slack, dtype, device)
    cache.k.fill_(0.5)  # attention's speed does not depend on the values; the pages must exist
    cache.v.fill_(0.5)
    if length:
        cache.commit(length)
    return cache


def time_forward(model, batch: int, q: int, kv_len: int, reps: int = 3, kv_dtype: torch.dtype | None = None) -> float:
    """Median seconds of one forward of `batch` x `q` new tokens over a cache of `kv_len` tokens."""
    device, dtype = model.device, kv_dtype or model.dtype
    cache = _filled_cache(model.cfg, batch, kv_len, q, dtype, device)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, q), device=device)
    with torch.inference_mode():
        t = _median(lambda: model(tokens, cache), device, reps, warmup=2)
    del cache
    return t


# --- the hardware calibration ---------------------------------------------------------------------------
@dataclass
class HardwareCalibration:
    """A calibrated profile, with everything that was measured to make it."""

    profile: HardwareProfile
    measurements: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the profile to `path` (default: `default_profile_path`) and the measurements beside it."""
        if path is None:
            path = default_profile_path(self.measurements.get("device", "cpu"), self.profile.dtype or "fp32")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.to_json(path)
        with open(path.with_suffix(".measurements.json"), "w") as f:
            json.dump(self.measurements, f, indent=1)
            f.write("\n")
        return path


def measure_hardware(
    device: str | torch.device = "cpu",
    quick: bool = False,
    progress: CalibrationProgress | None = None,
    *,
    model=None,
    dtype: torch.dtype | None = None,
    name: str | None = None,
) -> HardwareCalibration:
    """Run the microbenchmarks and forward timings; return the profile and all measurements.

    `model`: a magicdec Transformer to time whole forwards of (default: a randomly initialised model
    with the default model's shape, SmolLM2-135M). `dtype`: the compute dtype (default: the model's,
    else what `dtype="auto"` picks on this device); the profile records it. Quick mode takes seconds; the full one a few minutes.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype or (model.dtype if model is not None else auto_dtype(dev).dtype)
    es = _element_size(dtype)
    gpu = dev.type == "cuda"
    reps = 2 if quick else 7
    m: dict[str, Any] = {"device": str(device), "dtype": dtype_name(dtype), "quick": quick,
                         "machine": machine_info(dev)}
    stages = ["bandwidth", "matmul", "overhead", "sampling", "linear", "attention", "check"]

    def stage(i: int, label: str) -> None:
        if progress is not None:
            progress(i, len(stages), label)

    # 1. plain read bandwidth: reductions over a tensor well beyond the last-level cache
    stage(0, "read bandwidth")
    nbytes = (2 * GiB if gpu else 512 * 2**20) if quick else (4 * GiB if gpu else 1 * GiB)
    x = torch.empty(nbytes // es, dtype=dtype, device=dev).fill_(0.5)  # values do not change the speed
    # the bytes seen as fp32: a bf16 .sum() on CPU converts as it reads, at a fraction of the bandwidth
    x32 = x.view(torch.float32)
    t_sum = _best(lambda: x32.sum(), dev, reps)
    cols = 4096
    xm = x[: x.numel() // cols * cols].view(-1, cols)
    ones = torch.ones(cols, dtype=dtype, device=dev)
    t_mv = _best(lambda: torch.mv(xm, ones), dev, reps)
    read_bw = {"sum": nbytes / t_sum, "mv": xm.numel() * es / t_mv}
    peak_bandwidth = max(read_bw.values())
    m["read_bandwidth"] = {**read_bw, "bytes": nbytes}
    del x, x32, xm

    # 2. peak matmul rate: large square products
    stage(1, "matmul")
    shape_default = MODEL_PRESETS["smollm2-135m"]
    squares = []
    for n in ((2048,) if not gpu else (8192,)) if quick else ((2048, 4096) if not gpu else (8192, 16384)):
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        t = _best(lambda: a @ b, dev, 2 if n >= 4096 and not gpu else reps)
        squares.append({"n": n, "flops_per_s": 2 * n**3 / t, "seconds": t})
        del a, b
    peak_flops = max(r["flops_per_s"] for r in squares)
    m["square_matmul"] = squares

    # 3. overheads: a tiny-dim Transformer with 30 and with 4 layers, batch 1, one token, 16 cached
    stage(2, "per-forward overhead")
    overhead = []
    for layers in (4, 30):
        cfg = ModelConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128,
                          head_dim=16, max_seq_len=4096)
        tiny = synthetic_model(cfg, dev, dtype)
        t = _median_forward(tiny, 1, 1, 16, reps=15 if quick else 40)
        overhead.append({"n_layers": layers, "seconds": t})
        if layers == 30:
            # the decode loop's own work per step (sampling, bookkeeping, the host sync), beyond the forward
            loop_step = _decode_step_time(tiny, steps=16 if quick else 48)
        del tiny
    per_layer = max(0.0, (overhead[1]["seconds"] - overhead[0]["seconds"]) / (30 - 4))
    fixed = max(0.0, overhead[1]["seconds"] - 30 * per_layer)
    loop_extra = max(0.0, loop_step - overhead[1]["seconds"])
    m["overhead"] = {"tiny_forwards": overhead, "fixed_s": fixed, "per_layer_s": per_layer,
                     "decode_loop_step_s": loop_step, "decode_loop_extra_s": loop_extra}

    stage(3, "sampling")
    vocab = model.cfg.vocab_size if model is not None else shape_default.vocab_size
    m["sampling"] = measure_sampling(vocab, dev, reps=5 if quick else 15)

    # 4. whole forwards of a real-sized model. The linear layers' rate against tokens per forward:
    #    batch m, one new token each, over a cache too short for attention to count. Attention's rate
    #    against new tokens per sequence: a long cache less the same forward over the short one.
    own = model is None
    if own:
        model = synthetic_model(model_config_from_shape(shape_default), dev, dtype)
        shape = shape_default
    else:
        shape = target_shape(model.cfg)
    short = 16
    t_overhead = fixed + per_layer * shape.n_layers
    weight_bytes = shape.n_params_linear * es
    stage(4, "linear layers")
    if quick:
        tokens = (1, 4, 16, 64) if not gpu else (1, 64, 512)
    else:
        tokens = ((1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384) if not gpu
                  else (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
    linear = [{"tokens": n, "seconds": _median_forward(model, n, 1, short, reps=reps)} for n in tokens]
    set_linear_rates(linear, weight_bytes, t_overhead)
    stage(5, "attention")
    # the longest context the model takes (the score rows per query grow with it and fall out of cache)
    att_batch = 8 if not gpu else 32
    att_len = min(8192 if not gpu else 16384, model.cfg.max_seq_len - 16)
    kv_bytes = att_batch * att_len * shape.kv_bytes_per_token(es)
    attention = []
    for q in ((1, 4) if quick else (1, 2, 3, 4, 5, 6, 8) if not gpu else (1, 2, 4, 8, 16)):
        t_long = _median_forward(model, att_batch, q, att_len, reps=reps)
        t_short = _median_forward(model, att_batch, q, short, reps=reps)
        attention.append({"q": q, "batch": att_batch, "kv_len": att_len, "seconds": t_long, "seconds_short": t_short})
    set_attention_rates(attention, kv_bytes)
    m["linear"], m["attention"] = linear, attention

    # 5. the profile: measured rates, and the roofline numbers they imply (for reports and for work
    #    beyond the measured shapes); then the forwards of a batch x q x context grid as its check
    stage(6, "check")
    linear_rates = tuple((r["tokens"], r["weight_bytes_per_s"]) for r in linear)
    attention_rates = tuple((r["q"], r["kv_bytes_per_s"]) for r in attention)
    best_linear_flops = max(2 * r["tokens"] * shape.n_params_linear / max(r["seconds"] - t_overhead, 1e-9)
                            for r in linear)
    att_flops = max(4 * att_batch * r["q"] * att_len * shape.n_layers * shape.n_heads * shape.head_dim
                    / max(r["seconds"] - r["seconds_short"], 1e-9) for r in attention)
    flops = max(peak_flops, best_linear_flops, att_flops)
    bandwidth = max(peak_bandwidth, linear_rates[0][1], attention_rates[0][1])
    profile = HardwareProfile(
        name=name or _default_name(dev, dtype), dtype=dtype_name(dtype), flops_per_s=flops, mem_bandwidth=bandwidth,
        mem_bytes=device_memory_bytes(dev), matmul_efficiency=best_linear_flops / flops,
        bandwidth_efficiency=linear_rates[0][1] / bandwidth, attention_efficiency=att_flops / flops,
        # a decode step is a forward plus the loop's own work: the planner sees it as fixed overhead
        fixed_overhead_s=fixed + loop_extra, per_layer_overhead_s=per_layer,
        linear_rates=linear_rates, attention_rates=attention_rates,
        sampling_s_per_token=m["sampling"]["seconds_per_token"], attention=attention_path(dev, dtype),
        linear=linear_path(dev, dtype),
    )
    if quick:
        grid = [(1, 1, 2048), (1, 5, 2048), (8, 3, 1024)]
    else:
        grid = [(b, q, L) for b in (1, 8, 32) for q in (1, 3, 5) for L in (256, 2048, 8192)]
        if gpu:
            grid = [(b * 4, q, L * 4) for b, q, L in grid]
    avail = available_bytes(dev)
    forwards = []
    for b, q, L in grid:
        if b * (L + q) * model.cfg.kv_bytes_per_token(es) > min(0.3 * avail, (64 if gpu else 4) * GiB):
            continue
        t = _median_forward(model, b, q, L, reps=reps)
        pred = forward_cost(Workload(shape, profile, b, L, es, es), q, L).time - loop_extra
        forwards.append({"batch": b, "q": q, "kv_len": L, "seconds": t, "predicted": pred})
    if own:
        del model
    m["forwards"] = forwards
    m["model_shape"] = dataclasses.asdict(shape)
    m["check"] = {"median_relative_error": statistics.median(abs(f["predicted"] / f["seconds"] - 1) for f in forwards),
                  "worst_relative_error": max(abs(f["predicted"] / f["seconds"] - 1) for f in forwards)}
    stage(7, "done")
    return HardwareCalibration(profile, m)


def set_linear_rates(linear: list[dict[str, Any]], weight_bytes: float, t_overhead: float) -> None:
    """Add "weight_bytes_per_s" to forwards timed at growing token counts ({"tokens", "seconds"})."""
    for r, t in zip(linear, nondecreasing([r["seconds"] for r in linear])):
        r["weight_bytes_per_s"] = weight_bytes / max(t - t_overhead, 0.05 * t)


def set_attention_rates(attention: list[dict[str, Any]], kv_bytes: float) -> None:
    """Add "kv_bytes_per_s" to long-cache forwards timed at growing q ({"q", "seconds", "seconds_short"}):
    the KV bytes over what the long cache adds to the short one's time."""
    extra = nondecreasing([max(r["seconds"] - r["seconds_short"], 0.05 * r["seconds"]) for r in attention])
    for r, t in zip(attention, extra):
        r["kv_bytes_per_s"] = kv_bytes / t


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares closest non-decreasing sequence (pool adjacent violators).

    More work per forward cannot take less time, so where a measured time falls as the work grows,
    the pair is noise: both get their mean. Rates derived from the pooled times keep the planner's
    cost monotone in the number of tokens."""
    blocks: list[list[float]] = []  # [sum, count] of runs pooled so far
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def measure_sampling(vocab: int, device: torch.device, reps: int, batch: int = 32) -> dict[str, Any]:
    """Seconds per token that drawing with the sampling preset (T 0.7, top-p 0.9) adds to a greedy argmax.

    The logits are shaped like a language model's at these settings: most rows peaked (a nucleus of a few
    tokens), some wide (SmolLM2 on PG-19: nucleus past 64 tokens at ~11% of positions, past 1024 at 1-3%),
    as 28 rows of N(0, 6^2) logits, 3 of N(0, 3^2) (nuclei of 100-260 tokens) and 1 of N(0, 1)
    (over 20k tokens)."""
    from magicdec.sampling import RowParams, sample_tokens

    scale = torch.tensor([6.0] * (batch - 4) + [3.0] * 3 + [1.0])[:, None, None]
    logits = (torch.randn(batch, 1, vocab, generator=torch.Generator().manual_seed(0)) * scale).to(device)
    position = torch.zeros(batch, 1, dtype=torch.long, device=device)
    sampled = RowParams.of([sampling_params("sampling", 1)] * batch, range(batch), device)
    t_sampled = _median(lambda: sample_tokens(logits, sampled, position), device, reps)
    t_greedy = _median(lambda: sample_tokens(logits, RowParams(batch, device), position), device, reps)
    return {"batch": batch, "vocab": vocab, "seconds_sampled": t_sampled, "seconds_greedy": t_greedy,
            "seconds_per_token": max(0.0, t_sampled - t_greedy) / batch}


def _decode_step_time(model, steps: int) -> float:
    """Median seconds per step of autoregressive decoding (batch 1, short prompt) with the real engine."""
    from magicdec.engine import LLMEngine
    from magicdec.runner import CACHE_SLACK
    from magicdec.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    times = []
    for _ in range(3):
        engine = LLMEngine(model, (), slots=1, capacity=16 + steps + 1 + CACHE_SLACK)
        engine.generate([[1] * 16], params)
        times.append(engine.stats.decode_s / engine.stats.steps)
    return statistics.median(times)


def _median_forward(model, batch: int, q: int, kv_len: int, reps: int) -> float:
    return time_forward(model, batch, q, kv_len, reps=reps)


def _default_name(device: torch.device, dtype: torch.dtype) -> str:
    """calibrated-<GPU>-<dtype>, or calibrated-cpu-<matmul hardware>-<threads>t-<dtype> (as CPU presets)."""
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip().replace(" ", "-")
        return f"calibrated-{gpu}-{dtype_name(dtype)}"
    return f"calibrated-cpu-{cpu_kind()}-{torch.get_num_threads()}t-{dtype_name(dtype)}"


# --- acceptance ----------------------------------------------------------------------------------------
def acceptance_mle(hist: Sequence[int]) -> float:
    """Per-token acceptance rate from a histogram of accepted draft counts (hist[k]: steps accepting k).

    The accepted count of a step with draft length gamma = len(hist) - 1 is a geometric variable
    truncated at gamma: P(k) = alpha^k (1 - alpha) for k < gamma and alpha^gamma for k = gamma. Its
    likelihood is alpha^(sum k n_k) (1 - alpha)^(sum_{k<gamma} n_k), maximised at
    alpha = sum k n_k / (sum k n_k + sum_{k<gamma} n_k).
    """
    if len(hist) < 2:
        raise ValueError("need a histogram over 0..gamma accepted drafts with gamma >= 1")
    if any(n < 0 for n in hist):
        raise ValueError("histogram counts must be non-negative")
    accepted = sum(k * n for k, n in enumerate(hist))
    rejections = sum(hist[:-1])
    if accepted + rejections == 0:
        raise ValueError("empty histogram")
    return accepted / (accepted + rejections)


def sampling_params(mode: str, new_tokens: int, seed: int = 0):
    """The decode settings of a calibration mode: greedy, or temperature 0.7 / top-p 0.9 sampling."""
    from magicdec.sampling import SamplingParams

    if mode == "greedy":
        return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=seed)
    if mode == "sampling":
        return SamplingParams(max_tokens=new_tokens, temperature=0.7, top_p=0.9, ignore_eos=True, seed=seed)
    raise ValueError(f"unknown mode {mode!r}; choose greedy or sampling")


def calibrate_acceptance(
    llm,
    texts: Sequence[str],
    drafters: Iterable[str] = ("self-streaming", "self-snapkv"),
    budgets: Iterable[int] = (64, 128, 256, 512, 1024),
    contexts: Iterable[int] = (1024, 2048, 4096, 8192),
    modes: Iterable[str] = ("greedy", "sampling"),
    gamma: int = 4,
    n_prompts: int = 4,
    new_tokens: int = 64,
    progress: CalibrationProgress | None = None,
    *,
    records: list[dict[str, Any]] | None = None,
    seed: int = 0,
) -> AcceptanceTable:
    """Measure acceptance rates of self-speculative drafters on `texts` with `llm` (an `LLM`).

    For each context length, `n_prompts` prompts of that many tokens are cut from inside the texts
    and prefilled once into the LLM's prompt cache (with the attention observation SnapKV needs); every
    (drafter, budget, mode) then decodes `new_tokens` tokens per prompt (EOS ignored) from copies of that
    prefill with draft length `gamma`. The rate stored for (drafter, budget, mode, context) is `acceptance_mle`
    of the summed histogram; each (drafter, mode) also gets the spread of per-sequence rates around
    their batch's rate (`row_spread`), which the planner uses for the slowest sequence of a batch.
    Budgets not below the context are skipped (the planner treats them as dense). A context that
    does not fit the model (context + new tokens + gamma + 2 beyond its max_seq_len) is shortened to
    fit, and stored under the length actually used.

    `records`, when given, receives one dict per decode (histogram, alpha, timings).
    """
    from magicdec.corpus import cut_prompts
    from magicdec.runner import CACHE_SLACK, PromptCache
    from magicdec.speculative import SpeculativeConfig

    drafters, budgets, modes = list(drafters), sorted(set(budgets)), list(modes)
    for mode in modes:
        sampling_params(mode, 1)  # validates
    contexts = sorted(set(contexts))
    limit = llm.model.cfg.max_seq_len - new_tokens - CACHE_SLACK
    table = AcceptanceTable()
    deviations: dict[tuple[str, str], list[float]] = {}  # (drafter, mode) -> per-row rate minus batch rate
    jobs = [(c, d, b, mo) for c in contexts for d in drafters for b in budgets for mo in modes
            if b < min(c, limit)]
    done = 0
    for context in contexts:
        ctx = min(context, limit)
        todo = [(d, b, mo) for c, d, b, mo in jobs if c == context]
        if not todo:
            continue
        if progress is not None:
            progress(done, len(jobs), f"prefill {n_prompts} x {ctx}")
        prompts = cut_prompts(llm.tokenizer, texts, n_prompts, ctx)
        llm.prompt_cache = PromptCache.sized_for(llm.model.cfg, [ctx] * n_prompts, llm.kv_dtype)
        llm.generate(prompt_token_ids=prompts, params=sampling_params("greedy", 1))
        for drafter_name, budget, mode in todo:
            if progress is not None:
                progress(done, len(jobs), f"{drafter_name} budget {budget} {mode} at {ctx}")
            spec = SpeculativeConfig(drafter_name, budget=budget, gamma=gamma)
            outs = llm.generate(prompt_token_ids=prompts, params=sampling_params(mode, new_tokens, seed),
                                speculative=spec)
            stats = llm.last_stats
            alpha = acceptance_mle(stats.accepted_hist)
            table.add(drafter_name, alpha, budget=budget, mode=mode, context=ctx)
            row_alphas = [acceptance_mle(o.accepted_hist) for o in outs if sum(o.accepted_hist)]
            deviations.setdefault((drafter_name, mode), []).extend(a - alpha for a in row_alphas)
            if records is not None:
                records.append({"drafter": drafter_name, "budget": budget, "mode": mode, "context": ctx,
                                "gamma": gamma, "batch": len(prompts), "accepted_hist": list(stats.accepted_hist),
                                "alpha": alpha, "row_alphas": row_alphas, "decode_s": stats.decode_s,
                                "draft_s": stats.draft_s, "verify_s": stats.verify_s,
                                "tokens_per_step": stats.tokens_per_step})
            done += 1
    llm.prompt_cache = None
    for (drafter_name, mode), devs in deviations.items():
        if len(devs) > 1:
            table.set_row_spread(drafter_name, row_spread(devs), mode=mode)
    if progress is not None:
        progress(done, len(jobs), "done")
    return table


def row_spread(deviations: Sequence[float]) -> float:
    """Standard deviation of per-sequence acceptance rates, from their deviations from their batch's
    rate (pooled over batches; the batch rates are estimated, hence n - 1)."""
    if len(deviations) < 2:
        raise ValueError("need at least two per-sequence rates")
    return min(1.0, (sum(d * d for d in deviations) / (len(deviations) - 1)) ** 0.5)


# --- all-reduce, for tensor parallelism ----------------------------------------------------------------
#: Message sizes of the all-reduce measurement: from a decode step's hidden states (B x dim) up to a
#: large prefill chunk's.
ALLREDUCE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def measure_allreduce(tp, sizes: Sequence[int] = ALLREDUCE_BYTES, reps: int = 10) -> dict[str, Any]:
    """Median seconds of an fp32 all-reduce of each size over tp's group (a TPGroup), and the line
    t = latency + bytes / bandwidth through the smallest and the largest message: `latency_s`, and
    `bus_bandwidth` in the profile's units (bytes/s times 2 (w - 1) / w, what a ring moves over each link).
    Not a least-squares fit: that follows the large messages and misses the small ones' latency, which is
    what a decode step's all-reduces of B x dim hidden states pay."""
    points = []
    for n in sizes:
        x = torch.ones(n // 4, device=tp.device)
        points.append({"bytes": n, "seconds": _median(lambda: tp.all_reduce_(x), tp.device, reps, warmup=2)})
    small, large = points[0], points[-1]
    slope = max((large["seconds"] - small["seconds"]) / (large["bytes"] - small["bytes"]), 1e-15)
    w = tp.world_size
    return {"backend": tp.backend, "world_size": w, "device": str(tp.device.type), "points": points,
            "latency_s": max(0.0, small["seconds"] - slope * small["bytes"]), "bus_bandwidth": 2 * (w - 1) / w / slope}


def _allreduce_rank(rank: int, world_size: int, port: int, device: str, out) -> None:
    """One process of `measure_local_allreduce`."""
    from magicdec.distributed import init_tp, shutdown_tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # one rank per core, as TP runs on CPU
    result = measure_allreduce(init_tp(device, timeout_s=120))
    if rank == 0:
        out.put(result)
    shutdown_tp()


def measure_local_allreduce(device: torch.device, world_size: int | None = None) -> dict[str, Any] | None:
    """`measure_allreduce` over processes of this machine: gloo between `world_size` (default 2) CPU
    processes, or NCCL over this machine's GPUs (all of them by default); None with fewer than two GPUs."""
    import socket

    import torch.multiprocessing as mp

    if device.type == "cuda":
        world_size = world_size or torch.cuda.device_count()
        if world_size < 2:
            return None
    world_size = world_size or 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world_size, port, device.type, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            p.kill()
        raise RuntimeError(f"the all-reduce measurement failed (exit codes {[p.exitcode for p in procs]})")
    return out.get()


def with_allreduce(profile: HardwareProfile, allreduce: dict[str, Any]) -> HardwareProfile:
    """`profile` with the interconnect numbers of an all-reduce measurement."""
    return dataclasses.replace(profile, ici_bandwidth=allreduce["bus_bandwidth"],
                               allreduce_latency_s=allreduce["latency_s"])
