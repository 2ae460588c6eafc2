"""The KV cache shared by dense and sparse variants.

Storage is one tensor per K and V for all layers, [n_layers, B, KV, capacity, hd], so that a rollback, a row
selection or a sliding-window eviction is one tensor op for the whole model.

Each row (sequence) has its own `lens` (slots filled) and `next_pos` (absolute position of its next token). New
tokens are written at slots lens..lens+q-1; nothing is kept until `commit` says how many of them each row accepts, so
a rollback is simply committing fewer. Slots past `lens` may hold stale data; the attention mask never lets a query
see them.

The serving engine keeps one row per request slot. `head(n)` (the first n rows) and `row(i)` are views sharing the
storage and the per-row state, so a forward over the running slots or a prefill into one slot writes straight into
the cache; every change of per-row state is therefore made in place.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from magicdec import kernels
from magicdec.config import ModelConfig
from magicdec.kv import quant


class KVCache:
    """A dense KV cache with per-sequence lengths (slot index == token position)."""

    #: per-row state tensors ([B, ...]): what a row view slices and a moved row takes along
    PER_ROW: tuple[str, ...] = ("lens", "next_pos")
    #: whether storage is [layers, rows, ...] (a row view slices it); False where rows read shared blocks
    ROWS_IN_STORAGE = True
    #: whether every forward attends over the whole capacity (shapes fixed, the lengths read on the device only), so
    #: that a CUDA graph captured once replays at any length (`magicdec.graphs`); else over the filled prefix
    static = False

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.cfg = cfg
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, quant.row_width(dtype, cfg.head_dim))
        self.k = torch.zeros(shape, dtype=quant.storage_dtype(dtype), device=device)
        self.v = torch.zeros(shape, dtype=quant.storage_dtype(dtype), device=device)
        self.capacity = capacity
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = 0  # host-side upper bound of lens, so attention reads only the filled prefix
        self._slots: Tensor | None = None  # slots being written by the current forward, [B, q]
        self._rows = torch.arange(batch, device=device)[:, None]  # [B, 1], pairs with _slots
        self._row_table: Tensor | None = None  # int32 [B, 1] where the rows are some of the storage's (`take`)
        # where torch's operators attend on CPU, over the whole buffer once half of it is filled (`attended_slots`)
        self._whole_buffer = (self.device.type == "cpu"
                              and not kernels.attends(self.device, dtype, cfg.head_dim))

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes a cache of this shape allocates (used to plan memory before allocating)."""
        element = quant.element_bytes(dtype, cfg.head_dim)
        return batch * capacity * cfg.kv_bytes_per_token(element)

    @property
    def batch(self) -> int:
        return self.lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def entries_read(self) -> Tensor:
        """[B] cached entries each row's next forward attends to (what `--phases` prices a forward by)."""
        return self.lens

    def _arange(self, q: int) -> Tensor:
        return torch.arange(q, device=self.device)

    # --- what the model calls, once per forward -------------------------------------------------
    def rope_positions(self, q: int) -> Tensor:
        """Positions [B, q] by which the new tokens' queries and keys are rotated."""
        return self.next_pos[:, None] + self._arange(q)

    def attn_mask(self, q: int) -> Tensor:
        """[B, 1, q, L] visibility of cache slots for the q new tokens (causal, per-row lengths)."""
        if self.max_len + q > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.max_len + q} slots > capacity {self.capacity}")
        self._slots = self.lens[:, None] + self._arange(q)  # [B, q]
        L = self.attended_slots(q)
        return self._arange(L)[None, None, None, :] <= self._slots[:, None, :, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write new k, v [B, KV, q, hd] at each row's next slots (`quant.store`); return K, V [B, KV, L, row] to
        attend and no block table (see `magicdec.kv.paged`), or for rows taken from a larger cache (`take`) its whole
        storage and the table of their rows in it."""
        q = k.shape[2]
        kc, vc = self.k[layer], self.v[layer]
        # index_put_ on the [B, slot, KV, hd] view: scatter_ into fp16/bf16 copies the whole tensor on CPU
        index = (self._rows, self._slots)
        kc.transpose(1, 2).index_put_(index, quant.store(k.transpose(1, 2), kc.dtype))
        vc.transpose(1, 2).index_put_(index, quant.store(v.transpose(1, 2), vc.dtype))
        if self._row_table is not None:  # rows of a larger storage: each one block of a pool, read in place
            return kc, vc, self._row_table
        L = self.attended_slots(q)
        return kc[:, :, :L], vc[:, :, :L], None

    def locate(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Where positions of rows (broadcast together) live: the indices of dims 1 and 3 of `k`."""
        return rows, positions

    def attended_slots(self, q: int) -> int:
        """How many leading slots a forward of q new tokens attends over (the rest are never filled).

        Where torch's operators attend on CPU, every slot once the filled prefix reaches half the capacity: a prefix
        of each row is a strided view, which the matmuls (and SDPA) copy before multiplying, while the whole buffer is
        contiguous; reading it costs at most twice the bytes and saves that copy, which made decode steps faster in
        bf16 and in fp32 (`git show e3fc202:benchmarks/README.md`, "Whole buffers"). The unfilled slots are masked. The
        native kernel reads the prefix view as it is: a prefill chunk past half a 32k cache attended over all of it,
        and checking the unfilled tiles cost a sixth of Gemma 3's global attention (24.0 s of a 32k prefill, 20.0
        without)."""
        n = self.max_len + q
        return self.capacity if self.static or self._whole_buffer and 2 * n >= self.capacity else n

    # --- what the engine calls -------------------------------------------------------------------
    def commit(self, n: Tensor | int) -> None:
        """Keep the first n[b] tokens written by the last forward in each row b (n may be 0)."""
        self.lens += n
        self.next_pos += n
        if isinstance(n, int):
            self.max_len += n
        else:
            self.max_len = int(self.lens.max())

    def truncate(self, lens: Tensor) -> None:
        """Roll each row back to `lens` [B] slots (dropping its newest entries)."""
        self.next_pos -= self.lens - lens
        self.lens.copy_(lens)
        self.max_len = int(self.lens.max())

    def evict(self) -> None:
        """Keep the cache within its budget: a dense cache keeps every entry (a sparse one slides its window)."""

    def clear(self) -> None:
        """Empty every row (a slot handed to a new request)."""
        self.lens.zero_()
        self.next_pos.zero_()
        self.max_len = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Make row dst a copy of row src (a request moving to another slot)."""
        n = self._filled_slots(src)
        if n:
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        for name in self.PER_ROW:
            per_row = getattr(self, name)
            per_row[dst] = per_row[src]

    def _filled_slots(self, row: int) -> int:
        """Leading slots that hold row's entries (slot == position here)."""
        return int(self.lens[row])

    def head(self, n: int) -> "KVCache":
        """A view of the first n rows."""
        return self._view(slice(0, n))

    def row(self, i: int) -> "KVCache":
        """A view of row i alone."""
        return self._view(slice(i, i + 1))

    def take(self, index: Tensor) -> "KVCache | None":
        """The rows at `index` [m] as a cache of their own for the next forwards, their per-row state copied (`put`
        writes it back) and their K/V read and written in place: a forward over some rows alone (the rows still
        drafting, `Drafter.propose`). None where forwards replay graphs captured over whole heads of rows."""
        return None if self.static else self._view(index)

    def put(self, index: Tensor, part: "KVCache") -> None:
        """Take back the per-row state of `part`, the rows `take(index)` gave."""
        for name in self.PER_ROW:
            getattr(self, name)[index] = getattr(part, name)
        self.max_len = max(self.max_len, part.max_len)

    def _view(self, rows: slice | Tensor) -> "KVCache":
        """The rows of a slice (views of the per-row state: changes are the cache's) or at an index (copies of it).
        Rows at an index keep the storage they own where it is: written at their rows of it, and read through a table
        of those rows (a copy of 16 rows of Gemma 3's sliding-layer rings would be 250 MB)."""
        view = copy.copy(self)
        for name in self.PER_ROW:
            setattr(view, name, getattr(self, name)[rows])
        if self.ROWS_IN_STORAGE and (isinstance(rows, Tensor) or self._row_table is not None):
            view._rows = self._rows[rows]  # of the whole storage, however many views down
            view._row_table = view._rows.to(torch.int32)
        else:
            if self.ROWS_IN_STORAGE:
                view.k, view.v = self.k[:, rows], self.v[:, rows]
            view._rows = torch.arange(view.lens.shape[0], device=self.device)[:, None]
        view.max_len = int(view.lens.max()) if view.lens.numel() else 0
        return view
