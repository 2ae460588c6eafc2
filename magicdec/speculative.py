"""Speculative decoding settings and how they turn into a drafter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from magicdec.decode import Replanner
from magicdec.drafters import Drafter, ModelDrafter, SelfSpecDrafter
from magicdec.errors import InvalidRequestError

if TYPE_CHECKING:
    from magicdec.engine import LLM

DRAFTERS = ("none", "self-streaming", "self-snapkv", "model")

#: Default position scheme per sparse cache kind, chosen by measured acceptance (benchmarks/README.md):
#: re-indexed positions accept as well greedily and better when sampling, for both kinds.
DEFAULT_REINDEX = {"streaming": True, "snapkv": True}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft. `draft`: none | self-streaming | self-snapkv | model (then `draft_model` is a path).

    budget: KV entries the draft may read per sequence (sparse caches); gamma: tokens drafted per round;
    draft_cache: dense | streaming | snapkv for a standalone draft model; reindex: rotate sparse-cache
    keys by slot (StreamingLLM style) instead of their original positions (None: per-kind default).
    """

    draft: str = "self-streaming"
    budget: int = 256
    gamma: int = 3
    draft_model: str | None = None
    draft_cache: str = "streaming"
    reindex: bool | None = None
    replan: Replanner | None = field(default=None, compare=False, repr=False)
    """Sets the draft length (up to `gamma`) as the batch shrinks and contexts grow (`--draft auto`)."""

    def __post_init__(self) -> None:
        if self.draft not in DRAFTERS:
            raise InvalidRequestError(f"unknown drafter {self.draft!r}; choose from {', '.join(DRAFTERS)}")
        if not (isinstance(self.gamma, int) and 1 <= self.gamma <= 16):
            raise InvalidRequestError(f"gamma must be an integer in [1, 16], got {self.gamma!r}")
        if not (isinstance(self.budget, int) and self.budget >= 8):
            raise InvalidRequestError(f"budget must be an integer >= 8, got {self.budget!r}")
        if self.draft == "model" and not self.draft_model:
            raise InvalidRequestError("draft 'model' needs a draft_model path")
        if self.draft_cache not in ("dense", "streaming", "snapkv"):
            raise InvalidRequestError(f"unknown draft cache {self.draft_cache!r}; choose dense, streaming or snapkv")

    def build(self, llm: "LLM") -> tuple[Drafter | None, int]:
        """The drafter for `llm`'s model and the gamma to use (None, 0 for plain decoding)."""
        if self.draft == "none":
            return None, 0
        if self.draft == "model":
            from magicdec.loading import load_model

            draft = load_model(self.draft_model, device=llm.model.device, dtype=llm.model.dtype)
            if draft.model.cfg.vocab_size != llm.model.cfg.vocab_size:
                raise InvalidRequestError(
                    f"draft vocabulary ({draft.model.cfg.vocab_size}) differs from the target's "
                    f"({llm.model.cfg.vocab_size})"
                )
            reindex = DEFAULT_REINDEX.get(self.draft_cache, False) if self.reindex is None else self.reindex
            return ModelDrafter(draft.model, self.draft_cache, self.budget, self.gamma, reindex), self.gamma
        kind = self.draft.removeprefix("self-")
        reindex = DEFAULT_REINDEX[kind] if self.reindex is None else self.reindex
        return SelfSpecDrafter(llm.model, kind, self.budget, self.gamma, reindex), self.gamma
