"""Self-speculation: the target's own weights over a fixed-budget sparse KV cache."""

from __future__ import annotations

from torch import Tensor

from magicdec.drafters.base import Drafter
from magicdec.kv import KVCache
from magicdec.kv.sparse import SnapKVObserver, compress
from magicdec.model import Transformer


class SelfSpecDrafter(Drafter):
    """Drafts with the target model reading only `budget` cached tokens (StreamingLLM or SnapKV).

    The sparse cache is cut from the target's dense cache after prefill, so drafting costs no extra
    prefill; SnapKV's selection uses the attention of the prompt's last tokens, observed during the
    target's own prefill.
    """

    def __init__(self, model: Transformer, kind: str, budget: int, gamma: int, reindex: bool):
        super().__init__(model, gamma)
        self.kind, self.budget, self.reindex = kind, budget, reindex
        self.name = f"self-{kind}"
        self.needs_target_attention = kind == "snapkv"

    def build_cache(
        self, tokens: Tensor, lens: Tensor, target_cache: KVCache, observer: SnapKVObserver | None, chunk: int
    ) -> KVCache:
        return compress(target_cache, self.kind, self.budget, self.reindex, self.gamma + 2, self.model.inv_freq, observer)
