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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM")
#: Layer kinds of a hybrid-attention model: attention over the whole context, or over the last `sliding_window` tokens.
GLOBAL, SLIDING = "global", "sliding"
#: Families named in checkpoints that are refused with their name (each differs from what the model implements).
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (4B and up); only the text-only Gemma3ForCausalLM runs",
    "Gemma2ForCausalLM": "Gemma 2 (attention logit soft-capping is not implemented)",
    "Gemma3nForCausalLM": "Gemma 3n (per-layer embeddings and AltUp are not implemented)",
    "Gemma3nForConditionalGeneration": "Gemma 3n (per-layer embeddings and AltUp are not implemented)",
    "GemmaForCausalLM": "Gemma 1",
}

#: Most layers a config may claim: far more than any model has (Llama 3.1 405B: 126), and few enough that a per-layer
#: list is small.
MAX_LAYERS = 4096

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
    if arch in REFUSED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder-only Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2), and the conventions in
    which Gemma 3 differs from them (the fields after `architecture`; their defaults are Llama's).

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
    layer_types: tuple[str, ...] = ()  # GLOBAL or SLIDING per layer; empty: every layer global
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its inverse root (None: head_dim)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE
    sandwich_norms: bool = False  # RMSNorm of the attention and MLP outputs too, before the residual adds
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(dim)
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise ConfigFieldError(name, f"must be a positive integer, got {getattr(self, name)!r}")
        if self.n_layers > MAX_LAYERS:  # per-layer lists are built from it before any weight is read
            raise ConfigFieldError("n_layers", f"must be at most {MAX_LAYERS}, got {self.n_layers}")
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
        self._check_conventions()

    def _check_conventions(self) -> None:
        """The Gemma-style fields: layer kinds with their window, and the optional scales."""
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a list from a JSON file
        if self.layer_types and (len(self.layer_types) != self.n_layers
                                 or not set(self.layer_types) <= {GLOBAL, SLIDING}):
            raise ConfigFieldError("layer_types", f"must name {GLOBAL!r} or {SLIDING!r} for each of the "
                                                  f"{self.n_layers} layers, got {self.layer_types!r}")
        if SLIDING in self.layer_types and not (_is_int(self.sliding_window) and self.sliding_window >= 1):
            raise ConfigFieldError("sliding_window", f"must be a positive integer, got {self.sliding_window!r}")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (_is_real(value) and value > 0):
                raise ConfigFieldError(name, f"must be a finite number > 0 or null, got {value!r}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported MLP activation {self.activation!r} (silu or gelu_tanh)")
        for name in ("qk_norm", "sandwich_norms", "scale_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigFieldError(name, f"must be true or false, got {getattr(self, name)!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The attention kind of each layer, GLOBAL or SLIDING."""
        return self.layer_types or (GLOBAL,) * self.n_layers

    @property
    def hybrid(self) -> bool:
        """Whether some layers attend over a sliding window (their K/V need not outgrow the window)."""
        return SLIDING in self.kinds

    def layers_of(self, kind: str) -> list[int]:
        """Indices of the layers of one kind."""
        return [i for i, k in enumerate(self.kinds) if k == kind]

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

    def kv_bytes_per_token(self, element_size: float, kind: str | None = None) -> int:
        """Bytes of K and V that one token occupies in a cache, over all layers (or the layers of one kind), at
        `element_size` bytes per value (`magicdec.kv.quant.element_bytes`: an int8 row's scale included)."""
        layers = self.n_layers if kind is None else len(self.layers_of(kind))
        return round(2 * layers * self.n_kv_heads * self.head_dim * element_size)

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
            # Sliding-window attention on every layer is not implemented: within the window it equals full
            # attention, so the usable context is capped at the window.
            config = dataclasses.replace(config, max_seq_len=min(config.max_seq_len, window))
        if arch == "Gemma3ForCausalLM":
            config = dataclasses.replace(config, **gemma3_fields(cfg))
        return config


def gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields in which a Hugging Face Gemma 3 text config differs from Llama's conventions."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not implemented")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"unsupported hidden_activation {cfg.get('hidden_activation')!r}")
    kinds = {"sliding_attention": SLIDING, "full_attention": GLOBAL}
    types = cfg.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        if not (_is_int(pattern) and pattern >= 1):
            raise ModelLoadError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(cfg["num_hidden_layers"])]
    if not (isinstance(types, list) and all(t in kinds for t in types)):
        raise ModelLoadError(f"layer_types must list 'sliding_attention' or 'full_attention' per layer, got {types!r}")
    rope_theta, local_theta = cfg.get("rope_theta", 1_000_000.0), cfg.get("rope_local_base_freq", 10_000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # transformers >= 5
        rope_theta = params["full_attention"].get("rope_theta", rope_theta)
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", local_theta)
    return {
        "layer_types": tuple(kinds[t] for t in types), "sliding_window": cfg.get("sliding_window"),
        "rope_theta": rope_theta, "rope_local_theta": local_theta,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"), "qk_norm": True, "sandwich_norms": True,
        "activation": "gelu_tanh", "scale_embeddings": True, "final_logit_softcap": cfg.get("final_logit_softcapping"),
        "norm_eps": cfg.get("rms_norm_eps", 1e-6), "tie_embeddings": cfg.get("tie_word_embeddings", True),
    }


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is sized, passed whole to it; its memory is planned once from these values.

    max_num_seqs: request slots (requests running at once); max_model_len: most prompt + output tokens of one request
    (None: the model's context); prefill_chunk: prompt tokens per prefill forward; max_prefill_tokens: prompt tokens
    prefilled per step across requests (None: every admitted prompt at once, as an offline batch wants; a server
    bounds it so that arrivals do not stall running streams); kv_dtype: the KV cache's dtype (None: the model's);
    max_queued: most waiting requests (None: unbounded); enable_prefix_caching: keep the K/V blocks of requests' tokens
    for later requests with the same prefix (`magicdec.kv.blocks`); kv_cache_bytes: the memory of the KV blocks
    (None: half the memory available when they are allocated); enforce_eager: on CUDA, launch every forward's kernels
    from Python instead of replaying decode forwards from CUDA graphs (`magicdec.graphs`)."""

    max_num_seqs: int = 256
    max_model_len: int | None = None
    prefill_chunk: int = 512
    max_prefill_tokens: int | None = None
    kv_dtype: torch.dtype | None = None
    max_queued: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_model_len", "max_prefill_tokens", "max_queued"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (self.kv_cache_bytes is None or (_is_int(self.kv_cache_bytes) and self.kv_cache_bytes >= 1)):
            raise InvalidRequestError(f"kv_cache_bytes must be an integer >= 1, got {self.kv_cache_bytes!r}")
