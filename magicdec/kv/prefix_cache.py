"""Automatic prefix caching: the K/V of full token blocks, kept across requests and found by their prefix.

A sequence's tokens split into blocks of `BLOCK_SIZE`; block i is keyed by a hash chained over its token ids and the
key of block i - 1, so equal keys mean equal prefixes (vLLM's automatic prefix caching keys its blocks the same
way). A new request copies the blocks of its longest cached prefix into its cache row and prefills only the rest;
a request's blocks are stored when its prompt is prefilled and again when it finishes, generated tokens included,
so the next turn of a chat finds its whole history.

Storage is a copy into the request's slot row, not a block table over shared pages: the attention kernels and torch's
matmuls read each row as one contiguous range, and a copy of an 8k-token prefix is a fraction of a second against
the seconds to minutes of its prefill on a CPU. Blocks are evicted least recently used first, the
last blocks of a chain before its first ones (a chain's head serves every longer prefix), and never while a request
that matched them waits to copy them. The pool holds at most `max_bytes`; memory checks count what it may still
take.

A hit is exact: a block's K/V are what a prefill of the same prefix computes (bit for bit on the native kernels,
whose rows do not depend on how tokens are grouped into forwards; to fp32 rounding on torch's operators).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

import torch
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.kv.base import KVCache

#: Tokens per cached block: a hit is a whole number of blocks. Small enough that a chat's next turn reuses all but a
#: few tokens of its history, large enough that hashing and copying an 8k prefix is a few hundred small operations.
BLOCK_SIZE = 32


def block_keys(tokens: Sequence[int]) -> list[bytes]:
    """The chained keys of the full blocks of `tokens`: key i covers tokens [0, (i + 1) * BLOCK_SIZE)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hashlib.blake2b(parent + array("q", tokens[start : start + BLOCK_SIZE]).tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """A bytes-bounded pool of K/V blocks (one model's layers and KV heads, in the cache dtype), LRU-evicted.

    `match` finds a prompt's longest cached prefix (and pins its blocks), `load` copies the pinned blocks into a
    cache row (and unpins them), `store` keeps a row's full blocks. `queries` and `hits` count prompt tokens looked
    up and found, as vLLM's counters do. A pool of 0 bytes is off: nothing matches, nothing is stored."""

    def __init__(self, cfg: ModelConfig, max_bytes: int, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self.block_bytes = self.bytes_for(cfg, BLOCK_SIZE, dtype)
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, tuple[Tensor, Tensor]] = OrderedDict()  # key -> K, V [L, KV, BLOCK, hd]
        self.pinned: dict[bytes, int] = {}  # key -> requests that matched it and have not copied it yet
        self.queries = self.hits = 0

    @staticmethod
    def bytes_for(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of a pool that holds `tokens` tokens' blocks (whole blocks: `tokens` rounded up)."""
        element = torch.empty((), dtype=dtype).element_size()
        return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * cfg.kv_bytes_per_token(element)

    @property
    def enabled(self) -> bool:
        return self.max_bytes >= self.block_bytes

    @property
    def capacity(self) -> int:
        """Blocks the pool holds at most."""
        return self.max_bytes // self.block_bytes

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    @property
    def growth_bytes(self) -> int:
        """Bytes the pool may still allocate (what a memory check must leave it)."""
        return max(0, self.capacity * self.block_bytes - self.nbytes)

    def clear(self) -> None:
        """Drop every unpinned block (a cold start, as a benchmark measuring prefill wants)."""
        for key in [k for k in self.blocks if k not in self.pinned]:
            del self.blocks[key]

    def resize(self, max_bytes: int) -> None:
        """Hold at most `max_bytes` from now on (0: off), evicting least recently used blocks."""
        self.max_bytes = max_bytes
        self._evict(0)

    # --- lookups -------------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], n_tokens: int) -> list[bytes]:
        """The longest cached prefix of the chain `keys` (of a prompt of `n_tokens` tokens), pinned until `load`
        copies it; counts the query (n_tokens) and the hit."""
        found = list(keys[: self.cached_prefix(keys)])
        self._touch(found)
        for key in found:
            self.pinned[key] = self.pinned.get(key, 0) + 1
        self.queries += n_tokens
        self.hits += len(found) * BLOCK_SIZE
        return found

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain) lead a cached prefix; nothing is touched or counted."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def load(self, keys: Sequence[bytes], row: KVCache) -> None:
        """Fill the empty cache row `row` (a one-row view) with the matched blocks `keys` and unpin them."""
        for i, key in enumerate(keys):  # block by block into the row: no concatenated copy in between
            k, v = self.blocks[key]
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            row.k[:, 0, :, span] = k
            row.v[:, 0, :, span] = v
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
        """Keep the full blocks of `tokens`, whose K/V the one-row view `row` holds in its leading slots. Blocks
        already cached are only touched; a chain longer than the pool keeps its first blocks."""
        if not self.enabled:
            return
        keys = block_keys(tokens)[: self.capacity]
        self._touch([key for key in keys if key in self.blocks])
        protect = set(keys)
        for i, key in enumerate(keys):
            if key in self.blocks:
                continue
            if not self._evict(self.block_bytes, protect):
                keys = keys[:i]  # every other block is pinned
                break
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            self.blocks[key] = (row.k[:, 0, :, span].clone(), row.v[:, 0, :, span].clone())
        self._touch(keys)

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a chain recently used, its first block most recently: eviction takes a chain's tail first."""
        for key in reversed(keys):
            self.blocks.move_to_end(key)

    def _evict(self, room: int, protect: set[bytes] = frozenset()) -> bool:
        """Drop least recently used blocks, neither pinned nor in `protect`, until `room` more bytes fit; False if
        they cannot."""
        while self.nbytes + room > self.max_bytes:
            victim = next((k for k in self.blocks if k not in self.pinned and k not in protect), None)
            if victim is None:
                return False
            del self.blocks[victim]
        return True
