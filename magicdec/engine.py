"""The engine: `LLMEngine` runs the step loop that both the offline API and the server drive, and `LLM` is
the offline API in the spirit of vLLM's.

    from magicdec import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    outs = llm.generate(prompts, params, speculative=SpeculativeConfig("self-streaming", budget=256, gamma=3))

A step is schedule -> execute -> update: the scheduler decides (admissions, prefill chunks, the draft
length), the runner executes on the model and caches, and the results update the requests.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from magicdec.distributed import init_tp, launched_world_size
from magicdec.drafters.base import Drafter
from magicdec.errors import InvalidRequestError
from magicdec.loading import LoadedModel, load_model
from magicdec.loading.tokenizer import Tokenizer
from magicdec.memory import available_bytes, peak_bytes
from magicdec import dtypes
from magicdec.model import Transformer, attention_path, linear_path
from magicdec.runner import CACHE_SLACK, ModelRunner, PromptCache
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma, GammaPolicy, Request, Scheduler, Status, cuda_row_bucket
from magicdec.speculative import SpeculativeConfig
from magicdec.stats import GenerationStats

#: Progress of a long run: (units done, units in all), in prompt + output tokens.
ProgressFn = Callable[[int, int], None]


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name -> torch dtype; None and "auto" -> None (the loader decides, `magicdec.cpu.auto_dtype`)."""
    if name is None or isinstance(name, torch.dtype) or name.lower() == "auto":
        return None if name is None or isinstance(name, str) else name
    short = dtypes.short_name(name)
    if short is None:
        raise InvalidRequestError(f"unknown dtype {name!r}; choose from auto, {', '.join(dtypes.BYTES)}")
    return getattr(torch, dtypes.TORCH_NAMES[short])


@dataclass
class RequestOutput:
    """The result for one prompt."""

    index: int  # position of the prompt in the call
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" or "abort"
    accepted_hist: list[int]  # verify rounds by number of draft tokens accepted (speculative only)


