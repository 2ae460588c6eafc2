"""The scopes the decode loop marks its work with, for `magicdec.phases`'s profile of decode rounds.

Outside a profiled window each scope is a shared no-op context (the model's attention opens one per layer, so
they must cost nothing then); inside one, each is a profiler scope (`torch.profiler.record_function`), and a forward's
scope also tells the window's recorder its shape.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch
from torch.profiler import record_function

PREFIX = "magicdec."
ATTENTION = PREFIX + "attention"
ROUND = PREFIX + "round"
FORWARD = PREFIX + "forward."
SAMPLING = PREFIX + "sample."
_NOTHING = contextlib.nullcontext()


class Recorder(Protocol):
    def note(self, kind: str, rows: int, tokens: int, lens: torch.Tensor) -> None: ...


#: the open window's recorder (magicdec.phases.PhaseRecorder), or None
active: Recorder | None = None


def scope(name: str):
    """A profiler scope named `name` while a window is open, else a shared no-op context."""
    return _NOTHING if active is None else record_function(name)


@contextlib.contextmanager
def forward(kind: str, rows: int, tokens: int, lens: torch.Tensor) -> Iterator[None]:
    """Scope one forward of `kind` ("plain", "draft", "verify") of `tokens` new tokens over `rows` rows attending
    `lens` [rows] entries each (read only while a window is open)."""
    if active is None:
        yield
        return
    active.note(kind, rows, tokens, lens)
    with record_function(FORWARD + kind):
        yield


def sampling(kind: str):
    """Scope the sampling of a `kind` forward's logits."""
    return scope(SAMPLING + kind)
