"""Sampling parameters, and the per-row sampler shared by plain decoding, drafting and verification.

Every random choice is a deterministic function of (request seed, token position, token id): the token at position t
of a sequence is argmax_x p_t(x) / E_t(x), with E_t(x) an exponential variate hashed from (seed, t, x) (the
exponential-race form of the Gumbel-max trick). Three things follow:

* Rows need no generator objects: a batch of requests, each with its own seed, samples in one tensor op, and a
  request's tokens do not depend on which other requests share the batch.
* Draft and target share the noise of each position. A draft token is accepted exactly when it equals the target's
  own sample at that position, so speculative output is token for token the output of plain decoding with the same
  seed (greedy rows are the special case of no noise). A drafter can make generation faster, never different, for
  sampled requests too.
* Noise can be computed for any subset of the vocabulary: on CPU, rows whose (top-p / top-k filtered) distribution
  lies within their few most probable tokens (CPU_CANDIDATES) draw noise for those alone, in one native operator
  where the kernels run (`magicdec.kernels.sample`).

Against Leviathan-style rejection sampling, the shared-noise coupling accepts slightly fewer draft tokens (SmolLM2
self-speculation on PG-19, T 0.7, top-p 0.9: 0.775 against 0.804 per token) and needs no draft distributions or
residuals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from magicdec import kernels
from magicdec.errors import InvalidRequestError
from magicdec.logprobs import MAX_LOGPROBS

#: Temperatures below this sample greedily: dividing logits by them overflows to inf/NaN.
GREEDY_BELOW = 1e-5
#: Most stop strings a request may give. Each is looked for in the request's newest text at every engine step, which
#: every running request waits for: 500,000 of them (they fit in a 5 MB body) added 0.8 s to each step.
MAX_STOP_STRINGS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters.

    seed: makes a sampled request reproducible (the same tokens alone or in any batch, with or without speculation).
    stop: strings that end the text (excluded from it). ignore_eos: keep going past EOS.
    logprobs: report each generated token's log-probability and its position's `logprobs` most probable tokens
    (None: none); prompt_logprobs: the same for the prompt's tokens (the first has none). Both are of the model's raw
    distribution (log_softmax of its logits), whatever temperature, top-k and top-p do to the draw
    (`magicdec.logprobs`); a request asking for prompt logprobs prefills its whole prompt, not taking a cached
    prefix, whose positions have no logits."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                          and 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# --- counter-based noise ------------------------------------------------------------------------------------
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's multipliers, as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_SEED_MASK = (1 << 63) - 1


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finalizer: a bijective avalanche of int64 (multiplication wraps)."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def exponential_noise(seed: Tensor, position: Tensor, token: Tensor) -> Tensor:
    """Exp(1) variates E(seed, position, token), independent across all three keys.

    seed [B] int64, position [B, q] int64, token [B, q, K] or [K] int64 -> [B, q, K] float32."""
    row = _mix(_mix(seed[:, None]) + position * _GOLDEN)  # [B, q]
    h = _mix(row[..., None] + token * _GOLDEN)
    u = (_shr(h, 11).double() + 0.5) * 2.0**-53  # uniform in (0, 1)
    return (-u.log()).float()


# --- logits -> distribution -----------------------------------------------------------------------------------
def _nucleus_floor(probs: Tensor, top_p: Tensor) -> Tensor:
    """The smallest probability in each row's top-p nucleus, [..., 1] (tokens tied with it stay in).

    probs [..., V] (rows sorted or not), top_p [..., 1]: keep a token unless the tokens more probable than it already
    hold top_p of the mass (the most probable one always stays; NaN rows keep one)."""
    sorted_p = probs.sort(dim=-1, descending=True).values
    n_keep = ((sorted_p.cumsum(dim=-1) - sorted_p) < top_p).sum(dim=-1, keepdim=True)
    return sorted_p.gather(-1, n_keep.clamp_min(1) - 1)


class RowParams:
    """Sampling parameters of a batch's rows (or an engine's slots) as tensors, with the host-side facts that choose
    the code path (all greedy, widest top-k, any top-p)."""

    #: the per-row tensors (what a view slices and a moved row takes along)
    TENSORS = ("greedy", "temperature", "top_k", "top_p", "seed")

    def __init__(self, n: int, device: torch.device | str):
        self.params: list[SamplingParams] = [SamplingParams()] * n
        self.greedy = torch.ones(n, dtype=torch.bool, device=device)
        self.temperature = torch.ones(n, device=device)
        self.top_k = torch.zeros(n, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, device=device)
        self.seed = torch.zeros(n, dtype=torch.long, device=device)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str) -> "RowParams":
        rows = cls(len(params), device)
        for i, (p, s) in enumerate(zip(params, seeds)):
            rows.set(i, p, s)
        return rows

    def set(self, i: int, params: SamplingParams, seed: int) -> None:
        """Row i samples with `params`, its noise keyed by `seed`."""
        self.params[i] = params
        self.greedy[i] = params.greedy
        self.temperature[i] = 1.0 if params.greedy else params.temperature
        self.top_k[i] = params.top_k
        self.top_p[i] = params.top_p
        self.seed[i] = seed & _SEED_MASK  # the low 63 bits: non-negative in an int64 tensor

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst samples as row src does (same parameters and noise)."""
        self.params[dst] = self.params[src]
        for name in self.TENSORS:
            tensor = getattr(self, name)
            tensor[dst] = tensor[src]

    def head(self, n: int) -> "RowParams":
        """The first n rows (tensor views)."""
        return self.select(slice(0, n))

    def row(self, i: int) -> "RowParams":
        """Row i alone (tensor views)."""
        return self.select(slice(i, i + 1))

    def select(self, rows: slice | Tensor) -> "RowParams":
        """The rows of a slice (tensor views) or at an index [n] (copies, in that order)."""
        view = object.__new__(RowParams)
        view.params = self.params[rows] if isinstance(rows, slice) else [self.params[i] for i in rows.tolist()]
        for name in self.TENSORS:
            setattr(view, name, getattr(self, name)[rows])
        return view

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def any_greedy(self) -> bool:
        return any(p.greedy for p in self.params)

    @property
    def max_top_k(self) -> int:
        return max((p.top_k for p in self.params if not p.greedy), default=0)

    @property
    def any_top_p(self) -> bool:
        return any(p.top_p < 1 and not p.greedy for p in self.params)


