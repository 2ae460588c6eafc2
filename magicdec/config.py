"""Configuration: the dimensions and conventions of a Llama-family transformer (`ModelConfig`), and how an engine
over it is sized (`EngineConfig`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from magicdec.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

#: The Hugging Face `config.json` key of each field, to name the key a user can fix in error messages.
HF_KEYS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
    "head_dim": "head_dim", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
    "max_seq_len": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
    "bos_token_id": "bos_token_id", "eos_token_ids": "eos_token_id", "architecture": "architectures",
}


class ConfigFieldError(ModelLoadError):
    """A config value of the wrong type or out of range; `field` is the ModelConfig field it went to."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem

    def renamed(self, keys: dict[str, str]) -> ModelLoadError:
        """The same error, naming the field by its key in the file it came from."""
        return ModelLoadError(f"{keys.get(self.field, self.field)} {self.problem}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder-only Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2).

    Every value is checked on construction (types, ranges, consistency), so a config that would make the forward pass
    fail or produce NaN is refused with a ConfigFieldError naming the field."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise ConfigFieldError(name, f"must be a positive integer, got {getattr(self, name)!r}")
        if not (_is_int(self.head_dim) and self.head_dim >= 0):
            raise ConfigFieldError("head_dim", f"must be a positive integer, got {self.head_dim!r}")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigFieldError("dim", f"({self.dim}) is not a multiple of the number of heads ({self.n_heads})")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ConfigFieldError("head_dim", f"must be even (rotary embeddings turn pairs), got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if not (_is_real(self.norm_eps) and self.norm_eps > 0):
            raise ConfigFieldError("norm_eps", f"must be a finite number > 0, got {self.norm_eps!r}")
        # Below 1 the rotary frequencies exceed one turn per token, and a tiny base overflows them to inf.
        if not (_is_real(self.rope_theta) and self.rope_theta >= 1):
            raise ConfigFieldError("rope_theta", f"must be a finite number >= 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigFieldError(name, f"must be true or false, got {getattr(self, name)!r}")

        def is_token(i: Any) -> bool:
            return _is_int(i) and 0 <= i < self.vocab_size

        if not (self.bos_token_id is None or is_token(self.bos_token_id)):
            raise ConfigFieldError("bos_token_id", f"must be a token id in [0, {self.vocab_size}), got "
                                                   f"{self.bos_token_id!r}")
        if not (isinstance(self.eos_token_ids, tuple) and all(map(is_token, self.eos_token_ids))):
            raise ConfigFieldError("eos_token_ids", f"must be token ids in [0, {self.vocab_size}), got "
                                                    f"{self.eos_token_ids!r}")
        _check_architecture(self.architecture)

    @staticmethod
    def _check_rope_scaling(rs: Any) -> None:
        """Llama 3 frequency scaling (the only kind kept in a config): what `model.rope_inv_freq` reads."""
        if not isinstance(rs, dict):
            raise ConfigFieldError("rope_scaling", f"must be an object, got {rs!r}")
        factors = {"factor": rs.get("factor"), "low_freq_factor": rs.get("low_freq_factor", 1.0),
                   "high_freq_factor": rs.get("high_freq_factor", 4.0)}
        for key, value in factors.items():
            if not (_is_real(value) and value > 0):
                raise ConfigFieldError("rope_scaling", f"needs '{key}', a finite number > 0 (got {value!r})")
        if factors["high_freq_factor"] <= factors["low_freq_factor"]:
            raise ConfigFieldError("rope_scaling", "needs high_freq_factor > low_freq_factor")
        old_ctx = rs.get("original_max_position_embeddings")
        if not (_is_int(old_ctx) and old_ctx >= 1):
            raise ConfigFieldError("rope_scaling", f"needs 'original_max_position_embeddings', a positive integer "
                                                   f"(got {old_ctx!r})")

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V that one token occupies in a cache, over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dictionary; bad values raise ModelLoadError naming the key."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"a config must be a JSON object, got {cfg!r}")
        try:
            return cls._from_hf(cfg)
        except ConfigFieldError as e:
            raise e.renamed(HF_KEYS) from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        def required(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelLoadError(f"config lacks {key!r}")
            return cfg[key]

        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ConfigFieldError("architecture", f"must be a list of names, got {archs!r}")
        arch = archs[0]
        _check_architecture(arch)  # first: another family's config lacks the keys read below
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 nests rope settings under `rope_parameters`.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None:
            if not isinstance(rope_scaling, dict):
                raise ConfigFieldError("rope_scaling", f"must be an object, got {rope_scaling!r}")
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")
            if kind in ("default", None):
                rope_scaling = None
        n_heads = required("num_attention_heads")
        config = cls(
            vocab_size=required("vocab_size"),
            dim=required("hidden_size"),
            n_layers=required("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"],
            ffn_dim=required("intermediate_size"),
            head_dim=cfg.get("head_dim") or 0,
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=10000.0 if rope_theta is None else rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )
        window = cfg.get("sliding_window")
        uses_window = arch == "MistralForCausalLM" or cfg.get("use_sliding_window", False) is True
        if uses_window and window is not None:
            if not (_is_int(window) and window >= 1):
                raise ModelLoadError(f"sliding_window must be a positive integer or null, got {window!r}")
            # Sliding-window attention is not implemented: within the window it equals full attention, so the usable
            # context is capped at the window.
            config = dataclasses.replace(config, max_seq_len=min(config.max_seq_len, window))
        return config


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is sized, passed whole to it; its memory is planned once from these values.

    max_num_seqs: request slots (requests running at once); max_model_len: most prompt + output tokens of one request
    (None: the model's context); prefill_chunk: prompt tokens per prefill forward; max_prefill_tokens: prompt tokens
    prefilled per step across requests (None: every admitted prompt at once, as an offline batch wants; a server
    bounds it so that arrivals do not stall running streams); kv_dtype: the KV cache's dtype (None: the model's);
    max_queued: most waiting requests (None: unbounded); enable_prefix_caching: keep the K/V of requests' token
    blocks for later requests with the same prefix (`magicdec.kv.prefix_cache`); prefix_cache_bytes: the most that
    cache holds (None: a quarter of the memory available when it is made)."""

    max_num_seqs: int = 256
    max_model_len: int | None = None
    prefill_chunk: int = 512
    max_prefill_tokens: int | None = None
    kv_dtype: torch.dtype | None = None
    max_queued: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_model_len", "max_prefill_tokens", "max_queued"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidRequestError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not (self.prefix_cache_bytes is None or (_is_int(self.prefix_cache_bytes) and self.prefix_cache_bytes >= 0)):
            raise InvalidRequestError(f"prefix_cache_bytes must be an integer >= 0, got {self.prefix_cache_bytes!r}")
