"""Sampling parameters and the logits -> distribution transform shared by target and draft."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from magicdec.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # None (no stop strings), one string and a list are accepted; the frozen params keep a tuple.
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        elif not isinstance(self.stop, tuple):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and 0 <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
        for name in ("max_tokens", "top_k"):
            if isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be strings, got {self.stop!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution tokens are drawn from: softmax(logits / T) restricted by top-k and top-p.

    logits [..., V] fp32 -> probs [..., V]. Applied identically to target and draft logits, which is what
    keeps speculative sampling exact for the filtered target distribution.
    """
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        probs = probs.masked_fill(probs < _nucleus_floor(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


#: Candidates examined before the whole vocabulary on CPU. A nucleus or a filtered distribution rarely
#: reaches past them, and sorting (or drawing noise for) a 50k-128k vocabulary per row dominates a CPU
#: decode step at batch 32; rows that do reach past them take the full path. On CUDA the full sort
#: is fast, and the per-row check would cost a host sync.
CPU_CANDIDATES = 256


def _on_cpu_with_many(probs: Tensor) -> bool:
    return probs.device.type == "cpu" and probs.shape[-1] > CPU_CANDIDATES


def _floor_of_sorted(sorted_p: Tensor, top_p: float) -> Tensor:
    # keep a token unless the tokens more probable than it already hold top_p of the mass (the top one stays)
    n_keep = ((sorted_p.cumsum(dim=-1) - sorted_p) < top_p).sum(dim=-1, keepdim=True)
    return sorted_p.gather(-1, n_keep - 1)


def _nucleus_floor(probs: Tensor, top_p: float) -> Tensor:
    """The smallest probability in each row's top-p nucleus, [..., 1] (tokens tied with it stay in)."""
    if not _on_cpu_with_many(probs):
        return _floor_of_sorted(probs.sort(dim=-1, descending=True).values, top_p)
    top = probs.topk(CPU_CANDIDATES, dim=-1).values  # sorted, largest first
    floor = _floor_of_sorted(top, top_p)
    wide = top.sum(dim=-1) < top_p  # the nucleus reaches past the candidates
    if wide.any():
        floor[wide] = _floor_of_sorted(probs[wide].sort(dim=-1, descending=True).values, top_p)
    return floor


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [..., V] -> [...], by the exponential trick (no host sync on CUDA).

    On CPU, rows whose positive probabilities all lie among their CPU_CANDIDATES largest (after a
    top-p or top-k filter, or a residual of such distributions) draw noise for those candidates only."""
    if not _on_cpu_with_many(probs):
        return _exponential_argmax(probs, generator)
    top, index = probs.topk(CPU_CANDIDATES, dim=-1)
    tokens = index.gather(-1, _exponential_argmax(top, generator)[..., None]).squeeze(-1)
    wide = top[..., -1] > 0  # positive probability beyond the candidates
    if wide.any():
        tokens[wide] = _exponential_argmax(probs[wide], generator)
    return tokens


def _exponential_argmax(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def next_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """Greedy or sampled next tokens for logits [..., V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probs_from_logits(logits, params), generator)
