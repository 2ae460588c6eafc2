"""GGUF files (llama architecture): metadata -> ModelConfig, tensors dequantized with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from magicdec.config import ConfigFieldError, ModelConfig
from magicdec.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_K"}


def read_gguf(path: Path):
    """Open a GGUF file; any parse failure (truncated, corrupt) becomes a ModelLoadError."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_metadata(reader) -> dict:
    """All key/value metadata of a GGUF file as plain Python values."""
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"unreadable GGUF metadata ({type(e).__name__}: {e})") from None


#: The GGUF metadata key of each ModelConfig field, for error messages.
GGUF_KEYS = {
    "vocab_size": "llama.vocab_size", "dim": "llama.embedding_length", "n_layers": "llama.block_count",
    "n_heads": "llama.attention.head_count", "n_kv_heads": "llama.attention.head_count_kv",
    "ffn_dim": "llama.feed_forward_length", "head_dim": "llama.attention.key_length",
    "norm_eps": "llama.attention.layer_norm_rms_epsilon", "rope_theta": "llama.rope.freq_base",
    "max_seq_len": "llama.context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_ids": "tokenizer.ggml.eos_token_id",
}


def config_from_gguf(meta: dict) -> ModelConfig:
    """The model's config from GGUF metadata; bad values raise ModelLoadError naming the key."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")

    def value(field: str, default: object = None) -> object:
        return meta.get(GGUF_KEYS[field], default)

    def required(field: str) -> object:
        if value(field) is None:
            raise ModelLoadError(f"GGUF metadata lacks {GGUF_KEYS[field]}")
        return value(field)

    n_heads = required("n_heads")
    eos = value("eos_token_ids")
    tokens = meta.get("tokenizer.ggml.tokens")
    try:
        return ModelConfig(
            vocab_size=value("vocab_size") or (len(tokens) if isinstance(tokens, list) else 0),
            dim=required("dim"), n_layers=required("n_layers"), n_heads=n_heads,
            n_kv_heads=value("n_kv_heads", n_heads), ffn_dim=required("ffn_dim"),
            head_dim=value("head_dim") or meta.get("llama.rope.dimension_count") or 0,
            norm_eps=value("norm_eps", 1e-5), rope_theta=value("rope_theta", 10000.0),
            max_seq_len=value("max_seq_len", 4096),
            tie_embeddings=False,  # decided by the presence of output.weight, see load_gguf_state_dict
            bos_token_id=value("bos_token_id"), eos_token_ids=() if eos is None else (eos,),
            architecture="LlamaForCausalLM",
        )
    except ConfigFieldError as e:
        raise e.renamed(GGUF_KEYS) from None


def _unpermute(name: str, w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights (back to the half-split layout)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"weights do not match the config: {name} has shape {tuple(w.shape)}, "
                             f"whose {rows} rows do not split into {n_heads} heads of rotary pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_state_dict(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and return a state dict in Hugging Face Llama naming."""
    from gguf.quants import dequantize

    names = {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    sd = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise UnsupportedModelError(f"GGUF tensor {t.name} has unsupported type {qtype}")
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        elif parts[0] in names and len(parts) == 2:
            key = f"{names[parts[0]]}.{parts[1]}"
        else:
            continue  # e.g. rope_freqs (recomputed from the config); a tensor the model lacks is reported later
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if parts[-2] == "attn_q":
            w = _unpermute(t.name, w, cfg.n_heads)
        elif parts[-2] == "attn_k":
            w = _unpermute(t.name, w, cfg.n_kv_heads)
        sd[key] = w
    return sd
