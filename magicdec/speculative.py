"""Speculative decoding: the settings (`SpeculativeConfig`, frozen) and what they build (`Speculation`: a drafter,
whose weights and caches are state, and the policy that picks each step's draft length)."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from magicdec.corpus import load_texts
from magicdec.drafters import Drafter, ModelDrafter, SelfQuantDrafter, SelfSpecDrafter, VegasDrafter
from magicdec.drafters.vocab import DraftHead, frequent_tokens, token_counts
from magicdec.errors import InvalidRequestError
from magicdec.loading import load_model
from magicdec.loading.tokenizer import Tokenizer
from magicdec.model import Transformer
from magicdec.planner import HardwareProfile
from magicdec.runner import MAX_GAMMA
from magicdec.scheduler import GammaPolicy

DRAFTERS = ("none", "self-streaming", "self-snapkv", "self-vegas", "self-quant", "model", "auto")
#: What `auto` plans for: greedy requests (temperature 0) or sampled ones, whose acceptance is lower.
MODES = ("greedy", "sampling")

#: Default position scheme per sparse cache kind, chosen by measured acceptance (benchmarks/README.md):
#: re-indexed positions accept as well greedily and better when sampling, for both kinds.
DEFAULT_REINDEX = {"streaming": True, "snapkv": True}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft. `draft`: none | self-streaming | self-snapkv | self-vegas | self-quant | model (then
    `draft_model` is a path) | auto. self-vegas reads per layer the `budget` entries the last verification attended to
    most, in the target's own blocks (`VegasDrafter`); self-quant drafts over the whole context at 4 bits
    (`SelfQuantDrafter`; `budget` does not apply).

    auto: the planner picks a self-speculative drafter, its budget and draft length, or plain decoding, for the shape
    the engine runs (`LLM` resolves it, `magicdec.autoplan.choose`), and re-plans the draft length every step; it plans
    with `hardware` (a HardwareProfile, preset name or profile JSON; None: the one `magicdec calibrate` saved, else a
    preset) for `mode` ("greedy" or "sampling") requests, and with `draft_vocab` prices a draft head too; the
    planner picks what `budget` and `gamma` set for the others.

    budget: KV entries the draft may read per sequence (sparse caches); gamma: tokens drafted per round; draft_cache:
    dense | streaming | snapkv for a standalone draft model; reindex: rotate sparse-cache keys by slot (StreamingLLM
    style) instead of their original positions (None: per-kind default); draft_vocab: the draft proposes among the
    `draft_vocab` tokens most frequent in the text file `vocab_corpus` only (0: the whole vocabulary; see
    `magicdec.drafters.vocab`); draft_stop: per-row draft lengths, each row drafting while the product of its draft's
    confidences (`magicdec.drafters.base.confidence`) stays at or above it, and a verification taking each row's
    tokens alone (None: every row drafts gamma tokens; "auto", with draft "auto": the threshold priced by the
    planner's cost model against the acceptance learned per confidence, `magicdec.autoplan.Replanner`)."""

    draft: str = "self-streaming"
    budget: int = 256
    gamma: int = 3
    draft_model: str | None = None
    draft_cache: str = "streaming"
    reindex: bool | None = None
    draft_vocab: int = 0
    vocab_corpus: str | None = None
    hardware: HardwareProfile | str | None = None
    mode: str = "greedy"
    draft_stop: float | str | None = None

    def __post_init__(self) -> None:
        if self.draft not in DRAFTERS:
            raise InvalidRequestError(f"unknown drafter {self.draft!r}; choose from {', '.join(DRAFTERS)}")
        if self.mode not in MODES:
            raise InvalidRequestError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.hardware is not None and self.draft != "auto":
            raise InvalidRequestError("a hardware profile is what draft 'auto' plans with: give draft='auto'")
        if not (isinstance(self.gamma, int) and not isinstance(self.gamma, bool) and 1 <= self.gamma <= MAX_GAMMA):
            raise InvalidRequestError(f"gamma must be an integer in [1, {MAX_GAMMA}], got {self.gamma!r}")
        if self.draft_stop == "auto" and self.draft != "auto":
            raise InvalidRequestError("draft_stop 'auto' is priced by the planner: give draft='auto' too")
        if self.draft_stop not in (None, "auto") and not (isinstance(self.draft_stop, (int, float))
                                                          and 0 < self.draft_stop < 1):
            raise InvalidRequestError(f"draft_stop must be a probability in (0, 1) or 'auto', got {self.draft_stop!r}")
        if not (isinstance(self.budget, int) and self.budget >= 8):
            raise InvalidRequestError(f"budget must be an integer >= 8, got {self.budget!r}")
        if self.draft == "model" and not self.draft_model:
            raise InvalidRequestError("draft 'model' needs a draft_model path")
        if self.draft_cache not in ("dense", "streaming", "snapkv"):
            raise InvalidRequestError(f"unknown draft cache {self.draft_cache!r}; choose dense, streaming or snapkv")
        if not (isinstance(self.draft_vocab, int) and self.draft_vocab >= 0):
            raise InvalidRequestError(f"draft_vocab must be an integer >= 0, got {self.draft_vocab!r}")
        if self.draft_vocab and not self.vocab_corpus:
            raise InvalidRequestError("a draft vocabulary (draft_vocab) is counted in a corpus: give vocab_corpus")
        if self.draft_vocab and not Path(self.vocab_corpus).is_file():
            raise InvalidRequestError(f"corpus file not found: {self.vocab_corpus}")

    @classmethod
    def drafting(cls, draft: str, budget: int | None, **kwargs: Any) -> SpeculativeConfig:
        """The settings of drafter `draft` with a draft budget of `budget` (None or 0: a drafter that reads no budget,
        self-quant, which keeps the default) and `kwargs`."""
        return cls(draft, **({"budget": budget} if budget else {}), **kwargs)

    def build(self, target: Transformer, tokenizer: Tokenizer | None = None) -> Drafter | None:
        """The drafter for `target` (None: plain decoding); a `model` drafter loads its weights here, and with
        `draft_vocab` a draft head is cut from its LM head over the tokens `tokenizer` finds most often in
        `vocab_corpus`. An `auto` setting is planned first, at the engine's shape (`LLM` does it)."""
        if self.draft == "auto":
            raise InvalidRequestError("draft 'auto' is planned for an engine's batch and context: let LLM resolve it")
        drafter = self._drafter(target)
        if drafter is not None and self.draft_vocab:
            if tokenizer is None:
                raise InvalidRequestError("a draft vocabulary is counted with the model's tokenizer: pass it")
            ids = frequent_tokens(corpus_token_counts(tokenizer, self.vocab_corpus), self.draft_vocab,
                                  tokenizer.eos_ids)
            drafter.head = DraftHead(drafter.model, ids)
        return drafter

    def _drafter(self, target: Transformer) -> Drafter | None:
        if self.draft == "none":
            return None
        if self.draft == "model":
            # under tensor parallelism the draft model is sharded over the same ranks as the target
            draft = load_model(self.draft_model, device=target.device, dtype=target.dtype, tp=target.tp)
            if draft.model.cfg.vocab_size != target.cfg.vocab_size:
                raise InvalidRequestError(
                    f"draft vocabulary ({draft.model.cfg.vocab_size}) differs from the target's "
                    f"({target.cfg.vocab_size})"
                )
            reindex = DEFAULT_REINDEX.get(self.draft_cache, False) if self.reindex is None else self.reindex
            return ModelDrafter(draft.model, self.draft_cache, self.budget, self.gamma, reindex)
        if self.draft == "self-quant":
            return SelfQuantDrafter(target, self.gamma)
        if self.draft == "self-vegas":
            return VegasDrafter(target, self.budget, self.gamma)
        kind = self.draft.removeprefix("self-")
        reindex = DEFAULT_REINDEX[kind] if self.reindex is None else self.reindex
        return SelfSpecDrafter(target, kind, self.budget, self.gamma, reindex)


@functools.cache
def corpus_token_counts(tokenizer: Tokenizer, corpus: str) -> Counter[int]:
    """`token_counts` of a corpus file, counted once per process (a sweep of draft-head sizes, and `--draft auto`
    pricing a head before building it, read it once)."""
    return token_counts(tokenizer, load_texts(corpus))


@dataclass(frozen=True)
class Speculation:
    """A built drafter and the policy that picks each step's draft length (up to the drafter's gamma; 0: a plain
    step): `FixedGamma` for a fixed length, `autoplan.Replanner` for `auto`."""

    drafter: Drafter
    policy: GammaPolicy
