"""Self-speculation over the whole context at 4 bits: the target's own weights reading its K/V rounded to 4 bits."""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.drafters.base import SelfDrafter
from magicdec.kv import KVCache
from magicdec.kv.blocks import KVManager
from magicdec.kv.hybrid import HybridCache, global_config
from magicdec.kv.lowbit import LowBitKVCache
from magicdec.kv.quant import INT8
from magicdec.kv.sparse import SnapKVObserver


class SelfQuantDrafter(SelfDrafter):
    """Drafts with the target model over every cached token, each K/V row rounded to 4 bits (`magicdec.kv.lowbit`).
    A slot's rows are copied from the target's cache once it holds the whole prompt (then catching up as every
    `SelfDrafter` does); a hybrid model's global layers alone keep 4-bit rows."""

    name = "self-quant"

    def allocate(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 target: KVCache | None = None, kv: KVManager | None = None) -> None:
        rows = LowBitKVCache(global_config(self.model.cfg), slots, capacity + self.slack, device)
        self.cache = self._over_target(rows, target)

    def cache_bytes(self, slots: int, capacity: int, dtype: torch.dtype) -> int:
        return KVCache.nbytes(global_config(self.model.cfg), slots, capacity + self.slack, INT8)

    def prefill(self, slot: int, prompt: Tensor, end: int, target: KVCache, observer: SnapKVObserver | None) -> None:
        if end < len(prompt):  # the rows are copied once the target's row holds the whole prompt (and its key mean)
            return
        row = self.cache.row(slot)
        if isinstance(row, HybridCache):
            row, target = row.full, target.full
        row.append_from(target, torch.tensor([end], device=row.device), torch.ones(1, dtype=torch.bool,
                                                                                 device=row.device))
