"""Checkpoint configs and indexes from untrusted files: a model loads and computes finite logits, or a typed
error names the problem (the key, the tensor and both shapes, the shard path)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import set_gguf_metadata, tiny_llama_config, write_tiny_gguf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from magicdec.errors import MagicDecError, ModelLoadError, UnsupportedModelError
from magicdec.kv import KVCache
from magicdec.loading import load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_checkpoint(folder, tiny_llama_config(), seed=0)
    return folder


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A copy of the tiny checkpoint to damage."""
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def edit_config(folder: Path, base: Path | None = None, **changes) -> None:
    """Write `folder`'s config.json: the one in `base` (default: `folder`) with `changes`."""
    cfg = json.loads(((base or folder) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))


def finite_logits(loaded) -> bool:
    tokens = torch.tensor([[1, 5, 9, 200]])
    cache = KVCache(loaded.model.cfg, 1, tokens.shape[1], torch.float32, "cpu")
    with torch.inference_mode():
        return bool(loaded.model(tokens, cache).isfinite().all())


def test_the_tiny_checkpoint_loads_and_computes(checkpoint):
    assert finite_logits(load_model(checkpoint, device="cpu"))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"hidden_size": 0}, ModelLoadError, "hidden_size must be a positive integer"),
        ({"num_attention_heads": -4}, ModelLoadError, "num_attention_heads must be a positive integer"),
        ({"num_hidden_layers": 0}, ModelLoadError, "num_hidden_layers must be a positive integer"),
        ({"num_hidden_layers": 501332187960512}, ModelLoadError, "num_hidden_layers must be at most 4096"),
        ({"num_key_value_heads": 0}, ModelLoadError, "num_key_value_heads must be a positive integer"),
        ({"num_key_value_heads": 3}, UnsupportedModelError, "not a multiple of n_kv_heads"),
        ({"hidden_size": "64"}, ModelLoadError, "hidden_size must be a positive integer, got '64'"),
        ({"intermediate_size": 128.5}, ModelLoadError, "intermediate_size must be a positive integer"),
        ({"hidden_size": 66, "head_dim": None}, ModelLoadError, r"hidden_size \(66\) is not a multiple of the number of heads"),
        ({"head_dim": 15}, ModelLoadError, "head_dim must be even"),
        ({"rope_theta": 0, "rope_parameters": None}, ModelLoadError, "rope_theta must be a finite number >= 1"),
        ({"rope_theta": 1e-30, "rope_parameters": None}, ModelLoadError, "rope_theta"),
        ({"rope_theta": math.inf, "rope_parameters": None}, ModelLoadError, "rope_theta"),
        ({"rms_norm_eps": -1e-5}, ModelLoadError, "rms_norm_eps must be a finite number > 0"),
        ({"rms_norm_eps": math.nan}, ModelLoadError, "rms_norm_eps"),
        ({"bos_token_id": 1.0}, ModelLoadError, "bos_token_id must be a token id"),
        ({"bos_token_id": 320}, ModelLoadError, r"bos_token_id must be a token id in \[0, 320\)"),
        ({"eos_token_id": [2, "x"]}, ModelLoadError, "eos_token_id must be token ids"),
        ({"tie_word_embeddings": "false"}, ModelLoadError, "tie_word_embeddings must be true or false"),
        ({"max_position_embeddings": 0}, ModelLoadError, "max_position_embeddings"),
        ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "factor"}}, ModelLoadError, "needs 'factor'"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, ModelLoadError, "high_freq_factor > low_freq_factor"),
        ({"rope_scaling": "llama3"}, ModelLoadError, "rope_scaling must be an object"),
        ({"architectures": "LlamaForCausalLM"}, ModelLoadError, "architectures must be a list"),
        ({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": None}, UnsupportedModelError, "GPT2LMHeadModel"),
        ({"use_sliding_window": True, "sliding_window": "4k"}, ModelLoadError, "sliding_window"),
        ({"vocab_size": None}, ModelLoadError, "lacks 'vocab_size'"),
    ],
    ids=str,
)
def test_bad_config_values_are_refused_naming_the_key(ckpt, changes, error, message):
    edit_config(ckpt, **changes)
    with pytest.raises(error, match=message) as caught:
        load_model(ckpt, device="cpu")
    assert str(ckpt / "config.json") in str(caught.value)


