"""The all-reduce of tensor parallelism: its latency and bus bandwidth, for the planner's TP cost."""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any, Sequence

import torch

from magicdec.calibrate.timing import median_time
from magicdec.distributed import TPGroup, init_tp, shutdown_tp
from magicdec.planner import HardwareProfile

#: Message sizes of the all-reduce measurement: from a decode step's hidden states (B x dim) up to a
#: large prefill chunk's.
ALLREDUCE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def measure_allreduce(tp: TPGroup, sizes: Sequence[int] = ALLREDUCE_BYTES, reps: int = 10) -> dict[str, Any]:
    """Median seconds of an fp32 all-reduce of each size over tp's group (a TPGroup), and the line t = latency +
    bytes / bandwidth through the smallest and the largest message: `latency_s`, and `bus_bandwidth` in the profile's
    units (bytes/s times 2 (w - 1) / w, what a ring moves over each link). Not a least-squares fit: that follows the
    large messages and misses the small ones' latency, which is what a decode step's all-reduces of B x dim hidden
    states pay."""
    points = []
    for n in sizes:
        x = torch.ones(n // 4, device=tp.device)
        points.append({"bytes": n, "seconds": median_time(lambda: tp.all_reduce_(x), tp.device, reps, warmup=2)})
    small, large = points[0], points[-1]
    slope = max((large["seconds"] - small["seconds"]) / (large["bytes"] - small["bytes"]), 1e-15)
    w = tp.world_size
    return {"backend": tp.backend, "world_size": w, "device": str(tp.device.type), "points": points,
            "latency_s": max(0.0, small["seconds"] - slope * small["bytes"]), "bus_bandwidth": 2 * (w - 1) / w / slope}


def _allreduce_rank(rank: int, world_size: int, port: int, device: str, out) -> None:
    """One process of `measure_local_allreduce`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # one rank per core, as TP runs on CPU
    result = measure_allreduce(init_tp(device, timeout_s=120))
    if rank == 0:
        out.put(result)
    shutdown_tp()


def measure_local_allreduce(device: torch.device, world_size: int | None = None) -> dict[str, Any] | None:
    """`measure_allreduce` over processes of this machine: gloo between `world_size` (default 2) CPU processes, or
    NCCL over this machine's GPUs (all of them by default); None with fewer than two GPUs."""
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
