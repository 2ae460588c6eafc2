"""Prompts cut from long text: plain text files or JSON lines with a `text` field (e.g. PG-19 books)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from magicdec.errors import InvalidRequestError
from magicdec.loading.tokenizer import Tokenizer

#: Characters tokenized per wanted token when cutting a prompt (English prose runs ~4 chars/token).
CHARS_PER_TOKEN = 6


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


def cut_prompts(tok: Tokenizer, texts: Sequence[str], n: int, length: int, start_frac: float = 0.2) -> list[list[int]]:
    """n prompts of exactly `length` tokens, taken round-robin from the texts, starting `start_frac`
    into each text (and further in for later prompts from the same text), as the MagicDec paper cuts
    PG-19 prompts from inside books."""
    if n < 1 or length < 1:
        raise InvalidRequestError("the number of prompts and their length must be >= 1")
    prompts = []
    for i in range(n):
        text = texts[i % len(texts)]
        need = length * CHARS_PER_TOKEN
        if len(text) < need:
            raise InvalidRequestError(f"text {i % len(texts)} is too short for a {length}-token prompt")
        room = len(text) - need
        start = int(room * start_frac) + (i // len(texts)) * need
        start = start % (room + 1)
        ids = tok.tok.encode(text[start : start + need], add_special_tokens=False).ids
        if len(ids) < length:
            raise InvalidRequestError(f"text {i % len(texts)} yields fewer than {length} tokens at offset {start}")
        body = ids[1 : length + 1] if len(ids) > length else ids[:length]  # skip a likely partial first word
        prompts.append(([tok.bos_id] + body[: length - 1]) if tok.add_bos else body)
    return prompts
