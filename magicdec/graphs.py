"""CUDA graphs for the decode loop's forwards: each shape captured on first use, replayed after.

On a GPU a small model's forward is a few hundred kernels, and issuing them from Python costs more than running them
(on an H200 an eager Gemma 3 270M forward took ~10 ms at every batch size; `benchmarks/results/gpu_check_h200.json`).
A CUDA graph records a forward's kernels once and replays them with one launch (vLLM's and SGLang's decode path;
gpt-fast gets the same from `torch.compile(mode="reduce-overhead")`).

A replay repeats the captured kernels on the captured memory, so what changes between calls must live in tensors
that stay in place:

- the tokens and the `logits_at` indices are copied into static buffers of the graph;
- the cache's per-row state (lengths, positions, block tables, ring slots) are the runner's own tensors, updated in
  place between rounds, and a forward reads them on the device only;
- every shape is fixed per graph: the cache is in static mode (`KVCache.static`: attention spans the whole capacity,
  its mask built from the device lengths), and one graph serves one (model, head, cache, rows, tokens) combination.
  The rows are the scheduler's buckets (`scheduler.cuda_row_bucket`), so a few graphs serve every batch size.

Prefill chunks, forwards observed by SnapKV, ragged verifications (`model.Ragged`) and forwards of more tokens than
a verification's (a draft model catching up after plain rounds) run eagerly. A graph's logits are its output buffer,
and the graphs share one memory pool: the logits are valid until the next replay of any graph (the decode loop
samples from them before its next forward).
Graphs belong to one runner and its caches; `forget` drops those of a cache that goes (a drafter replaced).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

@dataclass
class Captured:
    """One captured forward: its graph, static inputs and output, and the cache view it was captured over (kept
    alive: the graph reads the view's tensors by address)."""

    graph: "torch.cuda.CUDAGraph"
    tokens: Tensor
    logits_at: Tensor | None
    out: Tensor
    cache: object = field(repr=False)


class CudaGraphs:
    """The captured forwards of one runner, keyed by model, head, cache and shape, of up to `max_tokens` tokens a row
    (a verification's longest); all in one memory pool."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, Captured | None] = {}  # None: capture failed, that shape runs eagerly
        self.capture_s = 0.0
        self.memory_bytes = 0

    @property
    def count(self) -> int:
        return sum(g is not None for g in self.graphs.values())

    def forget(self, cache) -> None:
        """Drop the graphs captured over `cache` (it is going away: a new drafter takes its place)."""
        ptr = cache.lens.data_ptr()
        self.graphs = {key: g for key, g in self.graphs.items() if key[2] != ptr}

    def wrap(self, model: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """`model`'s forward, replayed from a graph where one serves the call (see the module), else eager."""
        def forward(tokens: Tensor, cache, logits_at: Tensor | None = None, observer=None, head=None,
                    shares=None, ragged=None) -> Tensor:
            if (observer is not None or shares is not None or ragged is not None or not cache.static
                    or tokens.shape[1] > self.max_tokens):
                return model(tokens, cache, logits_at, observer, head, shares, ragged)
            key = (id(model), id(head), cache.lens.data_ptr(), tuple(tokens.shape),
                   None if logits_at is None else tuple(logits_at.shape))
            if key not in self.graphs:
                self.graphs[key] = self._capture(model, tokens, cache, logits_at, head)
            captured = self.graphs[key]
            if captured is None:
                return model(tokens, cache, logits_at, observer, head)
            captured.tokens.copy_(tokens)
            if logits_at is not None:
                captured.logits_at.copy_(logits_at)
            captured.graph.replay()
            return captured.out

        return forward

    def _capture(self, model, tokens: Tensor, cache, logits_at: Tensor | None, head) -> Captured | None:
        """Capture the forward with these inputs. The warm-up forward before it (Triton's compilation, lazy
        initializations) runs on the real inputs and writes the same K/V the replay that follows writes again."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        tokens, logits_at = tokens.clone(), None if logits_at is None else logits_at.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(tokens, cache, logits_at, None, head)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(tokens, cache, logits_at, None, head)
        except RuntimeError as e:  # an operation that cannot be captured: this shape stays eager
            warnings.warn(f"CUDA graph capture failed for {tuple(tokens.shape)} tokens, running it eagerly: {e}",
                          stacklevel=3)
            return None
        self.capture_s += time.perf_counter() - start
        self.memory_bytes += torch.cuda.memory_reserved() - before
        return Captured(graph, tokens, logits_at, out, cache)
