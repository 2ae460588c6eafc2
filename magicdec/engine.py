"""The engine: `LLMEngine` runs the step loop that both the offline API and the server drive, and `LLM` is the
offline API in the spirit of vLLM's.

    from magicdec import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    outs = llm.generate(prompts, params, speculative=SpeculativeConfig("self-streaming", budget=256, gamma=3))
    outs = llm.generate(prompts, params, speculative=SpeculativeConfig("auto"))  # planned for this batch and context

A step is schedule -> execute -> update: the scheduler decides (admissions, prefill chunks, the draft length), the
runner executes on the model and caches, and the results update the requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from magicdec import dtypes, kernels, scopes
from magicdec.autoplan import Choice, choose
from magicdec.config import EngineConfig
from magicdec.distributed import init_tp, launched_world_size
from magicdec.drafters.base import Drafter
from magicdec.errors import InvalidRequestError
from magicdec.kv.blocks import BLOCK_SIZE, KVManager, blocks_for
from magicdec.loading import LoadedModel, load_model
from magicdec.loading.tokenizer import Tokenizer
from magicdec.logprobs import TokenLogprob
from magicdec.memory import available_bytes, check_fits, peak_bytes
from magicdec.model import Transformer, attention_path, linear_path, weight_dtype
from magicdec.phases import PhaseRecorder
from magicdec.profiles import model_key, target_shape
from magicdec.runner import CACHE_SLACK, ModelRunner, uses_graphs
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma, GammaPolicy, Request, Scheduler, Status, cuda_row_bucket
from magicdec.speculative import Speculation, SpeculativeConfig
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


def parse_kv_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A KV cache dtype name (`parse_dtype`'s, or int8 / fp8: magicdec.kv.quant) -> torch dtype; None and "auto" ->
    None (the engine decides: `resolve_config`)."""
    if isinstance(name, str) and name.lower() in dtypes.KV_ONLY:
        return getattr(torch, dtypes.KV_ONLY[name.lower()])
    try:  # a torch dtype, int8 and fp8 included, comes back as it is
        return parse_dtype(name)
    except InvalidRequestError:
        raise InvalidRequestError(f"unknown KV cache dtype {name!r}; choose from auto, "
                                  f"{', '.join([*dtypes.BYTES, *dtypes.KV_ONLY])}") from None


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
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, where SamplingParams.logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), if asked


