"""The README and the guides stay true: every `magicdec ...` command they show parses with the CLI's own parser, and
every relative link points at a file of the repository."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from magicdec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def shell_lines(block: str) -> list[str]:
    """A code block's commands: continuation lines joined, commands chained with `&&` apart."""
    return [cmd for line in block.replace("\\\n", " ").splitlines() for cmd in line.split("&&") if cmd.strip()]


def magicdec_argv(line: str) -> list[str] | None:
    """The arguments after `magicdec` (or `torchrun ... -m magicdec`, `python -m magicdec`) on a shell line, else None;
    environment assignments and a trailing comment are dropped."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and ENV.match(words[0]):
        words = words[1:]
    if words[:1] == ["magicdec"]:
        return words[1:]
    if words[:1] in (["torchrun"], ["python"], ["python3"]) and "-m" in words:
        i = words.index("-m")
        if words[i + 1:i + 2] == ["magicdec"]:
            return words[i + 2:]
    return None


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in shell_lines(block):
                argv = magicdec_argv(line)
                if argv is not None:
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()[:80]}", argv))
    return found


COMMANDS = commands()


def test_the_pages_show_commands():
    shown = {argv[0] for _, argv in COMMANDS if argv}
    assert {"generate", "bench", "plan", "calibrate", "serve"} <= shown, shown


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_shown_parses(where, argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: the CLI refuses it (exit {e.code}): {err.getvalue().strip()}")


def test_the_readme_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "bash scripts/setup.sh --test && python -m pytest -q -n 2 tests"
    assert test_command in ci and test_command in readme
    assert ("bash scripts/setup.sh && magicdec generate --corpus ../shared/data/pg19_dev.jsonl --num-prompts 8 "
            "--prompt-tokens 8000 --n 4 --max-tokens 64 --temperature 0.7 --top-p 0.9 --seed 0 --draft auto "
            "--compare-ar") in readme


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor in the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
