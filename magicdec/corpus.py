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
    """The texts of a prompt file or corpus: one per line of a .jsonl file (a `text` or `prompt` string), else the
    whole file.

    Nothing is dropped silently, so that output i always belongs to text i: a blank line between records, a record
    whose text is blank, a line that is not such a JSON record, and bytes that are not UTF-8 raise
    InvalidRequestError naming the line. Blank lines at the end of the file are ignored."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"corpus file not found: {path}")
    data = path.read_bytes()
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InvalidRequestError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    if path.suffix != ".jsonl":
        if not content.strip():
            raise InvalidRequestError(f"{path}: no text found")
        return [content]
    lines = content.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise InvalidRequestError(f"{path}: no text found")
    return [_jsonl_text(path, number, line) for number, line in enumerate(lines, 1)]


def _jsonl_text(path: Path, number: int, line: str) -> str:
    where = f"{path}:{number}"
    if not line.strip():
        raise InvalidRequestError(f"{where}: blank line (each line must hold one JSON record)")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{where}: invalid JSON ({e.msg})") from None
    text = obj.get("text" if "text" in obj else "prompt") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}: expected an object with a 'text' or 'prompt' string")
    if not text.strip():
        raise InvalidRequestError(f"{where}: the text is empty")
    return text


def cut_prompts(tok: Tokenizer, texts: Sequence[str], n: int, length: int, *, lo: float = 0.2,
                hi: float = 0.7) -> list[list[int]]:
    """`n` prompts of exactly `length` ids (BOS first if the model uses one), cut from inside the texts.

    Prompt i comes from text i % len(texts), starting at a word boundary at a fraction of the text spread over [lo,
    hi] (later passes over the same text start elsewhere), so prompts sit well inside books, away from front matter,
    as the MagicDec paper cuts PG-19 prompts. Texts too short for a prompt are skipped."""
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
