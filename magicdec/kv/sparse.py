"""Fixed-budget sparse KV caches for drafting: StreamingLLM (sink + sliding window) and SnapKV.

Both keep `budget` slots per sequence: a fixed prefix (`keep` slots: the attention sinks for
StreamingLLM, the SnapKV-selected prompt tokens for SnapKV) followed by a window of the most recent
tokens that slides as generation proceeds, so the draft's cost never grows with the context.

Positions: with `reindex=True` (StreamingLLM's choice) a key in slot j is rotated as position j, so
the draft sees a contiguous sequence 0..budget-1; with `reindex=False` keys keep the rotation of their
original position. Because RoPE rotations compose, moving a key from position a to b is one more
rotation by b - a (`rotate_keys`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv.base import KVCache
from magicdec.model import apply_rope, rope_cos_sin

#: StreamingLLM's attention sinks: the first few tokens take a large share of attention in every layer.
DEFAULT_SINK = 4
#: SnapKV's pooling kernel over the observation scores (clusters neighbouring important tokens).
SNAPKV_KERNEL = 7


def rotate_keys(k: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Move RoPE-rotated keys k [..., hd] by delta positions (delta broadcasts to k.shape[:-1])."""
    cos, sin = rope_cos_sin(inv_freq, delta, torch.float32)
    return apply_rope(k.float(), cos, sin).to(k.dtype)


class SparseKVCache(KVCache):
    """A KV cache of `budget` slots (+ `slack` for tokens in flight) that evicts its oldest window entries."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        budget: int,
        keep: int,
        slack: int,
        dtype: torch.dtype,
        device: torch.device | str,
        reindex: bool,
        inv_freq: Tensor,
    ):
        if not 0 <= keep < budget:
            raise ValueError(f"the fixed prefix ({keep}) must be smaller than the budget ({budget})")
        super().__init__(cfg, batch, budget + slack, dtype, device)
        self.budget, self.keep, self.reindex = budget, keep, reindex
        self.inv_freq = inv_freq

    def load_slots(self, src: KVCache, index: Tensor, n: Tensor) -> None:
        """Fill from src: slot j of row b takes src slot index[l, b, h, j] ([L|1, B, KV|1, budget]).

        n [B] is the number of valid slots per row. src must hold keys rotated by absolute position.
        """
        L, B, KV, _, hd = src.k.shape
        idx = index.expand(L, B, KV, -1)
        K = idx.shape[-1]
        gidx = idx[..., None].expand(L, B, KV, K, hd)
        k = src.k.gather(3, gidx).to(self.k.dtype)
        if self.reindex:
            k = rotate_keys(k, torch.arange(K, device=idx.device) - idx, self.inv_freq)
        self.k[:, :, :, :K] = k
        self.v[:, :, :, :K] = src.v.gather(3, gidx).to(self.v.dtype)
        self.lens = n.clone()
        self.next_pos = src.next_pos.clone()
        self.max_len = int(n.max())

    def evict(self) -> None:
        """Slide each row's window so that it holds at most `budget` slots (oldest non-prefix go first)."""
        if self.max_len <= self.budget:
            return
        shift = (self.lens - self.budget).clamp_min(0)  # [B]
        W = self.budget - self.keep
        # window slot keep + j takes the entry at keep + j + shift; the fixed prefix stays in place
        src = self.keep + torch.arange(W, device=self.device)[None, :] + shift[:, None]  # [B, W]
        L, B, KV, _, hd = self.k.shape
        gidx = src[None, :, None, :, None].expand(L, B, KV, W, hd)
        k = self.k.gather(3, gidx)
        if self.reindex:
            k = rotate_keys(k, -shift[None, :, None, None], self.inv_freq)
        self.v[:, :, :, self.keep : self.budget] = self.v.gather(3, gidx)
        self.k[:, :, :, self.keep : self.budget] = k
        self.lens = self.lens - shift
        self.max_len = min(self.max_len, self.budget)


