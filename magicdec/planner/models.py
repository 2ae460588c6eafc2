"""Model shapes: the dimensions of a decoder-only transformer that decide its cost (no torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from magicdec.jsonfile import read_json_object


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Dimensions of a Llama-style decoder (GQA attention, SwiGLU MLP, RMSNorm)."""

    name: str = "custom"
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    sliding_layers: int = 0  # layers attending over the last `sliding_window` keys only (Gemma 3: 5 of 6)
    sliding_window: int = 0

    def __post_init__(self) -> None:
        for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def n_params_linear(self) -> int:
        """Parameters that take part in a matmul each forward pass: q/k/v/o, gate/up/down, lm head.

        The embedding table is not counted: a forward pass gathers B*q rows of it, it does not stream it (when tied,
        the same matrix is counted once, as the lm head)."""
        attention = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attention += self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        return self.n_layers * (attention + mlp) + self.dim * self.vocab_size

    @property
    def n_params(self) -> int:
        """All parameters: linear ones, the embedding table unless tied, and RMSNorm weights."""
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim
        norms = (2 * self.n_layers + 1) * self.dim
        return self.n_params_linear + embedding + norms

    def weight_bytes(self, dtype_bytes: float) -> float:
        """Memory the weights occupy at `dtype_bytes` per parameter."""
        return self.n_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes of K and V cache that one token adds across the layers whose cache grows with the context (all but
        the sliding-window ones)."""
        return 2 * (self.n_layers - self.sliding_layers) * self.n_kv_heads * self.head_dim * dtype_bytes

    def window_keys(self, context: int) -> int:
        """Keys a sliding-window layer attends at this context (0 without such layers)."""
        return min(context, self.sliding_window) if self.sliding_layers else 0

    def window_kv_bytes(self, context: int, dtype_bytes: float) -> float:
        """Bytes of K and V that the sliding-window layers of one sequence hold and read at this context."""
        return 2 * self.sliding_layers * self.window_keys(context) * self.n_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelShape:
        """Build a shape from a Hugging Face Llama-family `config.json` dict."""
        try:
            n_heads = config["num_attention_heads"]
            dim = config["hidden_size"]
            return cls(
                name=name or config.get("_name_or_path") or config.get("model_type") or "custom",
                n_layers=config["num_hidden_layers"], dim=dim, n_heads=n_heads,
                n_kv_heads=config.get("num_key_value_heads") or n_heads,
                # Some configs carry "head_dim": null; then it is the usual dim / heads (0, refused, when those are
                # not positive integers themselves).
                head_dim=config.get("head_dim") or (dim // n_heads if _positive_ints(dim, n_heads) else 0),
                ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ValueError(f"config is missing {e.args[0]!r}; is it a Llama-family config.json?") from None


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


MODEL_PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # togethercomputer/LLaMA-2-7B-32K
        ModelShape(name="llama-2-7b-32k", n_layers=32, dim=4096, n_heads=32, n_kv_heads=32,
                   head_dim=128, ffn_dim=11008, vocab_size=32000),
        # meta-llama/Llama-3.1-8B
        ModelShape(name="llama-3.1-8b", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
                   head_dim=128, ffn_dim=14336, vocab_size=128256),
        # TinyLlama/TinyLlama_v1.1 (TinyLlama-1.1B)
        ModelShape(name="tinyllama-1.1b", n_layers=22, dim=2048, n_heads=32, n_kv_heads=4,
                   head_dim=64, ffn_dim=5632, vocab_size=32000),
        # HuggingFaceTB/SmolLM2-135M
        ModelShape(name="smollm2-135m", n_layers=30, dim=576, n_heads=9, n_kv_heads=3,
                   head_dim=64, ffn_dim=1536, vocab_size=49152, tie_embeddings=True),
        # meta-llama/Llama-3.2-1B
        ModelShape(name="llama-3.2-1b", n_layers=16, dim=2048, n_heads=32, n_kv_heads=8,
                   head_dim=64, ffn_dim=8192, vocab_size=128256, tie_embeddings=True),
        # google/gemma-3-270m: 15 of 18 layers attend over a 512-token window
        ModelShape(name="gemma3-270m", n_layers=18, dim=640, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=2048,
                   vocab_size=262144, tie_embeddings=True, sliding_layers=15, sliding_window=512),
    )
}


def get_model_shape(name_or_path: str | os.PathLike[str]) -> ModelShape:
    """Return the preset called `name_or_path`, or read a `config.json` (file or model folder)."""
    key = os.fspath(name_or_path)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = os.path.join(key, "config.json") if os.path.isdir(key) else key
    if os.path.isfile(path):
        # Name it after its folder, as Hugging Face names models after their repository.
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        return ModelShape.from_hf_config(read_json_object(path, "model config"), name=folder)
    raise ValueError(
        f"unknown model {key!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}) "
        "and not a config.json or a folder holding one"
    )
