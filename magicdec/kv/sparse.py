"""Fixed-budget sparse KV caches for drafting: StreamingLLM (sink + sliding window) and SnapKV.

Both keep `budget` slots per sequence: a fixed prefix (`keep` slots: the attention sinks for StreamingLLM, the
SnapKV-selected prompt tokens for SnapKV) followed by a window of the most recent tokens that slides as generation
proceeds, so the draft's cost never grows with the context.

Positions: with `reindex=True` (StreamingLLM's choice) the draft sees its cache as one contiguous sequence, the
prefix directly followed by the window; with `reindex=False` every key keeps the rotation of its original position.
RoPE scores depend only on the distance between query and key, and the window is contiguous in the original
positions, so re-indexing needs no rotation of the window at all: queries and window keys keep their original
positions, and only the prefix keys are rotated to sit just before the window's first position (`rotate_keys`:
rotations compose, moving a key from position a to b is one more rotation by b - a). Sliding the window by s then
moves the prefix by s too: a rotation of `keep` entries, not of the whole cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv import quant
from magicdec.kv.base import KVCache
from magicdec.kv.blocks import BLOCK_SIZE, blocks_for
from magicdec.kv.paged import PagedKVCache
from magicdec.model import apply_rope, attention_bias, rope_cos_sin

#: StreamingLLM's attention sinks: the first few tokens take a large share of attention in every layer.
DEFAULT_SINK = 4
#: SnapKV's pooling kernel over the observation scores (clusters neighbouring important tokens).
SNAPKV_KERNEL = 7


def rotate_keys(k: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Move RoPE-rotated cached keys k [..., row] by delta positions (delta broadcasts to k.shape[:-1])."""
    cos, sin = rope_cos_sin(inv_freq, delta, torch.float32)
    return quant.store(apply_rope(quant.load(k, torch.float32), cos, sin), k.dtype)


