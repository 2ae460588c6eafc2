"""What measurements were taken on: the machine's CPU, memory, load and software versions."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

import magicdec
from magicdec.cpu import reported_flags
from magicdec.kernels import path_name


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file; None where there is none (or no file)."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def device_memory_bytes(device: torch.device) -> float:
    """Device memory (CUDA) or physical memory (CPU), bytes."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = _proc_field("/proc/meminfo", "MemTotal:")  # "<n> kB"
    if total is not None:
        return float(int(total.split()[0]) * 1024)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What the measurements were taken on: device, threads, CPU model and the flags that pick its kernels (AMX,
    AVX512-BF16, ...), memory, load, versions."""
    dev = torch.device(device)
    info: dict[str, Any] = {
        "device": str(dev),
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cpu_flags": reported_flags(),
        "kernels": path_name(),  # the native kernel path runs pick (magicdec.kernels), "torch" where none
        "malloc": magicdec.MALLOC,  # whether freed memory is kept for the next step's tensors (magicdec/__init__.py)
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