@pytest.mark.parametrize("text", ["[]", "null", "42", "{", "\xff"])
def test_a_config_that_is_no_object_is_refused(ckpt, text):
    (ckpt / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ModelLoadError, match="config.json: not a valid model config"):
        load_model(ckpt, device="cpu")


def test_llama3_rope_scaling_loads(ckpt):
    edit_config(ckpt, rope_scaling=LLAMA3)
    loaded = load_model(ckpt, device="cpu")
    assert loaded.model.cfg.rope_scaling["factor"] == 8.0 and finite_logits(loaded)


def test_weights_that_do_not_match_name_the_tensor_and_both_shapes(ckpt):
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight has shape \(128, 64\), the config implies \(96, 64\)"):
        load_model(ckpt, device="cpu")


@pytest.mark.parametrize("text", ["{", "[]", '{"add_bos_token": "yes"}'])
def test_a_corrupt_tokenizer_config_is_refused(ckpt, text):
    (ckpt / "tokenizer_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        load_model(ckpt, device="cpu")


def write_index(folder: Path, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("weight_map", [None, [], {}, {"model.norm.weight": 3}], ids=str)
def test_an_index_without_a_weight_map_is_refused(ckpt, weight_map):
    write_index(ckpt, weight_map)
    with pytest.raises(ModelLoadError, match="weight_map"):
        load_model(ckpt, device="cpu")


@pytest.mark.parametrize("where", ["parent folder", "absolute path"])
def test_shard_paths_outside_the_model_folder_are_refused(ckpt, tmp_path, where):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(ckpt / "model.safetensors", other / "model.safetensors")  # a real file: only the path is wrong
    shard = "../other/model.safetensors" if where == "parent folder" else str(other / "model.safetensors")
    write_index(ckpt, {name: shard for name in tensor_names(ckpt)})
    with pytest.raises(ModelLoadError, match="points outside the model folder"):
        load_model(ckpt, device="cpu")


def test_shards_in_a_subfolder_load(ckpt):
    (ckpt / "shards").mkdir()
    names = tensor_names(ckpt)
    (ckpt / "model.safetensors").rename(ckpt / "shards" / "all.safetensors")
    write_index(ckpt, {name: "shards/./all.safetensors" for name in names})
    assert finite_logits(load_model(ckpt, device="cpu"))


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", "0", "llama.attention.head_count must be a positive integer"),
    ("llama.rope.freq_base", "0", "llama.rope.freq_base must be a finite number >= 1"),
    ("tokenizer.ggml.eos_token_id", "4000", "tokenizer.ggml.eos_token_id must be token ids"),
])
def test_bad_gguf_metadata_is_refused_naming_the_key(tmp_path, monkeypatch, key, value, message):
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    set_gguf_metadata(path, key, value)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, device="cpu")


def test_a_config_claiming_more_layers_than_the_weights_is_refused_at_the_first_missing(ckpt):
    """The shapes are checked layer after layer (a claim of 5e14 layers, now refused by the ceiling, once listed 22 GB
    of expected tensors)."""
    edit_config(ckpt, num_hidden_layers=4000)
    with pytest.raises(ModelLoadError, match="lacks tensor 'model.layers.2.self_attn.q_proj.weight'"):
        load_model(ckpt, device="cpu")


# --- random garbage in every field ------------------------------------------------------------------------
CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "attention_bias", "rope_scaling", "rope_parameters", "architectures",
    "sliding_window", "use_sliding_window",
]
ROPE_KEYS = ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
             "rope_theta"]
scalars = (st.none() | st.booleans() | st.integers(-3, 700) | st.integers() | st.floats()
           | st.sampled_from(["llama3", "default", "LlamaForCausalLM", "Qwen2ForCausalLM"]) | st.text(max_size=6))
garbage = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(ROPE_KEYS), inner, max_size=5),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), garbage, min_size=1, max_size=3))
def test_garbage_config_loads_a_model_with_finite_logits_or_is_refused(checkpoint, tmp_path, changes):
    folder = tmp_path / "garbage"  # the weights are shared: only config.json differs between examples
    if not folder.exists():
        shutil.copytree(checkpoint, folder)
    edit_config(folder, checkpoint, **changes)
    try:
        loaded = load_model(folder, device="cpu")
    except MagicDecError as e:
        event("refused")
        message = str(e)
        assert message.strip() and "\n" not in message and "Traceback" not in message
        return
    event("loaded")
    assert finite_logits(loaded)
