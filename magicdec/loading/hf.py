"""Hugging Face checkpoint folders: config.json + (sharded) safetensors + tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from magicdec.config import ModelConfig
from magicdec.errors import ModelLoadError


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{path}: invalid config ({type(e).__name__}: {e})") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = [folder / "model.safetensors"]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{folder}: missing weight file(s): {', '.join(missing)}")
    return files


def load_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, in Hugging Face naming and stored dtype."""
    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    return sd


def to_magicdec_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama naming -> this project's naming, fusing q/k/v and gate/up projections."""

    def take(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}") from None

    out = {
        "tok_embeddings.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        out[o + "attention.wqkv.weight"] = torch.cat([take(attn + f"{x}_proj.weight") for x in "qkv"])
        if cfg.qkv_bias:
            out[o + "attention.wqkv.bias"] = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"])
        out[o + "attention.wo.weight"] = take(attn + "o_proj.weight")
        out[o + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        out[o + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
        mlp = p + "mlp."
        out[o + "feed_forward.w13.weight"] = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        out[o + "feed_forward.w2.weight"] = take(mlp + "down_proj.weight")
    return out
