"""A standalone draft model's prefix cache: the K/V of its prompts' full blocks, kept across requests and copied into
a draft cache row on a hit.

A draft model keeps a dense row per slot (or a sparse cache cut from a dense staging row), not the target's block pool
(`magicdec.kv.blocks`); its blocks are keyed as the target's are (`block_keys`), so the scheduler matches a prompt
against both with the same keys. A hit copies the blocks into the row and prefills only the rest; the blocks of a
prompt are stored when its prefill ends. Blocks are evicted least recently used first, the last blocks of a chain
before its first ones, and never while a request that matched them waits to copy them. The pool holds at most
`max_bytes`.

A hit is exact: a block's K/V are what a prefill of the same prefix computes (bit for bit on the native kernels,
whose rows do not depend on how tokens are grouped into forwards; to fp32 rounding on torch's operators).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv import quant
from magicdec.kv.base import KVCache
from magicdec.kv.blocks import BLOCK_SIZE, block_keys


class Block(NamedTuple):
    """One block's K/V, [layers, KV, BLOCK_SIZE, hd]."""

    k: Tensor
    v: Tensor


class PrefixCache:
    """A bytes-bounded pool of K/V blocks (one model's layers and KV heads, in the cache dtype), LRU-evicted.

    `match` finds a prompt's longest cached prefix (and pins its blocks), `load` copies the pinned blocks into a
    cache row (and unpins them), `store` keeps a row's full blocks. A pool of 0 bytes is off: nothing matches,
    nothing is stored."""

    def __init__(self, cfg: ModelConfig, max_bytes: int, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        element = quant.element_bytes(dtype, cfg.head_dim)
        self.block_bytes = BLOCK_SIZE * cfg.kv_bytes_per_token(element)
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.pinned: dict[bytes, int] = {}  # key -> requests that matched it and have not copied it yet

    @property
    def capacity(self) -> int:
        """Blocks the pool holds at most."""
        return self.max_bytes // self.block_bytes

    # --- lookups -------------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], n_tokens: int) -> list[bytes]:
        """The longest cached prefix of the chain `keys` (of a prompt of `n_tokens` tokens), pinned until `load`
        copies it."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        found = list(keys[:n])
        self._touch(found)
        for key in found:
            self.pinned[key] = self.pinned.get(key, 0) + 1
        return found

    def load(self, keys: Sequence[bytes], row: KVCache) -> None:
        """Fill the empty cache row `row` (a one-row view) with the matched blocks `keys` and unpin them."""
        for i, key in enumerate(keys):  # block by block into the row: no concatenated copy in between
            block = self.blocks[key]
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            row.k[:, 0, :, span] = block.k
            row.v[:, 0, :, span] = block.v
        if keys:
            row.commit(len(keys) * BLOCK_SIZE)
        self.unpin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """The request that matched `keys` copied them (or will not): they may be evicted again."""
        for key in keys:
            if self.pinned[key] == 1:
                del self.pinned[key]
            else:
                self.pinned[key] -= 1

    def store(self, tokens: Sequence[int], row: KVCache) -> None:
        """Keep the full blocks of `tokens`, whose K/V the one-row view `row` holds in its leading slots. Blocks already
        cached are only touched; a chain longer than the pool keeps its first blocks."""
        keys = block_keys(tokens)[: self.capacity]
        self._touch([key for key in keys if key in self.blocks])
        protect = set(keys)
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            if not self._evict(protect):
                break  # every other block is pinned
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            self.blocks[key] = Block(row.k[:, 0, :, span].clone(), row.v[:, 0, :, span].clone())
        self._touch(keys)

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a chain recently used, its first block most recently: eviction takes a chain's tail first."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def _evict(self, protect: set[bytes]) -> bool:
        """Drop least recently used blocks, neither pinned nor in `protect`, until one more fits; False if none can
        go."""
        while len(self.blocks) >= self.capacity:
            victim = next((k for k in self.blocks if k not in self.pinned and k not in protect), None)
            if victim is None:
                return False
            del self.blocks[victim]
        return True
