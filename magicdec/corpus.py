"""Prompts cut from long text: plain text files or JSON lines with a `text` field (e.g. PG-19 books)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer

#: Characters tokenized per wanted token when cutting a prompt (English prose runs ~4 chars/token).
CHARS_PER_TOKEN = 8


def load_texts(path: str | Path) -> list[str]:
    """The documents of a corpus file: one per JSON line (`text` or `prompt` key), else the whole file."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"corpus file not found: {path}")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{i + 1}: invalid JSON ({e.msg})") from None
            text = obj.get("text") or obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise InvalidRequestError(f"{path}:{i + 1}: expected an object with a 'text' or 'prompt' string")
            texts.append(text)
    else:
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InvalidRequestError(f"{path}: no text found")
    return texts


def cut_prompts(tok: Tokenizer, texts: Sequence[str], n: int, length: int, *, lo: float = 0.2,
                hi: float = 0.7) -> list[list[int]]:
    """`n` prompts of exactly `length` ids (BOS first if the model uses one), cut from inside the texts.

    Prompt i comes from text i % len(texts), starting at a word boundary at a fraction of the text
    spread over [lo, hi] (later passes over the same text start elsewhere), so prompts sit well
    inside books, away from front matter, as the MagicDec paper cuts PG-19 prompts. Texts too short
    for a prompt are skipped.
    """
    if n < 1 or length < 1:
        raise InvalidRequestError("the number of prompts and their length must be >= 1")
    if not texts:
        raise InvalidRequestError("no texts to cut prompts from")
    prompts: list[list[int]] = []
    i = 0
    while len(prompts) < n:
        if i > 4 * n + 4 * len(texts):
            raise InvalidRequestError(f"the texts are too short for {n} prompts of {length} tokens")
        text = texts[i % len(texts)]
        frac = lo + (hi - lo) * ((i * 0.618034 + (i // len(texts)) * 0.381966) % 1.0)
        i += 1
        chars = CHARS_PER_TOKEN * length + 1000
        start = text.find(" ", int(len(text) * frac)) + 1
        if start <= 0 or start + chars // 2 > len(text):
            start = text.find(" ", max(0, len(text) - chars)) + 1
        ids = tok.encode(text[start : start + chars])
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts
