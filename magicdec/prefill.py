"""Prompt prefill of one cache row, in chunks that a scheduler can interleave with decoding.

A prompt of T tokens runs as chunks of at most `chunk` tokens over its first T - tail tokens, then its last `tail`
(OBSERVATION_WINDOW) tokens as one final forward. The split depends on T alone (and on where a cached prefix ends:
the chunks after it keep the boundaries at multiples of `chunk`), so a prompt's K/V are computed alike whatever else
the engine runs, and the final forward is the one whose attention SnapKV observes to select which prompt tokens a
sparse draft cache keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.kv import KVCache
from magicdec.model import AttentionObserver, Transformer

#: Tokens of the final prefill forward (SnapKV's observation window).
OBSERVATION_WINDOW = 32


def prefill_chunks(n_tokens: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    """The (start, end) forwards that prefill a prompt of n_tokens tokens from token `start` on (the first ones
    came from the prefix cache; start <= n_tokens - OBSERVATION_WINDOW), the observation window last."""
    head = n_tokens - min(OBSERVATION_WINDOW, n_tokens)
    bounds = [start, *range((start // chunk + 1) * chunk, head, chunk), head]
    return [(s, e) for s, e in zip(bounds, bounds[1:]) if e > s] + [(head, n_tokens)]


def cacheable_prefix(n_tokens: int) -> int:
    """Most leading tokens of a prompt that may come from the prefix cache: the observation window is always
    computed (its forward gives the last logits and SnapKV's observation)."""
    return max(0, n_tokens - OBSERVATION_WINDOW)


@torch.inference_mode()
def prefill_chunk(
    model: Transformer,
    row: KVCache,  # one row (a view of a slot)
    prompt: Tensor,  # [T]
    start: int,
    end: int,
    observer: AttentionObserver | None = None,
    every: bool = False,
) -> Tensor:
    """Run prompt[start:end] through the model into `row` and commit it; return the last logits [1, V], or with
    `every` the logits of every position [end - start, V] (for the prompt's log-probabilities)."""
    if start == 0:
        row.clear()
    at = None if every else torch.full((1, 1), end - start - 1, dtype=torch.long, device=prompt.device)
    logits = model(prompt[None, start:end], row, logits_at=at, observer=observer)[0]
    row.commit(end - start)
    return logits


def prefill_upto(model: Transformer, row: KVCache, prompt: Tensor, end: int,
                 observer: AttentionObserver | None = None, every: bool = False) -> Tensor | None:
    """Bring `row` (one row, holding the prompt's first tokens from a prefix cache or earlier chunks) up to
    prompt[:end] in one forward; return the last logits [1, V] (`every`: every computed position's, as
    `prefill_chunk` does), or None where the row held them all already. A target and a draft model prefill the same
    chunks this way, each computing only what its own row lacks."""
    start = row.max_len
    return prefill_chunk(model, row, prompt, start, end, observer, every) if start < end else None


def prefill_row(model: Transformer, row: KVCache, prompt: Tensor, chunk: int,
                observer: AttentionObserver | None = None) -> Tensor:
    """Prefill a whole prompt into the empty `row` in the chunks an engine runs; `observer` sees the final forward.
    Returns the last logits [1, V]."""
    row.clear()
    for start, end in prefill_chunks(len(prompt), chunk):
        logits = prefill_chunk(model, row, prompt, start, end, observer if end == len(prompt) else None)
    return logits
