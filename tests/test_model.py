"""The transformer and the KV cache against transformers fp32, on the default model and tiny random ones."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_err, tiny_llama_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magicdec.errors import UnsupportedModelError
from magicdec.kv import KVCache
from magicdec.loading import load_model
from magicdec.prefill import prefill_row

TOL = 1e-4  # max|ours - ref| / max|ref|


def forward_all(model, tokens: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot forward of [B, T] tokens into a fresh cache."""
    cache = KVCache(model.cfg, tokens.shape[0], tokens.shape[1], torch.float32, "cpu")
    with torch.inference_mode():
        return model(tokens, cache, logits_at=logits_at)


# --- the default model ----------------------------------------------------------------------------------
def test_default_model_logits_match_transformers_long_prompt(default_model, hf_model, corpus_prompt):
    ids = corpus_prompt(2100, book=1)
    T = len(ids)
    positions = torch.tensor(sorted(set(range(0, T, 29)) | {T - 2, T - 1}))  # spread over the whole prompt
    x = torch.tensor([ids])
    ours = forward_all(default_model.model, x, logits_at=positions[None])
    with torch.inference_mode():
        ref = hf_model(x, logits_to_keep=positions).logits
    assert ours.shape == ref.shape == (1, len(positions), 49152)
    assert rel_err(ours, ref) < TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_default_model_prefill_chunked_equals_one_shot_ragged(default_model, corpus_prompt):
    """prefill_row with small chunks into the rows of one cache == each prompt's one-shot last logits alone."""
    model = default_model.model
    prompts = [corpus_prompt(n, book=b, at=0.6) for n, b in ((300, 2), (45, 3), (170, 4))]
    cache = KVCache(model.cfg, len(prompts), 300, torch.float32, "cpu")
    with torch.inference_mode():
        last = [prefill_row(model, cache.row(i), torch.tensor(p), chunk=64)[0] for i, p in enumerate(prompts)]
    assert cache.lens.tolist() == [300, 45, 170]
    for i, p in enumerate(prompts):
        alone = forward_all(model, torch.tensor([p]), logits_at=torch.tensor([[len(p) - 1]]))[0, 0]
        assert rel_err(last[i], alone) < TOL, i


# --- tiny random checkpoints of each supported family ------------------------------------------------------
def _configs():
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        # Llama 3.1 frequency scaling: original context 32 < the 200 tested positions
        "llama3.1-rope-scaling": (tiny_llama_config(rope_parameters=llama3, max_position_embeddings=256), None),
        "llama-tied-mha-headdim": (tiny_llama_config(tie_word_embeddings=True, num_key_value_heads=4,
                                                     head_dim=32, rms_norm_eps=1e-5), None),
        "llama-untied-sharded": (tiny_llama_config(num_key_value_heads=1), "60KB"),
        "qwen2-qkv-bias": (Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), None),
        "mistral": (MistralConfig(**common, sliding_window=None, tie_word_embeddings=False), None),
    }


