"""Query-aware sparse drafts (Vegas): a draft that reads, per layer, the entries the last verification attended to.

A verification forward attends over every cached position from its first token, the last one the target accepted;
the attention kernels leave each position's share of that token's attention, its query heads' probabilities summed
(`AttentionShares`, filled by `magicdec.model.attend`). After the round, `select` keeps per layer and row the `top`
positions of largest share (summed over the KV heads), token by token: blocks of 32 positions would give most of the
gain away (a block holds a few attended tokens among many others).

The draft then reads, in place in the target's block pool, per layer: the sink (the first positions), the selected
positions, the recent window and its own new tokens (`VegasKVCache`). Nothing is copied: each layer's table names
single positions of the pool (`magicdec.kernels.token_view`), keys keep the rotation of their own positions, and the
draft's tokens are written at the target's own next positions, which the verification forward writes again before
anything reads them as the target's. A row's selected positions all lie before its window (they were chosen before
`lens - window` at selection, and the window only moves on), so no position is read twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec import kernels
from magicdec.config import GLOBAL, ModelConfig
from magicdec.kv.blocks import BLOCK_SIZE, NULL_BLOCK
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.sparse import DEFAULT_SINK


def vegas_window(budget: int) -> int:
    """Recent positions a Vegas draft reads beside its sink and selection: an eighth of its budget."""
    return max(1, budget // 8)


def vegas_top(budget: int) -> int:
    """Positions a Vegas draft selects per layer: its budget less the sink and the window."""
    return budget - DEFAULT_SINK - vegas_window(budget)


class AttentionShares:
    """One forward's shares of token `row`'s attention over each cached position, per layer whose K/V grow with the
    context (a hybrid model's global layers): `buffer` hands the attention of such a layer an fp32 [B, KV, L] tensor
    to fill (see `magicdec.model.SharesRecorder`); `start` begins the next forward's. The storage is kept from forward
    to forward: one allocated for each verification (94 MB at SmolLM2 x 32 rows x 8k) was now and then faulted in
    afresh, and a verification's attention took up to a quarter longer."""

    row = 0  # the verification's first token: the last one the target accepted, always kept
    GROWTH = 1.25  # storage grown this much beyond the forward that outgrew it: the context grows every round

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.index = {layer: i for i, layer in enumerate(cfg.layers_of(GLOBAL))}
        self.device = device
        self.shares: Tensor | None = None  # [layers, B, KV, L], the current forward's, taken at its first layer's call
        self._storage = torch.empty(0, dtype=torch.float32, device=device)

    def start(self) -> None:
        """The next forward fills shares of its own shape."""
        self.shares = None

    def buffer(self, layer: int, shape: tuple[int, int, int]) -> Tensor | None:
        i = self.index.get(layer)
        if i is None:
            return None
        if self.shares is None:
            n = len(self.index) * shape[0] * shape[1] * shape[2]
            if self._storage.numel() < n:
                self._storage = torch.empty(int(n * self.GROWTH), dtype=torch.float32, device=self.device)
            self.shares = self._storage[:n].view(len(self.index), *shape)
        return self.shares[i]


def select(shares: Tensor, lens: Tensor, top: int, window: int) -> Tensor:
    """Per row and layer, the `top` positions of largest share (summed over the KV heads) among
    [DEFAULT_SINK, lens - window): [B, layers, top], ascending, -1 in the leading entries a short row cannot fill (as
    many in every layer). shares: [layers, B, KV, L]; lens [B]: the positions each row holds."""
    layers, B, KV, L = shares.shape
    if kernels.selects(shares):
        return kernels.top_positions(shares.view(layers * B, KV, L), lens - window, DEFAULT_SINK,
                                     top).view(layers, B, top).transpose(0, 1)
    pos = torch.arange(L, device=shares.device)
    selectable = (pos >= DEFAULT_SINK) & (pos < (lens - window)[:, None])  # [B, L]
    k = min(top, L)
    values, index = shares.sum(2).masked_fill_(~selectable, -1.0).topk(k, dim=-1)  # shares >= 0; ties: topk's order
    index = torch.where(values >= 0, index, -1)
    if k < top:
        index = torch.cat((index.new_full((*index.shape[:-1], top - k), -1), index), dim=-1)
    return index.sort(dim=-1).values.transpose(0, 1)


class VegasKVCache(PagedKVCache):
    """A draft's view of the target's pool (`target`: the target's `PagedKVCache`, whose block tables it shares):
    per layer, the sink, the row's `selected` positions, the window of the `window` positions before the forward's
    and the forward's own tokens, read through tables of single positions. `lens` / `next_pos` count the positions the
    draft takes as known; `writable` rows write their new K/V at the target's next positions (the others, idle or
    prefilling, into the null block: their next positions may hold the target's K/V)."""

    PER_ROW = PagedKVCache.PER_ROW + ("selected", "writable")

    def __init__(self, cfg: ModelConfig, target: PagedKVCache, top: int, window: int):
        super().__init__(cfg, target.k, target.v, target.batch, target.tables.shape[1], target.tables)
        self.top, self.window = top, window
        device = target.k.device
        self.selected = torch.full((target.batch, cfg.n_layers, top), -1, dtype=torch.long, device=device)
        self.writable = torch.zeros(target.batch, dtype=torch.bool, device=device)
        # each layer's pools as single positions: position p of block b is row b * step + p of a view
        self._views = [(kernels.token_view(k)[0], kernels.token_view(v)[0]) for k, v in zip(target.k, target.v)]
        self.step = kernels.token_view(target.k[0])[1]
        self._selection_tables: Tensor | None = None  # [layers, B, sink + top] int32, built by `follow` for a round
        self._token_tables: Tensor | None = None  # [layers, B, sink + top + window + q] int32, the current forward's

    @property
    def entries_read(self) -> Tensor:
        return self._held().sum(1)

    def _window(self) -> Tensor:
        """[B, window]: the positions of each row's window, the last `window` before its next one."""
        return self.next_pos[:, None] - self.window + self._arange(self.window)

    def _held(self) -> Tensor:
        """[B, sink + top + window]: which of the sink, the selection and the window hold a position of the row (every
        layer selects as many)."""
        n = self.next_pos[:, None]
        return torch.cat((self._arange(DEFAULT_SINK) < n, self.selected[:, 0] >= 0, self._window() >= DEFAULT_SINK), 1)

    def attn_mask(self, q: int) -> Tensor:
        """[B, 1, q, sink + top + window + q]: the sink, the selection and the window where they hold positions, and
        the new tokens causally; also builds each layer's table and the new tokens' (block, offset)."""
        n, B = self.next_pos, self.batch
        new = n[:, None] + self._arange(q)  # [B, q]
        sink = self._arange(DEFAULT_SINK).expand(B, -1)
        held = self._held()
        if self._selection_tables is None:
            self._selection_tables = self._flat(torch.cat((sink[:, None].expand(-1, self.cfg.n_layers, -1),
                                                           self.selected), 2)).transpose(0, 1)
        recent = self._flat(torch.cat((self._window(), new), 1))  # [B, window + q], the same in every layer
        self._token_tables = torch.cat((self._selection_tables, recent.expand(self.cfg.n_layers, -1, -1)), 2)
        block = self.tables.gather(1, new.clamp_max(self.capacity - 1) // BLOCK_SIZE).long()
        self._write = (torch.where(self.writable[:, None], block, NULL_BLOCK), new % BLOCK_SIZE)
        causal = self._arange(q)[:, None] >= self._arange(q)[None, :]  # [q, q]
        return torch.cat((held[:, None, :].expand(-1, q, -1), causal.expand(B, -1, -1)), 2)[:, None]

    def _flat(self, pos: Tensor) -> Tensor:
        """Rows of the token views (int32, the kernels' table dtype) of positions pos [B, ...] of each row; positions
        outside the row's read one they do not see."""
        pos = pos.clamp(0, self.capacity - 1)
        block = self.tables.gather(1, (pos // BLOCK_SIZE).view(self.batch, -1)).view(pos.shape)
        return (block * self.step + pos % BLOCK_SIZE).to(torch.int32)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write new k, v [B, KV, q, hd] at the writable rows' next positions of the target's pool; return the
        layer's pool as single positions and its table [B, sink + top + window + q]."""
        self._store(self.k[layer], self.v[layer], k, v)
        return *self._views[layer], self._token_tables[layer]

    def follow(self, known: Tensor, rows: Tensor) -> None:
        """A round starts: the rows where rows [B] is set know `known` [B] positions of the target's (its cache holds
        them): the next forward reads up to there and writes after; the other rows write nowhere. The sink's and the
        selection's tables are built once for the round's forwards."""
        self.lens.copy_(torch.where(rows, known, self.lens))
        self.next_pos.copy_(torch.where(rows, known, self.next_pos))
        self.writable.copy_(rows)
        self.max_len = int(self.lens.max()) if self.lens.numel() else 0
        self._selection_tables = None  # a new round: the selection may have changed since the last

    def _view(self, rows: slice | Tensor) -> "VegasKVCache":
        view = super()._view(rows)
        if self._selection_tables is not None:  # the round's tables, cut to the rows
            view._selection_tables = self._selection_tables[:, rows]
        return view

    def clear(self) -> None:
        super().clear()
        self.selected.fill_(-1)
        self.writable.zero_()
