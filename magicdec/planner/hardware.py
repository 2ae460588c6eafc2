"""Hardware profiles: the few numbers of a device that the roofline cost model needs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from magicdec.jsonfile import read_json_object


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Peak rates of one device, and how much of them a real forward pass gets.

    All rates are per device. With tensor parallelism the cost model divides the work by `tp` and adds the all-reduce
    traffic over `ici_bandwidth`."""

    name: str
    flops_per_s: float
    """Dense (no structured sparsity) peak FLOP/s in the compute dtype."""
    mem_bandwidth: float
    """Peak memory bandwidth, bytes/s."""
    mem_bytes: float
    """Device memory capacity, bytes."""
    matmul_efficiency: float = 0.7
    """Fraction of `flops_per_s` the linear layers reach when compute-bound."""
    bandwidth_efficiency: float = 0.8
    """Fraction of `mem_bandwidth` that streaming weights and KV cache reaches."""
    attention_efficiency: float = 0.5
    """Fraction of `flops_per_s` the attention arithmetic reaches (decode-shaped attention
    uses small, oddly shaped matmuls, so it gets less than the linear layers)."""
    fixed_overhead_s: float = 0.0
    """Time per forward pass that does not scale with work: kernel launches, Python, sync."""
    per_layer_overhead_s: float = 0.0
    """Extra fixed time per layer per forward pass (e.g. all-reduce latency under TP)."""
    launch_per_layer_s: float = 0.0
    """Host time to launch one layer's kernels, per forward pass (eager PyTorch on a GPU). The device runs the
    kernels while the host launches the next ones, so a forward takes the longer of the two: its work plus
    overhead, or n_layers times this. 0 where the host waits on each kernel (CPUs)."""
    ici_bandwidth: float | None = None
    """Per-direction interconnect bandwidth per device, bytes/s (NVLink, PCIe); None if unknown. From
    `magicdec calibrate`: the all-reduce's measured bus bandwidth (the message's bytes per second times
    2 (tp - 1) / tp, what a ring moves over each link)."""
    allreduce_latency_s: float = 0.0
    """Seconds an all-reduce takes beyond its bytes (launch, synchronization, the ring's steps); under
    TP a forward pays it twice per layer."""
    linear_rates: tuple[tuple[float, float], ...] | None = None
    """Measured (tokens per forward, weight bytes/s) pairs of the linear layers, ascending in tokens.
    When given they replace the linear layers' roofline: small-matrix kernels do not follow
    it (on CPUs a few rows can cost twice one row), and the rate also folds in the per-token
    work around the matmuls (norms, RoPE, activations, cache writes)."""
    attention_rates: tuple[tuple[float, float], ...] | None = None
    """Measured (new tokens per sequence, KV bytes/s) pairs of attention, ascending; when given
    they replace attention's roofline."""
    dtype: str | None = None
    """Compute dtype the rates were measured in ("fp32", "bf16"); None for datasheet figures."""
    attention: str | None = None
    """How attention ran when the rates were measured ("native", "matmul" or "sdpa": see
    `magicdec.model.attention_path`); None for datasheet figures and profiles measured before the native
    kernel existed."""
    linear: str | None = None
    """How linear layers ran when the rates were measured ("packed": the native kernel, or "torch": see
    `magicdec.model.linear_path`); None for datasheet figures and profiles measured before the packed
    kernel existed."""
    sampling_s_per_logit: float = 0.0
    """Seconds that drawing a sampled token at temperature 0.7 and top-p 0.9 adds to a greedy argmax, per logit it
    draws from (one row, one position): the sort and the sums grow with the vocabulary, so a model of 262k tokens
    pays five times what one of 49k does, and a draft head of 32k rows an eighth of its model's. The planner charges
    it per token drawn in sampling mode (a plain step draws one per row, a speculative round 2 gamma + 1). 0 for
    datasheet figures."""
    selection_s_per_share: float = 0.0
    """Seconds a Vegas round's selection (`magicdec.kv.vegas.select`) takes per attention share it ranks: per row,
    global layer, KV head and cached position. 0 for datasheet figures (not measured)."""
    table_read_factor: float = 1.0
    """How many times longer attention takes over positions read one by one through a token table (scattered over
    the block pool, as a Vegas draft reads them) than over as many read block by block. 1 for datasheet figures (not
    measured)."""
    shared_attention_factor: float = 1.0
    """Attention time of rows that share their prompt's blocks, 4 rows a prompt (`magicdec.planner.cost.SHARED_ROWS`),
    over its time where every row reads blocks of its own (cascade attention, and the shared blocks kept in the
    caches; `magicdec.calibrate.cascade`). 1 for datasheet figures (not measured)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        numbers = ["flops_per_s", "mem_bandwidth", "mem_bytes", "matmul_efficiency", "bandwidth_efficiency",
                   "attention_efficiency", "fixed_overhead_s", "per_layer_overhead_s", "launch_per_layer_s",
                   "allreduce_latency_s", "sampling_s_per_logit", "selection_s_per_share", "table_read_factor",
                   "shared_attention_factor"]
        for field in numbers + (["ici_bandwidth"] if self.ici_bandwidth is not None else []):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{field} must be a finite number, got {value!r}")
        for field in ("linear_rates", "attention_rates"):
            rates = getattr(self, field)
            if rates is None:
                continue
            try:
                rates = tuple((float(x), float(r)) for x, r in rates)  # JSON gives lists
            except (TypeError, ValueError):
                raise ValueError(f"{field} must be a list of [x, rate] pairs, got {rates!r}") from None
            if not rates or not all(0 < v < math.inf for pair in rates for v in pair) or any(
                    a[0] >= b[0] for a, b in zip(rates, rates[1:])):
                raise ValueError(f"{field} must be (x, rate) pairs, positive and ascending in x")
            object.__setattr__(self, field, rates)
        for field in ("flops_per_s", "mem_bandwidth", "mem_bytes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        for field in ("matmul_efficiency", "bandwidth_efficiency", "attention_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {value}")
        if min(self.fixed_overhead_s, self.per_layer_overhead_s, self.launch_per_layer_s, self.allreduce_latency_s,
               self.sampling_s_per_logit, self.selection_s_per_share) < 0:
            raise ValueError("overheads must be non-negative")
        if self.table_read_factor < 1:
            raise ValueError(f"table_read_factor must be >= 1, got {self.table_read_factor}")
        if not 0 < self.shared_attention_factor <= 1:
            raise ValueError(f"shared_attention_factor must be in (0, 1], got {self.shared_attention_factor}")
        if self.ici_bandwidth is not None and self.ici_bandwidth <= 0:
            raise ValueError(f"ici_bandwidth must be positive or None, got {self.ici_bandwidth}")

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write this profile to a JSON file."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> HardwareProfile:
        """Read a profile written by `to_json` (or by hand); a malformed one raises ValueError naming the file."""
        data = read_json_object(path, "hardware profile")
        fields = dataclasses.fields(cls)
        unknown = sorted(set(data) - {field.name for field in fields})
        if unknown:
            raise ValueError(f"{path}: unknown hardware profile fields {unknown}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ValueError(f"{path}: hardware profile lacks {', '.join(missing)}")
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


GB = 1e9
TB = 1e12
TFLOPS = 1e12


#: Host seconds to launch a layer's kernels in magicdec's eager forward on a GPU: on an H200's host, Gemma 3 270M's
#: decode, verification and draft forwards took 9.5-12.7 ms at every batch and context up to 128 x 32k, 18 layers
#: (benchmarks/results/gpu_check_h200.json), where the same forwards replayed from CUDA graphs took 2.2-8.5.
#: `eager` adds it to a preset.
GPU_LAUNCH_PER_LAYER_S = 0.55e-3


# GPU presets. Peak numbers are from the NVIDIA datasheets; the efficiencies (the profile's defaults) and the fixed
# overhead are our assumptions (typical of a compiled PyTorch decode loop), not measurements. Datasheets quote "with
# sparsity" tensor FLOP/s; we use the dense figure (half of it).
def _gpu(name: str, tflops: float, mem_bandwidth: float, mem_gb: float, ici_gb: float) -> HardwareProfile:
    return HardwareProfile(name=name, flops_per_s=tflops * TFLOPS, mem_bandwidth=mem_bandwidth, mem_bytes=mem_gb * GB,
                           ici_bandwidth=ici_gb * GB, fixed_overhead_s=2e-3)


def eager(preset: HardwareProfile) -> HardwareProfile:
    """A GPU preset as magicdec's engine runs on it: forwards launched kernel by kernel from Python (no CUDA graphs),
    so that a small model's forward takes the host's launch time whatever its work (named `<preset>-eager`)."""
    return dataclasses.replace(preset, name=f"{preset.name}-eager", launch_per_layer_s=GPU_LAUNCH_PER_LAYER_S)


PRESETS: dict[str, HardwareProfile] = {p.name: p for p in (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, 2,039 GB/s HBM2e, 80 GB; NVLink 600
    # GB/s total = 300 GB/s each direction.
    _gpu("a100-80gb", tflops=312, mem_bandwidth=2.039 * TB, mem_gb=80, ici_gb=300),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM 80GB): BF16 1,979 TFLOPS with sparsity = 989 dense, 3.35 TB/s HBM3,
    # 80 GB; NVLink 900 GB/s total = 450 GB/s each direction.
    _gpu("h100", tflops=989, mem_bandwidth=3.35 * TB, mem_gb=80, ici_gb=450),
    # NVIDIA H200 datasheet (SXM): same compute as H100 (989 TFLOPS BF16 dense), 4.8 TB/s HBM3e, 141 GB; NVLink 900
    # GB/s total.
    _gpu("h200", tflops=989, mem_bandwidth=4.8 * TB, mem_gb=141, ici_gb=450),
    # NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 with sparsity), 864 GB/s GDDR6, 48 GB; no NVLink, PCIe Gen4
    # x16 = 64 GB/s bidirectional = 32 GB/s each direction.
    _gpu("l40s", tflops=362, mem_bandwidth=864 * GB, mem_gb=48, ici_gb=32),
    # NVIDIA L40 datasheet: BF16 181 TFLOPS dense (362 with sparsity), 864 GB/s GDDR6, 48 GB; PCIe Gen4 x16 as L40S.
    _gpu("l40", tflops=181, mem_bandwidth=864 * GB, mem_gb=48, ici_gb=32),
)}

#: CPU presets: profiles `magicdec calibrate` measured on this project's machines (package data), each
#: named after what it measured: cpu-<matmul hardware (`magicdec.cpu.cpu_kind`)>-<threads>t-<dtype>.
CPU_PRESET_FILES = (
    "hardware-cpu-amx-2t-fp32.json",  # 2-core Intel Xeon VM (AMX-BF16, AVX512-BF16), 2 threads, fp32
    "hardware-cpu-avx512bf16-2t-bf16.json",  # 2-core AMD EPYC Zen 4 VM (AVX512-BF16, no AMX), 2 threads, bf16
)


def _packaged_profile(file: str) -> HardwareProfile:
    with resources.as_file(resources.files("magicdec") / "data" / file) as path:
        return HardwareProfile.from_json(path)


_CPU_PROFILES = tuple(map(_packaged_profile, CPU_PRESET_FILES))
CPU_PRESETS = tuple(p.name for p in _CPU_PROFILES)
PRESETS.update((p.name, p) for p in _CPU_PROFILES)


def get_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """Return the preset called `name_or_path`, or load the profile JSON file at that path."""
    key = os.fspath(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    if os.path.isfile(key):
        return HardwareProfile.from_json(key)
    raise ValueError(
        f"unknown hardware profile {key!r}: not a preset ({', '.join(sorted(PRESETS))}) "
        "and not a JSON file"
    )
