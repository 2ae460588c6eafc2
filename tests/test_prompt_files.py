"""Prompt files and corpora: every line is a prompt or an error naming the line, so outputs keep their prompts."""

from __future__ import annotations

import json

import pytest

from magicdec.cli import main
from magicdec.corpus import load_texts
from magicdec.errors import InvalidRequestError


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.jsonl", b'{"prompt": "a"}\n   \n{"prompt": "b"}\n', r"p.jsonl:2: blank line"),
        ("p.jsonl", b'{"prompt": "a"}\n{"prompt": " \\t"}\n{"prompt": "b"}\n', r"p.jsonl:2: the text is empty"),
        ("p.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"p.jsonl:2: not UTF-8 text \(byte 0xe9\)"),
        ("p.jsonl", b'{"text": "a"}\n["a"]\n', r"p.jsonl:2: expected an object"),
        ("p.jsonl", b'{"text": "a"}\n{"text": \n', r"p.jsonl:2: invalid JSON"),
        ("p.jsonl", b"\n \n", r"p.jsonl: no text found"),
        ("p.txt", b"caf\xe9 au lait", r"p.txt:1: not UTF-8 text"),
        ("p.txt", b" \n\t", r"p.txt: no text found"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InvalidRequestError, match=message):
        load_texts(path)


def test_trailing_blank_lines_and_crlf_are_fine(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r\n{"text": "b", "prompt": "ignored"}\r\n\r\n  \n')
    assert load_texts(path) == ["a", "b"]


def test_json_outputs_carry_their_prompt_index(tmp_path, capsys, default_model):
    prompts = ["One", "Two words", "And now three words"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main(["generate", "--prompt", "Zero", "--prompt-file", str(path), "--max-tokens", "1", "--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    lengths = [len(ids) for ids in default_model.tokenizer.encode_batch(["Zero", *prompts])]
    assert [(o["index"], o["prompt_tokens"]) for o in outputs] == list(enumerate(lengths))
