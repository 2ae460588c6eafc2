"""GGUF files (llama architecture): metadata -> ModelConfig, tensors dequantized with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from magicdec.config import ModelConfig
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
    return {name: field.contents() for name, field in reader.fields.items()}


def config_from_gguf(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")
    p = "llama."
    n_heads = meta[p + "attention.head_count"]
    dim = meta[p + "embedding_length"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    rope_dim = meta.get(p + "rope.dimension_count", dim // n_heads)
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=meta[p + "block_count"],
        n_heads=n_heads,
        n_kv_heads=meta.get(p + "attention.head_count_kv", n_heads),
        ffn_dim=meta[p + "feed_forward_length"],
        head_dim=meta.get(p + "attention.key_length", rope_dim),
        norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.get(p + "rope.freq_base", 10000.0),
        max_seq_len=meta.get(p + "context_length", 4096),
        tie_embeddings=False,  # decided by the presence of output.weight, see load_gguf_state_dict
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        architecture="LlamaForCausalLM",
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights (back to the half-split layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_state_dict(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and return a state dict in Hugging Face Llama naming."""
    from gguf.quants import dequantize

    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    sd = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise UnsupportedModelError(f"GGUF tensor {t.name} has unsupported type {qtype}")
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight
        if parts[0] == "blk":
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        elif parts[0] in names:
            key = f"{names[parts[0]]}.{parts[1]}"
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if parts[-2] == "attn_q":
            w = _unpermute(w, cfg.n_heads)
        elif parts[-2] == "attn_k":
            w = _unpermute(w, cfg.n_kv_heads)
        sd[key] = w
    return sd
