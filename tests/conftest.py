"""Shared fixtures: the default model (ours and the Hugging Face reference), corpus text, tiny checkpoints.

Heavy objects are session-scoped: the transformers reference model takes ~20 s to load (it dequantizes
the GGUF itself), so it is loaded once, and only when a test asks for it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _test_threads() -> int:
    """Intra-op threads for the tests: MAGICDEC_TEST_THREADS, else the cores other processes leave idle.

    On a small shared machine, torch's default (one thread per core) spin-waits against other busy
    processes and runs 10-20x slower than one thread; this keeps the suite's time predictable.
    """
    if os.environ.get("MAGICDEC_TEST_THREADS"):
        return max(1, int(os.environ["MAGICDEC_TEST_THREADS"]))
    cores = os.cpu_count() or 1
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
    """The engine over the default model, in fp32."""
    from magicdec.engine import LLM

    return LLM(device="cpu", dtype="fp32")


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
