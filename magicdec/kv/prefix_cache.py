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

A hybrid-attention model (`magicdec.kv.hybrid`) keeps its sliding-window layers' K/V in a ring of the last few hundred
positions, so a block stores the global layers' K/V always and the sliding layers' only where the ring still held
the block when it was stored (the tail of a prompt, or of a finished chat turn). A hit must end where the window
before it is known: its last `window_blocks` blocks carry the sliding K/V, which `load` writes into the slot's ring.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from magicdec.config import GLOBAL, SLIDING, ModelConfig
from magicdec.kv.base import KVCache
from magicdec.kv.hybrid import HybridCache, WindowKVCache

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


class Block(NamedTuple):
    """One block's K/V, [layers, KV, BLOCK_SIZE, hd]: every layer's, or a hybrid model's global layers' with its
    sliding layers' beside them (`window`: (K, V), None where the ring no longer held the block)."""

    k: Tensor
    v: Tensor
    window: tuple[Tensor, Tensor] | None = None


def _parts(row: KVCache | HybridCache) -> tuple[KVCache, WindowKVCache | None]:
    """The cache of the layers a block always stores, and a hybrid model's sliding-layer ring (None otherwise)."""
    return (row.full, row.window) if isinstance(row, HybridCache) else (row, None)


class PrefixCache:
    """A bytes-bounded pool of K/V blocks (one model's layers and KV heads, in the cache dtype), LRU-evicted.

    `match` finds a prompt's longest cached prefix (and pins its blocks), `load` copies the pinned blocks into a
    cache row (and unpins them), `store` keeps a row's full blocks. `queries` and `hits` count prompt tokens looked
    up and found, as vLLM's counters do. A pool of 0 bytes is off: nothing matches, nothing is stored."""

    def __init__(self, cfg: ModelConfig, max_bytes: int, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self.block_bytes = self.bytes_for(cfg, BLOCK_SIZE, dtype)  # a block without sliding K/V
        self.window_bytes = self.bytes_for(cfg, 0, dtype, BLOCK_SIZE)  # a block's sliding K/V (0: not hybrid)
        #: blocks before a hit's end that must carry sliding K/V: those holding the window of the first query after it
        self.window_blocks = -(-(cfg.sliding_window - 1) // BLOCK_SIZE) if cfg.hybrid else 0
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.pinned: dict[bytes, int] = {}  # key -> requests that matched it and have not copied it yet
        self.nbytes = 0
        self.queries = self.hits = 0

    @staticmethod
    def bytes_for(cfg: ModelConfig, tokens: int, dtype: torch.dtype, window_tokens: int = 0) -> int:
        """Bytes of a pool that holds `tokens` tokens' blocks, `window_tokens` of them with a hybrid model's sliding
        K/V (whole blocks: both rounded up)."""
        element = torch.empty((), dtype=dtype).element_size()
        blocks = -(-tokens // BLOCK_SIZE) * BLOCK_SIZE * cfg.kv_bytes_per_token(element, GLOBAL)
        return blocks + -(-window_tokens // BLOCK_SIZE) * BLOCK_SIZE * cfg.kv_bytes_per_token(element, SLIDING)

    @property
    def enabled(self) -> bool:
        return self.max_bytes >= self.block_bytes

    @property
    def capacity(self) -> int:
        """Blocks the pool holds at most."""
        return self.max_bytes // self.block_bytes

    @property
    def growth_bytes(self) -> int:
        """Bytes the pool may still allocate (what a memory check must leave it)."""
        return max(0, self.max_bytes - self.nbytes)

    def clear(self) -> None:
        """Drop every unpinned block (a cold start, as a benchmark measuring prefill wants)."""
        for key in [k for k in self.blocks if k not in self.pinned]:
            self._drop(key)

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
        """How many of `keys` (a chain) lead a cached prefix that a hit may cover; nothing is touched or counted."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        while n:  # a hybrid model's hit ends after blocks that carry the window before it
            bare = [i for i in range(max(0, n - self.window_blocks), n) if self.blocks[keys[i]].window is None]
            if not bare:
                break
            n = bare[-1]
        return n

    def load(self, keys: Sequence[bytes], row: KVCache | HybridCache) -> None:
        """Fill the empty cache row `row` (a one-row view) with the matched blocks `keys` and unpin them."""
        full, ring = _parts(row)
        for i, key in enumerate(keys):  # block by block into the row: no concatenated copy in between
            block = self.blocks[key]
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            full.k[:, 0, :, span] = block.k
            full.v[:, 0, :, span] = block.v
        n = len(keys) * BLOCK_SIZE
        if ring is not None and n:
            self._load_window(keys, ring, n)
        if keys:
            row.commit(n)
        self.unpin(keys)

    def _load_window(self, keys: Sequence[bytes], ring: WindowKVCache, n: int) -> None:
        """Write the sliding K/V of the window before position n (what its query sees) into the ring's slots."""
        first = max(0, n - (self.cfg.sliding_window - 1))
        for i in range(first // BLOCK_SIZE, len(keys)):
            k, v = self.blocks[keys[i]].window
            pos = torch.arange(max(first, i * BLOCK_SIZE), (i + 1) * BLOCK_SIZE, device=ring.device)
            slots, offsets = pos % ring.capacity, pos - i * BLOCK_SIZE
            ring.k[:, 0].index_copy_(2, slots, k.index_select(2, offsets))
            ring.v[:, 0].index_copy_(2, slots, v.index_select(2, offsets))
            ring.hold(pos)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """The request that matched `keys` copied them (or will not): they may be evicted again."""
        for key in keys:
            if self.pinned[key] == 1:
                del self.pinned[key]
            else:
                self.pinned[key] -= 1

    def store(self, tokens: Sequence[int], row: KVCache | HybridCache) -> None:
        """Keep the full blocks of `tokens`, whose K/V the one-row view `row` holds in its leading slots (a hybrid
        model's sliding K/V where its ring holds them: a cached block without them takes them on). Blocks already
        cached are only touched; a chain longer than the pool keeps its first blocks."""
        if not self.enabled:
            return
        keys = block_keys(tokens)[: self.capacity]
        full, ring = _parts(row)
        held = self._held(ring, len(keys))
        self._touch([key for key in keys if key in self.blocks])
        protect = set(keys)
        for i, key in enumerate(keys):
            block = self.blocks.get(key)
            window = held[i] and (block is None or block.window is None)
            if block is not None and not window:
                continue
            size = (self.block_bytes if block is None else 0) + (self.window_bytes if window else 0)
            if not self._evict(size, protect):
                keys = keys[:i]  # every other block is pinned
                break
            span = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            if block is None:
                block = Block(full.k[:, 0, :, span].clone(), full.v[:, 0, :, span].clone())
            if window:
                slots = torch.arange(span.start, span.stop, device=ring.device) % ring.capacity
                block = block._replace(window=(ring.k[:, 0].index_select(2, slots), ring.v[:, 0].index_select(2, slots)))
            self.blocks[key] = block
            self.nbytes += size
        self._touch(keys)

    @staticmethod
    def _held(ring: WindowKVCache | None, n_blocks: int) -> list[bool]:
        """For each of the row's first n_blocks blocks: whether the sliding-layer ring holds all of its positions."""
        if ring is None:
            return [False] * n_blocks
        pos = torch.arange(n_blocks * BLOCK_SIZE, device=ring.device)
        return (ring.slot_pos[0, pos % ring.capacity] == pos).view(n_blocks, BLOCK_SIZE).all(1).tolist()

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
            self._drop(victim)
        return True

    def _drop(self, key: bytes) -> None:
        block = self.blocks.pop(key)
        self.nbytes -= self.block_bytes + (self.window_bytes if block.window is not None else 0)
