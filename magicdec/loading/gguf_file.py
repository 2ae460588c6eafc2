"""GGUF files (llama and gemma3 architectures): metadata -> ModelConfig, tensors dequantized with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from magicdec.config import GLOBAL, SLIDING, ConfigFieldError, ModelConfig
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


#: The GGUF metadata key of each ModelConfig field, after the architecture's prefix ("llama.", "gemma3.") where it
#: starts with a dot.
GGUF_KEYS = {
    "vocab_size": ".vocab_size", "dim": ".embedding_length", "n_layers": ".block_count",
    "n_heads": ".attention.head_count", "n_kv_heads": ".attention.head_count_kv",
    "ffn_dim": ".feed_forward_length", "head_dim": ".attention.key_length",
    "norm_eps": ".attention.layer_norm_rms_epsilon", "rope_theta": ".rope.freq_base",
    "max_seq_len": ".context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_ids": "tokenizer.ggml.eos_token_id", "sliding_window": ".attention.sliding_window",
}
#: GGUF architectures and the Hugging Face architecture each is loaded as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
#: Gemma 3's RoPE base of the sliding-window layers (a constant of the family, not in GGUF metadata, as in llama.cpp).
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
#: Gemma 3 layers per global layer (llama.cpp's swa pattern): layers 5, 11, 17, ... attend globally.
GEMMA3_PATTERN = 6


def config_from_gguf(meta: dict) -> ModelConfig:
    """The model's config from GGUF metadata; bad values raise ModelLoadError naming the key."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} (supported: "
                                    f"{', '.join(map(repr, GGUF_ARCHITECTURES))})")
    keys = {f: arch + k if k.startswith(".") else k for f, k in GGUF_KEYS.items()}

    def value(field: str, default: object = None) -> object:
        return meta.get(keys[field], default)

    def required(field: str) -> object:
        if value(field) is None:
            raise ModelLoadError(f"GGUF metadata lacks {keys[field]}")
        return value(field)

    n_heads = required("n_heads")
    tokens = meta.get("tokenizer.ggml.tokens")
    try:
        return ModelConfig(
            vocab_size=value("vocab_size") or (len(tokens) if isinstance(tokens, list) else 0),
            dim=required("dim"), n_layers=required("n_layers"), n_heads=n_heads,
            n_kv_heads=value("n_kv_heads", n_heads), ffn_dim=required("ffn_dim"),
            head_dim=value("head_dim") or meta.get(f"{arch}.rope.dimension_count") or 0,
            norm_eps=value("norm_eps", 1e-5), rope_theta=value("rope_theta", 10000.0),
            max_seq_len=value("max_seq_len", 4096),
            tie_embeddings=False,  # decided by the presence of output.weight, see load_gguf_state_dict
            bos_token_id=value("bos_token_id"), eos_token_ids=_eos_ids(meta, value("eos_token_ids")),
            architecture=GGUF_ARCHITECTURES[arch],
            **(_gemma3_fields(meta, value("sliding_window"), required("n_layers")) if arch == "gemma3" else {}),
        )
    except ConfigFieldError as e:
        raise e.renamed(keys) from None


def _eos_ids(meta: dict, eos: object) -> tuple:
    """The end-of-sequence token, and a chat model's end-of-turn token where the vocabulary has one (Gemma's
    generation config stops at both)."""
    ids = () if eos is None else (eos,)
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and "<end_of_turn>" in tokens and meta.get("general.architecture") == "gemma3":
        ids += (tokens.index("<end_of_turn>"),)
    return ids


def _gemma3_fields(meta: dict, window: object, n_layers: object) -> dict:
    """The Gemma 3 conventions (see ModelConfig), from GGUF metadata and the family's constants."""
    if meta.get("gemma3.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"Gemma 3 RoPE scaling {meta['gemma3.rope.scaling.type']!r} (the 4B and larger "
                                    "models) is not implemented")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_PATTERN)
    if not isinstance(n_layers, int) or not isinstance(pattern, int):
        raise ModelLoadError("GGUF metadata: gemma3.block_count and the sliding window pattern must be integers")
    dim, heads = meta.get("gemma3.embedding_length"), meta.get("gemma3.attention.head_count")
    return {
        "layer_types": tuple(GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)),
        "sliding_window": window, "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA, "qk_norm": True,
        "sandwich_norms": True, "activation": "gelu_tanh", "scale_embeddings": True,
        "final_logit_softcap": meta.get("gemma3.final_logit_softcapping"),
        # as llama.cpp: the 27B model (62 layers) scales by dim / heads, the others by the head size
        "query_pre_attn_scalar": dim // heads if n_layers == 62 and isinstance(dim, int) else None,
    }


def _unpermute(name: str, w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights (back to the half-split layout)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"weights do not match the config: {name} has shape {tuple(w.shape)}, "
                             f"whose {rows} rows do not split into {n_heads} heads of rotary pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


#: GGUF tensor names -> Hugging Face Llama names (blk.N.<name> -> model.layers.N.<name>)
LLAMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
#: ... and Gemma 3's, whose `ffn_norm` is the norm before the MLP (Llama's post-attention norm is also before it)
GEMMA3_NAMES = {
    **LLAMA_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def load_gguf_state_dict(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and return a state dict in Hugging Face naming and conventions."""
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    names = GEMMA3_NAMES if gemma else LLAMA_NAMES
    sd = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.N.attn_q.weight | token_embd.weight
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        elif parts[0] in names and len(parts) == 2:
            key = f"{names[parts[0]]}.{parts[1]}"
        else:
            continue  # e.g. rope_freqs (recomputed from the config); a tensor the model lacks is reported later
        w = _dequantize(t)
        if gemma and parts[-2].endswith("norm"):
            w = w - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w (Gemma's RMSNorm scales by 1 + w)
        elif parts[-2] in ("attn_q", "attn_k") and not gemma:  # llama.cpp permutes Llama's q/k rows, not Gemma's
            w = _unpermute(t.name, w, cfg.n_heads if parts[-2] == "attn_q" else cfg.n_kv_heads)
        sd[key] = w
    return sd


def _dequantize(t) -> torch.Tensor:
    """One GGUF tensor in fp32, in torch's [out, in] order."""
    from gguf.quants import dequantize

    if t.tensor_type.name not in SUPPORTED_QUANTS:
        raise UnsupportedModelError(f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name}")
    shape = tuple(int(x) for x in reversed(t.shape))
    arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())