class LLMEngine:
    """Requests in, tokens out, one step at a time, over the slots and limits of `config`.

    `speculation` turns drafting on (its policy picks each step's draft length from the live batch and context; 0
    means plain decoding for that step); `set_speculation` changes it between runs. `eos_ids` end requests that do
    not ignore EOS; `tokenizer` decodes output text (and stop strings). `kv` is the target's KV manager, shared with
    other engines (`LLM` keeps one across the engines it builds, with its cached prefixes); without one, the engine
    makes its own as `config` sizes it."""

    def __init__(self, model: Transformer, config: EngineConfig, *, eos_ids: Sequence[int] = (),
                 tokenizer: Tokenizer | None = None, speculation: Speculation | None = None,
                 kv: KVManager | None = None):
        config = resolve_config(config, model)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.kv = kv if kv is not None else make_kv_manager(model, config)
        if self.kv.dtype != config.kv_dtype:
            raise ValueError(f"a KV pool of {self.kv.dtype} serves no {config.kv_dtype} KV cache")
        self.runner = ModelRunner(model, config, eos_ids, kv=self.kv,
                                  drafter=speculation.drafter if speculation else None)
        self.scheduler = Scheduler(config, FixedGamma(0), kv=self.kv,
                                   decode=tokenizer.decode if tokenizer is not None else None,
                                   row_bucket=cuda_row_bucket if model.device.type == "cuda" else lambda n: n)
        self.scheduler.set_speculation(*self._policy(speculation))
        self.requests: dict[str, Request] = {}
        self._offline_ids = itertools.count()
        # Seeds of unseeded requests. Under tensor parallelism every rank must sample with the same seeds (identical
        # logits then give identical tokens with no broadcast), so the generator is seeded from rank 0 once; the ranks
        # add the same requests in the same order and so draw the same seeds.
        self._seeds = random.Random(model.tp.shared_seed() if model.tp is not None else random.getrandbits(63))
        self.reset_stats()

    @property
    def max_model_len(self) -> int:
        """Most prompt + output tokens one request may have."""
        return self.config.max_model_len

    @staticmethod
    def _policy(speculation: Speculation | None) -> tuple[GammaPolicy, int, bool, int]:
        if speculation is None:
            return FixedGamma(0), 0, False, 0
        drafter = speculation.drafter
        return speculation.policy, drafter.gamma, drafter.prefills, drafter.blocks_per_request

    def set_speculation(self, speculation: Speculation | None) -> None:
        """Draft with `speculation` (None: plain decoding) from now on; only between runs, with no request in."""
        if self.has_unfinished():
            raise RuntimeError("the drafter can only change while no request is in the engine")
        self.runner.use_drafter(speculation.drafter if speculation is not None else None)
        self.scheduler.set_speculation(*self._policy(speculation))

    def capture_graphs(self) -> GenerationStats:
        """Where the runner replays decode forwards from CUDA graphs, capture the plain decode step of every row
        bucket now (a server's start-up, before any request); returns stats holding what was captured."""
        if self.has_unfinished():
            raise RuntimeError("CUDA graphs are captured before any request")
        buckets = {self.scheduler.decode_rows(n) for n in range(1, self.config.max_num_seqs + 1)}
        self.runner.capture_graphs(sorted(buckets))
        stats = GenerationStats()
        self.record_graphs(stats)
        return stats

    def record_graphs(self, stats: GenerationStats) -> None:
        """Put the CUDA graphs captured so far (their count, capture time and memory) into `stats`."""
        graphs = self.runner.graphs
        if graphs is not None:
            stats.cuda_graphs, stats.graph_capture_s, stats.graph_memory_bytes = (graphs.count, graphs.capture_s,
                                                                                  graphs.memory_bytes)

    def reset_stats(self) -> GenerationStats:
        """Start counting anew (each `LLM.generate` call reports its own run)."""
        self.stats = GenerationStats(dtype=str(self.model.dtype).removeprefix("torch."))
        return self.stats

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (raises InvalidRequestError for a bad one, QueueFullError when the queue is full)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = check_token_ids(prompt_ids, self.model.cfg.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; with max_tokens={params.max_tokens} it exceeds "
                f"the context of {self.max_model_len} tokens"
            )
        need = len(prompt_ids) + params.max_tokens + CACHE_SLACK
        draft = self.scheduler.draft_blocks
        if blocks_for(need) + draft > self.kv.num_blocks - 1:
            beside = f", its sparse draft cache taking {draft * BLOCK_SIZE} of them" if draft else ""
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; with max_tokens={params.max_tokens} it needs more KV "
                f"blocks than the whole KV cache holds ({self.kv.capacity_tokens} tokens{beside}; see --kv-cache-gb)")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(request_id, prompt_ids, params, seed)
        self.scheduler.add(request)
        self.requests[request_id] = request
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt_ids)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stop a request early, freeing its slot; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            slot = self.scheduler.abort(request)
            if slot is not None:
                self.runner.release(slot)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 progress: ProgressFn | None = None, phases: PhaseRecorder | None = None) -> list[Request]:
        """The offline loop: queue every prompt (ids), step until all are done; the requests in prompt order.
        `params` is one for all or one per prompt; `progress` gets (prompt + output tokens done, in all); `phases`
        profiles its decode rounds from the first step after every prompt is prefilled."""
        per_prompt = per_prompt_params(params, len(prompts))
        requests = [self.add_request(f"offline-{next(self._offline_ids)}", p, sp) for p, sp in zip(prompts, per_prompt)]
        total = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, per_prompt))
        try:
            while self.has_unfinished():
                if phases is not None and phases.waiting and all(r.status in DECODING for r in requests):
                    phases.start(self.model.device, self.model.dtype)
                rounds = self.stats.steps
                self.step()
                if phases is not None and phases.running and self.stats.steps > rounds:
                    phases.round_done()
                if progress is not None:
                    progress(sum(len(r.prompt_ids) * (r.status is not Status.WAITING) + len(r.output_ids)
                                 for r in requests), total)
        finally:
            if phases is not None:
                phases.stop()
        return requests

    def step(self) -> list[Request]:
        """Schedule, execute, update. Returns the requests that gained tokens or finished in this step.

        Under tensor parallelism every rank schedules the same step from the same state, but a gamma policy that
        times rounds (`--draft auto`) reads this rank's clock: rank 0's draft length travels to the others, so that
        all run the same forwards."""
        scheduled = self.scheduler.schedule()
        if self.model.tp is not None and scheduled.n_rows and self.scheduler.max_gamma:
            scheduled.gamma = self.model.tp.share(scheduled.gamma)
        result = self.runner.execute(scheduled)
        changed, freed = self.scheduler.update(scheduled, result, timed=scopes.active is None)
        for slot in freed:
            self.runner.release(slot)
        self.stats.record(scheduled, result)
        for request in changed:
            if request.finished:
                self.requests.pop(request.request_id, None)
        return changed

    def text_of(self, request: Request) -> str:
        """The request's output text, cut before the first stop string."""
        text = self.tokenizer.decode(request.output_ids)
        for s in request.params.stop:
            if s in text:
                text = text[: text.index(s)]
        return text