class LLMEngine:
    """Requests in, tokens out, one step at a time; `slots` requests of up to `capacity` tokens run at once.

    `drafter` and `gamma_policy` turn on speculation (the policy picks each step's draft length from the
    live batch and context; 0 means plain decoding for that step). `max_prefill_tokens` bounds the prompt
    tokens prefilled per step (None: everything admitted, as an offline batch wants); `max_queued` bounds
    the queue (None: unbounded).
    """

    def __init__(
        self,
        model: Transformer,
        eos_ids: Sequence[int],
        *,
        slots: int,
        capacity: int,
        kv_dtype: torch.dtype | None = None,
        tokenizer: Tokenizer | None = None,
        drafter: Drafter | None = None,
        gamma_policy: GammaPolicy | None = None,
        prefill_chunk: int = 512,
        max_prefill_tokens: int | None = None,
        max_queued: int | None = None,
        prompt_cache: PromptCache | None = None,
    ):
        if drafter is not None and gamma_policy is None:
            raise ValueError("a drafter needs a gamma policy")
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.capacity = capacity
        self.runner = ModelRunner(model, eos_ids, slots=slots, capacity=capacity, kv_dtype=kv_dtype or model.dtype,
                                  drafter=drafter, prompt_cache=prompt_cache)
        policy = gamma_policy if drafter is not None else FixedGamma(0)
        self.scheduler = Scheduler(slots, prefill_chunk, policy, drafter.gamma if drafter is not None else 0,
                                   max_prefill_tokens=max_prefill_tokens or 1 << 62,
                                   max_queued=max_queued,
                                   is_cached=(lambda p: p in prompt_cache) if prompt_cache is not None else None,
                                   row_bucket=cuda_row_bucket if model.device.type == "cuda" else lambda n: n)
        self.requests: dict[str, Request] = {}
        self._offline_ids = itertools.count()
        # Seeds of unseeded requests. Under tensor parallelism every rank must sample with the same seeds
        # (identical logits then give identical tokens with no broadcast), so the generator is seeded from
        # rank 0 once; the ranks add the same requests in the same order and so draw the same seeds.
        self._seeds = random.Random(model.tp.shared_seed() if model.tp is not None else random.getrandbits(63))
        self.stats = GenerationStats(dtype=str(model.dtype).removeprefix("torch."))

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request may have."""
        return self.capacity - CACHE_SLACK

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (raises InvalidRequestError for a bad one, QueueFullError when the queue is full)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = check_token_ids(prompt_ids, self.model.cfg.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_request_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; with max_tokens={params.max_tokens} it exceeds "
                f"the context of {self.max_request_tokens} tokens"
            )
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(request_id, prompt_ids, params, seed)
        self.scheduler.add(request)
        self.requests[request_id] = request
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request early (its slot is freed at the next step); unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.abort(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 progress: ProgressFn | None = None) -> list[Request]:
        """The offline loop: queue every prompt (ids), step until all are done; the requests in prompt order.
        `params` is one for all or one per prompt; `progress` gets (prompt + output tokens done, in all)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise InvalidRequestError("params must be one SamplingParams or one per prompt")
        requests = [self.add_request(f"offline-{next(self._offline_ids)}", p, sp) for p, sp in zip(prompts, per_prompt)]
        total = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, per_prompt))
        while self.has_unfinished():
            self.step()
            if progress is not None:
                progress(sum(len(r.prompt_ids) * (r.status is not Status.WAITING) + len(r.output_ids)
                             for r in requests), total)
        return requests

    def step(self) -> list[Request]:
        """Schedule, execute, update. Returns the requests that gained tokens or finished in this step."""
        step = self.scheduler.schedule()
        try:
            result = self.runner.execute(step)
        except Exception:
            # the runner may not have freed these slots; freeing is idempotent, so ask again next step
            self.scheduler.retry_release(step.release)
            raise
        changed = self.scheduler.update(step, result)
        s = self.stats
        s.prefill_s += result.prefill_s
        live = [n for n, k in zip(result.accepted, result.kept) if k]
        if live:  # (a round can find every row gone: first tokens that were EOS)
            s.decode_s += result.decode_s
            s.draft_s += result.draft_s
            s.decode_tokens += sum(result.kept)
            s.count_round(step.gamma, len(live), live)
            self.scheduler.gamma_policy.observe(step.gamma, live, result.decode_s)
        s.generated_tokens += len(result.first) + sum(result.kept)
        for request in changed:
            if request.params.stop and not request.finished:
                self._check_stop_strings(request)
            if request.finished:
                self.requests.pop(request.request_id, None)
        return changed

    def _check_stop_strings(self, request: Request) -> None:
        """End a request whose text now contains a stop string, keeping the tokens up to the one completing it."""
        stops, ids = request.params.stop, request.output_ids
        span = max(map(len, stops))  # every token adds at least one character, so a stop spans <= len tokens
        window = max(0, len(ids) - span - 16)
        if not any(s in self.tokenizer.decode(ids[window:]) for s in stops):
            return
        lo, hi = window + 1, len(ids)  # the fewest tokens whose text contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.tokenizer.decode(ids[window:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        del ids[lo:]
        self.scheduler.finish(request, "stop")

    def text_of(self, request: Request) -> str:
        """The request's output text, cut before the first stop string."""
        text = self.tokenizer.decode(request.output_ids)
        for s in request.params.stop:
            if s in text:
                text = text[: text.index(s)]
        return text


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt as a list of in-vocabulary ints, or InvalidRequestError."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise InvalidRequestError(f"a prompt's token ids must be a list of integers, got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("token ids must be integers")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError(f"token ids must lie in the vocabulary [0, {vocab_size})")
    return ids


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
        max_num_seqs: int = 256,
        prompt_cache_bytes: int = 0,
        tp: bool | None = None,
    ):
        """`tp`: run this process as one rank of a tensor-parallel group that torchrun launched (see
        magicdec.distributed); None: when the launcher started more than one process. Every rank must then
        make the same calls with the same arguments; each returns the same outputs."""
        if prefill_chunk < 1:
            raise InvalidRequestError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_num_seqs < 1:
            raise InvalidRequestError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        tp = launched_world_size() > 1 if tp is None else tp
        group = init_tp(device) if tp else None
        self.loaded: LoadedModel = load_model(model, device=device, dtype=parse_dtype(dtype), tp=group)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.kv_dtype = parse_dtype(kv_dtype) or self.model.dtype
        self.attention = attention_path(self.model.device, self.kv_dtype)  # builds a native kernel now, not mid-run
        self.linear = linear_path(self.model.device, self.model.dtype)  # "packed" where load_model packed them
        self.prefill_chunk = prefill_chunk
        self.max_num_seqs = max_num_seqs
        # prefilled prompts kept across generate calls (0: off); see runner.PromptCache
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.last_stats: GenerationStats | None = None

    @property
    def max_context(self) -> int:
        return self.model.cfg.max_seq_len

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of strings, not a single string")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p.strip():
                raise InvalidRequestError(f"prompt {i} is empty or not a string")
        return self.tokenizer.encode_batch(prompts)

    def engine(self, slots: int, capacity: int, speculative: SpeculativeConfig | None = None, *,
               fit_memory: bool = False, **kwargs) -> LLMEngine:
        """An engine over this model for `slots` concurrent requests of up to `capacity` - CACHE_SLACK tokens
        each. With `fit_memory`, fewer slots where free memory holds fewer (at least one; the engine says
        clearly if even that does not fit). kwargs go to LLMEngine."""
        drafter, policy = speculative.build(self.model) if speculative is not None else (None, None)
        if fit_memory:
            per_slot = ModelRunner.memory_bytes(self.model, 1, capacity, self.kv_dtype, drafter, self.prefill_chunk)
            slots = max(1, min(slots, int(0.9 * available_bytes(self.model.device)) // per_slot))
            if self.model.tp is not None:  # the ranks must run the same batch: the fewest that fit on every one
                slots = self.model.tp.min_int(slots)
        return LLMEngine(self.model, self.tokenizer.eos_ids, slots=slots, capacity=capacity, kv_dtype=self.kv_dtype,
                         tokenizer=self.tokenizer, drafter=drafter, gamma_policy=policy,
                         prefill_chunk=self.prefill_chunk, prompt_cache=self.prompt_cache, **kwargs)

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        speculative: SpeculativeConfig | None = None,
        progress: ProgressFn | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, or token ids); `params` is one for all or one per prompt.

        All prompts are queued at once; up to `max_num_seqs` (fewer if memory is short) run together, and a
        finished one's slot goes to the next. Stats land in `self.last_stats`."""
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequestError("give prompts or prompt_token_ids, not both")
        ids = [check_token_ids(p, self.model.cfg.vocab_size) for p in prompt_token_ids] \
            if prompt_token_ids is not None else self.encode(prompts or [])
        if not ids:
            raise InvalidRequestError("no prompts given")
        params = params if params is not None else SamplingParams()
        per_prompt = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(ids) or not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise InvalidRequestError("params must be one SamplingParams or one per prompt")
        for i, (p, sp) in enumerate(zip(ids, per_prompt)):
            if len(p) + sp.max_tokens > self.max_context:
                raise InvalidRequestError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={sp.max_tokens} it exceeds the "
                    f"model's context of {self.max_context} tokens"
                )
        capacity = max(len(p) + sp.max_tokens for p, sp in zip(ids, per_prompt)) + CACHE_SLACK
        engine = self.engine(min(len(ids), self.max_num_seqs), capacity, speculative, fit_memory=True)
        requests = engine.generate(ids, per_prompt, progress)
        engine.stats.peak_memory_bytes = peak_bytes(self.model.device)
        self.last_stats = engine.stats
        return [RequestOutput(i, prompts[i] if prompts is not None else None, r.prompt_ids, engine.text_of(r),
                              r.output_ids, r.finish_reason, r.accepted_hist) for i, r in enumerate(requests)]
