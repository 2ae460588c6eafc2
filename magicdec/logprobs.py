"""Log-probabilities of tokens, as the OpenAI API and vLLM report them.

A position's log-probabilities are log_softmax of the target model's raw logits in fp32 (vLLM's default "raw"
logprobs): temperature, top-k and top-p shape the draw, not these numbers. The runner computes them only for the rows
of requests that ask, from the logits it samples from (a verification forward gives a one-token step's logits bit for
bit, so with speculation they are plain decoding's), and sends them to the host with the step's other results in one
copy (`to_host`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

#: Most alternatives a position may report (OpenAI's limit for completions and chat, vLLM's default).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of the token at one position, and the position's `top` most probable tokens as (token
    id, log-probability), the most probable first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Logprobs:
    """Log-probabilities of positions [...]: of each position's token (`chosen`, [...]) and of its k most probable
    tokens (`top_ids`, `top`, [..., k]); on the device, then on the host."""

    chosen: Tensor
    top_ids: Tensor
    top: Tensor

    def parts(self) -> list[Tensor]:
        return [self.chosen, self.top_ids, self.top]

    def entries(self, i: int, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
        """Row i's first len(tokens) positions (their tokens), with k alternatives each (host tensors)."""
        n = len(tokens)
        chosen, ids, top = self.chosen[i, :n].tolist(), self.top_ids[i, :n, :k].tolist(), self.top[i, :n, :k].tolist()
        return [TokenLogprob(t, c, tuple(zip(ids_j, top_j))) for t, c, ids_j, top_j in zip(tokens, chosen, ids, top)]


def compute_logprobs(logits: Tensor, tokens: Tensor, k: int) -> Logprobs:
    """log_softmax of logits [..., V] in fp32 at tokens [...], and the k largest with their token ids."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(k, dim=-1)
    return Logprobs(logprobs.gather(-1, tokens[..., None])[..., 0], top.indices, top.values)


def to_host(tensors: Sequence[Tensor]) -> list[Tensor]:
    """int64 and fp32 tensors, on the host in one device-to-host copy (fp32 ones travel as their bits), in their
    shapes."""
    flat = [t.reshape(-1) if t.dtype == torch.long else t.reshape(-1).view(torch.int32).long() for t in tensors]
    host = torch.cat(flat).cpu() if flat else torch.zeros(0, dtype=torch.long)
    out, at = [], 0
    for t in tensors:
        part = host[at : at + t.numel()]
        at += t.numel()
        out.append((part if t.dtype == torch.long else part.int().view(torch.float32)).view(t.shape))
    return out
