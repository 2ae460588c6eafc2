"""Prefill and the decode loop: plain autoregressive, or speculative with a drafter.

One loop serves both: a speculative round drafts gamma tokens, verifies them in one target forward of
gamma+1 tokens and commits each sequence's accepted prefix plus one; autoregressive decoding is the
same round with no drafter (one target forward of one token). Everything per sequence lives in
tensors [B, ...]; Python sees the batch once per round (to learn which sequences finished).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.kv import KVCache
from magicdec.kv.sparse import SnapKVObserver
from magicdec.memory import check_fits, peak_bytes
from magicdec.model import AttentionObserver, Transformer
from magicdec.sampling import SamplingParams, next_tokens
from magicdec.verify import verify_greedy, verify_sampling

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}

ProgressFn = Callable[[int, int], None]  # (done, total) units of prefill work


@dataclass
class SequenceOutput:
    token_ids: list[int]
    finish_reason: str
    accepted_hist: list[int] = field(default_factory=list)  # verify steps by number of drafts accepted


@dataclass
class GenerationStats:
    """Totals of one `generate` call. Times are wall-clock seconds."""

    batch: int
    prompt_tokens: int
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    steps: int = 0  # decode rounds (target forwards after prefill)
    gamma: int = 0  # the largest draft length of the run
    accepted_hist: list[int] = field(default_factory=list)  # verify steps (per sequence) by accepted count
    drafted_tokens: int = 0
    gamma_changes: list[tuple[int, int]] = field(default_factory=list)  # (round, gamma from then on)
    peak_memory_bytes: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token of each sequence comes from the prefill logits, not from a decode step
        return (self.generated_tokens - self.batch) / self.decode_s if self.decode_s else 0.0

    @property
    def verify_steps(self) -> int:
        return sum(self.accepted_hist)

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verify step and sequence."""
        n = self.verify_steps
        return sum(i * c for i, c in enumerate(self.accepted_hist)) / n if n else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted."""
        accepted = sum(i * c for i, c in enumerate(self.accepted_hist))
        return accepted / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per verify step and sequence (accepted + 1)."""
        return self.mean_accepted + 1 if self.gamma else 1.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        for k in ("prefill_tok_s", "decode_tok_s", "mean_accepted", "acceptance_rate", "tokens_per_step"):
            d[k] = getattr(self, k)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Left-aligned token matrix [B, T_max] (padding 0) and lengths [B]."""
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    tokens = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return tokens.to(device), lens.to(device)


#: Prefill runs the last OBSERVATION_WINDOW tokens of every prompt as one final aligned forward, so
#: SnapKV can observe their attention and every decode path computes the prompt's K/V identically.
OBSERVATION_WINDOW = 32


@torch.inference_mode()
def prefill(
    model: Transformer,
    cache: KVCache,
    tokens: Tensor,  # [B, T]
    lens: Tensor,  # [B]
    chunk: int,
    progress: ProgressFn | None = None,
    observer: AttentionObserver | None = None,
) -> Tensor:
    """Run prompts through the model in chunks of `chunk` tokens; return each row's last logits [B, V].

    Rows of different lengths share each chunk; a row's padding is written past its length and never
    committed, so it is invisible to every later query. The last `tail` tokens of every row go last, in
    one forward where each row has exactly `tail` real tokens; `observer` sees that forward's attention.
    """
    B, T = tokens.shape
    tail = min(OBSERVATION_WINDOW, int(lens.min()))
    head = lens - tail
    T_head = int(head.max())
    for start in range(0, T_head, chunk):
        end = min(start + chunk, T_head)
        model(tokens[:, start:end], cache, logits_at=torch.zeros(B, 1, dtype=torch.long, device=tokens.device))
        cache.commit((head - start).clamp(0, end - start))
        if progress is not None:
            progress(end, T)
    tail_tokens = tokens.gather(1, head[:, None] + torch.arange(tail, device=tokens.device))
    at = torch.full((B, 1), tail - 1, dtype=torch.long, device=tokens.device)
    logits = model(tail_tokens, cache, logits_at=at, observer=observer)[:, 0]
    cache.commit(tail)
    if progress is not None:
        progress(T, T)
    return logits


class _Outputs:
    """Per-sequence output buffers on the device, and the rules that end a sequence."""

    def __init__(self, B: int, params: SamplingParams, eos_ids: Sequence[int], slack: int, device):
        self.params = params
        self.tokens = torch.zeros(B, params.max_tokens + slack, dtype=torch.long, device=device)
        self.length = torch.zeros(B, dtype=torch.long, device=device)
        self.finish = torch.zeros(B, dtype=torch.long, device=device)
        self.eos = torch.tensor(list(eos_ids) if not params.ignore_eos else [], dtype=torch.long, device=device)

    def emit(self, new: Tensor, count: Tensor) -> None:
        """Append the first count[b] tokens of new [B, k] to each row, stopping at EOS and max_tokens."""
        B, k = new.shape
        idx = torch.arange(k, device=new.device)
        valid = idx < count[:, None]
        is_eos = torch.isin(new, self.eos) & valid
        upto_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, k)
        room = self.params.max_tokens - self.length
        keep = torch.minimum(torch.minimum(count, upto_eos), room)
        keep = torch.where(self.finish > 0, 0, keep)
        self.tokens.scatter_(1, self.length[:, None] + idx, new)
        self.length += keep
        hit_eos = (is_eos & (idx < keep[:, None])).any(1)
        running = self.finish == 0
        self.finish = torch.where(running & hit_eos, FINISH_STOP, self.finish)
        self.finish = torch.where(
            (self.finish == 0) & (self.length >= self.params.max_tokens), FINISH_LENGTH, self.finish
        )

    def select_rows(self, rows: Tensor) -> None:
        self.tokens = self.tokens.index_select(0, rows)
        self.length = self.length.index_select(0, rows)
        self.finish = self.finish.index_select(0, rows)


class StopStrings:
    """Host-side stop-string detection (only used when the request has stop strings)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode

    def first_stop(self, ids: list[int]) -> int | None:
        """Smallest number of tokens whose text contains a stop string, or None."""
        if not any(s in self.decode(ids) for s in self.stops):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.decode(ids[:mid]) for s in self.stops):
                hi = mid
            else:
                lo = mid + 1
        return lo


