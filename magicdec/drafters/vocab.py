"""A draft LM head over the most frequent tokens only (FR-Spec: Zhao et al. 2025, arXiv 2502.14856).

With a large vocabulary the LM head is a large part of a draft step: Gemma 3's 262144 x 640 head is 335 MB in bf16,
more than all its layers, and every draft forward reads it, and its sampler ranks every logit. A draft head keeps the
head's rows of the tokens a corpus uses most, and the draft proposes among those alone. Output stays exactly the
target's: the target verifies each draft token with its whole head, so a token outside the draft head is never
proposed (a rejection where the target picks one) but never emitted in place of the target's choice.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from magicdec import kernels
from magicdec.loading.tokenizer import Tokenizer
from magicdec.model import PackedLinear, Transformer, packed, weight_dtype


def token_counts(tokenizer: Tokenizer, texts: Sequence[str]) -> Counter[int]:
    """How often each token id occurs in `texts`."""
    counts: Counter[int] = Counter()
    for ids in tokenizer.encode_batch(list(texts)):
        counts.update(ids)
    return counts


def frequent_tokens(counts: Counter[int], size: int, always: Iterable[int]) -> Tensor:
    """The ids of the `size` most frequent tokens of `counts` (fewer where it holds fewer; ties by first occurrence)
    and the ids `always` (a tokenizer's end-of-sequence ids), ascending: [n] int64."""
    keep = {token for token, _ in counts.most_common(size)} | set(always)
    return torch.tensor(sorted(keep), dtype=torch.long)


def head_coverage(counts: Counter[int], size: int) -> float:
    """The share of the tokens counted in `counts` that the `size` most frequent of them make up: what a draft head
    of `size` rows can propose, where the text is like the one counted (1.0 for an empty count)."""
    total = sum(counts.values())
    return sum(n for _, n in counts.most_common(size)) / total if total else 1.0


def lm_head_rows(model: Transformer, ids: Tensor) -> Tensor:
    """The LM head's weight rows of tokens `ids`: [n, dim], in the head's storage dtype."""
    if model.cfg.tie_embeddings:
        return model.tok_embeddings.weight.detach()[ids]
    if isinstance(model.output, PackedLinear):
        return kernels.unpack_linear(model.output.packed, model.output.out_features)[ids]
    return model.output.weight.detach()[ids]


class DraftHead(nn.Module):
    """The target's LM head restricted to tokens `ids` [n]: `forward(x [..., dim]) -> logits [..., n]`, packed for the
    native linear kernel where the model's own layers are."""

    def __init__(self, model: Transformer, ids: Tensor):
        super().__init__()
        linear = nn.Linear(model.cfg.dim, len(ids), bias=False, device=model.device, dtype=model.dtype)
        linear.weight.data.copy_(lm_head_rows(model, ids.to(model.device)))
        self.linear = packed(linear, weight_dtype(model), fp32=True)
        self.register_buffer("ids", ids.to(model.device), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)
