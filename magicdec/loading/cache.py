"""The converted-weights cache: a GGUF file dequantized once into fp32 safetensors, config and tokenizer.

Layout of `cache_root()` (`$MAGICDEC_CACHE`, else ~/.cache/magicdec):

    <stem>-<sha256 prefix>/        one entry per GGUF *content*: config.json, model.safetensors,
                                   tokenizer.json, and manifest.json (the source's SHA-256 and each
                                   file's size), renamed into place only once complete
    <entry>.tmp-<pid>/             a conversion in progress (left behind if that process died)
    sha256/<path hash>.json        a GGUF file's SHA-256, with the file's identity when it was hashed

Entries are keyed by content, not by name, size and mtime: two different files can share all three (a copy edited
with `gguf-set-metadata` and `touch -r`), and must not share converted weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from magicdec.config import ModelConfig
from magicdec.errors import MagicDecError, MagicDecWarning
from magicdec.jsonfile import read_json_object
from magicdec.loading.gguf_file import config_from_gguf, gguf_metadata, load_gguf_state_dict, read_gguf
from magicdec.loading.hf import to_magicdec_names
from magicdec.loading.tokenizer import Tokenizer, read_tokenizer_file, tokenizer_from_gguf_fields

CACHE_ENV = "MAGICDEC_CACHE"
ENTRY_FILES = ("config.json", "model.safetensors", "tokenizer.json")
MANIFEST = "manifest.json"


@dataclass
class Converted:
    """A GGUF model in the form the loader builds from: config, fp32 weights (magicdec naming), tokenizer."""

    cfg: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer: Tokenizer


class _DamagedEntry(Exception):
    """A cache entry that cannot be used as it is; the message names the file."""


def cache_root() -> Path:
    """`$MAGICDEC_CACHE`, else ~/.cache/magicdec."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "magicdec")


def load_gguf(path: Path) -> Converted:
    """Config, fp32 weights and tokenizer of a GGUF file: from its cache entry, else converted (and cached).

    A damaged entry is converted again. Where the cache cannot be written (read-only, or not a folder), the file is
    converted in memory with a MagicDecWarning; that is checked before the conversion work."""
    digest = content_digest(path)
    root = cache_root()
    entry = root / f"{path.stem}-{digest[:24]}"
    if entry.exists():
        try:
            return _read_entry(entry, digest)
        except _DamagedEntry as e:
            _warn(f"{e}; converting {path.name} again")
            shutil.rmtree(entry, ignore_errors=True)  # where the cache is writable
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        _warn(f"cannot write the converted-weights cache {root} ({e.strerror or e}); converting {path.name} "
              f"in memory, which every load repeats: set {CACHE_ENV} to a writable folder")
        return convert_gguf(path)
    try:
        _remove_stale_conversions(root)
        converted = convert_gguf(path)
        try:
            _write_entry(tmp, converted, digest, path)
            _publish(tmp, entry)
        except OSError as e:
            _warn(f"could not save the converted weights of {path.name} in {root} ({e.strerror or e}); "
                  "the next load converts again")
        return converted
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when published


def convert_gguf(path: Path) -> Converted:
    """Parse and dequantize a GGUF file."""
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    cfg = config_from_gguf(meta)
    sd = load_gguf_state_dict(reader, cfg)
    cfg = dataclasses.replace(cfg, tie_embeddings="lm_head.weight" not in sd)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    tok = Tokenizer(tokenizer_from_gguf_fields(meta), cfg.bos_token_id, cfg.eos_token_ids, add_bos)
    return Converted(cfg, to_magicdec_names(sd, cfg), tok)


def content_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, hashed once per version of the file and remembered in the cache.

    Hashing the whole file is the only key that is correct (a header plus a strided sample misses an edit between the
    samples), but it reads every byte of the file, on every load. So the digest is kept with the file's (device,
    inode, size, mtime, ctime): any write to the file, and any `touch`, even `touch -r` that restores the old mtime,
    sets the ctime to now, and no call sets it back; a copy is a new inode. While all five match, the file holds the
    bytes that were hashed."""
    path = path.resolve()
    st = path.stat()
    identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    memo = cache_root() / "sha256" / f"{hashlib.sha256(os.fsencode(path)).hexdigest()[:32]}.json"
    try:
        saved = json.loads(memo.read_text())
        if saved["identity"] == identity:
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not hashed before, or an unreadable memo: hash it
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(path), "identity": identity, "sha256": digest}))
        tmp.replace(memo)
    except OSError:
        pass  # a read-only cache: hash again next time (load_gguf warns about the cache)
    return digest


def _read_entry(entry: Path, digest: str) -> Converted:
    if not (entry / MANIFEST).is_file():
        raise _DamagedEntry(f"converted-weights cache entry {entry} has no {MANIFEST}")
    manifest = read_json_object(entry / MANIFEST, "converted-weights manifest", _DamagedEntry)
    if manifest.get("source_sha256") != digest:
        raise _DamagedEntry(f"{entry / MANIFEST} does not belong to this GGUF file")
    sizes = manifest.get("files")
    for name in ENTRY_FILES:
        file = entry / name
        expected = sizes.get(name) if isinstance(sizes, dict) else None
        if not file.is_file() or file.stat().st_size != expected:
            raise _DamagedEntry(f"converted-weights cache file {file} is missing or damaged")
    raw = read_json_object(entry / "config.json", "converted config", _DamagedEntry)
    try:
        add_bos = raw.pop("add_bos")
        cfg = ModelConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})
        sd = load_file(str(entry / "model.safetensors"))
        tok = Tokenizer(read_tokenizer_file(entry / "tokenizer.json"), cfg.bos_token_id, cfg.eos_token_ids, add_bos)
    except (OSError, KeyError, TypeError, MagicDecError, SafetensorError) as e:
        raise _DamagedEntry(f"converted-weights cache entry {entry} is damaged ({type(e).__name__}: {e})") from None
    return Converted(cfg, sd, tok)


def _write_entry(folder: Path, converted: Converted, digest: str, source: Path) -> None:
    save_file(converted.state_dict, str(folder / "model.safetensors"))
    converted.tokenizer.save(folder / "tokenizer.json")
    config = {**dataclasses.asdict(converted.cfg), "add_bos": converted.tokenizer.add_bos}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    # Written last: an entry with a manifest that matches its files is complete.
    manifest = {"source": str(source), "source_sha256": digest,
                "files": {name: (folder / name).stat().st_size for name in ENTRY_FILES}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _publish(tmp: Path, entry: Path) -> None:
    """Rename a complete conversion into place, so a concurrent load never sees half an entry."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if not (entry / MANIFEST).exists():  # else another process published the same conversion first
            raise


def _remove_stale_conversions(root: Path) -> None:
    """Remove the temporary folders of conversions whose process is gone (each about the model's fp32 size)."""
    for folder in root.glob("*.tmp-*"):
        pid = folder.name.rpartition(".tmp-")[2]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _warn(message: str) -> None:
    warnings.warn(message, MagicDecWarning, stacklevel=3)
