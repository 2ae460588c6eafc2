"""Tokenizers: from a Hugging Face `tokenizer.json`, or built from GGUF metadata."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from magicdec.errors import ModelLoadError, UnsupportedModelError
from magicdec.jsonfile import read_json_object

# The pre-tokenizer split pattern of Llama 3 ("llama-bpe" in GGUF files).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """Text <-> token ids, with the model's BOS/EOS conventions."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos and bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of a prompt, with BOS prepended when the model expects it (and `add_bos` allows it)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
        """`encode` of each text."""
        ids = [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]
        return [[self.bos_id, *x] for x in ids] if self.add_bos and add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids; special tokens (BOS, EOS, a chat template's markers) are left out unless
        `skip_special_tokens` is False."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str | None:
        """A token's string in the vocabulary (a special token's own text, such as "<|im_end|>"); None for no token
        or an id outside the vocabulary."""
        return None if token_id is None else self.tok.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        """The first EOS token's text (the one a chat template ends a turn with)."""
        return self.token_text(self.eos_ids[0] if self.eos_ids else None)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, so that a text longer than n times this cannot be n
        tokens; None where the tokenizer may drop or merge text, which leaves no such bound.

        A token's string in the vocabulary is at least as long as the text it stands for when no step before the model
        removes characters: byte-level BPE spells each byte of the text as one character (and a character is one byte
        or more), SentencePiece spells a space as U+2581, a byte-fallback piece (<0xNN>) stands for part of one
        character, and an added token for its own content."""
        if not _keeps_every_character(self.tok):
            return None
        return max(map(len, self.tok.get_vocab(with_added_tokens=True)))

    def save(self, path: Path) -> None:
        self.tok.save(str(path))

    @classmethod
    def from_hf_folder(cls, folder: Path, bos_id: int | None, eos_ids: Sequence[int]) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        tok = read_tokenizer_file(path)
        add_bos = False
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            add_bos = read_json_object(cfg_path, "tokenizer config", ModelLoadError).get("add_bos_token") or False
            if not isinstance(add_bos, bool):
                raise ModelLoadError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
        # Llama 3 style tokenizers add BOS through their post-processor instead of add_bos_token.
        if bos_id is not None and tok.post_processor is not None:
            add_bos = add_bos or bos_id in tok.encode("x").ids
        return cls(tok, bos_id, eos_ids, add_bos)


def read_tokenizer_file(path: Path) -> HFTokenizer:
    """A `tokenizer.json`; an unreadable one becomes a ModelLoadError naming it."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on unreadable files
        raise ModelLoadError(f"{path}: unreadable tokenizer ({e})") from None


#: Pipeline steps (normalizers, pre-tokenizers) that keep every character of the text: they map characters one to
#: one, split or add; with the conditions in `_keeps_step`.
KEEPING_STEPS = frozenset({"ByteLevel", "Digits", "Metaspace", "Prepend", "Append", "Split", "Punctuation", "Replace"})


def _keeps_every_character(tok: HFTokenizer) -> bool:
    """Whether every character of a text ends up in some token's string (the premise of `max_token_chars`).

    Not so where a normalizer or pre-tokenizer strips, collapses or composes characters (Strip, NFC, whitespace
    splitting), where an added token swallows the spaces beside it, or where one unknown token stands for a run of
    unknown characters (fused, without byte fallback)."""
    model = tok.model
    if not isinstance(model, models.BPE) or (model.unk_token and model.fuse_unk and not model.byte_fallback):
        return False
    if any(t.lstrip or t.rstrip for t in tok.get_added_tokens_decoder().values()):
        return False
    steps = [json.loads(step.__getstate__()) for step in (tok.normalizer, tok.pre_tokenizer) if step is not None]
    return all(_keeps_step(step) for step in steps)


def _keeps_step(step: dict) -> bool:
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps_step(s) for s in step.get("normalizers") or step.get("pretokenizers") or [])
    if kind == "Replace":  # a string replaced by one at least as long
        pattern = step.get("pattern", {}).get("String")
        return pattern is not None and len(step.get("content", "")) >= len(pattern)
    return kind in KEEPING_STEPS and step.get("behavior") != "Removed"


#: llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
#: SentencePiece's word-boundary marker, which stands for a space inside its pieces
SPACE = "\u2581"


def tokenizer_from_gguf_fields(meta: dict) -> HFTokenizer:
    """Build the tokenizer of GGUF `tokenizer.ggml.*` metadata: byte-level BPE ("gpt2") or SentencePiece BPE
    ("llama", as Gemma's)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return sentencepiece_from_gguf_fields(meta)
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported ('gpt2' or 'llama' BPE)")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in (tokens, merges)):
        raise ModelLoadError("GGUF metadata lacks the tokenizer.ggml.tokens and tokenizer.ggml.merges string lists")
    try:
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception on inconsistent merges
        raise ModelLoadError(f"GGUF tokenizer metadata is inconsistent ({e})") from None
    tok = HFTokenizer(bpe)
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == control])
    return tok


def sentencepiece_from_gguf_fields(meta: dict) -> HFTokenizer:
    """A SentencePiece BPE tokenizer (spaces as U+2581, bytes as <0xNN> pieces) from GGUF metadata, which stores its
    pieces and their scores but no merges: BPE merges the adjacent pair whose joined piece scores highest, so the
    merges are every split of every piece into two pieces, ranked by the joined piece's score (what Hugging Face's
    conversion of a SentencePiece model does)."""
    tokens, scores = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.scores")
    if not (isinstance(tokens, list) and isinstance(scores, list) and len(tokens) == len(scores)
            and all(isinstance(t, str) for t in tokens)):
        raise ModelLoadError("GGUF metadata lacks the tokenizer.ggml.tokens strings and their tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    # user-defined runs of spaces are stored with spaces; the model's text has U+2581 in their place
    pieces = [t.replace(" ", SPACE) if ty == USER_DEFINED else t for t, ty in zip(tokens, types)]
    vocab = {t: i for i, t in enumerate(pieces)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab, _score_merges(pieces, scores, types, vocab), byte_fallback=True, fuse_unk=True,
                     unk_token=pieces[unk] if isinstance(unk, int) and 0 <= unk < len(pieces) else None)
    tok = HFTokenizer(bpe)
    replace = normalizers.Replace(" ", SPACE)
    prepend = meta.get("tokenizer.ggml.add_space_prefix", False)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prepend else replace
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prepend else []))
    # control tokens are special (dropped when decoding); user-defined ones ("\n\n", "<h1>") match as they are
    added = [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types)
             if ty == CONTROL or (ty == USER_DEFINED and " " not in t)]
    tok.add_tokens(added)
    return tok


def _score_merges(pieces: list[str], scores: list[float], types: list[int],
                  vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges of SentencePiece pieces: each split of a piece (but control tokens) into two pieces, in the order of
    the joined pieces: user-defined ones first (SentencePiece matches them whole before merging), in vocabulary order,
    then the normal ones by score (ties: longer left part, then longer right part, then piece ids)."""
    merges = []
    for i, (piece, score, kind) in enumerate(zip(pieces, scores, types)):
        if kind == CONTROL:
            continue
        rank = (0, i) if kind == USER_DEFINED else (1, -score)
        splits = [(piece[:j], piece[j:]) for j in range(1, len(piece))]
        splits = sorted((vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab)
        merges.extend((rank, -len(a), -len(b), n, a, b) for n, (_, _, a, b) in enumerate(splits))
    merges.sort(key=lambda m: m[:4])
    return [(a, b) for *_, a, b in merges]
