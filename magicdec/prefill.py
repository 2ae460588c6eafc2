"""Prompt prefill of one cache row, in chunks that a scheduler can interleave with decoding.

A prompt of T tokens runs as chunks of at most `chunk` tokens over its first T - tail tokens, then its last `tail`
(OBSERVATION_WINDOW) tokens as one final forward. The split depends on T alone, so a prompt's K/V are computed
identically whatever else the engine runs, and the final forward is the one whose attention SnapKV observes to select
which prompt tokens a sparse draft cache keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.kv import KVCache
from magicdec.model import AttentionObserver, Transformer

#: Tokens of the final prefill forward (SnapKV's observation window).
OBSERVATION_WINDOW = 32


def prefill_chunks(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The (start, end) forwards that prefill a prompt of n_tokens tokens, the observation window last."""
    tail = min(OBSERVATION_WINDOW, n_tokens)
    head = n_tokens - tail
    return [(s, min(s + chunk, head)) for s in range(0, head, chunk)] + [(head, n_tokens)]


@torch.inference_mode()
def prefill_chunk(
    model: Transformer,
    row: KVCache,  # one row (a view of a slot)
    prompt: Tensor,  # [T]
    start: int,
    end: int,
    observer: AttentionObserver | None = None,
) -> Tensor:
    """Run prompt[start:end] through the model into `row` and commit it; return the last logits [1, V]."""
    if start == 0:
        row.clear()
    at = torch.full((1, 1), end - start - 1, dtype=torch.long, device=prompt.device)
    logits = model(prompt[None, start:end], row, logits_at=at, observer=observer)[:, 0]
    row.commit(end - start)
    return logits


def prefill_row(model: Transformer, row: KVCache, prompt: Tensor, chunk: int,
                observer: AttentionObserver | None = None) -> Tensor:
    """Prefill a whole prompt into `row`; `observer` sees the final forward. Returns the last logits [1, V]."""
    for start, end in prefill_chunks(len(prompt), chunk):
        logits = prefill_chunk(model, row, prompt, start, end, observer if end == len(prompt) else None)
    return logits
