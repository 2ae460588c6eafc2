"""`magicdec serve` under tensor parallelism: rank 0 runs HTTP and the scheduler, the other ranks follow.

Every rank holds an identical LLMEngine. Each turn of rank 0's engine thread (magicdec.server.async_engine) sends the
commands it is about to apply (add a request, abort one) to the other ranks before applying them; every rank then
applies the same commands to the same state, so they all make the same scheduling decision and step together, with
the model's all-reduces as the only other communication. While idle, rank 0 sends an empty turn every quarter of the
collective timeout, so waiting for requests never counts as a hung rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from magicdec.distributed.group import TPGroup
from magicdec.engine import LLMEngine
from magicdec.errors import DistributedError, MagicDecError
from magicdec.scheduler import Status

#: A turn's commands as sent to the other ranks: ("add", request id, prompt ids, SamplingParams) or
#: ("abort", request id); None ends the followers.
Turn = list[tuple[Any, ...]] | None


class StepMirror:
    """Rank 0's side: `AsyncEngine(..., mirror=StepMirror(tp))` sends every turn to the other ranks."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.heartbeat_s = tp.timeout_s / 4

    def send(self, turn: Turn) -> None:
        self.tp.share(turn)

    def stop(self) -> None:
        """Tell the followers that serving is over (best effort: they may be gone already)."""
        try:
            self.send(None)
        except DistributedError:
            pass

    def lost(self, error: DistributedError) -> None:
        """A collective failed: end this rank now with one line (the CLI's contract), without tearing the group down
        (with a dead peer that can block)."""
        print(f"magicdec: error: {error}", file=sys.stderr, flush=True)
        os._exit(3)


def follow(engine: LLMEngine, tp: TPGroup) -> None:
    """A rank other than 0: apply rank 0's turns to `engine` and step when it steps, until it stops."""
    while (turn := tp.share(None)) is not None:
        for command in turn:
            if command[0] == "abort":
                engine.abort_request(command[1])
                continue
            try:
                engine.add_request(*command[1:])
            except MagicDecError:
                pass  # refused on rank 0 too: the same checks on the same state
        if not engine.has_unfinished():
            continue
        try:
            engine.step()
        except DistributedError:
            raise
        except Exception:  # rank 0 fails the step's requests and serves on (AsyncEngine._fail_touched): so do we
            for request in [r for r in engine.requests.values() if r.status is not Status.WAITING]:
                engine.abort_request(request.request_id)
