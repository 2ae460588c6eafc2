"""What this CPU computes fast: its instruction-set flags, and the compute dtype they call for.

bf16 pays on a CPU only where the hardware multiplies bf16 natively: on Intel Xeons with AMX-BF16 and AVX512-BF16,
and AMD Zen 4 (AVX512-BF16), torch's bf16 matmul runs on native bf16 products, faster than fp32, and halves the bytes
of weights and KV cache; on a CPU without them (an AMD Zen 3) bf16 matmul converts every element and runs far slower
than fp32 (measurements: `git show e3fc202:benchmarks/README.md`, "bf16 on CPU"). So `dtype="auto"` on CPU asks for
the flags first, then confirms with one quick timing that bf16 matmul is not slower here (a build of torch without the fast kernels,
or a hypervisor hiding the feature, would otherwise pick the slow path).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from magicdec import dtypes

#: Flags of a CPU that multiplies bf16 natively (any one suffices).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: Flags recorded with benchmark results: the ones that decide which kernels torch runs.
REPORTED_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512f",
                  "avx2", "fma")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def reported_flags(flags: frozenset[str] | None = None) -> list[str]:
    """Which of `REPORTED_FLAGS` this CPU has (for machine info in results)."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in REPORTED_FLAGS if f in flags]


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """The CPU's fastest matmul hardware, as presets and calibrated profiles are named: amx, avx512bf16, avx512, avx2
    or generic."""
    flags = cpu_flags() if flags is None else flags
    for flag, kind in (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return "generic"


def dtype_name(dtype: torch.dtype) -> str:
    """fp32, bf16 or fp16: the short name the CLI, profiles and presets use."""
    name = dtypes.short_name(dtype)
    if name is None:
        raise ValueError(f"no short name for {dtype}")
    return name


@functools.cache
def bf16_matmul_speedup() -> float:
    """fp32 time over bf16 time of a small linear layer (32 x 576 -> 1536), timed side by side.

    Takes a few milliseconds on a CPU with bf16 hardware; computed once per process."""
    x = torch.randn(32, 576)
    w = torch.randn(1536, 576)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    times: dict[torch.dtype, list[float]] = {d: [] for d in pairs}
    with torch.inference_mode():
        for _ in range(7):
            for dtype, (a, b) in pairs.items():
                t0 = time.perf_counter()
                torch.nn.functional.linear(a, b)
                times[dtype].append(time.perf_counter() - t0)
    # the first round warms up the kernels; the median of the rest resists other processes' noise
    return statistics.median(times[torch.float32][1:]) / statistics.median(times[torch.bfloat16][1:])


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype picked for a device, and why (printed with a run's stats). `storage`: the dtype linear weights
    are stored in where it differs (16-bit under fp32 arithmetic on the AVX2 kernels); None: `dtype`."""

    dtype: torch.dtype
    reason: str
    storage: torch.dtype | None = None

    @property
    def name(self) -> str:
        return dtype_name(self.dtype) + (f" over {dtype_name(self.storage)} weights" if self.storage else "")

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def auto_dtype(device: torch.device, flags: frozenset[str] | None = None) -> DtypeChoice:
    """`dtype="auto"`: bf16 on accelerators; on CPU, bf16 where the CPU multiplies bf16 natively and a quick timing
    confirms bf16 matmul is not slower than fp32, fp32 elsewhere."""
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, f"auto: {device.type}")
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        return DtypeChoice(torch.float32, "auto: this CPU has no AMX-BF16 or AVX512-BF16")
    speedup = bf16_matmul_speedup()
    if speedup < 1.0:
        return DtypeChoice(torch.float32, f"auto: CPU has {', '.join(have)} but bf16 matmul measured "
                                          f"{1 / speedup:.1f}x slower than fp32")
    return DtypeChoice(torch.bfloat16, f"auto: CPU has {', '.join(have)}; bf16 matmul {speedup:.1f}x fp32")
