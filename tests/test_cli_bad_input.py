"""Every bad input on the command line: exit status 2, one line `magicdec: error: ...` naming the problem, no
traceback, and no work done first (bench and calibrate check their inputs before loading a model)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_gguf

from magicdec.cli import main

DATA = Path(os.environ.get("MAGICDEC_DATA", Path(__file__).resolve().parents[1].parent / "shared/data/pg19_dev.jsonl"))
NO_MODEL = "/no/such/model"  # bench cases name it: their error must come before the model is loaded
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

GOOD_PROFILE = {"name": "mine", "flops_per_s": 1e11, "mem_bandwidth": 2e10, "mem_bytes": 8e9}
FILES = {
    "blank_line.jsonl": b'{"prompt": "ab"}\n \n{"prompt": "ba"}\n',
    "blank_prompt.jsonl": b'{"prompt": "ab"}\n{"prompt": "  "}\n',
    "latin1.jsonl": b'{"text": "ab"}\n{"text": "caf\xe9"}\n',
    "latin1.txt": b"caf\xe9",
    "corrupt.json": b'{"entries": [',
    "empty.json": b"",
    "list.json": b"[]",
    "no_rates.json": b'{"entries": []}',
    "no_alpha.json": b'{"entries": [{"drafter": "self-streaming", "budget": 64}]}',
    "text_alpha.json": b'{"entries": [{"drafter": "self-streaming", "budget": 64, "alpha": "high"}]}',
    "profile_lacks.json": json.dumps({k: v for k, v in GOOD_PROFILE.items() if k != "mem_bytes"}).encode(),
    "profile_text.json": json.dumps({**GOOD_PROFILE, "flops_per_s": "fast"}).encode(),
    "bench_list.json": b"[1, 2]",
    "bench_points.json": b'{"points": ["B1"]}',
}

CASES = [
    # generate: model, prompts and sampling (the tiny model unless a case names one)
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], "does not exist"),
    (["generate", "--prompt", ""], "empty"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "hi", "--top-k", "-3"], "top_k"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--prompt", "hi", "--max-tokens", "9000"], "context"),
    (["generate"], "no prompts"),
    (["generate", "--corpus", "/no/such/corpus.jsonl"], "not found"),
    (["generate", "--prompt-file", "/no/such/prompts.txt"], "not found"),
    (["generate", "--prompt", "hi", "--draft", "model"], "draft_model"),
    (["generate", "--prompt", "hi", "--draft", "self-streaming", "--draft-vocab", "4k"], "give --vocab-corpus"),
    (["generate", "--prompt", "hi", "--draft", "auto", "--draft-vocab", "4k"], "give --vocab-corpus"),
    (["generate", "--prompt", "hi", "--draft-vocab", "4k"], "give --draft too"),
    (["generate", "--prompt", "hi", "--draft", "auto", "--draft-vocab", "4k", "--vocab-corpus", "/no/such.txt"],
     "not found"),
    (["generate", "--prompt", "hi", "--draft", "self-streaming", "--draft-vocab", "4k", "--vocab-corpus",
      "/no/such/corpus.txt"], "not found"),
    (["generate", "--prompt-file", "{blank_line.jsonl}"], "blank_line.jsonl:2: blank line"),
    (["generate", "--prompt-file", "{blank_prompt.jsonl}"], "blank_prompt.jsonl:2: the text is empty"),
    (["generate", "--prompt-file", "{latin1.jsonl}"], "latin1.jsonl:2: not UTF-8 text"),
    (["generate", "--corpus", "{latin1.txt}"], "latin1.txt:1: not UTF-8 text"),
    (["generate", "--prompt", "ab", "--seed", "abc"], "argument --seed"),
    (["generate", "--prompt", "ab", "--gamma", "zero"], "argument --gamma"),
    (["generate", "--prompt", "ab", "--draft-stop", "1.5"], "argument --draft-stop: a probability in (0, 1)"),
    (["generate", "--prompt", "ab", "--draft-stop", "nan"], "argument --draft-stop: a probability in (0, 1)"),
    (["generate", "--prompt", "ab", "--draft", "self-streaming", "--draft-stop", "auto"], "priced by the planner"),
    # generate: devices and planner files
    (["generate", "--prompt", "ab", "--device", "bogus"], "unknown device 'bogus'"),
    (["generate", "--prompt", "ab", "--device", "meta"], "device 'meta' is not supported"),
    (["generate", "--prompt", "ab", "--device", "cuda:99"], "device 'cuda:99'"),
    pytest.param(["generate", "--prompt", "ab", "--device", "cuda"], "no CUDA device", marks=NO_CUDA),
    (["generate", "--prompt", "ab", "--draft", "auto", "--hardware", "nosuch"], "unknown hardware profile 'nosuch'"),
    (["generate", "--prompt", "ab", "--draft", "auto", "--hardware", "{profile_lacks.json}"], "lacks mem_bytes"),
    # ... the cache holds a corrupt profile of the CPU and a corrupt acceptance table of the tiny model
    (["generate", "--prompt", "ab", "--draft", "auto", "--device", "cpu", "--dtype", "fp32"],
     "hardware-cpu-fp32.json: not a valid hardware profile"),
    (["generate", "--prompt", "ab", "--draft", "auto", "--hardware", "cpu-amx-2t-fp32"],
     "acceptance-tiny.json: not a valid acceptance table"),
    # calibrate
    pytest.param(["calibrate", "--device", "cuda"], "no CUDA device", marks=NO_CUDA),
    (["calibrate", "--device", "cuda:99"], "device 'cuda:99'"),
    (["calibrate", "--quick", "--acceptance", "--corpus", "{latin1.jsonl}"], "not UTF-8 text"),
    # plan
    (["plan", "--hardware", "no-such-gpu"], "unknown hardware"),
    (["plan", "--model", "no-such-model"], "no-such-model"),
    (["plan", "--batch", "0"], "argument --batch: sizes must be >= 1"),
    (["plan", "--batch", "-4"], "argument --batch: sizes must be >= 1"),
    (["plan", "--batch", ","], "argument --batch: no sizes"),
    (["plan", "--context", "0"], "argument --context: sizes must be >= 1"),
    (["plan", "--acceptance", "{corrupt.json}"], "corrupt.json: not a valid acceptance table (invalid JSON"),
    (["plan", "--acceptance", "{empty.json}"], "empty.json: not a valid acceptance table"),
    (["plan", "--acceptance", "{list.json}"], "list.json: not a valid acceptance table (expected a JSON object"),
    (["plan", "--acceptance", "{no_rates.json}"], "holds no rates"),
    (["plan", "--acceptance", "{no_alpha.json}"], "lacks 'alpha'"),
    (["plan", "--acceptance", "{text_alpha.json}"], "expected a number, got 'high'"),
    (["plan", "--hardware", "{profile_lacks.json}"], "hardware profile lacks mem_bytes"),
    (["plan", "--hardware", "{profile_text.json}"], "flops_per_s must be a finite number, got 'fast'"),
    (["plan", "--model", "{corrupt.json}"], "corrupt.json: not a valid model config"),
    # bench: everything is checked before the model is loaded
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--modes", "bogus"], "unknown mode bogus"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--positions", "bogus"], "unknown positions bogus"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--drafters", "none,bogus"], "unknown drafter bogus"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--gamma", "17"], "gamma must be an integer in [1, 16]"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--budget", "4"], "budget must be an integer >= 8"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--draft-stop", "0,x"], "argument --draft-stop: not a number"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--draft-vocab", "0,1k", "--vocab-corpus", "/no/such.txt"],
     "corpus file not found: /no/such.txt"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--out", "{corrupt.json}"], "--out"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--out", "{bench_list.json}"], "expected a JSON object"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--out", "{bench_points.json}"], "'points' must map"),
    (["bench", "--model", NO_MODEL, "--corpus", "{latin1.jsonl}"], "not UTF-8 text"),
    (["bench", "--model", NO_MODEL, "--corpus", str(DATA), "--repeats", "0"], "argument --repeats: must be >= 1"),
    # serve (a too-large --max-running is tests/test_server.py's)
    (["serve", "--port", "70000"], "argument --port: not a TCP port"),
    (["serve", "--max-running", "0"], "argument --max-running"),
    (["serve", "--max-model-len", "0"], "argument --max-model-len"),
    (["serve", "--model", NO_MODEL], "does not exist"),
]


@pytest.fixture
def files(tmp_path, monkeypatch) -> dict[str, str]:
    """The bad files of the cases, by name; and a magicdec cache holding corrupt calibration results."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MAGICDEC_CACHE", str(cache))
    for name in ("hardware-cpu-fp32.json", "acceptance-tiny.json"):
        (cache / name).write_text("{")
    for name, content in FILES.items():
        (tmp_path / name).write_bytes(content)
    return {name: str(tmp_path / name) for name in FILES}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_input_is_one_line_and_exit_2(argv, message, files, tiny_gguf, capsys):
    for name, path in files.items():
        argv = [a.replace(f"{{{name}}}", path) for a in argv]
    if argv[0] == "generate":
        defaults = {"--model": str(tiny_gguf), "--max-tokens": "2"}
        argv += [arg for flag, value in defaults.items() if flag not in argv for arg in (flag, value)]
    code, err = run_cli(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("magicdec: error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_library_notices_go_to_stderr_as_it_is_when_they_are_logged(capsys):
    """`main` sets up the library's notices (a kernel being compiled) on stderr; a later notice goes to the stderr of
    its moment, not to the one `main` saw (here a test's capture, closed since: a notice there printed a logging error
    into whichever test compiled the kernels next)."""
    assert run_cli(["plan", "--hardware", "h100", "--batch", "1", "--context", "1k"], capsys)[0] == 0
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        logging.getLogger("magicdec.kernels").info("a notice")
    assert stderr.getvalue() == "magicdec: a notice\n"