CONFIG_NAMES = ["llama3.1-rope-scaling", "llama-tied-mha-headdim", "llama-untied-sharded", "qwen2-qkv-bias", "mistral"]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_tiny_checkpoint_logits_match_transformers(name, tmp_path, tiny_checkpoint):
    config, shard = _configs()[name]
    ref = tiny_checkpoint(tmp_path, config, seed=len(name), max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    cfg = loaded.model.cfg
    assert cfg.tie_embeddings == config.tie_word_embeddings
    assert cfg.qkv_bias == (name == "qwen2-qkv-bias")
    assert (cfg.rope_scaling is not None) == name.startswith("llama3.1")
    x = torch.randint(0, 320, (2, 200), generator=torch.Generator().manual_seed(0))
    ours = forward_all(loaded.model, x)
    with torch.inference_mode():
        want = ref(x).logits
    assert rel_err(ours, want) < TOL


def test_llama31_legacy_rope_scaling_config(tmp_path, tiny_checkpoint):
    """A transformers-4-style config.json (`rope_theta` + `rope_scaling`) loads the same as the v5 form."""
    config, _ = _configs()["llama3.1-rope-scaling"]
    ref = tiny_checkpoint(tmp_path, config, seed=3)
    raw = json.loads((tmp_path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert loaded.model.cfg.rope_theta == 500000.0 and loaded.model.cfg.rope_scaling["factor"] == 8.0
    x = torch.randint(0, 320, (1, 160), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(x).logits
    assert rel_err(forward_all(loaded.model, x), want) < TOL


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_is_honoured_or_rejected(family, tmp_path, tiny_checkpoint):
    """A window smaller than the sequence must be implemented, rejected, or capped by max_seq_len."""
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, sliding_window=16)
    config = (MistralConfig(**common) if family == "mistral"
              else Qwen2Config(**common, use_sliding_window=True, max_window_layers=0))
    ref = tiny_checkpoint(tmp_path, config, seed=5)
    try:
        loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    except UnsupportedModelError:
        return
    T = 64 if loaded.model.cfg.max_seq_len > 16 else 16  # a capped context need only be right within it
    x = torch.randint(0, 320, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = ref(x).logits
    assert rel_err(forward_all(loaded.model, x), want) < TOL


# --- prefill in chunks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_forward_equals_one_shot(tiny_llama, chunk):
    loaded, _ = tiny_llama
    model = loaded.model
    x = torch.randint(0, 320, (3, 90), generator=torch.Generator().manual_seed(chunk))
    full = forward_all(model, x)
    cache = KVCache(model.cfg, 3, 90, torch.float32, "cpu")
    parts = []
    with torch.inference_mode():
        for s in range(0, 90, chunk):
            parts.append(model(x[:, s : s + chunk], cache))
            cache.commit(parts[-1].shape[1])
    assert cache.lens.tolist() == [90] * 3 and cache.max_len == 90
    assert rel_err(torch.cat(parts, dim=1), full) < TOL


# --- the KV cache -------------------------------------------------------------------------------------------
def test_cache_per_row_commit_and_truncate_roll_back(tiny_llama):
    """Speculative-style rows: write 4 tokens, keep n[b] of them, roll back; positions stay consistent."""
    model = tiny_llama[0].model
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 320, (3, 10), generator=g)
    draft = torch.randint(0, 320, (3, 4), generator=g)
    after = torch.randint(0, 320, (3, 2), generator=g)
    cache = KVCache(model.cfg, 3, 32, torch.float32, "cpu")
    with torch.inference_mode():
        model(prompt, cache)
        cache.commit(10)
        model(draft, cache)
        keep = torch.tensor([0, 2, 4])
        cache.commit(keep)
        assert cache.lens.tolist() == [10, 12, 14] and cache.next_pos.tolist() == [10, 12, 14]
        assert cache.max_len == 14
        assert cache.rope_positions(2).tolist() == [[10, 11], [12, 13], [14, 15]]
        got = model(after, cache)  # logits of `after` following each row's kept prefix
    for b in range(3):
        seq = torch.cat((prompt[b], draft[b, : keep[b]], after[b]))[None]
        want = forward_all(model, seq)[0, -2:]
        assert rel_err(got[b], want) < TOL, b

    # roll every row back to the prompt, then continue: identical to never having drafted
    cache.truncate(torch.tensor([10, 10, 10]))
    assert cache.lens.tolist() == [10] * 3 and cache.next_pos.tolist() == [10] * 3 and cache.max_len == 10
    with torch.inference_mode():
        got = model(after, cache)
    want = forward_all(model, torch.cat((prompt, after), dim=1))[:, -2:]
    assert rel_err(got, want) < TOL

    # truncating only some rows (partial rollback) keeps the others intact
    with torch.inference_mode():
        cache.commit(2)
        cache.truncate(torch.tensor([12, 11, 10]))
        nxt = model(after[:, :1], cache)[:, 0]
    for b, n in enumerate([12, 11, 10]):
        seq = torch.cat((prompt[b], after[b]))[: n][None]
        want = forward_all(model, torch.cat((seq, after[b : b + 1, :1]), dim=1))[0, -1]
        assert rel_err(nxt[b], want) < TOL, b


def test_cache_row_views_share_state_and_overflow(tiny_llama):
    """head(n) / row(i) views write into the cache's storage and per-row state; the other rows stay as they were."""
    model = tiny_llama[0].model
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 320, (3, 6), generator=g)
    cache = KVCache(model.cfg, 3, 8, torch.float32, "cpu")
    with torch.inference_mode():
        model(x, cache)
        cache.commit(torch.tensor([6, 3, 5]))
        k_before = cache.k.clone()
        row = cache.row(2)
        assert row.batch == 1 and row.lens.tolist() == [5] and row.max_len == 5
        got = model(torch.tensor([[11]]), row)[0, 0]
        row.commit(1)
        assert cache.lens.tolist() == [6, 3, 6] and cache.next_pos.tolist() == [6, 3, 6]
        assert torch.equal(cache.k[:, :2], k_before[:, :2])  # rows 0 and 1 untouched
        assert rel_err(got, forward_all(model, torch.cat((x[2, :5], torch.tensor([11])))[None])[0, -1]) < TOL
        head = cache.head(2)
        assert head.batch == 2 and head.max_len == 6
        nxt = torch.tensor([[12], [13]])
        got = model(nxt, head)[:, 0]
        head.commit(1)
        assert cache.lens.tolist() == [7, 4, 6]
        for i, n in enumerate([6, 3]):
            want = forward_all(model, torch.cat((x[i, :n], nxt[i]))[None])[0, -1]
            assert rel_err(got[i], want) < TOL
        with pytest.raises(RuntimeError, match="overflow"):
            model(torch.zeros(1, 2, dtype=torch.long), cache.row(0))  # 7 + 2 slots > capacity 8


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    chunk=st.sampled_from([1, 5, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_ragged_batch_padding_never_leaks(tiny_llama, lens, chunk, seed):
    """Prefill a ragged batch padded with random junk, decode 2 tokens: each row == that row alone."""
    model = tiny_llama[0].model
    g = torch.Generator().manual_seed(seed)
    B, T = len(lens), max(lens)
    tokens = torch.randint(0, 320, (B, T), generator=g)  # junk everywhere past each row's length
    nxt = torch.randint(0, 320, (B, 2), generator=g)
    n = torch.tensor(lens)
    cache = KVCache(model.cfg, B, T + 2, torch.float32, "cpu")
    with torch.inference_mode():
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            model(tokens[:, s:e], cache)
            cache.commit((n - s).clamp(0, e - s))
        assert cache.lens.tolist() == lens
        first = model(nxt[:, :1], cache)[:, 0]
        cache.commit(1)
        second = model(nxt[:, 1:], cache)[:, 0]
        cache.commit(1)
    assert cache.lens.tolist() == [x + 2 for x in lens] and cache.next_pos.tolist() == cache.lens.tolist()
    for b, L in enumerate(lens):
        want = forward_all(model, torch.cat((tokens[b, :L], nxt[b]))[None])[0, -2:]
        assert rel_err(torch.stack((first[b], second[b])), want) < TOL, (b, L)