#: A request in one of these has its whole prompt prefilled.
DECODING = (Status.RUNNING, Status.FINISHED)


def resolve_config(config: EngineConfig, model: Transformer) -> EngineConfig:
    """`config` with the model's defaults filled in: its context as `max_model_len`, and as the KV dtype its dtype, or
    the 16-bit storage of the native kernels where they compute in the model's fp32 (`kernels.default_kv_dtype`)."""
    kv_dtype = config.kv_dtype or kernels.default_kv_dtype(model.device, model.dtype, weight_dtype(model))
    return dataclasses.replace(config, max_model_len=config.max_model_len or model.cfg.max_seq_len, kv_dtype=kv_dtype)


def make_kv_manager(model: Transformer, config: EngineConfig) -> KVManager:
    """The KV manager `config` (resolved) asks for: a pool of `kv_cache_bytes` (None: half the memory available now,
    the same on every tensor-parallel rank, which must make the same block decisions), a hybrid model's window store
    taking a quarter of it."""
    size = config.kv_cache_bytes
    if size is None:
        size = available_bytes(model.device) // 2
        if model.tp is not None:
            size = model.tp.min_int(size)
    check_fits(size, model.device, f"a KV cache of {size / 2**30:.2f} GiB (--kv-cache-gb)")
    window = size // 4 if model.cfg.hybrid and config.enable_prefix_caching else 0
    num_blocks = max(2, (size - window) // KVManager.block_bytes(model.cfg, config.kv_dtype))
    return KVManager(model.cfg, num_blocks, config.kv_dtype, model.device, caching=config.enable_prefix_caching,
                     window_bytes=window)


def per_prompt_params(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One SamplingParams for each of n prompts, from one for all or one per prompt."""
    per_prompt = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != n or not all(isinstance(p, SamplingParams) for p in per_prompt):
        raise InvalidRequestError("params must be one SamplingParams or one per prompt")
    return per_prompt


def prefix_rows(ids: Sequence[Sequence[int]]) -> float:
    """Rows per shared prompt prefix among the prompts `ids`: prompts that agree over all their whole chunks of the
    attention kernels (`kernels.CHUNK` positions: what rows sharing cached blocks attend over together) count once;
    a prompt shorter than a chunk shares nothing."""
    keys = {tuple(p[: len(p) // kernels.CHUNK * kernels.CHUNK]) if len(p) >= kernels.CHUNK else i
            for i, p in enumerate(ids)}
    return len(ids) / max(1, len(keys))


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
    """A loaded model ready to generate. Device, dtypes and the engine configuration are decided here, once; the
    engine (its caches) and each speculative setting's drafter are built on first use and reused."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        kv_cache_dtype: str | torch.dtype | None = None,
        prefill_chunk: int = 512,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_gb: float | None = None,
        enforce_eager: bool = False,
        tp: bool | None = None,
    ):
        """`max_model_len`: most prompt + output tokens of a request (None: the model's context); `max_num_seqs`: most
        requests running at once. `kv_cache_gb`: the KV blocks' memory, shared by the running requests as they grow and
        by the cached prefixes (None: half the memory available after the model loads). `kv_cache_dtype`: the KV cache's
        storage, "auto" (None: the model's dtype, or the native kernels' 16-bit storage), fp32, bf16, fp16, or 8-bit:
        int8 (a scale per cached row; the native CPU kernel reads it where it runs) or fp8 (e4m3, unscaled), at half the
        bytes of bf16 and their rounding (magicdec.kv.quant). `enable_prefix_caching`: reuse the K/V blocks of earlier
        requests' prompts and outputs (kept across generate calls while the pool has room). `enforce_eager`: on CUDA, no
        CUDA graphs (`magicdec.graphs`). `tp`: run this process as one rank of a tensor-parallel group that torchrun
        launched (see magicdec.distributed); None: when the launcher started more than one process. Every rank must then
        make the same calls with the same arguments; each returns the same outputs."""
        # the settings are checked before the model loads
        if kv_cache_gb is not None and not (isinstance(kv_cache_gb, (int, float)) and 0 < kv_cache_gb < 1 << 20):
            raise InvalidRequestError(f"kv_cache_gb must be a positive number of GiB, got {kv_cache_gb!r}")
        kv_bytes = None if kv_cache_gb is None else int(kv_cache_gb * 2**30)
        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                              kv_dtype=parse_kv_dtype(kv_cache_dtype), enable_prefix_caching=enable_prefix_caching,
                              kv_cache_bytes=kv_bytes, enforce_eager=enforce_eager)
        tp = launched_world_size() > 1 if tp is None else tp
        group = init_tp(device) if tp else None
        self.loaded: LoadedModel = load_model(model, device=device, dtype=parse_dtype(dtype), tp=group)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        context = self.model.cfg.max_seq_len
        if (max_model_len or 0) > context:
            raise InvalidRequestError(f"max_model_len {max_model_len} exceeds the model's context of {context}")
        self.config = resolve_config(config, self.model)
        self.attention = attention_path(self.model.device, self.kv_dtype)  # builds a native kernel now, not mid-run
        self.linear = linear_path(self.model.device, weight_dtype(self.model))  # "packed" where load_model packed them
        self.kernels = kernels.path_name()  # the native kernels' instruction-set path, "torch" where none runs
        # where a layer's norms and RoPE run: the path's layer operators, two calls a layer ("sublayers") or one
        # operator a call ("native", MAGICDEC_FUSED=ops), or torch's ("torch": MAGICDEC_FUSED=0, no path)
        x = torch.empty(0, dtype=self.model.dtype, device=self.model.device)
        self.layer_ops = "sublayers" if kernels.sublayers(x) else "native" if kernels.fuses(x) else "torch"
        self.cascade = "on" if self._groups_rows() else "off"  # as the model loaded (`_groups_rows` reads it per call)
        self.kv = make_kv_manager(self.model, self.config)  # shared by the engines built here
        self.last_stats: GenerationStats | None = None
        #: What `SpeculativeConfig("auto")` resolved to in the last `generate` or `engine` call (None where that call
        #: asked for another drafter or none): the drafter's settings, its Replanner and the plan.
        self.last_auto: Choice | None = None
        # keyed by settings as resolved (`auto` at another shape may pick another drafter), less the draft stop, which
        # is the gamma policy's
        self._drafters: dict[SpeculativeConfig, Drafter | None] = {}
        self._engine: LLMEngine | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.config.kv_dtype

    @property
    def max_model_len(self) -> int:
        """Most prompt + output tokens of one request."""
        return self.config.max_model_len

    def clear_prefix_cache(self) -> None:
        """Forget the cached prefixes, so that the next prompts are prefilled cold."""
        self.kv.drop_cached()

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of strings, not a single string")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p.strip():
                raise InvalidRequestError(f"prompt {i} is empty or not a string")
        return self.tokenizer.encode_batch(prompts)

    def plan(self, speculative: SpeculativeConfig, prompt_token_ids: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> Choice:
        """What `generate` resolves `speculative` (draft "auto") to for these prompts, before running them: it plans
        the same way when it does (at as many sequences as run together, at the longest request's prompt and half its
        new tokens; greedy copies of one prompt count once, as they decode alike)."""
        if speculative.draft != "auto":
            raise InvalidRequestError(f"draft {speculative.draft!r} needs no plan: only 'auto' is planned")
        ids, per_prompt = self._requests(None, prompt_token_ids, params)
        return self._choose(speculative, *self._generate_shape(ids, per_prompt, speculative.mode))

    def _groups_rows(self) -> bool:
        """Whether rows that share cached blocks attend over them together now: the native kernels over a 16-bit
        cache, with MAGICDEC_CASCADE on (`kernels.groups`, read at each call)."""
        return self.attention == "native" and self.kv_dtype.itemsize == 2 and kernels.groups()

    def _generate_shape(self, ids: list[list[int]], per_prompt: list[SamplingParams],
                        mode: str) -> tuple[int, int, int, float]:
        """(batch, context, rows that differ, rows per shared prompt prefix where the kernels group them, else 1) of a
        `generate` call, as `plan` says."""
        batch = min(len(ids), self.config.max_num_seqs)
        context = max(len(p) + sp.max_tokens // 2 for p, sp in zip(ids, per_prompt))
        rows = len({tuple(p) for p in ids}) if mode == "greedy" else batch
        return batch, context, min(rows, batch), prefix_rows(ids) if self._groups_rows() else 1.0

    def _choose(self, speculative: SpeculativeConfig, batch: int, context: int, rows: int | None = None,
                shared: float = 1.0) -> Choice:
        """`auto` planned for `batch` sequences of `context` tokens (`rows` of them differing, default all; `shared`
        rows per prompt prefix), with the acceptance measured for this model and its KV dtype."""
        return choose(self.model, batch, context, kv_dtype=self.kv_dtype, model_name=model_key(self.loaded.source),
                      profile=speculative.hardware, mode=speculative.mode, draft_vocab=speculative.draft_vocab,
                      vocab_corpus=speculative.vocab_corpus, tokenizer=self.tokenizer, rows=rows,
                      graphs=uses_graphs(self.model, self.kv_dtype, self.config), prefix_rows=shared,
                      draft_stop=speculative.draft_stop)

    def _speculation(self, speculative: SpeculativeConfig | None, batch: int, context: int,
                     rows: int | None = None, shared: float = 1.0) -> Speculation | None:
        """The drafter of `speculative` (built once per setting: a draft model's weights load once) and its gamma
        policy: `auto` planned at (`batch`, `context`, `rows`, `shared`) and kept in `last_auto`, its Replanner
        re-planning each step; else the config's fixed gamma. None for plain decoding."""
        self.last_auto = None
        policy = None
        if speculative is not None and speculative.draft == "auto":
            self.last_auto = self._choose(speculative, batch, context, rows, shared)
            speculative, policy = self.last_auto.speculative, self.last_auto.replanner
        if speculative is None:
            return None
        key = dataclasses.replace(speculative, draft_stop=None)
        if key not in self._drafters:
            self._drafters[key] = speculative.build(self.model, self.tokenizer)
        drafter = self._drafters[key]
        policy = policy or FixedGamma(speculative.gamma, speculative.draft_stop)
        return Speculation(drafter, policy) if drafter is not None else None

    def engine(self, speculative: SpeculativeConfig | None = None, *, fit_memory: bool = False,
               **overrides) -> LLMEngine:
        """The LLM's engine, drafting as `speculative` says, with `overrides` (EngineConfig fields) over the LLM's
        configuration; `auto` is planned for its slots at its longest request (`last_auto`). An engine whose slots and
        request length cover these (and whose other settings match) is reused with its caches; else it is replaced.
        With `fit_memory`, a new engine takes fewer slots where free memory holds fewer (at least one; it says clearly
        if even that does not fit)."""
        config = dataclasses.replace(self.config, **overrides)
        return self._engine_with(self._speculation(speculative, config.max_num_seqs, config.max_model_len), config,
                                 fit_memory)

    def _engine_with(self, speculation: Speculation | None, config: EngineConfig, fit_memory: bool) -> LLMEngine:
        engine = self._engine
        if engine is not None and _covers(engine.config, config):
            engine.set_speculation(speculation)
            return engine
        self.free_engine()  # its caches go before the new ones are allocated
        if fit_memory:
            config = dataclasses.replace(config, max_num_seqs=self._slots_that_fit(config, speculation))
        self._engine = LLMEngine(self.model, config, eos_ids=self.tokenizer.eos_ids, tokenizer=self.tokenizer,
                                 speculation=speculation, kv=self.kv)
        return self._engine

    def free_engine(self) -> None:
        """Drop the engine and its caches (the next call builds one); the blocks of requests it still held (a run
        interrupted midway) go back to the pool, their full blocks cached."""
        if self._engine is not None:
            self._engine.runner.use_drafter(None)
            for request_id in list(self.kv.held):
                self.kv.free(request_id)
            self._engine = None

    def _slots_that_fit(self, config: EngineConfig, speculation: Speculation | None) -> int:
        drafter = speculation.drafter if speculation is not None else None
        per_slot = ModelRunner.memory_bytes(self.model, dataclasses.replace(config, max_num_seqs=1), drafter)
        slots = max(1, min(config.max_num_seqs, int(0.9 * available_bytes(self.model.device)) // per_slot))
        if self.model.tp is not None:  # the ranks must run the same batch: the fewest that fit on every one
            slots = self.model.tp.min_int(slots)
        return slots

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        speculative: SpeculativeConfig | None = None,
        progress: ProgressFn | None = None,
        phases: PhaseRecorder | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, or token ids); `params` is one for all or one per prompt.
        `speculative` drafts; `auto` is planned for these prompts (`plan`; what it chose lands in `last_auto`).
        `phases` profiles the first decode rounds after every prompt is prefilled: where their forwards' time goes
        (`magicdec.phases`), in `last_stats.phases`.

        All prompts are queued at once; up to `max_num_seqs` (fewer if memory is short) run together, and a finished
        one's slot goes to the next. Stats land in `self.last_stats`."""
        ids, per_prompt = self._requests(prompts, prompt_token_ids, params)
        planned = self._generate_shape(ids, per_prompt, speculative.mode if speculative is not None else "greedy")
        config = dataclasses.replace(self.config, max_num_seqs=planned[0],
                                     max_model_len=max(len(p) + sp.max_tokens for p, sp in zip(ids, per_prompt)))
        engine = self._engine_with(self._speculation(speculative, *planned), config, fit_memory=True)
        stats = engine.reset_stats()
        requests = engine.generate(ids, per_prompt, progress, phases)
        stats.peak_memory_bytes = peak_bytes(self.model.device)
        if phases is not None:
            shape = target_shape(self.model.cfg)
            stats.phases = phases.report(shape, dtypes.nbytes(weight_dtype(self.model)),
                                         dtypes.kv_nbytes(self.kv_dtype, shape.head_dim), prefix_rows=planned[3])
        engine.record_graphs(stats)
        self.last_stats = stats
        return [RequestOutput(i, prompts[i] if prompts is not None else None, r.prompt_ids, engine.text_of(r),
                              r.output_ids, r.finish_reason, r.accepted_hist, r.logprobs, r.prompt_logprobs)
                for i, r in enumerate(requests)]

    def _requests(
        self, prompts: Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None,
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """The prompts' ids and each one's SamplingParams, checked: each must fit in the context with its tokens."""
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequestError("give prompts or prompt_token_ids, not both")
        ids = [check_token_ids(p, self.model.cfg.vocab_size) for p in prompt_token_ids] \
            if prompt_token_ids is not None else self.encode(prompts or [])
        if not ids:
            raise InvalidRequestError("no prompts given")
        per_prompt = per_prompt_params(SamplingParams() if params is None else params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, per_prompt)):
            if len(p) + sp.max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={sp.max_tokens} it exceeds the "
                    f"model's context of {self.max_model_len} tokens"
                )
        return ids, per_prompt


def _covers(built: EngineConfig, wanted: EngineConfig) -> bool:
    """Whether an engine built with `built` can run what `wanted` asks: as many slots and as long requests or more,
    every other setting the same."""
    return (wanted.max_num_seqs <= built.max_num_seqs and wanted.max_model_len <= built.max_model_len
            and dataclasses.replace(wanted, max_num_seqs=built.max_num_seqs, max_model_len=built.max_model_len) == built)
