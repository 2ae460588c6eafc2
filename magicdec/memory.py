"""Memory planning: know what a batch needs before allocating it."""

from __future__ import annotations

import torch

from magicdec.errors import OutOfMemoryError

GiB = 1024**3


def available_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available system memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read MemAvailable from /proc/meminfo")


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocator peak on CUDA, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_fits(needed: int, device: torch.device, what: str) -> None:
    """Raise OutOfMemoryError, up front, when `needed` bytes exceed what the device has free."""
    have = available_bytes(device)
    if needed > have:
        raise OutOfMemoryError(
            f"{what} needs {needed / GiB:.2f} GiB but only {have / GiB:.2f} GiB is available on {device}; "
            "use a smaller batch, shorter prompts, fewer max tokens or --kv-cache-dtype int8"
        )
