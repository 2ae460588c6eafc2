"""Roofline cost of one forward pass, and of the three kinds of step speculative decoding takes.

The forward pass is split into two groups of kernels that are bound separately:

- the linear layers (q/k/v/o, MLP, lm head) stream the weights and the activations, and do 2 * B * q *
  n_params_linear flops;
- attention streams the KV cache and does 4 * B * q * L * n_layers * n_heads * head_dim flops.

Each group takes max(bytes / effective bandwidth, flops / effective FLOP rate), and the pass takes the sum of the two
plus overhead (plus all-reduce time under tensor parallelism), or on a GPU the time the host takes to launch its
kernels where that is longer (eager PyTorch launches a small model's kernels slower than the device runs them).
Taking one max over the whole pass would let the attention's idle compute hide the linear layers' compute: once
verification of gamma+1 tokens makes the linear layers compute-bound while attention is still streaming a long KV
cache, the two add up, which is why verification gets dearer with gamma even when the KV cache dominates.

A calibrated profile may carry measured rates instead of a single efficiency per group: the weight bytes/s of the
linear layers against the tokens per forward, and the KV bytes/s of attention against the new tokens per sequence
(`HardwareProfile.linear_rates`, `attention_rates`). A group's time is then its bytes over the rate interpolated at
its shape; the roofline still names the bound ("weights", "kv" or "compute").

Rows that share a prompt prefix (`Workload.prefix_rows` of them per prompt) attend over its blocks once per group on
the native kernels (cascade attention): a group's task reads the blocks once and computes all its rows' queries, so
a forward over the whole context takes `shared_attention` of its rows' attention time, from the attention's time at
the group's query rows and `HardwareProfile.shared_attention_factor` (measured at SHARED_ROWS rows per prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from magicdec.planner.hardware import HardwareProfile
from magicdec.planner.models import ModelShape


@dataclass(frozen=True)
class ForwardCost:
    """Bytes, flops and seconds of one forward pass, per device."""

    bytes_weights: float
    bytes_kv: float
    bytes_activations: float
    flops_linear: float
    flops_attention: float
    t_memory: float
    """All bytes at the effective bandwidth."""
    t_compute: float
    """All flops at the effective FLOP rates."""
    t_comm: float
    """Tensor-parallel all-reduces (0 when tp == 1)."""
    t_overhead: float
    """Fixed and per-layer overhead (without the kernel launches a host-bound forward waits for: see `time`)."""
    time: float
    """Predicted seconds for the pass."""
    dominant: str
    """The largest share of `time`: "weights", "kv", "compute" or "overhead" (incl. comm)."""


#: Rows per prompt that `HardwareProfile.shared_attention_factor` is measured at.
SHARED_ROWS = 4
#: Positions the native kernels group rows over (`magicdec.kernels.CHUNK`): a row's last chunk, which holds its own
#: tokens, is its own.
GROUP_CHUNK = 1024


@dataclass(frozen=True)
class Workload:
    """`batch` sequences at `context` tokens of one model on one machine: what the cost model and the planner price.
    `dtype_bytes` and `kv_dtype_bytes` are bytes per weight and per KV-cache element; `tp` is the number of devices
    the model is split over (tensor parallelism). A draft model's forwards are priced on the same workload with its
    own shape and TP degree (`dataclasses.replace`). `prefix_rows`: rows per prompt prefix (1: every row's context its
    own), which read the prefix's K/V together (`shared_attention`)."""

    shape: ModelShape
    hw: HardwareProfile
    batch: int
    context: int
    dtype_bytes: float = 2
    kv_dtype_bytes: float = 2
    tp: int = 1
    prefix_rows: float = 1.0


def shared_attention(w: Workload, q: int, attention_time: Callable[[float], float]) -> float:
    """The share of its rows' attention time that a forward of `q` new tokens a row over the whole context takes where
    `w.prefix_rows` rows share each prompt. Over the context before the last chunk, one task attends for a group of r
    rows as for one row of r q new tokens (`attention_time(x)`: the forward's attention time at x new tokens a row, so
    a group costs what its query rows cost where attention is compute-bound, as a verification's is on vector
    instructions), plus, for each other row, a fraction e of a row's own pass (its queries gathered, its partial
    results copied), e fitted to the profile's factor at SHARED_ROWS rows of one new token; the last chunk each row's
    own. Never more than a pass per row."""
    rows = max(1.0, w.prefix_rows)
    one, own = attention_time(1), attention_time(q)
    if rows == 1 or own <= 0:
        return 1.0
    fitted = SHARED_ROWS * w.hw.shared_attention_factor * one - attention_time(SHARED_ROWS)
    extra = max(0.0, fitted / ((SHARED_ROWS - 1) * one))
    together = min(1.0, (attention_time(rows * q) + (rows - 1) * extra * own) / (rows * own))
    grouped = _grouped(w)
    return grouped * together + 1 - grouped


