"""Batched verification of draft tokens: greedy matching and lossless speculative sampling.

Both take the target's logits for gamma+1 positions (the position before each draft token, plus one)
and return, per sequence, how many draft tokens are accepted and the token that follows them
(the target's correction at the first rejection, or the bonus token when all are accepted).
"""

from __future__ import annotations

import torch
from torch import Tensor

from magicdec.sampling import SamplingParams, probs_from_logits, sample


def _accepted_prefix(accept: Tensor) -> Tensor:
    """Length of the leading run of True per row: [B, gamma] bool -> [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_logits: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    """target_logits [B, g+1, V], draft [B, g] -> (n_accepted [B], next_token [B])."""
    best = target_logits.argmax(dim=-1)  # [B, g+1]
    n = _accepted_prefix(best[:, :-1] == draft)
    return n, best.gather(1, n[:, None]).squeeze(1)


def verify_sampling(
    target_logits: Tensor,  # [B, g+1, V]
    draft: Tensor,  # [B, g]
    draft_probs: Tensor,  # [B, g, V], the distributions the draft tokens were sampled from
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the output follows p exactly.

    Draft token i is accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the next
    token is drawn from normalise(max(0, p_i - q_i)); if all are accepted it is drawn from p_{g+1}.
    """
    p = probs_from_logits(target_logits, params)  # [B, g+1, V]
    B, g = draft.shape
    p_x = p[:, :g].gather(-1, draft[..., None]).squeeze(-1)
    q_x = draft_probs.gather(-1, draft[..., None]).squeeze(-1)
    u = torch.rand(B, g, device=draft.device, generator=generator)
    n = _accepted_prefix(u * q_x <= p_x)
    p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)  # [B, V]
    q_padded = torch.cat((draft_probs, torch.zeros_like(draft_probs[:, :1])), dim=1)  # q_{g+1} = 0
    q_n = q_padded.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    residual = (p_n - q_n).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass is 0 only when p_n == q_n, where a rejection has probability 0; fall back to p_n for safety
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)
    return n, sample(residual, generator)