class SparseKVCache(PagedKVCache):
    """A KV cache of `budget` entries (+ `slack` for tokens in flight) whose window slides without copies.

    Layout per row: slots [0, keep) hold the fixed prefix; slots [keep, capacity) are a ring holding the window,
    position t in slot keep + (t - keep) mod ring. `slot_pos` records the position held by each slot (set by
    `attn_mask` for the tokens a forward is about to write) and the mask shows a query the prefix plus the window
    entries in [win_start, its position]. Sliding the window is advancing `win_start`; nothing moves (and with
    `reindex`, only the `keep` prefix keys are rotated). `lens` counts the entries a row currently holds (prefix +
    window).

    The slots lie in blocks of the KV pool `k`, `v` [layers, blocks, KV, BLOCK_SIZE, row] (the target's, or a draft
    model's share of it): slot s of row b in block `tables[b, s // BLOCK_SIZE]`. A request's `blocks_for(capacity)`
    blocks are taken from the pool when it is admitted and given back with its others (`KVManager.take_draft`), so a
    sparse draft's memory is held by the requests running, not reserved for every slot; the runner maps them
    (`set_blocks`) and unmaps a released row."""

    PER_ROW = PagedKVCache.PER_ROW + ("slot_pos", "win_start", "n_prefix")

    def __init__(self, cfg: ModelConfig, k: Tensor, v: Tensor, batch: int, budget: int, keep: int, slack: int,
                 reindex: bool, inv_freq: Tensor):
        if not 0 <= keep < budget:
            raise ValueError(f"the fixed prefix ({keep}) must be smaller than the budget ({budget})")
        super().__init__(cfg, k, v, batch, blocks_for(budget + slack))
        self.capacity = budget + slack  # the ring's slots: the last block's tail is never written
        self.budget, self.keep, self.reindex = budget, keep, reindex
        self.ring = self.capacity - keep
        self.inv_freq = inv_freq
        device = k.device
        self._rows = torch.arange(batch, device=device)[:, None]
        self.slot_pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)
        self.win_start = torch.zeros(batch, dtype=torch.long, device=device)
        self.n_prefix = torch.zeros(batch, dtype=torch.long, device=device)

    @staticmethod
    def blocks_per_row(budget: int, slack: int) -> int:
        """Pool blocks a row of this budget and slack takes."""
        return blocks_for(budget + slack)

    @staticmethod
    def state_bytes(rows: int, budget: int, slack: int) -> int:
        """Bytes of the rows' own state beside the pool's blocks: each slot's position (int64) and the tables."""
        return rows * ((budget + slack) * 8 + blocks_for(budget + slack) * 4)

    def _where(self, rows: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(block, offset) of slots of rows (broadcast together): indices of dims 1 and 3 of `k`."""
        return self.tables[rows, slots // BLOCK_SIZE].long(), slots % BLOCK_SIZE

    def _slots_of(self, positions: Tensor) -> Tensor:
        return self.keep + (positions - self.keep) % self.ring

    def attn_mask(self, q: int) -> Tensor:
        """[B, 1, q, capacity]: the prefix, and window entries from win_start up to each query."""
        qpos = self.next_pos[:, None] + self._arange(q)  # [B, q]
        slots = self._slots_of(qpos)
        self._write, self._table = self._where(self._rows, slots), self.tables
        self.slot_pos.scatter_(1, slots, qpos)
        pos = self.slot_pos[:, None, :]  # [B, 1, C]
        in_prefix = (self._arange(self.capacity) < self.keep)[None, None, :]
        held = (pos >= 0) & (in_prefix | (pos >= self.win_start[:, None, None]))
        return (held & (pos <= qpos[:, :, None]))[:, None]

    def load_slots(self, src: KVCache, index: Tensor, n: Tensor) -> None:
        """Fill from src: entry j of row b is src slot index[l, b, h, j] ([L|1, B, KV|1, budget]).

        Entries [0, keep) form the prefix, the rest the window; n [B] is the number of valid entries per row. src
        must hold keys rotated by absolute position (slot == position); the window part of `index` must be the row's
        last positions, in order."""
        L, KV = src.k.shape[0], src.k.shape[2]
        B, K = src.lens.shape[0], index.shape[-1]
        valid = torch.arange(K, device=index.device)[None, :] < n[:, None]  # [B, K]
        # entries past a short row's end stand at its next position, whose ring slot no held entry uses
        idx = torch.where(valid[None, :, None, :], index, src.next_pos[None, :, None, None]).expand(L, B, KV, -1)
        window_pos = idx[0, :, 0, self.keep :]  # [B, K - keep], the same for all layers and heads
        dest = torch.cat((torch.arange(self.keep, device=idx.device).expand(B, -1), self._slots_of(window_pos)), 1)
        dev = idx.device
        rows = torch.arange(B, device=dev)[None, :, None, None]
        block, offset = src.locate(rows, idx.clamp_max(src.capacity - 1))  # [L, B, KV, K] each
        layer, head = torch.arange(L, device=dev)[:, None, None, None], torch.arange(KV, device=dev)[None, None, :, None]
        to_block, to_offset = self._where(rows[0, :, :, 0], dest)  # [B, K] each
        to = (layer, to_block[None, :, None, :], head, to_offset[None, :, None, :])
        self.k.index_put_(to, src.k[layer, block, head, offset].to(self.k.dtype))
        self.v.index_put_(to, src.v[layer, block, head, offset].to(self.v.dtype))
        self.slot_pos.fill_(-1).scatter_(1, dest, torch.where(valid, idx[0, :, 0], -1))
        self.win_start.copy_(torch.minimum(window_pos[:, 0], src.next_pos))  # a prompt shorter than keep: its end
        self.lens.copy_(n)
        self.next_pos.copy_(src.next_pos)
        self.max_len = self.capacity  # attention always spans the whole (small) buffer
        self.n_prefix.copy_(n.clamp_max(self.keep))  # a prompt shorter than keep leaves the prefix partly empty
        if self.reindex and self.keep:
            # prefix entry j moves to the position just before the window: win_start - n_prefix + j
            target = self.win_start[:, None] - self.n_prefix[:, None] + torch.arange(self.keep, device=idx.device)
            self._rotate_prefix((target[None, :, None, :] - idx[..., : self.keep]))

    def append_from(self, src: KVCache, end: Tensor, rows: Tensor) -> None:
        """Append src's entries at positions [next_pos, end) to the windows of the rows where rows [B] is set, then
        slide the windows to their budget; only the latest budget - keep of them are copied (the rest would slide
        out). src must hold keys rotated by absolute position (slot == position)."""
        count = torch.where(rows, end - self.next_pos, 0).clamp_min(0)  # [B]
        q = min(int(count.max()), self.budget - self.keep)
        if q == 0:
            return
        pos = end[:, None] - q + self._arange(q)  # [B, q]: each row's last q positions before end
        b, j = (rows[:, None] & (pos >= self.next_pos[:, None])).nonzero(as_tuple=True)
        p = pos[b, j]
        slots = self._slots_of(p)
        block, offset = src.locate(b, p)
        to_block, to_offset = self._where(b, slots)
        self.k[:, to_block, :, to_offset] = src.k[:, block, :, offset].to(self.k.dtype)
        self.v[:, to_block, :, to_offset] = src.v[:, block, :, offset].to(self.v.dtype)
        self.slot_pos[b, slots] = p
        self.commit(count)
        self.evict()

    def held(self, row: int) -> tuple[Tensor, Tensor]:
        """(slots, positions) of the entries row `row` holds: the prefix, then the window in order."""
        pos = self.slot_pos[row]
        slots = torch.arange(self.capacity, device=pos.device)
        prefix = (slots < self.keep) & (pos >= 0)
        window = (slots >= self.keep) & (pos >= self.win_start[row]) & (pos < self.next_pos[row])
        w = slots[window][pos[window].argsort()]
        return torch.cat((slots[prefix], w)), torch.cat((pos[prefix], pos[w]))

    def _rotate_prefix(self, delta: Tensor) -> None:
        """Rotate every row's prefix keys by delta (broadcasting to [layers, B, KV, keep]), a block of the prefix at a
        time: slots [0, keep) are the leading slots of each row's first blocks, so each is one index along the pool's
        blocks (the per-slot gather of the whole prefix made SnapKV rounds 1.3x slower)."""
        delta = delta.expand(*delta.shape[:-1], self.keep)
        for first in range(0, self.keep, BLOCK_SIZE):
            n = min(BLOCK_SIZE, self.keep - first)
            blocks = self.tables[:, first // BLOCK_SIZE].long()  # [B]
            part = self.k[:, blocks, :, :n]  # [layers, B, KV, n, row]
            self.k[:, blocks, :, :n] = rotate_keys(part, delta[..., first : first + n], self.inv_freq)

    def commit(self, n: Tensor | int) -> None:
        self.lens += n
        self.next_pos += n

    def truncate(self, lens: Tensor) -> None:
        self.next_pos -= self.lens - lens
        self.lens.copy_(lens)

    def evict(self) -> None:
        """Slide each row's window so that it holds at most budget - keep entries."""
        shift = (self.next_pos - self.win_start - (self.budget - self.keep)).clamp_min(0)  # [B]
        self.win_start += shift
        self.lens -= shift
        if self.reindex and self.keep:
            self._rotate_prefix(shift[None, :, None, None])

    def clear(self) -> None:
        super().clear()
        self.slot_pos.fill_(-1)
        self.win_start.zero_()  # a stale window start would hide every entry from a new query
        self.n_prefix.zero_()
        self.max_len = self.capacity

    def _view(self, rows: slice | Tensor) -> "SparseKVCache":
        view = super()._view(rows)
        view.max_len = self.capacity
        return view


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
        att = (qg @ keys.transpose(-1, -2)).float()  # [B, KV, G*q, L]
        # masked in place by adding -inf, broadcast over the group's heads: a tenth of the time of a broadcast
        # masked_fill_, a quarter of the observation's time with a repeated mask and out-of-place steps
        att.view(B, KV, G, q, -1).add_(attention_bias(mask, 1, att.dtype)[:, :, None])
        self.scores[layer] = att.div_(hd**0.5).softmax(dim=-1).sum(dim=2)  # [B, KV, L]: summed over heads, queries


def snapkv_index(observer: SnapKVObserver, lens: Tensor, budget: int, window: int) -> Tensor:
    """Per layer and KV head: the top budget-window prompt slots by pooled score, then the last window.

    Returns [L, B, KV, budget] slot indices, each row's selected prefix in ascending order. Rows whose prompt fits in
    the budget keep every slot."""
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


def prefix_size(kind: str, budget: int) -> int:
    """Entries of a sparse cache's fixed prefix: StreamingLLM's sinks, or SnapKV's selected prompt tokens."""
    if kind == "streaming":
        return min(DEFAULT_SINK, budget - 1)
    if kind == "snapkv":
        return budget - snapkv_window(budget)
    raise ValueError(f"unknown sparse cache kind {kind!r}; choose from {SPARSE_KINDS}")


def compress_into(sparse: SparseKVCache, dense: KVCache, kind: str, observer: SnapKVObserver | None = None) -> None:
    """Fill every row of `sparse` (a view, typically one slot) with the entries of the same rows of `dense` that
    `kind` keeps; `observer` holds those rows' prefill attention (SnapKV)."""
    lens, budget = dense.lens, sparse.budget
    if kind == "streaming":
        index = streaming_index(lens, budget, sparse.keep)
    elif kind == "snapkv":
        if observer is None or observer.scores[0] is None:
            raise ValueError("a SnapKV cache needs the attention observed during prefill")
        index = snapkv_index(observer, lens, budget, budget - sparse.keep)
    else:
        raise ValueError(f"unknown sparse cache kind {kind!r}; choose from {SPARSE_KINDS}")
    sparse.load_slots(dense, index, lens.clamp_max(budget))
