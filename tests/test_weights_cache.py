"""The converted-weights cache: keyed on content, verified on load, repaired when damaged, never required."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import set_gguf_metadata, write_tiny_gguf

from magicdec.errors import MagicDecWarning
from magicdec.loading import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("MAGICDEC_CACHE", str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def entries(cache: Path) -> list[Path]:
    return sorted(p.parent for p in cache.glob("*/manifest.json"))


def set_times(path: Path, st: os.stat_result) -> None:
    """Give `path` the access and modification times of `st`, as `touch -r` does."""
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_second_load_reads_the_entry(tiny_gguf, cache):
    first = load_model(tiny_gguf, device="cpu")
    [entry] = entries(cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_model(tiny_gguf, device="cpu")
    assert same_weights(first, again)
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == stamps  # read, not rewritten


def test_a_file_edited_in_place_with_its_old_mtime_is_converted_again(tiny_gguf, tmp_path, cache):
    path = Path(shutil.copy(tiny_gguf, tmp_path / "tiny.gguf"))
    assert load_model(path, device="cpu").model.cfg.max_seq_len == 1024
    before = path.stat()
    set_gguf_metadata(path, "llama.context_length", "512")
    set_times(path, before)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert load_model(path, device="cpu").model.cfg.max_seq_len == 512
    assert len(entries(cache)) == 2


def test_same_name_size_and_mtime_do_not_share_an_entry(tiny_gguf, tmp_path, cache):
    """Two copies of one GGUF, one with a changed metadata value and the other's mtime."""
    a, b = tmp_path / "a" / tiny_gguf.name, tmp_path / "b" / tiny_gguf.name
    for path in (a, b):
        path.parent.mkdir()
        shutil.copy2(tiny_gguf, path)
    set_gguf_metadata(b, "llama.context_length", "512")
    set_times(b, a.stat())
    assert (a.name, a.stat().st_size, a.stat().st_mtime_ns) == (b.name, b.stat().st_size, b.stat().st_mtime_ns)
    assert load_model(a, device="cpu").model.cfg.max_seq_len == 1024
    assert load_model(b, device="cpu").model.cfg.max_seq_len == 512
    assert len(entries(cache)) == 2


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def manifest_of_another_file(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps({**manifest, "source_sha256": "0" * 64}))


DAMAGE = {
    "truncated weights": (lambda e: truncate(e / "model.safetensors"), "model.safetensors"),
    "broken config": (lambda e: (e / "config.json").write_text("{"), "config.json"),
    "missing tokenizer": (lambda e: (e / "tokenizer.json").unlink(), "tokenizer.json"),
    "missing manifest": (lambda e: (e / "manifest.json").unlink(), "manifest.json"),
    "manifest of another file": (manifest_of_another_file, "manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_named_and_converted_again(tiny_gguf, cache, damage):
    first = load_model(tiny_gguf, device="cpu")
    [entry] = entries(cache)
    harm, file = DAMAGE[damage]
    harm(entry)
    with pytest.warns(MagicDecWarning, match=file):
        again = load_model(tiny_gguf, device="cpu")
    assert same_weights(first, again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tiny_gguf, device="cpu")  # the entry is whole again


def test_folders_of_interrupted_conversions_are_removed(tiny_gguf, cache):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = cache / f"tiny-0123.tmp-{finished.stdout.strip()}"
    live = cache / f"tiny-4567.tmp-{os.getpid()}"
    for folder in (dead, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    load_model(tiny_gguf, device="cpu")
    assert not dead.exists() and live.exists()
    assert [p.name for p in cache.glob("*.tmp-*")] == [live.name]


@pytest.mark.parametrize("where", ["a file", "a folder under a file"])
def test_an_unwritable_cache_converts_in_memory_with_a_warning(tiny_gguf, tmp_path, monkeypatch, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MAGICDEC_CACHE", str(blocker if where == "a file" else blocker / "cache"))
    with pytest.warns(MagicDecWarning, match="MAGICDEC_CACHE") as caught:
        loaded = load_model(tiny_gguf, device="cpu")
    assert len(caught) == 1 and str(blocker) in str(caught[0].message)
    assert loaded.model.cfg.n_layers == 2 and blocker.read_text() == "not a folder"


def test_the_command_line_prints_the_warning_as_one_line(tiny_gguf, tmp_path, monkeypatch, capsys):
    from magicdec.cli import main

    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("MAGICDEC_CACHE", str(blocker))
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", "ab", "--max-tokens", "2"]) == 0
    warning_lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning_lines) == 1 and warning_lines[0].startswith("magicdec: warning: cannot write")
