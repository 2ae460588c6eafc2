"""Our GGUF-built tokenizer against transformers' tokenizer for the same GGUF file.

One known divergence, on transformers' side: its GGUF converter ignores `tokenizer.ggml.pre = "smollm"`
and pre-tokenizes with plain GPT-2 ByteLevel, while SmolLM2's own tokenizer.json (and llama.cpp's
"smollm" pre-tokenizer) first isolate every digit. The two differ only where whitespace precedes a digit
("\n\n1", "    27"). So the id comparisons use transformers' vocabulary, merges, special tokens and
decoder with the digit split restored (`hf_reference`), the pre-tokenization itself is checked against an
independent regex oracle, and `test_transformers_divergence_is_only_digit_pretokenization` pins down
the difference.
"""

from __future__ import annotations

import json

import pytest
import regex
from tokenizers import Tokenizer, pre_tokenizers

from magicdec.loading import pad_token_id

# GPT-2's split pattern, as the ByteLevel pre-tokenizer applies it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIALS = regex.compile(r"(<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>)")


def smollm_pretokens(text: str) -> list[str]:
    """llama.cpp's 'smollm' pre-tokenization: isolate each digit, then split the rest the GPT-2 way."""
    out = []
    for piece in regex.split(r"(\p{N})", text):
        out.extend(regex.findall(GPT2_PATTERN, piece))
    return out


@pytest.fixture(scope="module")
def hf_reference(hf_tokenizer) -> Tokenizer:
    """transformers' tokenizer for the GGUF, with the digit split its converter drops put back."""
    tok = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer]
    )
    return tok

EDGE_CASES = [
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\n\nnewlines\r\nCRLF\rCR",
    "\n\n\n\n",
    "digits 0 7 42 1984 3.14159 1,000,000 0x1F 2024-06-01 +44(0)20 555-0123",
    "0000000000123456789",
    "café naïve résumé coöperate Æsir Œuvre ß",
    "e\u0301 (combining acute) vs \u00e9, NFD vs NFC",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Ελληνικά, русский, עברית, العربية",
    "emoji 🤗🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "I'll, you're, he's, DON'T, we'VE, they'd",
    "punctuation!!! ... ??? --- ((nested)) [brackets] {braces} <angle> `code` \"quotes\" «guillemets»",
    "def f(x):\n    return x ** 2  # comment\n\n\tindented",
    "<|im_start|>user\nHello<|im_end|>\n<|endoftext|>",
    "a" * 300,
    "\u0000 nul and \x7f del and \u00a0 nbsp",
]


def ours_ids(default_model, text: str) -> list[int]:
    return default_model.tokenizer.tok.encode(text, add_special_tokens=False).ids


def test_default_model_does_not_add_bos(default_model, hf_tokenizer):
    tok = default_model.tokenizer
    assert tok.add_bos is False  # the GGUF does not ask for BOS
    assert tok.encode("Hello there") == hf_tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    assert tok.eos_ids == (2,) and tok.vocab_size == len(hf_tokenizer) == 49152


@pytest.mark.parametrize("book", range(8))
def test_corpus_text_matches_transformers(default_model, hf_tokenizer, hf_reference, corpus_texts, book):
    text = corpus_texts[book % len(corpus_texts)]
    for at in (0.1, 0.55):
        start = int(len(text) * at)
        piece = text[start : start + 4000]
        ids = ours_ids(default_model, piece)
        assert ids == hf_reference.encode(piece, add_special_tokens=False).ids
        assert default_model.tokenizer.decode(ids) == piece
        assert hf_tokenizer.decode(ids) == piece


@pytest.mark.parametrize("text", EDGE_CASES, ids=range(len(EDGE_CASES)))
def test_edge_cases_match_transformers(default_model, hf_tokenizer, hf_reference, text):
    ids = ours_ids(default_model, text)
    assert ids == hf_reference.encode(text, add_special_tokens=False).ids
    ours_text = default_model.tokenizer.decode(ids)
    assert ours_text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    if "<|" not in text:
        assert ours_text == text  # byte-level BPE is lossless


def test_special_tokens_are_single_ids_and_skipped_on_decode(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # <|im_start|>, <|im_end|>
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert (tok.bos_token, tok.eos_token, tok.token_text(None), tok.token_text(10**6)) == \
           ("<|im_start|>", "<|im_end|>", None, None)


def test_pad_token_from_gguf_metadata_or_a_hf_config(default_path, tmp_path):
    assert pad_token_id(default_path) == 2  # tokenizer.ggml.padding_token_id: <|im_end|>
    assert pad_token_id(tmp_path) is None  # no config.json
    for value, want in ((7, 7), (None, None), (True, None), ("7", None)):
        (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": value}))
        assert pad_token_id(tmp_path) == want


def test_digits_are_split_individually(default_model):
    """SmolLM2's pre-tokenizer ('smollm' in the GGUF) splits every digit, as llama.cpp does."""
    tok = default_model.tokenizer.tok
    assert [tok.decode([i]) for i in ours_ids(default_model, "12345")] == list("12345")


def test_encode_batch_equals_encode(default_model, corpus_texts):
    tok = default_model.tokenizer
    texts = [t[10000:10500] for t in corpus_texts[:4]] + EDGE_CASES[1:5]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def _pretokens(default_model, text: str) -> list[str]:
    pieces = []
    for part in SPECIALS.split(text):  # special tokens are matched before pre-tokenization
        if part and not SPECIALS.fullmatch(part):
            pieces += [part[a:b] for _, (a, b) in default_model.tokenizer.tok.pre_tokenizer.pre_tokenize_str(part)]
    return pieces


@pytest.mark.parametrize("book", range(0, 14, 3))
def test_pretokenization_matches_smollm_regex(default_model, corpus_texts, book):
    text = corpus_texts[book % len(corpus_texts)]
    start = int(len(text) * 0.3)
    for piece in [text[start : start + 6000], *EDGE_CASES]:
        want = [p for part in SPECIALS.split(piece) if part and not SPECIALS.fullmatch(part) for p in smollm_pretokens(part)]
        assert _pretokens(default_model, piece) == want


def test_transformers_divergence_is_only_digit_pretokenization(default_model, hf_tokenizer, corpus_texts):
    """Where ours and plain transformers disagree, whitespace precedes a digit; elsewhere ids are equal."""
    dec = default_model.tokenizer.tok.decode
    assert [dec([i]) for i in ours_ids(default_model, "a.\n\n1.")] == ["a", ".", "\n\n", "1", "."]
    assert [dec([i]) for i in hf_tokenizer("a.\n\n1.", add_special_tokens=False)["input_ids"]] == ["a", ".", "\n", "\n", "1", "."]
    for text in corpus_texts[:6]:
        piece = text[50000:56000]
        no_ws_digit = regex.sub(r"(?<=\s)\p{N}", "x", piece)  # no digit right after whitespace
        assert ours_ids(default_model, no_ws_digit) == hf_tokenizer(no_ws_digit, add_special_tokens=False)["input_ids"]
