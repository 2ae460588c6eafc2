"""Incremental detokenization for streaming: text deltas that never need taking back."""

from __future__ import annotations

from typing import Sequence

from magicdec.loading.tokenizer import Tokenizer

#: What the tokenizer decodes an incomplete UTF-8 sequence (a multi-byte character split over tokens) to.
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's growing token ids into text deltas.

    A delta holds back text that may still change: a trailing incomplete UTF-8 sequence, and a tail that could be the
    start of a stop string (the engine ends the request at a stop string, and the text excludes it). `finish` returns
    the rest of the final text, so the deltas add up to it exactly."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:_read]
        self._prefix = self._read = 0  # ids[_prefix:_read] are decoded again as context for the next ones
        self.emitted = 0  # characters of `text` handed out

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final."""
        self.ids.extend(new_ids)
        # Decode only the new tokens, with the previous ones as context (a tokenizer may render a token differently at
        # the start of a text, e.g. without its leading space), as vLLM does: decoding everything each time would cost
        # time quadratic in the output length.
        context = self.tokenizer.decode(self.ids[self._prefix : self._read])
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if not window.endswith(REPLACEMENT) and window.startswith(context):
            self.text += window[len(context) :]
            self._prefix, self._read = self._read, len(self.ids)
        end = len(self.text)
        found = [self.text.find(s) for s in self.stop if s in self.text]
        if found:
            end = min(found)
        else:  # hold back the longest tail that a stop string starts with (no longer than the text: a stop string of
            # a million characters would otherwise cost a million slices a push, on the event loop)
            end -= max((k for s in self.stop for k in range(1, min(len(s), len(self.text) + 1))
                        if self.text.endswith(s[:k])), default=0)
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (`LLMEngine.text_of`) after what was emitted."""
        return final_text[self.emitted :]