def probs_from_logits(logits: Tensor, rows: RowParams) -> Tensor:
    """The distribution tokens are drawn from: softmax(logits / T) restricted by top-k and top-p, per row.

    logits [B, q, V] fp32 -> probs [B, q, V]. Applied identically to target and draft logits."""
    logits = logits / rows.temperature[:, None, None]
    if rows.max_top_k:
        kth = logits.topk(min(rows.max_top_k, logits.shape[-1]), dim=-1).values  # [B, q, kmax]
        k = (rows.top_k.clamp(1, kth.shape[-1]) - 1)[:, None, None].expand(-1, logits.shape[1], 1)
        cut = torch.where((rows.top_k > 0)[:, None, None], kth.gather(-1, k), float("-inf"))
        logits = logits.masked_fill(logits < cut, float("-inf"))
    probs = logits.softmax(dim=-1)
    if rows.any_top_p:
        top_p = rows.top_p[:, None, None]
        floor = torch.where(top_p < 1, _nucleus_floor(probs, top_p), 0.0)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


#: Logits per block of `argmax`.
ARGMAX_BLOCK = 256


def argmax(logits: Tensor) -> Tensor:
    """`logits.argmax(dim=-1)`: the first index of each row's maximum (NaN counting as the maximum), [..., V] -> [...].

    torch's argmax over a large last axis runs at about a sixth of the rate of its amax on CPU (43 against 7 ms over
    a verification's 128 x 262k logits), so this takes the maximum of each block of ARGMAX_BLOCK logits, the first
    block holding the largest, and the first maximum within it: the same index."""
    *lead, V = logits.shape
    if V % ARGMAX_BLOCK or V < 2 * ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.reshape(-1, V // ARGMAX_BLOCK, ARGMAX_BLOCK)  # [n, V / block, block]
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [n]
    inner = blocks[torch.arange(len(blocks), device=logits.device), best].argmax(dim=-1)
    return (best * ARGMAX_BLOCK + inner).view(lead)


def _race(probs: Tensor, seed: Tensor, position: Tensor, token: Tensor) -> Tensor:
    """argmax over the last axis of probs / E(seed, position, token): an exact draw from probs."""
    return argmax(probs / exponential_noise(seed, position, token))


def sample_probs(probs: Tensor, seed: Tensor, position: Tensor, ids: Tensor | None = None) -> Tensor:
    """One token per row and position of probs [B, q, V] -> [B, q], keyed by (seed [B], position [B, q]).

    ids [V]: the token id of each column, which keys its noise and is returned (None: the column index; a draft
    head over part of the vocabulary passes its tokens)."""
    token = torch.arange(probs.shape[-1], device=probs.device) if ids is None else ids
    return _token_of(_race(probs, seed, position, token), ids)


def _token_of(index: Tensor, ids: Tensor | None) -> Tensor:
    """The token ids of logit indices: `ids[index]` for a head over part of the vocabulary (None: the indices)."""
    return index if ids is None else ids[index]


#: Candidate counts the CPU sampler tries in turn before the whole vocabulary. On CPU, sorting (or drawing
#: noise for) a 50k-128k vocabulary per row and position costs more than a draft forward at batch 32,
#: while a top-p nucleus or top-k support rarely reaches past a few dozen tokens (PG-19 at T 0.7, top-p 0.9: SmolLM2
#: past 64 at 9% of 28,672 positions, past 1024 at 2; Gemma 3 270M past 64 at 10% of 12,288, never past 1024).
CPU_CANDIDATES = (64, 1024)


def top_indices(logits: Tensor, k: int) -> Tensor:
    """Indices [n, k] of each row's k largest logits [n, V], the largest first.

    torch's topk over a 262k vocabulary costs more than a draft forward of a large batch; the k largest logits lie in
    the k blocks of V / (8k) logits with the largest maxima (a block holding one of them has a maximum at least as
    large, and fewer than k blocks can beat it), so topk runs over block maxima and then an eighth of the row."""
    n, V = logits.shape
    block = V // (8 * k)
    if block < 2 or V % block:
        return logits.topk(k, dim=-1).indices
    blocks = logits.view(n, V // block, block)
    best_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [n, k]
    held = blocks[torch.arange(n, device=logits.device)[:, None], best_blocks].view(n, k * block)
    best = held.topk(k, dim=-1).indices  # [n, k], into `held`
    return best_blocks.gather(1, best // block) * block + best % block


#: Floats of the rows `_candidate_probs` takes at a time: a few rows of a large vocabulary, so that no [n, V] tensor
#: is allocated (page faults of a fresh 100 MB tensor cost more than its arithmetic).
SOFTMAX_ROWS_FLOATS = 1 << 19


def _candidate_probs(logits: Tensor, temperature: Tensor, index: Tensor) -> Tensor:
    """softmax(logits / T) [n, V] at index [n, k] (temperature [n]), computed a few rows at a time: each row's
    softmax is the one a softmax of all rows at once gives it."""
    step = max(1, SOFTMAX_ROWS_FLOATS // logits.shape[-1])
    out = torch.empty(index.shape, device=logits.device)
    for i in range(0, len(logits), step):
        rows = slice(i, i + step)
        out[rows] = (logits[rows] / temperature[rows, None]).softmax(dim=-1).gather(-1, index[rows])
    return out


def _sample_candidates(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, position: Tensor, k: int,
    ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Draw from each row's k most probable tokens, where that is the same draw as over the whole vocabulary.

    logits [n, V], temperature / top_k / top_p / seed / position [n]. Returns (done [n] bool, tokens [n]): a row is
    done when every token its filters keep is a candidate, so the race below (noise keyed by token id, as in
    `sample_probs`, whose `ids` this takes too) picks what the full race would."""
    index = top_indices(logits, k)  # [n, k], most probable first
    p = _candidate_probs(logits, temperature, index)
    in_top_k = (top_k[:, None] == 0) | (torch.arange(k, device=p.device) < top_k[:, None])
    p = p * in_top_k
    k_fits = (top_k > 0) & (top_k <= k)  # the whole top-k support is here: renormalize over it
    p = p / torch.where(k_fits, p.sum(dim=-1), 1.0)[:, None]
    n_keep = ((p.cumsum(dim=-1) - p) < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_min(1)
    floor = torch.where(top_p[:, None] < 1, p.gather(-1, n_keep - 1), 0.0)  # [n, 1]
    # tokens beyond the candidates are no more probable than the last one
    done = k_fits | ((top_p < 1) & (top_k == 0) & (p[:, -1] < floor[:, 0]))
    kept = p.masked_fill(p < floor, 0.0)
    token = _token_of(index, ids)
    tokens = token.gather(-1, _race(kept[:, None], seed, position[:, None], token[:, None]))  # [n, 1]
    return done, tokens[:, 0]


def _sample_cpu(logits: Tensor, rows: RowParams, position: Tensor, ids: Tensor | None) -> Tensor:
    """`sample_tokens` for the sampled rows of a CPU batch: from each row's CPU_CANDIDATES most probable tokens where
    that is the whole draw (in one native operator where the kernels run, `kernels.sample`, which also races every token
    of a row of temperature alone; else `_candidate_draws`), the other rows on the full path.

    logits [B, q, V] -> [B, q]; greedy rows get token 0 (the caller puts their argmax there)."""
    B, q, V = logits.shape
    if kernels.samples(logits):
        tokens, done = kernels.sample(logits, rows.greedy, rows.temperature, rows.top_k, rows.top_p, rows.seed,
                                      position, ids, CPU_CANDIDATES)
        tokens, todo = tokens.view(-1), (~done).view(-1).nonzero()[:, 0]
    else:
        tokens, todo = _candidate_draws(logits, rows, position, ids)
    if len(todo):  # nuclei or supports wider than the candidates: the full path
        wide = rows.select(todo // q)
        pos = position.reshape(-1)[todo, None]
        drawn = sample_probs(probs_from_logits(logits.reshape(B * q, 1, V)[todo], wide), wide.seed, pos, ids)
        tokens[todo] = drawn[:, 0]
    return tokens.view(B, q)


def _candidate_draws(logits: Tensor, rows: RowParams, position: Tensor, ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """The candidate draws of `_sample_cpu` in torch's operators, CPU_CANDIDATES in turn: (tokens [B * q], the rows
    [n] left to the full path)."""
    B, q, V = logits.shape
    sampled = (~rows.greedy).repeat_interleave(q)  # [B * q]
    flat_logits = logits.reshape(B * q, V)
    todo = sampled.nonzero()[:, 0]
    logits_todo = flat_logits if len(todo) == B * q else flat_logits[todo]
    row_of = todo // q
    temperature, top_k, top_p, seed = (getattr(rows, name)[row_of] for name in ("temperature", "top_k", "top_p", "seed"))
    pos = position.reshape(-1)[todo]
    tokens = torch.zeros(B * q, dtype=torch.long, device=logits.device)
    for k in CPU_CANDIDATES:
        if not len(todo) or k >= V:
            break
        done, drawn = _sample_candidates(logits_todo, temperature, top_k, top_p, seed, pos, k, ids)
        tokens[todo[done]] = drawn[done]
        left = ~done
        todo, logits_todo = todo[left], logits_todo[left]
        temperature, top_k, top_p, seed, pos = temperature[left], top_k[left], top_p[left], seed[left], pos[left]
    return tokens, todo


def sample_tokens(logits: Tensor, rows: RowParams, position: Tensor, ids: Tensor | None = None) -> Tensor:
    """The tokens at sequence positions position [B, q] given logits [B, q, V] predicting them; ids [V]: the token
    id of each logit (None: its index), for a draft head over part of the vocabulary.

    On CPU the sampled rows take `_sample_cpu` (the same draws as the full path, most of them from a few dozen
    candidates); on CUDA the full path, whose sort is fast and which needs no per-row host checks."""
    if rows.all_greedy:
        return _token_of(argmax(logits), ids)
    if logits.device.type == "cpu":
        drawn = _sample_cpu(logits, rows, position, ids)
    else:
        drawn = sample_probs(probs_from_logits(logits, rows), rows.seed, position, ids)
    if not rows.any_greedy:
        return drawn
    return torch.where(rows.greedy[:, None], _token_of(argmax(logits), ids), drawn)

