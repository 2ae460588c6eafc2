"""Log-probabilities as the OpenAI API shows them: the legacy completions format, chat's `content` list, and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

from typing import Sequence

from magicdec.loading.tokenizer import Tokenizer
from magicdec.logprobs import TokenLogprob

#: What a log-probability of -inf is shown as (JSON has no infinity; vLLM's floor).
FLOOR = -9999.0


class TokenTexts:
    """The text of single tokens (each token decoded alone, as vLLM shows them), remembered once decoded."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.known.get(token)
        if text is None:
            text = self.known[token] = self.tokenizer.decode([token])
        return text


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprob | None], texts: TokenTexts,
                        offset: int) -> dict:
    """OpenAI's legacy `logprobs` of positions holding `tokens` (an entry None: a position without one, the prompt's
    first), the text starting at character `offset`: each position's top_logprobs holds its alternatives and its own
    token, as OpenAI's and vLLM's do."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(entry.logprob))
        top = {texts(t): _value(lp) for t, lp in entry.top}
        top.setdefault(text, _value(entry.logprob))
        out["top_logprobs"].append(top)
    return out


def _chat_item(token: int, logprob: float, texts: TokenTexts) -> dict:
    text = texts(token)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[dict]:
    """Chat's `logprobs.content`: per token its text, log-probability, UTF-8 bytes and top_logprobs."""
    return [{**_chat_item(e.token, e.logprob, texts), "top_logprobs": [_chat_item(t, lp, texts) for t, lp in e.top]}
            for e in entries]


def prompt_logprobs(entries: Sequence[TokenLogprob | None], texts: TokenTexts) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}
    for its token and alternatives (rank: 1 for the most probable; None for a token outside the alternatives)."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(entry.top, 1)}
        ranked.setdefault(entry.token, (entry.logprob, None))
        out.append({str(t): {"logprob": _value(lp), "rank": rank, "decoded_token": texts(t)}
                    for t, (lp, rank) in ranked.items()})
    return out
