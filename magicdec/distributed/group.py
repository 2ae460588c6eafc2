"""The process group of a tensor-parallel run, set up from torchrun's environment.

torchrun (or any launcher that sets the same variables) gives every process RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT; `init_tp` joins the default process group over gloo on CPUs and NCCL on CUDA devices (one device per
local rank). Every collective carries the group's timeout and its failures become one `DistributedError`, so a rank
that died or hangs ends the others within the timeout with one clear line instead of a silent hang or a traceback per
rank.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from magicdec.errors import DistributedError, InvalidRequestError

#: Seconds a collective may wait for the other ranks before every rank gives up (MAGICDEC_TP_TIMEOUT).
#: Generous, because a rank legitimately waits for the slowest one's longest step (a long prefill on CPU).
DEFAULT_TIMEOUT_S = 300.0


def launched_world_size() -> int:
    """The number of ranks the launcher started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def timeout_from_env() -> float:
    """MAGICDEC_TP_TIMEOUT seconds, else DEFAULT_TIMEOUT_S."""
    text = os.environ.get("MAGICDEC_TP_TIMEOUT")
    try:
        value = DEFAULT_TIMEOUT_S if text is None else float(text)
    except ValueError:
        raise InvalidRequestError(f"MAGICDEC_TP_TIMEOUT must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise InvalidRequestError(f"MAGICDEC_TP_TIMEOUT must be > 0, got {text!r}")
    return value


class TPGroup:
    """This process's place in a tensor-parallel run, and the collectives the engine uses.

    `comm_s` accumulates the seconds spent inside the model's all-reduces (on CPU, gloo's all-reduce is synchronous,
    so this is communication plus waiting for the slowest rank; on CUDA it is only the launch time unless the caller
    synchronizes)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend, self.timeout_s = backend, timeout_s
        self.comm_s = 0.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextmanager
    def _collective(self) -> Iterator[None]:
        """Turn a collective's failure (DistBackendError, gloo's timeouts and closed connections) into one
        DistributedError."""
        try:
            yield
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(f"rank {self.rank} of {self.world_size}: a collective failed (another rank died, "
                                   f"hung for more than {self.timeout_s:g}s, or is unreachable): {first}") from None

    def all_reduce_(self, x: Tensor) -> Tensor:
        """Sum x over the ranks, in place; returns x."""
        t = time.perf_counter()
        with self._collective():
            dist.all_reduce(x)
        self.comm_s += time.perf_counter() - t
        return x

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a picklable object), in rank order."""
        out: list[Any] = [None] * self.world_size
        with self._collective():
            dist.all_gather_object(out, value)
        return out

    def agree(self, what: str, value: Any) -> None:
        """Refuse a run whose ranks disagree on `value` (the model, the arguments), naming the first that differs."""
        values = self.gather(value)
        for rank, other in enumerate(values):
            if other != values[0]:
                raise InvalidRequestError(f"ranks disagree on {what}: rank 0 has {values[0]!r}, rank {rank} has "
                                          f"{other!r}; launch every rank with the same settings")

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the slots that fit on every device)."""
        return min(self.gather(int(value)))

    def share(self, value: Any) -> Any:
        """Rank 0's `value` (a picklable object; the others pass anything) on every rank."""
        box = [value]
        with self._collective():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def shared_seed(self) -> int:
        """A random seed drawn on rank 0 and given to every rank."""
        return self.share(random.getrandbits(63) if self.is_main else None)


def _device_for(device: str | None, local_rank: int) -> torch.device:
    """cpu, or this rank's CUDA device (one per local rank); None: cuda when available."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda" or dev.index is not None:
        raise InvalidRequestError(f"under tensor parallelism --device is cpu or cuda (each rank takes the CUDA "
                                  f"device of its local rank), got {device!r}")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise InvalidRequestError(f"local rank {local_rank} needs CUDA device {local_rank}, but this machine has "
                                  f"{have}; start at most {have} processes per node")
    return torch.device("cuda", local_rank)


_GROUP: TPGroup | None = None


def init_tp(device: str | None = None, timeout_s: float | None = None) -> TPGroup:
    """Join the process group torchrun describes in the environment (once per process; later calls return it).

    Backend: NCCL when the rank runs on CUDA, gloo on CPU."""
    global _GROUP
    if _GROUP is not None:
        return _GROUP
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise InvalidRequestError(f"tensor parallelism needs a launcher's environment ({', '.join(missing)} unset): "
                                  "start with `torchrun --nproc-per-node N -m magicdec ...`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = _device_for(device, int(os.environ.get("LOCAL_RANK", rank)))
    timeout_s = timeout_from_env() if timeout_s is None else timeout_s
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                **({"device_id": dev} if dev.type == "cuda" else {}))
    except RuntimeError as e:  # the rendezvous timed out: a rank never came
        raise DistributedError(f"rank {rank} of {world}: could not join the process group within "
                               f"{timeout_s:g}s: {str(e).strip().splitlines()[0]}") from None
    _GROUP = TPGroup(rank, world, dev, backend, timeout_s)
    return _GROUP


def shutdown_tp() -> None:
    """Leave the process group after a run that ended normally (a failed one exits without it: tearing down a group
    whose peer is dead can block)."""
    global _GROUP
    if _GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = None
