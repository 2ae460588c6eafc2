"""The public Python API: `LLM` and `SamplingParams`, in the spirit of vLLM's.

    from magicdec import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    outs = llm.generate(prompts, params, speculative=SpeculativeConfig("self-streaming", budget=256, gamma=3))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from magicdec.decode import GenerationStats, ProgressFn, StopStrings, generate_ids
from magicdec.errors import InvalidRequestError
from magicdec.loading import LoadedModel, load_model
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig

DTYPES = {"auto": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name -> torch dtype; None and "auto" -> None (the loader decides, `magicdec.cpu.auto_dtype`)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InvalidRequestError(f"unknown dtype {name!r}; choose from auto, fp32, bf16, fp16") from None


@dataclass
class RequestOutput:
    """The result for one prompt."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    accepted_hist: list[int]  # verify steps by number of draft tokens accepted (speculative only)


class LLM:
    """A loaded model ready to generate. Device and dtypes are decided here, once."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        kv_dtype: str | torch.dtype | None = None,
        prefill_chunk: int = 512,
    ):
        if prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.loaded: LoadedModel = load_model(model, device=device, dtype=parse_dtype(dtype))
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.kv_dtype = parse_dtype(kv_dtype) or self.model.dtype
        self.prefill_chunk = prefill_chunk
        self.last_stats: GenerationStats | None = None

    @property
    def max_context(self) -> int:
        return self.model.cfg.max_seq_len

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of strings, not a single string")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p:
                raise InvalidRequestError(f"prompt {i} is empty or not a string")
        return self.tokenizer.encode_batch(prompts)

    def check_prompts(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("no prompts given")
        vocab = self.model.cfg.vocab_size
        for i, ids in enumerate(prompt_ids):
            if len(ids) == 0:
                raise InvalidRequestError(f"prompt {i} is empty")
            if len(ids) + params.max_tokens > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={params.max_tokens} it exceeds the "
                    f"model's context of {self.max_context} tokens"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        speculative: SpeculativeConfig | None = None,
        progress: ProgressFn | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, or token ids). Stats land in `self.last_stats`."""
        params = params or SamplingParams()
        ids = [list(p) for p in prompt_token_ids] if prompt_token_ids is not None else self.encode(prompts or [])
        self.check_prompts(ids, params)
        stops = StopStrings(params.stop, self.tokenizer.decode) if params.stop else None
        drafter, gamma = speculative.build(self) if speculative is not None else (None, 0)
        results, stats = generate_ids(
            self.model, ids, params, self.tokenizer.eos_ids,
            drafter=drafter, gamma=gamma, kv_dtype=self.kv_dtype, prefill_chunk=self.prefill_chunk,
            stop_strings=stops, progress=progress, replan=speculative.replan if speculative is not None else None,
        )
        self.last_stats = stats
        outputs = []
        for i, r in enumerate(results):
            text = self.tokenizer.decode(r.token_ids)
            for s in params.stop:
                if s in text:
                    text = text[: text.index(s)]
            outputs.append(RequestOutput(prompts[i] if prompts else None, ids[i], text, r.token_ids,
                                         r.finish_reason, r.accepted_hist))
        return outputs

