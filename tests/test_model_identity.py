"""model_identity: results name a checkpoint by its name and a content hash, not by a path."""

import hashlib

from magicdec.loading import model_identity


def test_gguf_file_named_by_stem_and_content(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.Q4.gguf", tmp_path / "b" / "m.Q4.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF weights")
    assert model_identity(a) == model_identity(b) == {
        "name": "m.Q4", "sha256": hashlib.sha256(b"GGUF weights").hexdigest()[:16]}
    b.write_bytes(b"GGUF other weights")
    assert model_identity(b)["sha256"] != model_identity(a)["sha256"]


def test_folder_named_by_folder_and_its_safetensors(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    (folder / "model-00001.safetensors").write_bytes(b"one")
    (folder / "model-00002.safetensors").write_bytes(b"two")
    (folder / "config.json").write_text("{}")
    ident = model_identity(folder)
    assert ident["name"] == "SmolLM2-135M" and len(ident["sha256"]) == 16
    (folder / "config.json").write_text('{"changed": 1}')  # only the weights count
    assert model_identity(folder) == ident