def distinct_kv(w: Workload) -> float:
    """The share of its rows' K/V bytes that a forward over the whole context reads once where `w.prefix_rows` rows
    share each prompt: a group's blocks before the last chunk once for all its rows (the bytes a floor counts)."""
    grouped = _grouped(w)
    return grouped / max(1.0, w.prefix_rows) + 1 - grouped


def _grouped(w: Workload) -> float:
    """The share of the context that rows over one prompt attend over in groups: all but the last chunk."""
    return max(0, w.context - GROUP_CHUNK) / max(1, w.context)


def _activation_elements_per_token(shape: ModelShape) -> int:
    """Elements each linear layer reads and writes for one token, summed over the model.

    Per layer: the qkv projection reads dim and writes (n_heads + 2 n_kv_heads) head_dim, o reads n_heads head_dim
    and writes dim, gate/up read dim and write 2 ffn, down reads ffn and writes dim. The lm head reads dim and writes
    vocab logits."""
    per_layer = (
        shape.dim + (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
        + shape.n_heads * shape.head_dim + shape.dim
        + shape.dim + 2 * shape.ffn_dim
        + shape.ffn_dim + shape.dim
    )
    return shape.n_layers * per_layer + shape.dim + shape.vocab_size


def rate_at(rates: tuple[tuple[float, float], ...], x: float) -> float:
    """A measured rate at `x`: log-log interpolation between the (x, rate) pairs; below the first the first rate,
    beyond the last the work grows as x at the last point's time (compute-bound)."""
    if x <= rates[0][0]:
        return rates[0][1]
    if x >= rates[-1][0]:
        return rates[-1][1] * rates[-1][0] / x
    for (x0, r0), (x1, r1) in zip(rates, rates[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return r0 * (r1 / r0) ** f
    raise AssertionError("unreachable")


def _group_times(
    memory_s: float, compute_s: float, rates: tuple[tuple[float, float], ...] | None, nbytes: float, x: float,
) -> tuple[float, float]:
    """(memory time, compute time) of one kernel group: its roofline terms, or, where the profile measured the
    group's rates, its bytes over the rate at `x`, all of it on the roofline's bound."""
    if rates is None:
        return memory_s, compute_s
    t = nbytes / rate_at(rates, x)
    return (t, 0.0) if memory_s >= compute_s else (0.0, t)


def _allreduce_time(w: Workload, message_bytes: float) -> float:
    """Seconds of a forward's tensor-parallel all-reduces: two ring all-reduces of `message_bytes` per layer."""
    if w.tp == 1:
        return 0.0
    if w.hw.ici_bandwidth is None:
        raise ValueError(f"profile {w.hw.name!r} has no ici_bandwidth; cannot model tp={w.tp}")
    # A ring all-reduce sends and receives 2 (tp-1)/tp of the message on each device.
    per_call = w.hw.allreduce_latency_s + 2 * (w.tp - 1) / w.tp * message_bytes / w.hw.ici_bandwidth
    return 2 * w.shape.n_layers * per_call


def forward_cost(w: Workload, q: int, kv_len: int) -> ForwardCost:
    """Cost of one forward pass of the workload's sequences, `q` new tokens each, attending `kv_len` keys.

    With `w.tp` > 1 the layers' weights, KV cache and flops are split evenly over the devices (the LM head is
    replicated on every device, as magicdec.distributed runs it), and each layer adds two ring all-reduces of the
    B*q*dim hidden states: `hw.allreduce_latency_s` each plus the bytes over `hw.ici_bandwidth`."""
    shape, hw, batch, tp = w.shape, w.hw, w.batch, w.tp
    if batch < 1 or q < 1 or kv_len < 0 or tp < 1:
        raise ValueError(f"need batch >= 1, q >= 1, kv_len >= 0, tp >= 1; got {batch}, {q}, {kv_len}, {tp}")
    tokens = batch * q
    # Activations stay in the compute dtype (16-bit at least) even when weights are quantized.
    act_dtype_bytes = max(w.dtype_bytes, 2)
    head = shape.dim * shape.vocab_size  # replicated under TP
    params_per_device = (shape.n_params_linear - head) / tp + head
    bytes_weights = params_per_device * w.dtype_bytes
    # a hybrid model's sliding layers read the window whatever kv_len (a draft's budget) the global layers read
    bytes_kv = batch * (kv_len * shape.kv_bytes_per_token(w.kv_dtype_bytes)
                        + shape.window_kv_bytes(w.context, w.kv_dtype_bytes)) / tp
    bytes_activations = tokens * _activation_elements_per_token(shape) * act_dtype_bytes / tp
    flops_linear = 2 * tokens * params_per_device
    attended = kv_len * (shape.n_layers - shape.sliding_layers) + shape.window_keys(w.context) * shape.sliding_layers
    flops_attention = 4 * tokens * attended * shape.n_heads * shape.head_dim / tp

    bandwidth = hw.mem_bandwidth * hw.bandwidth_efficiency
    t_linear_memory, t_linear_compute = _group_times(
        (bytes_weights + bytes_activations) / bandwidth, flops_linear / (hw.flops_per_s * hw.matmul_efficiency),
        hw.linear_rates, bytes_weights, tokens)

    def attention_times(x: float) -> tuple[float, float]:  # (memory, compute) at x new tokens a row
        return _group_times(bytes_kv / bandwidth, flops_attention * x / q / (hw.flops_per_s * hw.attention_efficiency),
                            hw.attention_rates if bytes_kv > 0 else None, bytes_kv, x)

    t_kv, t_attention_compute = attention_times(q)
    if kv_len == w.context:  # the whole context, shared prefixes included (a sparse draft's own entries are not)
        share = shared_attention(w, q, lambda x: max(attention_times(x)))
        t_kv, t_attention_compute = t_kv * share, t_attention_compute * share
    t_comm = _allreduce_time(w, tokens * shape.dim * act_dtype_bytes)
    t_overhead = hw.fixed_overhead_s + hw.per_layer_overhead_s * shape.n_layers

    shares = {"weights": 0.0, "kv": 0.0, "compute": 0.0, "overhead": t_overhead + t_comm}
    shares["weights" if t_linear_memory >= t_linear_compute else "compute"] += max(t_linear_memory, t_linear_compute)
    shares["kv" if t_kv >= t_attention_compute else "compute"] += max(t_kv, t_attention_compute)
    # the device works while the host launches the next kernels: a forward takes at least the launches
    shares["overhead"] += max(0.0, hw.launch_per_layer_s * shape.n_layers - sum(shares.values()))
    return ForwardCost(
        bytes_weights=bytes_weights, bytes_kv=bytes_kv, bytes_activations=bytes_activations,
        flops_linear=flops_linear, flops_attention=flops_attention,
        t_memory=t_linear_memory + t_kv, t_compute=t_linear_compute + t_attention_compute, t_comm=t_comm,
        t_overhead=t_overhead, time=sum(shares.values()), dominant=max(shares, key=lambda k: shares[k]),
    )


def decode_step_time(w: Workload) -> float:
    """Seconds of one autoregressive step: one new token per sequence over a `context`-long cache."""
    return forward_cost(w, 1, w.context).time


def verify_step_time(w: Workload, gamma: int) -> float:
    """Seconds of one target verification: gamma drafted tokens plus one, over the dense cache."""
    return forward_cost(w, gamma + 1, w.context).time


def draft_time(w: Workload, budget: int | None, gamma: int, *, first_tokens: int) -> float:
    """Seconds of the gamma draft forwards of one round.

    The first forward also feeds what the draft cache has not seen of the previous round: a standalone draft reads
    the last draft and the target's bonus token after a fully accepted round (`first_tokens` 2); self-speculation
    copies the target's entries for all but the newest token and reads one (`first_tokens` 1). The others run one
    token each. Self-speculation passes the target's workload and the sparse cache's `budget`; a standalone draft
    passes the workload with its own shape and TP degree, with `budget=None` for a dense draft cache (it attends the
    whole `context`) or its sparse budget. A budget larger than the context is the context."""
    kv_len = w.context if budget is None else min(budget, w.context)
    return forward_cost(w, first_tokens, kv_len).time + (gamma - 1) * forward_cost(w, 1, kv_len).time


def selection_time(w: Workload) -> float:
    """Seconds a Vegas round spends on its selection beside its forwards' own work: its verification leaves each
    cached position's share of the first token's attention (per row, global layer and KV head: the G query heads'
    fp32 numerators and their sum, (G + 1) 4 bytes written at the streaming bandwidth), and the round ranks the
    shares (`hw.selection_s_per_share` each)."""
    shape = w.shape
    shares = w.batch * (shape.n_layers - shape.sliding_layers) * shape.n_kv_heads * w.context / w.tp
    written = (shape.n_heads // shape.n_kv_heads + 1) * 4
    return shares * (written / (w.hw.mem_bandwidth * w.hw.bandwidth_efficiency) + w.hw.selection_s_per_share)