def streaming_index(lens: Tensor, budget: int, sink: int) -> Tensor:
    """Slots kept by StreamingLLM for rows of lengths lens [B]: [1, B, 1, budget]."""
    j = torch.arange(budget, device=lens.device)[None, :]
    shift = (lens - budget).clamp_min(0)[:, None]
    return torch.where(j < sink, j, j + shift)[None, :, None, :]


class SnapKVObserver:
    """Collects, per layer, how much attention the observation queries pay to each prompt position."""

    def __init__(self, n_layers: int):
        self.scores: list[Tensor | None] = [None] * n_layers

    def __call__(self, layer: int, xq: Tensor, keys: Tensor, mask: Tensor) -> None:
        B, H, q, hd = xq.shape
        KV = keys.shape[1]
        G = H // KV
        qg = xq.reshape(B, KV, G * q, hd).to(keys.dtype)
        att = (qg @ keys.transpose(-1, -2)).float() / hd**0.5  # [B, KV, G*q, L]
        att = att.masked_fill(~mask.repeat(1, 1, G, 1), float("-inf")).softmax(dim=-1)
        self.scores[layer] = att.sum(dim=2)  # [B, KV, L]: summed over the group's heads and queries


def snapkv_index(observer: SnapKVObserver, lens: Tensor, budget: int, window: int) -> Tensor:
    """Per layer and KV head: the top budget-window prompt slots by pooled score, then the last window.

    Returns [L, B, KV, budget] slot indices, each row's selected prefix in ascending order. Rows whose
    prompt fits in the budget keep every slot.
    """
    scores = torch.stack(observer.scores)  # [L, B, KV, S]
    L, B, KV, S = scores.shape
    if int(lens.max()) <= budget:
        return torch.arange(budget, device=lens.device)[None, None, None, :]
    pos = torch.arange(S, device=lens.device)
    selectable = pos[None, :] < (lens - window)[:, None]  # [B, S]: prompt before the observation window
    scores = scores.masked_fill(~selectable[None, :, None, :], 0.0)  # pool over the prefix only, as SnapKV
    pooled = torch.nn.functional.max_pool1d(
        scores.reshape(-1, 1, S), SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2
    ).reshape(L, B, KV, S)
    pooled = pooled.masked_fill(~selectable[None, :, None, :], float("-inf"))
    n_select = budget - window
    top = pooled.topk(min(n_select, S), dim=-1).indices.sort(dim=-1).values  # [L, B, KV, n_select]
    j = torch.arange(window, device=lens.device)
    recent = (lens[:, None] - window + j)[None, :, None, :].expand(L, B, KV, window)
    index = torch.cat((top, recent), dim=-1)
    short = (lens <= budget)[None, :, None, None]
    return torch.where(short, torch.arange(budget, device=lens.device), index)


SPARSE_KINDS = ("streaming", "snapkv")


def snapkv_window(budget: int) -> int:
    """Recent tokens a SnapKV cache keeps (and slides); the rest of its budget is selected prompt tokens."""
    return min(32, budget // 2)


def compress(
    dense: KVCache,
    kind: str,
    budget: int,
    reindex: bool,
    slack: int,
    inv_freq: Tensor,
    observer: SnapKVObserver | None = None,
) -> SparseKVCache:
    """A sparse cache holding the `budget` entries of `dense` that `kind` keeps, for every row."""
    lens = dense.lens
    if kind == "streaming":
        keep = min(DEFAULT_SINK, budget - 1)
        index = streaming_index(lens, budget, keep)
    elif kind == "snapkv":
        if observer is None or observer.scores[0] is None:
            raise ValueError("a SnapKV cache needs the attention observed during prefill")
        window = snapkv_window(budget)
        keep = budget - window
        index = snapkv_index(observer, lens, budget, window)
    else:
        raise ValueError(f"unknown sparse cache kind {kind!r}; choose from {SPARSE_KINDS}")
    cache = SparseKVCache(dense.cfg, dense.batch, budget, keep, slack, dense.k.dtype, dense.device, reindex, inv_freq)
    cache.load_slots(dense, index.clamp_max(dense.capacity - 1), lens.clamp_max(budget))
    return cache
