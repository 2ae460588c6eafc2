"""Shared fixtures: the default model (ours and the Hugging Face reference), corpus text, tiny checkpoints.

Heavy objects are session-scoped: the transformers reference model takes ~20 s to load (it dequantizes
the GGUF itself), so it is loaded once, and only when a test asks for it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def use_triton_interpreter() -> None:
    """Make this worker's Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported),
    or skip the calling test module: on a CUDA machine (benchmarks/gpu_check.py tests the compiled kernels there),
    where triton was imported without it, or without triton. Call it before importing a magicdec Triton module."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: benchmarks/gpu_check.py tests the compiled kernels", allow_module_level=True)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")


def _test_threads() -> int:
    """Intra-op threads for the tests: MAGICDEC_TEST_THREADS, else the cores other processes leave idle, shared among
    pytest-xdist's workers.

    On a small shared machine, torch's default (one thread per core) spin-waits against other busy processes and runs
    10-20x slower than one thread; this keeps the suite's time predictable. The README's command runs two workers:
    much of a test is Python between small tensor operations, which one thread per worker runs as fast as two."""
    if os.environ.get("MAGICDEC_TEST_THREADS"):
        return max(1, int(os.environ["MAGICDEC_TEST_THREADS"]))
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        return max(1, cores // workers)
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


torch.set_num_threads(_test_threads())


def data_path() -> Path:
    """The PG-19 sample (the repository sits beside `shared/`); MAGICDEC_DATA overrides."""
    env = os.environ.get("MAGICDEC_DATA")
    return Path(env) if env else REPO.parent / "shared/data/pg19_dev.jsonl"


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built() -> None:
    """This CPU's native kernels, compiled (once per checkout and torch version) before any test runs: the compile's
    notice on stderr is then no test's output, whichever test would have needed the kernels first."""
    from magicdec import kernels

    kernels.supported(torch.device("cpu"), torch.bfloat16)


# --- corpus ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def books() -> list[dict]:
    path = data_path()
    if not path.exists():
        pytest.skip(f"corpus not found at {path} (set MAGICDEC_DATA to pg19_dev.jsonl)")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def corpus_texts(books) -> list[str]:
    return [b["text"] for b in books]


@pytest.fixture(scope="session")
def corpus_prompt(corpus_texts, default_model) -> Callable[..., list[int]]:
    """corpus_prompt(n_tokens, book=0, at=0.4) -> exactly n_tokens ids cut from inside a book."""
    tok = default_model.tokenizer

    def cut(n_tokens: int, book: int = 0, at: float = 0.4) -> list[int]:
        text = corpus_texts[book % len(corpus_texts)]
        start = int(len(text) * at)
        start = text.find(" ", start) + 1  # start on a word boundary
        ids = tok.tok.encode(text[start : start + 8 * n_tokens + 1000], add_special_tokens=False).ids
        assert len(ids) >= n_tokens, "book too short for the requested prompt"
        return ids[:n_tokens]

    return cut


# --- a machine where drafting pays -------------------------------------------------------------------------
@pytest.fixture
def kv_bound_profile(tmp_path) -> str:
    """A hardware profile (JSON path) whose linear layers cost next to nothing and whose attention reads its K/V at
    1 GB/s: `--draft auto` drafts on it from a few hundred tokens of context, whatever machine runs the test."""
    path = tmp_path / "kv-bound.json"
    path.write_text(json.dumps({"name": "kv-bound", "flops_per_s": 1e15, "mem_bandwidth": 1e9, "mem_bytes": 8e9,
                                "linear_rates": [[1, 1e12], [8, 1e13]], "attention_rates": [[1, 1e9], [8, 1e9]]}))
    return str(path)


# --- what the forwards ran over ------------------------------------------------------------------------------
@pytest.fixture
def draft_forward_rows(monkeypatch) -> list[int]:
    """The rows of every draft forward from here on, in order (`scopes.forward` noted; clear it between runs)."""
    from magicdec import scopes

    rows: list[int] = []

    @contextlib.contextmanager
    def note(kind: str, n: int, tokens: int, lens) -> Iterator[None]:
        if kind == "draft":
            rows.append(n)
        yield

    monkeypatch.setattr(scopes, "forward", note)
    return rows


# --- the default model: ours and the reference ------------------------------------------------------------
@pytest.fixture(scope="session")
def default_model():
    """The default model in fp32, the reference dtype (`dtype="auto"` may pick bf16 on this CPU)."""
    from magicdec.loading import load_model

    return load_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def default_model_bf16():
    from magicdec.loading import load_model

    return load_model(device="cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def default_path() -> Path:
    from magicdec.loading import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(default_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_path.parent, gguf_file=default_path.name)


@pytest.fixture(scope="session")
def hf_model(default_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_path.parent, gguf_file=default_path.name, dtype=torch.float32
    )
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def llm():
    """The engine over the default model, in fp32, with a KV pool of a fixed size: the default, half the memory
    available when the session builds it, would leave a draft model's share of the same size to fit beside whatever
    the tests before it hold."""
    from magicdec.engine import LLM

    return LLM(device="cpu", dtype="fp32", kv_cache_gb=2)


# --- tiny random Hugging Face checkpoints -------------------------------------------------------------
TINY_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 = unk, bos, eos of the tiny configs


def write_tiny_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer with no merges: 3 special tokens then the 256 byte symbols (259 ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded noise of a sensible scale (HF zero-inits biases, ones norms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """tiny_checkpoint(folder, hf_config, seed=0, max_shard_size=None) -> the randomized HF model saved there."""
    transformers = pytest.importorskip("transformers")

    def make(folder: Path, config, seed: int = 0, max_shard_size: str | None = None):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(model, seed)
        model.eval().requires_grad_(False)
        folder.mkdir(parents=True, exist_ok=True)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(folder, safe_serialization=True, **kwargs)
        write_tiny_tokenizer(folder)
        return model

    return make


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_checkpoint):
    """(our LoadedModel, the HF model) for a small random GQA Llama, loaded through load_model."""
    from magicdec.loading import load_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    ref = tiny_checkpoint(folder, tiny_llama_config(), seed=1)
    return load_model(folder, device="cpu", dtype=torch.float32), ref


# --- a tiny random GGUF file ------------------------------------------------------------------------------
def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A GGUF file of a small random Llama (F32 tensors, a byte-level BPE tokenizer of 260 tokens): the
    converted-weights cache's tests convert it in well under a second, where the default model takes ~10 s."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    vocab, dim, ffn, n_layers, n_heads, n_kv, hd = 320, 64, 128, 2, 4, 2, 16
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(1024)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tokens = TINY_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", weight(vocab, dim))
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    w.add_tensor("output.weight", weight(vocab, dim))
    for i in range(n_layers):
        for name, shape in (("attn_q", (n_heads * hd, dim)), ("attn_k", (n_kv * hd, dim)), ("attn_v", (n_kv * hd, dim)),
                            ("attn_output", (dim, n_heads * hd)), ("ffn_gate", (ffn, dim)), ("ffn_up", (ffn, dim)),
                            ("ffn_down", (dim, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(dim, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def set_gguf_metadata(path: Path, key: str, value: str) -> None:
    """Change one metadata value in place, as `gguf-set-metadata PATH KEY VALUE --force` does (its own code)."""
    import argparse

    from gguf import GGUFReader
    from gguf.scripts.gguf_set_metadata import set_metadata

    reader = GGUFReader(path, "r+")
    set_metadata(reader, argparse.Namespace(key=key, value=value, dry_run=False, force=True))
    reader.data.flush()


# --- running the engine directly ---------------------------------------------------------------------------
def kv_pool(model, nbytes, dtype=None, caching=True):
    """A KVManager of about `nbytes` of blocks for `model` (shared by engines, as an LLM shares its own), in `dtype`
    (default the model's); a hybrid model's window store takes a quarter."""
    from magicdec.kv.blocks import KVManager

    dtype = dtype or model.dtype
    window = nbytes // 4 if model.cfg.hybrid else 0
    blocks = max(2, (nbytes - window) // KVManager.block_bytes(model.cfg, dtype))
    return KVManager(model.cfg, blocks, dtype, model.device, caching=caching, window_bytes=window)


def run_engine(model, prompts, params, *, eos=(), drafter=None, gamma=0, draft_stop=None, policy=None, slots=None,
               kv=None, caching=False, tokenizer=None, prefill_chunk=512, max_prefill_tokens=None, arrivals=None,
               kv_dtype=None):
    """Every prompt through an LLMEngine over `model`; returns (requests, stats).

    params: one SamplingParams or one per prompt. gamma: a fixed draft length, rows stopping at `draft_stop` (or
    `policy`). arrivals:
    the step before which each prompt is added (default: all at once). kv: a KVManager to share (its cached
    prefixes kept across calls); else the engine makes its own, with prefix caching where `caching` (default: every
    prompt computed)."""
    from magicdec.config import EngineConfig
    from magicdec.engine import LLMEngine
    from magicdec.sampling import SamplingParams
    from magicdec.scheduler import FixedGamma
    from magicdec.speculative import Speculation

    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    kv_dtype = kv_dtype or (kv.dtype if kv is not None else None)  # a shared pool's dtype
    config = EngineConfig(max_num_seqs=slots or len(prompts), prefill_chunk=prefill_chunk, kv_dtype=kv_dtype,
                          max_model_len=max(len(p) + sp.max_tokens for p, sp in zip(prompts, params)),
                          max_prefill_tokens=max_prefill_tokens,
                          enable_prefix_caching=caching or kv is not None)
    speculation = Speculation(drafter, policy or FixedGamma(gamma, draft_stop)) if drafter is not None else None
    engine = LLMEngine(model, config, eos_ids=eos, speculation=speculation, kv=kv,
                       tokenizer=tokenizer)
    if arrivals is None:
        return engine.generate(prompts, params), engine.stats
    return drive(engine, prompts, params, arrivals), engine.stats


def drive(engine, prompts, params, arrivals, after_step=None):
    """Add prompt i with params[i] before step arrivals[i] and step `engine` until every request is
    finished, calling after_step() after each step; returns the requests."""
    requests, step = [None] * len(prompts), 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step:
                requests[i] = engine.add_request(str(i), prompts[i], params[i])
        engine.step()
        if after_step is not None:
            after_step()
        step += 1
    return requests
