"""KV caches: dense (the target's) and sparse fixed-budget ones (the draft's)."""

from magicdec.kv.base import KVCache

__all__ = ["KVCache"]
