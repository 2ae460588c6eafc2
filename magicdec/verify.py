"""Verification of draft tokens, one rule for greedy and sampled rows.

The target's token at each of the gamma+1 verified positions is what plain decoding would produce there (its argmax,
or its seeded draw: see magicdec.sampling). A draft token is accepted while it equals the target's token; at the
first mismatch the target's token replaces it, and when all match the target's last token is a bonus. The output is
therefore exactly the plain-decoding output.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accept_drafts(target: Tensor, draft: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """target [B, g+1] and draft [B, g] tokens -> (n_accepted [B], next_token [B]); with `lengths` [B], row b's draft
    is its first lengths[b] tokens (per-row draft lengths: the target's tokens past lengths[b] are never read)."""
    n = (target[:, :-1] == draft).long().cumprod(dim=1).sum(dim=1)
    if lengths is not None:
        n = torch.minimum(n, lengths)
    return n, target.gather(1, n[:, None]).squeeze(1)
