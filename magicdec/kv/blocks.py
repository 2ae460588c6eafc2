"""KV memory in blocks, and the one manager that owns it (the shape of vLLM v1's `KVCacheManager` / `BlockPool`).

The target's K/V that grow with the context (every layer's, or a hybrid model's global layers') live in a pool of
fixed-size blocks of `BLOCK_SIZE` positions, [layers, blocks, KV heads, BLOCK_SIZE, head_dim] (the "HND" paged layout
FlashInfer reads). A request holds a list of blocks (its block table), allocated as it grows: each prefill chunk, and
each decode round's lookahead (the draft tokens and the target's own). Memory therefore goes by the tokens requests
hold, not by the longest request a server might see.

Prefix caching is block sharing. A block that fills is keyed by a hash chained over its tokens and its prefix's key
(`block_keys`), so equal keys mean equal prefixes; a new request whose prompt starts with cached blocks maps them into
its own table (reference counted, no K/V copied) and prefills only the rest. A full block is never written again (a
request writes at its length and beyond), so sharing needs no copy-on-write: hits are whole blocks, and the block a
request writes next is always its own. A block nobody holds keeps its K/V and key until the pool needs it: such
blocks are evicted least recently used first, a chain's last blocks before its first ones (its head serves every
longer prefix).

A hybrid model's sliding-window layers keep a ring per request slot (`magicdec.kv.hybrid`): the ring is the window,
a fixed size per running request whichever way it is stored, and blocks that leave the window would be freed and
allocated again every BLOCK_SIZE tokens. A hit needs those layers' K/V of the window before its end, which a ring
has overwritten by the time another request wants them: `WindowStore` keeps copies of the sliding K/V of the blocks a
ring still holds when a prompt's prefill ends and when a request finishes, and a hit ends where they are known.

The block with id 0 is never allocated: the rows of a forward that write nothing real (idle slots riding along)
write into it, and unused table entries point at it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from magicdec.config import GLOBAL, SLIDING, ModelConfig
from magicdec.kv import quant
from magicdec.memory import check_fits

if TYPE_CHECKING:
    from magicdec.model import Transformer

#: Positions per block: a prefix hit is a whole number of blocks. Small enough that a chat's next turn reuses all but
#: a few tokens of its history and a request wastes less than a block, a multiple of the native kernels' 16-position
#: tiles (a tile never crosses a block).
BLOCK_SIZE = 32
#: The block that idle rows write into and that unused table entries name; never allocated.
NULL_BLOCK = 0


def block_keys(tokens: Sequence[int], start: int = 0, parent: bytes = b"") -> list[bytes]:
    """The chained keys of the full blocks of `tokens` from block `start` on (`parent`: the key of block start - 1):
    key i covers tokens [0, (i + 1) * BLOCK_SIZE)."""
    keys = []
    for first in range(start * BLOCK_SIZE, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hashlib.blake2b(parent + array("q", tokens[first : first + BLOCK_SIZE]).tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // BLOCK_SIZE)


class BlockPool:
    """Which blocks are free, which are held (and by how many requests), and which hold a cached prefix block."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        # no key: dropped ones first (`_queue_free`), then those never used
        self.free_ids: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # held by no one but keyed; least recently used first
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free, or cached and held by no one)."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - 1 - self.num_free

    def take(self, n: int) -> list[int]:
        """n blocks for a request (held once); cached blocks nobody holds are evicted, least recently used first.
        Call only where num_free >= n."""
        out = []
        for _ in range(n):
            if self.free_ids:
                block = self.free_ids.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.by_key[self.key_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def hold(self, blocks: Sequence[int]) -> None:
        """Another request holds these cached blocks (a prefix hit)."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets its blocks go, last first: a keyed block stays cached (the chain's tail evicted first), any
        other is free (`_queue_free`)."""
        free = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    free.append(block)
        self._queue_free(free)

    def _queue_free(self, blocks: list[int]) -> None:
        """Queue blocks that hold nothing reusable ahead of those never used, in ascending order (runs stay runs for the
        next request): memory written before is taken again before memory never touched, whose first write faults in
        each of its pages (about 5 ms a block of SmolLM2 on a VM whose host maps guest memory lazily, 0.1 ms once
        touched), so a pool larger than the work is not walked through end to end."""
        self.free_ids.extendleft(sorted(blocks, reverse=True))

    def register(self, block: int, key: bytes) -> None:
        """`block` is full and holds the prefix that `key` names (kept only where no other block holds it)."""
        if key not in self.by_key and block not in self.key_of:
            self.by_key[key] = block
            self.key_of[block] = key

    def cached_run(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest leading run of `keys` that the pool holds."""
        out = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def drop_cached(self) -> None:
        """Forget every cached block nobody holds (a cold start)."""
        dropped = list(self.evictable)
        for block in dropped:
            del self.by_key[self.key_of.pop(block)]
        self.evictable.clear()
        self._queue_free(dropped)


class WindowStore:
    """A hybrid model's sliding-layer K/V of some cached blocks (see the module), by block key, at most `max_bytes`,
    least recently used evicted first."""

    def __init__(self, cfg: ModelConfig, max_bytes: int, dtype: torch.dtype):
        self.cfg = cfg
        element = quant.element_bytes(dtype, cfg.head_dim)
        self.entry_bytes = BLOCK_SIZE * cfg.kv_bytes_per_token(element, SLIDING)
        self.max_entries = max_bytes // self.entry_bytes
        #: blocks before a hit's end whose sliding K/V it needs: those holding the window of the first query after it
        self.blocks_needed = blocks_for(cfg.sliding_window - 1)
        self.entries: OrderedDict[bytes, tuple[Tensor, Tensor]] = OrderedDict()

    def usable_prefix(self, keys: Sequence[bytes], n: int) -> int:
        """The longest hit of at most n leading blocks of `keys` whose window is known."""
        while n:
            bare = [i for i in range(max(0, n - self.blocks_needed), n) if keys[i] not in self.entries]
            if not bare:
                break
            n = bare[-1]
        return n

    def save(self, keys: Sequence[bytes], ring, n_tokens: int) -> None:
        """Keep the sliding K/V of the blocks among the first blocks `keys` of a row that its ring (a one-row
        `WindowKVCache` view) holds entirely, the row holding n_tokens positions."""
        if not self.max_entries:
            return
        pos = torch.arange(len(keys) * BLOCK_SIZE, device=ring.device)
        held = (ring.slot_pos[0, pos % ring.capacity] == pos).view(len(keys), BLOCK_SIZE).all(1).tolist()
        for i, key in enumerate(keys):
            if key in self.entries:
                self.entries.move_to_end(key)
            elif held[i] and (i + 1) * BLOCK_SIZE <= n_tokens:
                slots = torch.arange(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, device=ring.device) % ring.capacity
                self.entries[key] = (ring.k[:, 0].index_select(2, slots), ring.v[:, 0].index_select(2, slots))
                if len(self.entries) > self.max_entries:
                    self.entries.popitem(last=False)

    def load(self, keys: Sequence[bytes], ring) -> None:
        """Write the sliding K/V of the window before the hit `keys` ends (what its first query sees) into the ring
        of one row (a view), whose positions the caller commits."""
        n = len(keys) * BLOCK_SIZE
        first = max(0, n - (self.cfg.sliding_window - 1))
        for i in range(first // BLOCK_SIZE, len(keys)):
            k, v = self.entries[keys[i]]
            self.entries.move_to_end(keys[i])
            pos = torch.arange(max(first, i * BLOCK_SIZE), (i + 1) * BLOCK_SIZE, device=ring.device)
            slots, offsets = pos % ring.capacity, pos - i * BLOCK_SIZE
            ring.k[:, 0].index_copy_(2, slots, k.index_select(2, offsets))
            ring.v[:, 0].index_copy_(2, slots, v.index_select(2, offsets))
            ring.hold(pos)


class KVManager:
    """The target's KV memory: the block pool's storage and bookkeeping, each request's blocks, prefix matching and
    storing, and (hybrid models) the windows a hit needs. The scheduler asks it for blocks and hits; the runner reads
    `k` and `v` through the block tables the scheduler hands it. Lives as long as its `LLM` (engines come and go; the
    cached prefixes stay). `caching`: whether full blocks are kept and matched (prefix caching).

    Counters: `queries` and `hits` count prompt tokens looked up and found (vLLM's prefix-cache counters),
    `preemptions` requests sent back to the queue for lack of blocks."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device | str, *,
                 caching: bool = True, window_bytes: int = 0):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.cfg, self.dtype, self.caching = cfg, dtype, caching
        self.k, self.v = block_storage(cfg, num_blocks, dtype, device)
        self.pool = BlockPool(num_blocks)
        self.windows = WindowStore(cfg, window_bytes, dtype) if cfg.hybrid else None
        self.held: dict[str, list[int]] = {}  # request id -> its blocks, in order
        self.draft_held: dict[str, list[int]] = {}  # request id -> its sparse draft cache's blocks (`take_draft`)
        self.keyed: dict[str, list[bytes]] = {}  # request id -> keys of its leading full blocks registered so far
        self.queries = self.hits = self.preemptions = 0
        # a standalone draft model's share of every block (`draft_storage`)
        self.draft_k: Tensor | None = None
        self.draft_v: Tensor | None = None
        self._draft_model: object | None = None
        self.drafted: set[int] = set()  # blocks whose draft K/V hold all their positions
        self._marked: dict[str, int] = {}  # request id -> its leading blocks marked drafted so far

    @staticmethod
    def block_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one block (K and V of the layers that grow with the context)."""
        element = quant.element_bytes(dtype, cfg.head_dim)
        return BLOCK_SIZE * cfg.kv_bytes_per_token(element, GLOBAL)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Positions the pool holds for requests (the null block aside)."""
        return (self.num_blocks - 1) * BLOCK_SIZE

    @property
    def usage(self) -> float:
        """Fraction of the blocks that requests hold (cached blocks nobody holds count as free)."""
        return self.pool.num_used / (self.num_blocks - 1)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    # --- prefixes -------------------------------------------------------------------------------------------------
    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's chain) a hit would cover now; nothing is held or counted."""
        if not self.caching:
            return 0
        n = len(self.pool.cached_run(keys))
        return n if self.windows is None else self.windows.usable_prefix(keys, n)

    def hit_blocks(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks a hit on `keys` (a prompt's chain) would map now; nothing is held or counted."""
        return self.pool.cached_run(keys[: self.cached_prefix(keys)])

    def match(self, request_id: str, keys: Sequence[bytes], n_tokens: int) -> list[int]:
        """Start `request_id`'s blocks with the longest cached prefix of `keys` (its prompt of n_tokens tokens),
        held from now on; counts the query and the hit. Returns the hit's blocks."""
        blocks = self.hit_blocks(keys)
        self.pool.hold(blocks)
        self.held[request_id] = list(blocks)
        self.keyed[request_id] = list(keys[: len(blocks)])
        self.queries += n_tokens
        self.hits += len(blocks) * BLOCK_SIZE
        return blocks

    def store(self, request_id: str, tokens: Sequence[int], n_computed: int) -> None:
        """The request's K/V hold `tokens[:n_computed]`: key its blocks that filled since the last call."""
        if not self.caching:
            return
        keyed, blocks = self.keyed[request_id], self.held[request_id]
        full = min(n_computed, len(tokens)) // BLOCK_SIZE
        if full > len(keyed):
            new = block_keys(tokens[: full * BLOCK_SIZE], len(keyed), keyed[-1] if keyed else b"")
            for i, key in enumerate(new, start=len(keyed)):
                self.pool.register(blocks[i], key)
            keyed.extend(new)

    def keys_of(self, request_id: str) -> list[bytes]:
        """The keys of the request's full blocks registered so far."""
        return self.keyed.get(request_id, [])

    def drop_cached(self) -> None:
        """Forget every cached prefix nobody holds (a cold start, as a benchmark measuring prefill wants)."""
        self.pool.drop_cached()
        if self.windows is not None:
            self.windows.entries.clear()

    # --- a draft model's share of the blocks ------------------------------------------------------------------------
    def draft_storage(self, model: "Transformer") -> tuple[Tensor, Tensor]:
        """K and V of the draft model `model` for every block of the pool, [layers, blocks, KV, BLOCK_SIZE, row] in the
        pool's dtype: a request's draft K/V lie in its own blocks, read through its block table, so a prefix hit maps
        them with the target's. Allocated when another model asks (what the previous one computed is forgotten) and
        kept while the same one drafts, engine after engine."""
        if self._draft_model is not model:
            self.draft_k = self.draft_v = self._draft_model = None  # freed before the next is allocated
            cfg = model.cfg
            size = self.num_blocks * self.block_bytes(cfg, self.dtype)
            check_fits(size, self.k.device, f"the draft model's K/V for {self.num_blocks} KV blocks "
                                            f"({size / 2**30:.2f} GiB beside the target's, in proportion to "
                                            f"--kv-cache-gb)")
            self.draft_k, self.draft_v = block_storage(cfg, self.num_blocks, self.dtype, self.k.device)
            self._draft_model, self.drafted, self._marked = model, set(), {}
        return self.draft_k, self.draft_v

    def mark_drafted(self, request_id: str, n_tokens: int) -> None:
        """The draft model's K/V of the request's first n_tokens positions are computed (its prefill): its full
        blocks among them may serve a later hit's draft."""
        marked, blocks = self._marked.get(request_id, 0), self.held[request_id]
        full = min(n_tokens // BLOCK_SIZE, len(blocks))
        if full > marked:
            self.drafted.update(blocks[marked:full])
            self._marked[request_id] = full

    def drafted_prefix(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of a hit hold the draft model's K/V too."""
        return next((i for i, block in enumerate(blocks) if block not in self.drafted), len(blocks))

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero blocks (and their draft K/V) before a request writes them: a position not written yet meets a
        probability of 0 in attention, which must not meet a NaN of uninitialized memory."""
        if blocks:
            index = torch.tensor(blocks, device=self.k.device)
            for storage in (self.k, self.v, self.draft_k, self.draft_v):
                if storage is not None:
                    storage.index_fill_(1, index, 0)

    # --- growth ---------------------------------------------------------------------------------------------------
    def blocks_of(self, request_id: str) -> list[int]:
        return self.held.get(request_id, [])

    def missing(self, request_id: str, tokens: int) -> int:
        """Blocks the request lacks to hold `tokens` positions."""
        return max(0, blocks_for(tokens) - len(self.blocks_of(request_id)))

    def grow(self, request_id: str, tokens: int) -> list[int] | None:
        """Blocks for the request to hold `tokens` positions: the new ones (zeroed by the runner before use), or None
        where the pool lacks them (nothing taken)."""
        need = self.missing(request_id, tokens)
        if need > self.pool.num_free:
            return None
        new = self._take(need)
        self.held.setdefault(request_id, []).extend(new)
        self.keyed.setdefault(request_id, [])
        return new

    def take_draft(self, request_id: str, n: int) -> list[int] | None:
        """n blocks for the request's fixed-size sparse draft cache (`magicdec.kv.sparse`), held until `free`: never
        keyed or shared. None where the pool lacks them (nothing taken)."""
        if n > self.pool.num_free:
            return None
        blocks = self.draft_held[request_id] = self._take(n)
        return blocks

    def _take(self, n: int) -> list[int]:
        """n blocks from the pool (call where it has them): taken again, a block holds no draft model's K/V."""
        blocks = self.pool.take(n)
        self.drafted.difference_update(blocks)
        return blocks

    def free(self, request_id: str) -> None:
        """The request lets all its blocks go (finished, aborted or preempted); its keyed blocks stay cached."""
        self.pool.release(self.held.pop(request_id, []) + self.draft_held.pop(request_id, []))
        self.keyed.pop(request_id, None)
        self._marked.pop(request_id, None)


def block_storage(cfg: ModelConfig, num_blocks: int, dtype: torch.dtype,
                  device: torch.device | str) -> tuple[Tensor, Tensor]:
    """K and V [layers, blocks, KV, BLOCK_SIZE, row] of `num_blocks` blocks, the null block zeroed.

    Uninitialized: memory is touched as blocks are used (`KVManager.zero_blocks` zeroes a block before a request writes
    it). Head-major in memory, seen as [layers, blocks, KV, ...]: a KV head's consecutive blocks lie side by side, so a
    request's blocks taken in a run are one run per head to the attention kernel (blocks holding every head read
    16-20% slower than contiguous rows, head-major ones in order 2-5%; benchmarks/README.md, "Paged K/V: block size,
    allocation order, pool layout")."""
    layers, blocks, heads, size, width = storage_shape(cfg, num_blocks, dtype)
    memory = (layers, heads, blocks, size, width)
    k = torch.empty(memory, dtype=quant.storage_dtype(dtype), device=device).transpose(1, 2)
    v = torch.empty(memory, dtype=quant.storage_dtype(dtype), device=device).transpose(1, 2)
    k[:, NULL_BLOCK].zero_()
    v[:, NULL_BLOCK].zero_()
    return k, v


def storage_shape(cfg: ModelConfig, num_blocks: int, dtype: torch.dtype) -> tuple[int, ...]:
    """[layers, blocks, KV heads, BLOCK_SIZE, row] of the layers whose K/V grow with the context: rows of head_dim
    values (and an int8 row's scale, `quant.row_width`)."""
    return len(cfg.layers_of(GLOBAL)), num_blocks, cfg.n_kv_heads, BLOCK_SIZE, quant.row_width(dtype, cfg.head_dim)
