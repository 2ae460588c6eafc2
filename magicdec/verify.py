"""Verification of draft tokens, one rule for greedy and sampled rows.

The target's token at each of the gamma+1 verified positions is what plain decoding would produce there (its argmax,
or its seeded draw: see magicdec.sampling). A draft token is accepted while it equals the target's token; at the
first mismatch the target's token replaces it, and when all match the target's last token is a bonus. The output is
therefore exactly the plain-decoding output.
"""

from __future__ import annotations

from torch import Tensor


def accept_drafts(target: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    """target [B, g+1] and draft [B, g] tokens -> (n_accepted [B], next_token [B])."""
    n = (target[:, :-1] == draft).long().cumprod(dim=1).sum(dim=1)
    return n, target.gather(1, n[:, None]).squeeze(1)
