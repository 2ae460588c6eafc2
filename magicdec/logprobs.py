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


#: Logits per block of `compute_logprobs`: a prefill chunk's every position (512 x a 262k vocabulary: 537 MB of fp32
#: logits) never has its whole log_softmax allocated beside them.
LOGPROB_BLOCK_FLOATS = 1 << 24


def compute_logprobs(logits: Tensor, tokens: Tensor, k: int) -> Logprobs:
    """log_softmax of logits [..., V] in fp32 at tokens [...], and the k largest with their token ids; a few rows at
    a time (each row's log_softmax is the one a log_softmax of all rows at once gives it)."""
    V = logits.shape[-1]
    rows, ids = logits.reshape(-1, V), tokens.reshape(-1)
    step = max(1, LOGPROB_BLOCK_FLOATS // V)
    chosen, top_ids, top = [], [], []
    for i in range(0, max(len(rows), 1), step):
        logprobs = rows[i : i + step].float().log_softmax(dim=-1)
        best = logprobs.topk(k, dim=-1)
        chosen.append(logprobs.gather(-1, ids[i : i + step, None])[:, 0])
        top_ids.append(best.indices)
        top.append(best.values)
    shape = (*tokens.shape, k)
    return Logprobs(torch.cat(chosen).view(tokens.shape), torch.cat(top_ids).view(shape), torch.cat(top).view(shape))


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
