"""Where a decode round's time goes: each kind of forward (a plain step, a draft step, a verification) split into
attention, linear layers, other operators, sampling and host time, against the forward's floor.

`LLM.generate(..., phases=PhaseRecorder(N))` (`generate --phases N`, `bench --phases N`) runs torch's profiler over N
decode rounds once every prompt is prefilled, so prefill and start-up are outside the window. The runner and the
drafters mark what they run with scopes (`forward`, `sampling`, `round`) and the model marks its attention
(`magicdec.scopes`); outside such a window each scope is a shared no-op context, so the decode loop pays nothing for
them.

The split of one kind of forward, from the profiler's events inside its scopes:
- attention: the model's `attend` calls (the native or Triton kernel, or torch's operators where they attend);
- linear: the linear layers' operators (the packed kernel, on vector instructions or AMX tiles, or torch's
  `aten::linear`; inside a layer's sublayer operators, `kernels.attention_in` and `attention_out`, the events they
  record for their linear layers);
- other: every other operator of the forward (embedding, norms, RoPE, activations, residual adds, casts, the K/V
  writes into the cache, masks; the rest of a sublayer operator's time);
- host: the forward's wall time that no operator accounts for (Python between operators, dispatch);
- sampling: turning the forward's logits into tokens (verification's acceptance included), timed apart.
Besides the forwards, a round spends time on the drafter's bookkeeping and the engine's (a self-speculative draft
copying the target's new entries, commits, EOS checks): `outside_ms`.

The floor of a forward is what its bytes take at the memory's read rate, or its multiply-adds at the rate of a large
square matmul in the model's dtype, whichever is longer (the planner's `forward_cost` counts both); both rates are
measured right after the window. A plain step's or a verification's K/V bytes are counted once where rows over one
prompt read its blocks together (`prefix_rows`; the planner's `distinct_kv`). Where a last-level cache holds the
weights, the true floor is lower. The profiler adds about a microsecond to each operator it records, which lands in
`host`. The accounting is a CPU's: on CUDA the times are the host's launches (kernels run asynchronously).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from magicdec import scopes
from magicdec.calibrate.timing import best_time, memory_read_rate
from magicdec.errors import InvalidRequestError
from magicdec.planner.cost import Workload, distinct_kv, forward_cost
from magicdec.planner.hardware import HardwareProfile
from magicdec.planner.models import ModelShape

#: The kinds of forward a round runs.
KINDS = ("plain", "draft", "verify")
#: The kinds of forward that read the target's whole cache (a draft reads entries of its own).
TARGET_KINDS = ("plain", "verify")
#: Operator names (their endings) of the linear layers, and of the sublayer operators that run some of them inside.
LINEARS = ("::linear", "::linear_tiles")
SUBLAYERS = ("::attention_in", "::attention_out")
#: The size of the square matmul whose rate prices multiply-adds.
MATMUL_N = 1024
#: Any profile: `forward_cost` is asked for bytes and flops only, which do not depend on it.
_ANY = HardwareProfile(name="counts", flops_per_s=1.0, mem_bandwidth=1.0, mem_bytes=1.0)


@dataclass
class _Forwards:
    """What one kind of forward did in the window: how many, their shapes, and the microseconds of each part."""

    count: int = 0
    rows: int = 0  # summed over the forwards, as are the next two
    tokens: int = 0  # new tokens per row
    entries: float = 0.0  # KV entries a row attends, the mean over rows
    us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("wall", "attention", "linear", "other", "sampling"), 0.0))


class PhaseRecorder:
    """Profiles `rounds` decode rounds from `start` on and adds up each kind of forward's parts (see the module)."""

    def __init__(self, rounds: int):
        if not (isinstance(rounds, int) and rounds >= 1):
            raise InvalidRequestError(f"phases: profile at least one decode round, got {rounds!r}")
        self.rounds_left = rounds
        self.rounds = 0
        self.round_us = 0.0
        self.forwards = {kind: _Forwards() for kind in KINDS}
        self._profiler: profile | None = None
        self.closed = False
        self.read_rate = 0.0  # bytes/s, measured when the window closes
        self.matmul_rate = 0.0  # flop/s, likewise
        self._rates_on: tuple[torch.device, torch.dtype] | None = None  # where the rates are measured (`start`)

    @property
    def running(self) -> bool:
        return self._profiler is not None

    @property
    def waiting(self) -> bool:
        """Whether the window is still to open."""
        return self._profiler is None and not self.closed

    def start(self, device: torch.device, dtype: torch.dtype) -> None:
        """Open the window on a model on `device` computing in `dtype` (what the rates are measured on)."""
        self._rates_on = device, dtype
        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()
        scopes.active = self

    def round_done(self) -> None:
        """Count a decode round; after the last, stop profiling and take the window's events apart."""
        self.rounds += 1
        self.rounds_left -= 1
        if self.rounds_left == 0:
            self.stop()

    def stop(self) -> None:
        """Close the window (after its last round, or where the run ends before it)."""
        self.closed = True
        if self._profiler is None:
            return
        scopes.active = None
        self._profiler.__exit__(None, None, None)
        self._tally(self._profiler.events())
        self._profiler = None
        device, dtype = self._rates_on
        self.read_rate = memory_read_rate(device)
        a = torch.randn(MATMUL_N, MATMUL_N, device=device).to(dtype)
        self.matmul_rate = 2 * MATMUL_N**3 / best_time(lambda: a @ a, device, 3)

    def note(self, kind: str, rows: int, tokens: int, lens: torch.Tensor) -> None:
        """One forward of `kind` over `rows` rows of `tokens` new tokens each, whose rows attend `lens` [rows]
        entries."""
        f = self.forwards[kind]
        f.count += 1
        f.rows += rows
        f.tokens += tokens
        f.entries += float(lens.float().mean()) if lens.numel() else 0.0

    def _tally(self, events) -> None:
        for event in events:
            if event.name == scopes.ROUND:
                self.round_us += _us(event)
            elif event.name.startswith(scopes.SAMPLING):
                self.forwards[event.name.removeprefix(scopes.SAMPLING)].us["sampling"] += _us(event)
            elif event.name.startswith(scopes.FORWARD):
                us = self.forwards[event.name.removeprefix(scopes.FORWARD)].us
                us["wall"] += _us(event)
                _split(event, us)

    def report(self, shape: ModelShape, dtype_bytes: float, kv_bytes: float, prefix_rows: float = 1.0) -> dict:
        """Per kind of forward that ran: ms per forward of each part, host time, floor and ratio; and the rounds'
        time outside the forwards. `dtype_bytes`, `kv_bytes`: bytes per weight and per KV element; `prefix_rows`: rows
        per shared prompt prefix (`engine.prefix_rows`)."""
        kinds = {}
        forward_us = 0.0
        for kind, f in self.forwards.items():
            if not f.count:
                continue
            us = f.us
            forward_us += us["wall"] + us["sampling"]
            ops = us["attention"] + us["linear"] + us["other"]
            part = {name: us[name] / f.count / 1e3 for name in ("attention", "linear", "other", "sampling")}
            ms = us["wall"] / f.count / 1e3
            floor = self._floor(shape, dtype_bytes, kv_bytes, f, prefix_rows if kind in TARGET_KINDS else 1.0)
            kinds[kind] = {"forwards": f.count, "rows": f.rows / f.count, "tokens": f.tokens / f.count,
                           "entries": f.entries / f.count, "ms": ms, **{f"{k}_ms": v for k, v in part.items()},
                           "host_ms": (us["wall"] - ops) / f.count / 1e3, "floor_ms": floor * 1e3,
                           "ratio": ms / (floor * 1e3) if floor else None}
        return {"rounds": self.rounds, "round_ms": self.round_us / max(self.rounds, 1) / 1e3,
                "outside_ms": (self.round_us - forward_us) / max(self.rounds, 1) / 1e3,
                "read_rate_gbs": self.read_rate / 1e9, "matmul_gflops": self.matmul_rate / 1e9, "kinds": kinds}

    def _floor(self, shape: ModelShape, dtype_bytes: float, kv_bytes: float, f: _Forwards,
               prefix_rows: float) -> float:
        """Seconds of the mean forward of `f` at its floor (see the module)."""
        rows, tokens, entries = round(f.rows / f.count), round(f.tokens / f.count), round(f.entries / f.count)
        w = Workload(shape, _ANY, rows, max(entries, 1), dtype_bytes, kv_bytes, prefix_rows=prefix_rows)
        cost = forward_cost(w, tokens, entries)
        memory = (cost.bytes_weights + cost.bytes_kv * distinct_kv(w) + cost.bytes_activations) / self.read_rate
        return max(memory, (cost.flops_linear + cost.flops_attention) / self.matmul_rate)