def workspace_bytes(model: Transformer, batch: int, chunk: int) -> int:
    """Peak activations of a prefill chunk: hidden states, the fused q/k/v and gate/up outputs, logits."""
    cfg = model.cfg
    element = torch.empty((), dtype=model.dtype).element_size()
    per_token = 4 * cfg.dim + (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.ffn_dim
    return batch * (chunk * per_token * element + cfg.vocab_size * 4 * (MAX_GAMMA + 1))


@dataclass
class Prefilled:
    """Prompts run through the target: its cache (rows at prompt length) and each row's last logits."""

    tokens: Tensor  # [B, T] prompts, left-aligned, zero-padded
    lens: Tensor  # [B]
    cache: KVCache
    logits: Tensor  # [B, V]
    observer: SnapKVObserver | None  # attention of the prompts' last tokens, when asked for
    seconds: float

    @property
    def batch(self) -> int:
        return len(self.lens)

    def tile(self, times: int) -> "Prefilled":
        """This batch repeated `times` times (row i of the result is row i % batch): the decode work of a
        batch `times` larger for one prefill (benchmarks use it to reach large batches affordably).
        The result has a cache of its own; this one is left as it is."""
        rows = torch.arange(self.batch, device=self.lens.device).repeat(times)
        cache = copy.copy(self.cache)
        cache.select_rows(rows)  # rebinds the copy's tensors to new, tiled ones
        observer = None
        if self.observer is not None:
            observer = SnapKVObserver(len(self.observer.scores))
            observer.scores = [s.index_select(0, rows) for s in self.observer.scores]
        return Prefilled(self.tokens[rows], self.lens[rows], cache, self.logits[rows], observer, self.seconds)


#: Most tokens a round can add beyond max_tokens (gamma drafts + 1); caches get this much slack.
MAX_GAMMA = 16
#: Rounds between calls of a re-planner (`decode(replan=...)`).
REPLAN_EVERY = 16
#: A re-planner: (live sequences, their mean context length) -> the draft length for the next rounds
#: (0: decode plainly from here on).
Replanner = Callable[[int, int], int]


@torch.inference_mode()
def prefill_prompts(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    kv_dtype: torch.dtype | None = None,
    chunk: int = 512,
    observe: bool = False,
    progress: ProgressFn | None = None,
) -> Prefilled:
    """Allocate the target cache (after checking it fits) and prefill the prompts into it."""
    device = model.device
    tokens, lens = pad_prompts(prompts, device)
    kv_dtype = kv_dtype or model.dtype
    B = len(prompts)
    capacity = tokens.shape[1] + max_new_tokens + MAX_GAMMA + 2
    check_fits(KVCache.nbytes(model.cfg, B, capacity, kv_dtype) + workspace_bytes(model, B, chunk), device,
               f"batch {B} x {capacity} tokens (KV cache and prefill workspace)")
    cache = KVCache(model.cfg, B, capacity, kv_dtype, device)
    observer = SnapKVObserver(model.cfg.n_layers) if observe else None
    t0 = time.perf_counter()
    logits = prefill(model, cache, tokens, lens, chunk, progress, observer)
    _sync(device)
    return Prefilled(tokens, lens, cache, logits, observer, time.perf_counter() - t0)


@torch.inference_mode()
def generate_ids(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_ids: Sequence[int],
    *,
    drafter: Drafter | None = None,
    gamma: int = 0,
    kv_dtype: torch.dtype | None = None,
    prefill_chunk: int = 512,
    stop_strings: StopStrings | None = None,
    progress: ProgressFn | None = None,
    replan: Replanner | None = None,
) -> tuple[list[SequenceOutput], GenerationStats]:
    """Prefill and decode a batch of token-id prompts; speculative when a drafter is given."""
    observe = drafter is not None and drafter.needs_target_attention
    pre = prefill_prompts(
        model, prompts, params.max_tokens, kv_dtype=kv_dtype, chunk=prefill_chunk, observe=observe, progress=progress
    )
    return decode(model, pre, params, eos_ids, drafter=drafter, gamma=gamma, stop_strings=stop_strings,
                  prefill_chunk=prefill_chunk, replan=replan)


@torch.inference_mode()
def decode(
    model: Transformer,
    pre: Prefilled,
    params: SamplingParams,
    eos_ids: Sequence[int],
    *,
    drafter: Drafter | None = None,
    gamma: int = 0,
    stop_strings: StopStrings | None = None,
    prefill_chunk: int = 512,
    reuse: bool = False,
    replan: Replanner | None = None,
) -> tuple[list[SequenceOutput], GenerationStats]:
    """Decode from prefilled prompts. With `reuse`, the target cache is rolled back to the prompts at
    the end (and finished rows are never dropped), so the same `pre` can be decoded again.

    With a drafter, `gamma` tokens are drafted per round, up to the drafter's own gamma. `replan`, if
    given, sets the draft length (at most drafter.gamma) in the first round and every REPLAN_EVERY
    rounds after, from the live batch size and mean context, which shrink and grow as the run goes
    on; a draft length of 0 ends speculation for the rest of the run. Outputs do not depend on it."""
    device = model.device
    gamma = gamma if drafter is not None else 0
    if gamma > MAX_GAMMA:
        raise ValueError(f"gamma {gamma} > {MAX_GAMMA}")
    if drafter is not None and gamma > drafter.gamma:
        raise ValueError(f"gamma {gamma} exceeds the drafter's gamma {drafter.gamma} (its cache slack)")
    B, cache = pre.batch, pre.cache
    max_gamma = drafter.gamma if replan is not None and drafter is not None else gamma
    stats = GenerationStats(batch=B, prompt_tokens=int(pre.lens.sum()), gamma=max_gamma,
                            accepted_hist=[0] * (max_gamma + 1))
    stats.prefill_s = pre.seconds
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    last = next_tokens(pre.logits, params, generator)  # [B] the token after each prompt
    if drafter is not None:
        t0 = time.perf_counter()
        drafter.prefill(pre.tokens, pre.lens, cache, pre.observer, last, prefill_chunk)
        _sync(device)
        stats.prefill_s += time.perf_counter() - t0

    out = _Outputs(B, params, eos_ids, max_gamma + 2, device)
    out.emit(last[:, None], torch.ones_like(last))
    rows = torch.arange(B, device=device)  # original index of each active row
    results: list[SequenceOutput | None] = [None] * B
    seq_hist = torch.zeros(B, max_gamma + 1, dtype=torch.long, device=device)  # per sequence accepted counts

    t_decode = time.perf_counter()
    while True:
        finish = out.finish.tolist()  # the one host sync per round
        if stop_strings is not None:
            _apply_stop_strings(out, finish, stop_strings)
        n_done = sum(f != FINISH_NONE for f in finish)
        # Dropping finished rows copies the caches, so do it only once enough rows have finished;
        # until then they ride along and commit nothing.
        if n_done == len(finish) or (4 * n_done >= len(finish) and not reuse):
            _collect(out, rows, finish, results, seq_hist)
            if n_done == len(finish):
                break
            keep = torch.tensor([i for i, f in enumerate(finish) if f == FINISH_NONE], device=device)
            rows, last = rows[keep], last[keep]
            out.select_rows(keep)
            cache.select_rows(keep)
            if drafter is not None:
                drafter.select_rows(keep)
        live = (out.finish == FINISH_NONE).long()
        if replan is not None and drafter is not None and stats.steps % REPLAN_EVERY == 0:
            n_live = len(finish) - n_done
            context = int((cache.lens * live).sum()) // n_live
            new_gamma = min(drafter.gamma, replan(n_live, context))
            if new_gamma < 1:
                # plain decoding is predicted faster from here on: drop the drafter (its cache would
                # fall behind, so there is no switching back)
                drafter, gamma = None, 0
                stats.gamma_changes.append((stats.steps, 0))
            elif new_gamma != gamma or not stats.gamma_changes:
                gamma = new_gamma
                stats.gamma_changes.append((stats.steps, gamma))
        stats.steps += 1
        if drafter is None:
            logits = model(last[:, None], cache)[:, 0]
            cache.commit(live if n_done else 1)
            last = next_tokens(logits, params, generator)
            out.emit(last[:, None], torch.ones_like(last))
            continue
        t = time.perf_counter()
        stats.drafted_tokens += gamma * (len(finish) - n_done)
        draft, draft_probs = drafter.propose(gamma, params, generator)
        _sync(device)
        stats.draft_s += time.perf_counter() - t
        t = time.perf_counter()
        target_logits = model(torch.cat((last[:, None], draft), dim=1), cache)  # [B, gamma+1, V]
        if params.greedy:
            n, nxt = verify_greedy(target_logits, draft)
        else:
            n, nxt = verify_sampling(target_logits, draft, draft_probs, params, generator)
        cache.commit((n + 1) * live)
        _sync(device)
        stats.verify_s += time.perf_counter() - t
        drafter.accept(n, nxt, live)
        out.emit(torch.cat((draft, nxt[:, None]), dim=1).scatter(1, n[:, None], nxt[:, None]), n + 1)
        seq_hist[rows, n] += live
        last = nxt
    _sync(device)
    stats.decode_s = time.perf_counter() - t_decode
    if reuse:
        cache.truncate(pre.lens)
    stats.accepted_hist = seq_hist.sum(0).tolist()
    stats.generated_tokens = sum(len(r.token_ids) for r in results)
    stats.peak_memory_bytes = peak_bytes(device)
    return results, stats


def _apply_stop_strings(out: _Outputs, finish: list[int], stops: StopStrings) -> None:
    """End rows whose text now contains a stop string, keeping the tokens up to the one completing it."""
    lengths = out.length.tolist()
    for i, f in enumerate(finish):  # rows that just hit EOS too: a stop string may come earlier
        n = stops.first_stop(out.tokens[i, : lengths[i]].tolist())
        if n is not None:
            out.length[i] = n
            out.finish[i] = FINISH_STOP
            finish[i] = FINISH_STOP


def _collect(out: _Outputs, rows: Tensor, finish: list[int], results: list, seq_hist: Tensor) -> None:
    lengths = out.length.tolist()
    for i, (r, f) in enumerate(zip(rows.tolist(), finish)):
        if f != FINISH_NONE and results[r] is None:
            ids = out.tokens[i, : lengths[i]].tolist()
            results[r] = SequenceOutput(ids, FINISH_NAMES[f], seq_hist[r].tolist())
