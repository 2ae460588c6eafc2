"""Bad input at the API level: every failure is one of magicdec's typed exceptions."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import tiny_llama_config

from magicdec.errors import (
    InvalidRequestError,
    MagicDecError,
    ModelLoadError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from magicdec.loading import load_model
from magicdec.sampling import MAX_STOP_STRINGS, SamplingParams


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """Point the GGUF conversion cache at a temporary folder."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MAGICDEC_CACHE", str(cache))
    return cache


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, tiny_checkpoint):
    folder = tmp_path_factory.mktemp("good")
    tiny_checkpoint(folder, tiny_llama_config(), seed=0)
    return folder


def copy_of(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


# --- loading ---------------------------------------------------------------------------------------------
def test_good_checkpoint_loads(good_checkpoint):
    assert load_model(good_checkpoint, device="cpu").model.cfg.n_layers == 2  # the fixture itself is sound


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_file_of_unknown_kind(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError):
        load_model(path)


def test_unsupported_architecture(good_checkpoint, tmp_path):
    ckpt = copy_of(good_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(ckpt)


def test_unsupported_rope_scaling(good_checkpoint, tmp_path):
    ckpt = copy_of(good_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(ckpt)


@pytest.mark.parametrize("damage", ["not json", "missing hidden_size"])
def test_broken_config(good_checkpoint, tmp_path, damage):
    ckpt = copy_of(good_checkpoint, tmp_path)
    if damage == "not json":
        (ckpt / "config.json").write_text("{architectures: [")
    else:
        cfg = json.loads((ckpt / "config.json").read_text())
        del cfg["hidden_size"]
        (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError):
        load_model(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(good_checkpoint, tmp_path, damage):
    ckpt = copy_of(good_checkpoint, tmp_path)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"\x13\x37" * 5000, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(ModelLoadError):
        load_model(ckpt)


def test_missing_tensor(good_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = copy_of(good_checkpoint, tmp_path)
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(ckpt)


def test_wrong_tensor_shape(good_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = copy_of(good_checkpoint, tmp_path)
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(65)
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError):
        load_model(ckpt)


def test_missing_shard(tmp_path, tiny_checkpoint):
    tiny_checkpoint(tmp_path, tiny_llama_config(), max_shard_size="60KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing weight file"):
        load_model(tmp_path)


def test_missing_tokenizer(good_checkpoint, tmp_path):
    ckpt = copy_of(good_checkpoint, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError):
        load_model(ckpt)


@pytest.mark.parametrize("size", [0, 100, 1 << 20])
def test_truncated_gguf(default_path, tmp_path, isolated_cache, size):
    path = tmp_path / "truncated.gguf"
    with default_path.open("rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(path)
    assert not list(isolated_cache.glob("*/manifest.json"))  # nothing half-converted is left to be reused
    assert not list(isolated_cache.glob("*.tmp-*"))


def test_garbage_gguf(tmp_path, isolated_cache):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelLoadError):
        load_model(path)


# --- sampling parameters -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0}, {"max_tokens": -5}, {"max_tokens": 2.5}, {"max_tokens": None},
        {"temperature": -0.1}, {"temperature": math.nan},
        {"top_k": -1}, {"top_k": 1.5},
        {"top_p": 0.0}, {"top_p": -0.2}, {"top_p": 1.01}, {"top_p": math.nan},
        {"stop": ""}, {"stop": ("ok", "")}, {"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
    ],
    ids=lambda kwargs: str(kwargs)[:40],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_valid_sampling_edges():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, stop="x", seed=2**64 - 1)
    assert p.greedy and p.stop == ("x",)
    assert len(SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS


@pytest.mark.parametrize("stop, kept", [(None, ()), ("x", ("x",)), (["x", "y"], ("x", "y")), (("x",), ("x",))])
def test_stop_strings_are_kept_as_a_tuple(stop, kept):
    assert SamplingParams(stop=stop).stop == kept


# --- requests --------------------------------------------------------------------------------------------------
def test_kv_cache_too_big_is_refused_before_allocating(default_model):
    """A KV cache that cannot fit raises OutOfMemoryError up front (here: 1 PiB of blocks), and so do slots whose
    state cannot (a token buffer of 10**9 positions per slot), and a draft cache that cannot fit beside them."""
    from magicdec.config import EngineConfig
    from magicdec.drafters import SelfSpecDrafter
    from magicdec.engine import LLMEngine
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation

    with pytest.raises(OutOfMemoryError, match="a KV cache of"):
        LLMEngine(default_model.model, EngineConfig(kv_cache_bytes=1 << 50), eos_ids=(2,))
    with pytest.raises(OutOfMemoryError, match="slots of up to"):
        LLMEngine(default_model.model, EngineConfig(max_num_seqs=64, max_model_len=10**9, kv_cache_bytes=1 << 20),
                  eos_ids=(2,))
    drafter = SelfSpecDrafter(default_model.model, "streaming", 10**11, 3, True)
    with pytest.raises(OutOfMemoryError, match="draft cache"):
        LLMEngine(default_model.model, EngineConfig(max_num_seqs=1, max_model_len=64), eos_ids=(2,),
                  speculation=Speculation(drafter, FixedGamma(3)))


@pytest.mark.parametrize(
    "call",
    ["empty text", "no prompts", "empty ids", "single string", "non-string", "ids out of vocab", "negative id",
     "float ids", "string ids", "bool ids", "ids as a string", "both kinds", "params per prompt miscounted"],
)
def test_invalid_prompts(llm, call):
    params = SamplingParams(max_tokens=4)
    kwargs = {
        "empty text": dict(prompts=["fine", ""]),
        "no prompts": dict(prompts=[]),
        "empty ids": dict(prompt_token_ids=[[1, 2], []]),
        "single string": dict(prompts="a string, not a list"),
        "non-string": dict(prompts=["ok", 42]),
        "ids out of vocab": dict(prompt_token_ids=[[1, 49152]]),
        "negative id": dict(prompt_token_ids=[[-1, 5]]),
        "float ids": dict(prompt_token_ids=[[1.0, 5.0]]),
        "string ids": dict(prompt_token_ids=[["1", "5"]]),
        "bool ids": dict(prompt_token_ids=[[True, 5]]),
        "ids as a string": dict(prompt_token_ids=["15"]),
        "both kinds": dict(prompts=["a"], prompt_token_ids=[[1, 5]]),  # which would label which?
        "params per prompt miscounted": dict(prompts=["a", "b"], params=[SamplingParams()]),
    }[call]
    kwargs.setdefault("params", params)
    with pytest.raises(InvalidRequestError):
        llm.generate(**kwargs)


def test_prompt_longer_than_context(llm):
    ctx = llm.max_model_len
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate(prompt_token_ids=[[5] * (ctx + 1)], params=SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="context"):  # prompt fits, prompt + max_tokens does not
        llm.generate(prompt_token_ids=[[5] * (ctx - 10)], params=SamplingParams(max_tokens=11))


def test_engine_options(tmp_path):
    from magicdec.engine import LLM, parse_dtype

    with pytest.raises(InvalidRequestError):
        parse_dtype("int7")
    with pytest.raises(InvalidRequestError):
        LLM(prefill_chunk=0)
    with pytest.raises(ModelLoadError):
        LLM(tmp_path / "missing")


def test_every_error_is_a_magicdec_error():
    for cls in (ModelLoadError, UnsupportedModelError, InvalidRequestError, OutOfMemoryError):
        assert issubclass(cls, MagicDecError)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": "hot"}, {"top_p": "0.5"}, {"max_tokens": True}, {"temperature": math.inf}, {"stop": ("a", 3)},
     {"stop": 3}, {"stop": {"a"}}, {"seed": "abc"}, {"seed": 1.5}, {"seed": True}, {"seed": -1}, {"seed": 2**64}],
    ids=str,
)
def test_invalid_sampling_types(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:99", "mps", ""])
def test_devices_this_machine_lacks_are_refused_before_loading(device):
    with pytest.raises(InvalidRequestError, match="device"):
        load_model(device=device)


@pytest.mark.parametrize("kwargs", [{"profile": "nosuch"}, {"acceptance": "{broken"}, {"acceptance": "[]"}], ids=str)
def test_auto_planning_with_unreadable_inputs_is_a_typed_error(kwargs, tmp_path):
    from magicdec.autoplan import choose
    from magicdec.planner import MODEL_PRESETS

    if "acceptance" in kwargs:
        (tmp_path / "table.json").write_text(kwargs["acceptance"])
        kwargs = {"acceptance": tmp_path / "table.json"}
    with pytest.raises(InvalidRequestError, match="hardware profile|acceptance table"):
        choose(MODEL_PRESETS["llama-3.1-8b"], 8, 4096, **kwargs)


@pytest.mark.parametrize("grid", [{"modes": ["bogus"]}, {"positions": ["bogus"]}, {"gammas": [0]}, {"budgets": [4]}],
                         ids=str)
def test_a_bench_grid_it_cannot_run_is_refused(grid):
    from magicdec.bench import BenchGrid

    base = dict(batches=[1], contexts=[256], drafters=["none", "self-streaming"], budgets=[64], gammas=[2],
                modes=["greedy"], new_tokens=8)
    with pytest.raises(InvalidRequestError):
        BenchGrid(**{**base, **grid})