def _us(event) -> float:
    return event.time_range.end - event.time_range.start


def _split(event, us: dict[str, float]) -> None:
    """Add the operators under `event` to attention, linear and other (a nested scope of ours is looked into)."""
    for child in event.cpu_children:
        if child.name == scopes.ATTENTION:
            us["attention"] += _us(child)
        elif child.name.endswith(LINEARS):
            us["linear"] += _us(child)
        elif child.name.endswith(SUBLAYERS):  # the linear layers it records apart, the rest its other operators
            linear = sum(_us(c) for c in child.cpu_children if c.name.endswith(LINEARS))
            us["linear"] += linear
            us["other"] += _us(child) - linear
        elif child.name.startswith(scopes.PREFIX):
            _split(child, us)
        else:
            us["other"] += _us(child)


def format_phases(report: dict, label: str) -> str:
    """The report as a table, ms per forward (`LLM.generate`'s `last_stats.phases`)."""
    lines = [f"[{label}] phases of {report['rounds']} decode rounds, ms per forward (floor: bytes at "
             f"{report['read_rate_gbs']:.1f} GB/s read, multiply-adds at {report['matmul_gflops']:.0f} GFLOP/s):",
             f"{'forward':>8} {'count':>5} {'rows':>5} {'tokens':>6} {'entries':>8} {'wall':>8} {'attention':>9} "
             f"{'linear':>7} {'other':>7} {'host':>7} {'sampling':>8} {'floor':>7} {'ratio':>6}"]
    for kind, k in report["kinds"].items():
        ratio = f"{k['ratio']:.2f}x" if k["ratio"] else "-"
        lines.append(f"{kind:>8} {k['forwards']:>5} {k['rows']:>5.0f} {k['tokens']:>6.1f} {k['entries']:>8.0f} "
                     f"{k['ms']:>8.2f} {k['attention_ms']:>9.2f} {k['linear_ms']:>7.2f} {k['other_ms']:>7.2f} "
                     f"{k['host_ms']:>7.2f} {k['sampling_ms']:>8.2f} {k['floor_ms']:>7.2f} {ratio:>6}")
    lines.append(f"[{label}] a round took {report['round_ms']:.1f} ms, {report['outside_ms']:.1f} of them outside the "
                 f"forwards and their sampling")
    return "\n".join(lines)
