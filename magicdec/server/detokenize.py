"""Incremental detokenization for streaming: text deltas that never need taking back."""

from __future__ import annotations

from typing import Sequence

from magicdec.loading.tokenizer import Tokenizer

#: What the tokenizer decodes an incomplete UTF-8 sequence (a multi-byte character split over tokens) to.
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's growing token ids into text deltas.

    A delta holds back text that may still change: a trailing incomplete UTF-8 sequence, and a tail that
    could be the start of a stop string (the engine ends the request at a stop string, and the text
    excludes it). `finish` returns the rest of the final text, so the deltas add up to it exactly.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final."""
        self.ids.extend(new_ids)
        # Decoding everything again is quadratic in the output length, but a few microseconds per token at
        # the output lengths served here, and it is exact where windowed decoding needs tokenizer care.
        text = self.tokenizer.decode(self.ids)
        end = len(text.rstrip(REPLACEMENT))
        found = [text.find(s) for s in self.stop if s in text]
        if found:
            end = min(end, *found)
        else:  # the longest tail that a stop string starts with
            end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        if end <= len(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) : end], text[:end]
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (`LLMEngine.text_of`) after what was emitted."""
        return final_text[len(self.emitted) :]
