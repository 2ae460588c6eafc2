"""Hugging Face checkpoint folders: config.json + (sharded) safetensors + tokenizer files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from magicdec.config import ModelConfig
from magicdec.errors import MagicDecError, ModelLoadError
from magicdec.jsonfile import read_json_object


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    raw = read_json_object(path, "model config", ModelLoadError)
    try:
        return ModelConfig.from_hf(raw)
    except MagicDecError as e:
        raise type(e)(f"{path}: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards its index names, else model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        files = [folder / "model.safetensors"]
    else:
        weight_map = read_json_object(index, "safetensors index", ModelLoadError).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(s, str) for s in weight_map.values())):
            raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = [folder / _shard_name(index, s) for s in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{folder}: missing weight file(s): {', '.join(missing)}")
    return files


def _shard_name(index: Path, shard: str) -> str:
    """A shard path from an index, refused unless it stays inside the model folder.

    Checked on the path as written, not on the resolved one: symbolic links inside a model folder (as the Hugging
    Face hub cache makes them) are the folder owner's choice and stay allowed."""
    norm = os.path.normpath(shard)
    if os.path.isabs(shard) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
        raise ModelLoadError(f"{index}: shard path {shard!r} points outside the model folder")
    return norm


def load_hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, in Hugging Face naming and stored dtype."""
    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({e})") from None
    return sd


def hf_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of `cfg` must have, in Hugging Face naming, with its shape, layer after layer: a
    config that claims more layers than the checkpoint holds is refused at the first one missing, before any work
    grows with the number it claims."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, cfg.dim)
    yield "model.norm.weight", (cfg.dim,)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            yield f"{p}self_attn.{x}_proj.weight", (rows, cfg.dim)
            if cfg.qkv_bias:
                yield f"{p}self_attn.{x}_proj.bias", (rows,)
        yield f"{p}self_attn.o_proj.weight", (cfg.dim, q)
        yield f"{p}input_layernorm.weight", (cfg.dim,)
        yield f"{p}post_attention_layernorm.weight", (cfg.dim,)
        yield f"{p}mlp.gate_proj.weight", (cfg.ffn_dim, cfg.dim)
        yield f"{p}mlp.up_proj.weight", (cfg.ffn_dim, cfg.dim)
        yield f"{p}mlp.down_proj.weight", (cfg.dim, cfg.ffn_dim)
        yield from _gemma_norm_shapes(cfg, p).items()


#: Gemma's norms beyond Llama's (Hugging Face name -> this project's), and the dimension each normalizes
GEMMA_NORMS = {
    "pre_feedforward_layernorm": ("ffn_norm", "dim"), "post_feedforward_layernorm": ("post_ffn_norm", "dim"),
    "self_attn.q_norm": ("attention.q_norm", "head_dim"), "self_attn.k_norm": ("attention.k_norm", "head_dim"),
}


def _gemma_norm_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    if not cfg.sandwich_norms:
        return {}
    return {f"{prefix}{name}.weight": (getattr(cfg, size),) for name, (_, size) in GEMMA_NORMS.items()}


def check_shapes(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raise ModelLoadError naming the first tensor that is missing or whose shape the config contradicts."""
    for name, shape in hf_shapes(cfg):
        if name not in sd:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        if tuple(sd[name].shape) != shape:
            raise ModelLoadError(f"weights do not match the config: {name} has shape {tuple(sd[name].shape)}, "
                                 f"the config implies {shape}")


def to_magicdec_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama naming -> this project's naming, fusing q/k/v and gate/up projections."""
    check_shapes(sd, cfg)
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        out[o + "attention.wqkv.weight"] = torch.cat([sd[attn + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.qkv_bias:
            out[o + "attention.wqkv.bias"] = torch.cat([sd[attn + f"{x}_proj.bias"] for x in "qkv"])
        out[o + "attention.wo.weight"] = sd[attn + "o_proj.weight"]
        out[o + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        # Llama's post-attention norm is the one before the MLP; Gemma's follows attention, and has its own before
        out[o + ("post_attention_norm" if cfg.sandwich_norms else "ffn_norm") + ".weight"] = \
            sd[p + "post_attention_layernorm.weight"]
        for name, (ours, _) in GEMMA_NORMS.items() if cfg.sandwich_norms else ():
            out[f"{o}{ours}.weight"] = sd[f"{p}{name}.weight"]
        mlp = p + "mlp."
        out[o + "feed_forward.w13.weight"] = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
        out[o + "feed_forward.w2.weight"] = sd[mlp + "down_proj.weight"]
    if cfg.architecture == "Gemma3ForCausalLM":  # Gemma's RMSNorm scales by 1 + w: stored as such here
        out = {name: w.float() + 1.0 if name.endswith("norm.weight") else w for name, w in out.items()}
    return out
