"""The model runner: the only code that touches the model and the caches while requests run.

It owns one row per request slot in every cache, the slots' token buffers and sampling parameters, and executes what
the scheduler decided for a step: prefill chunks of arriving requests, then one decode round (plain, or draft gamma
tokens, verify them in one target forward and commit) for the first n slots. Everything per slot lives in tensors;
the step ends with one host transfer of its results.

The target's K/V live in the KV manager's blocks, which each slot reads through its block table. Slots that are
inside the decoded range but not decoding (free, or still prefilling) ride along: their forwards compute garbage
that is never committed, written past their length into their own blocks or into the null block, and a slot's state
is rebuilt when it is handed out.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from magicdec import scopes
from magicdec.config import EngineConfig
from magicdec.drafters.base import Drafter
from magicdec.graphs import CudaGraphs
from magicdec.kv.blocks import BLOCK_SIZE, KVManager, block_keys
from magicdec.kv.hybrid import HybridCache, paged_cache, paged_part, ring_bytes
from magicdec.kv.paged import PagedKVCache
from magicdec.kv.sparse import SnapKVObserver
from magicdec.logprobs import Logprobs, TokenLogprob, compute_logprobs, to_host
from magicdec.memory import check_fits
from magicdec.model import Ragged, Transformer, attention_path
from magicdec.prefill import OBSERVATION_WINDOW, prefill_upto
from magicdec.sampling import RowParams, SamplingParams, sample_tokens
from magicdec.step import LENGTH, RUNNING, STOPPED, PrefillWork, ScheduledStep, SlotAssignment, SlotOutput, StepResult
from magicdec.verify import accept_drafts

#: Most draft tokens per round; a slot's cache holds this many tokens beyond its request's length.
MAX_GAMMA = 16
#: Cache entries a slot needs beyond prompt + max_tokens: a round can write gamma + 1 tokens past the end.
CACHE_SLACK = MAX_GAMMA + 2

GREEDY = SamplingParams()


def synchronize(device: torch.device) -> None:
    """Wait for the device (CUDA runs asynchronously; CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workspace_bytes(model: Transformer, rows: int, chunk: int) -> int:
    """Peak activations of a forward: a prefill chunk's hidden states, fused projections and logits."""
    cfg = model.cfg
    element = torch.empty((), dtype=model.dtype).element_size()
    per_token = 4 * cfg.dim + (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.ffn_dim
    return chunk * per_token * element + rows * cfg.vocab_size * 4 * (MAX_GAMMA + 1) * 3


def uses_graphs(model: Transformer, kv_dtype: torch.dtype, config: EngineConfig) -> bool:
    """Whether a runner replays its decode forwards from CUDA graphs: on CUDA where the Triton kernels attend (over a
    static span, reading the lengths on the device), unless `config.enforce_eager`; not under tensor parallelism,
    whose collectives run eagerly."""
    device = model.device
    return (device.type == "cuda" and not config.enforce_eager and model.tp is None
            and attention_path(device, kv_dtype) == "triton")


def forward_tokens(config: EngineConfig) -> int:
    """Most tokens one forward writes into a slot: a prefill chunk, its final observation window, or a verification
    (the ring of a sliding-window layer must hold them beyond the window)."""
    return max(config.prefill_chunk, OBSERVATION_WINDOW, MAX_GAMMA + 1)


class ModelRunner:
    """Per-slot state for `config.max_num_seqs` request slots of up to `config.max_model_len` tokens each (the engine
    resolves both, and the KV dtype, before building its runner) over the target's KV blocks in `kv`: each slot's
    block table (the scheduler decides which blocks, the runner writes them), a hybrid model's sliding-layer rings, the
    drafter's caches, token buffers and sampling parameters. A slot starts from the blocks of its prefix hit; a
    hybrid model's rings also take the window before the hit from `kv.windows`, which keeps the windows of prompts
    prefilled and requests released."""

    def __init__(self, model: Transformer, config: EngineConfig, eos_ids: Sequence[int], *, kv: KVManager,
                 drafter: Drafter | None = None):
        self.model, self.kv = model, kv
        self.slots, self.kv_dtype, self.prefill_chunk = config.max_num_seqs, config.kv_dtype, config.prefill_chunk
        self.capacity = config.max_model_len + CACHE_SLACK  # positions per slot
        device = self.device = model.device
        check_fits(self.memory_bytes(model, config, drafter), device,
                   f"{self.slots} slots of up to {config.max_model_len} tokens (their state, draft cache and "
                   f"workspace; the KV blocks are allocated already)")
        self.cache = paged_cache(model.cfg, kv, self.slots, self.capacity, forward_tokens(config))
        self.paged: PagedKVCache = paged_part(self.cache)  # the rows that read the KV blocks
        # decode forwards replayed from CUDA graphs where the Triton kernels attend (their lengths read on the
        # device); elsewhere every forward is eager and attends over the filled prefix only
        self.graphs = CudaGraphs(MAX_GAMMA + 1) if uses_graphs(model, self.kv_dtype, config) else None
        self.forward = self._forward_over(model, self.cache)
        self.drafter: Drafter | None = None
        self.use_drafter(drafter, checked=True)
        self.seq = torch.zeros(self.slots, self.capacity, dtype=torch.long, device=device)  # prompt + output tokens
        self.n_tokens = torch.zeros(self.slots, dtype=torch.long, device=device)  # known tokens per slot
        self.limit = torch.zeros(self.slots, dtype=torch.long, device=device)  # prompt + max_tokens
        self.use_eos = torch.zeros(self.slots, dtype=torch.bool, device=device)
        self.live = torch.zeros(self.slots, dtype=torch.bool, device=device)  # slots that are decoding
        self.rows = RowParams(self.slots, device)
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
        self.prompts: list[list[int]] = [[] for _ in range(self.slots)]  # each slot's prompt ids

    @staticmethod
    def memory_bytes(model: Transformer, config: EngineConfig, drafter: Drafter | None) -> int:
        """Bytes a runner for `config` (max_model_len and kv_dtype resolved) allocates besides the KV blocks,
        planned before allocating."""
        slots, capacity = config.max_num_seqs, config.max_model_len + CACHE_SLACK
        draft = drafter.cache_bytes(slots, capacity, config.kv_dtype) if drafter is not None else 0
        return (ring_bytes(model.cfg, slots, capacity, config.kv_dtype, forward_tokens(config)) + draft
                + 8 * slots * capacity + workspace_bytes(model, slots, config.prefill_chunk))

    def use_drafter(self, drafter: Drafter | None, checked: bool = False) -> None:
        """Draft with `drafter` from now on (None: plain decoding), between runs (no slot in use): the previous
        drafter's cache is dropped and the new one's allocated for these slots. `checked`: its bytes were counted in
        this runner's memory check already."""
        if drafter is not None and drafter is self.drafter:  # its cache is allocated for these slots already
            return
        if self.drafter is not None:
            if self.graphs is not None:
                self.graphs.forget(self.drafter.cache)
            self.drafter.free()
        if drafter is not None:
            if not checked:
                check_fits(drafter.cache_bytes(self.slots, self.capacity, self.kv_dtype), self.device,
                           f"the draft cache of {self.slots} slots x {self.capacity} tokens")
            drafter.allocate(self.slots, self.capacity, self.kv_dtype, self.device, self.cache, self.kv)
            drafter.forward = self._forward_over(drafter.model, drafter.cache)
        self.drafter = drafter

    def _forward_over(self, model: Transformer, cache) -> Callable[..., Tensor]:
        """`model`'s decode forward over `cache` as this runner runs it: replayed from CUDA graphs over a static cache,
        or eager over a cache that attends over its filled prefix."""
        cache.static = self.graphs is not None
        return self.graphs.wrap(model) if self.graphs is not None else model

    @torch.inference_mode()
    def capture_graphs(self, rows: list[int]) -> None:
        """Capture the plain decode forward for each of `rows` now (a server's start) instead of at its first use.
        Call with no request in: the idle rows' writes land in the null block and in rows cleared at assignment."""
        if self.graphs is not None:
            for n in rows:
                self.forward(torch.zeros(n, 1, dtype=torch.long, device=self.device), self.cache.head(n))

    # --- slot lifecycle ---------------------------------------------------------------------------------
    def _assign(self, a: SlotAssignment) -> None:
        """Hand a slot to a request and map its prefix hit's blocks into its table (a hybrid model's ring takes the
        window before the hit); the rest of its prompt is prefilled by the chunks that follow."""
        n, slot = len(a.prompt), a.slot
        row = self.cache.row(slot)
        row.clear()
        self.paged.unmap(slot)
        if a.blocks:
            self.paged.set_blocks(slot, 0, a.blocks)
            if isinstance(row, HybridCache):
                self.kv.windows.load(a.cached, row.window)
            row.commit(len(a.blocks) * BLOCK_SIZE)
        if self.drafter is not None:
            self.kv.zero_blocks(a.draft_blocks)
            self.drafter.assign(slot, a.drafted, a.draft_blocks)
        self.seq[slot, :n] = torch.tensor(a.prompt, dtype=torch.long)
        self.n_tokens[slot] = n
        self.limit[slot] = n - a.generated + a.params.max_tokens
        self.use_eos[slot] = not a.params.ignore_eos
        self.live[slot] = False
        self.rows.set(slot, a.params, a.seed)
        self.prompts[slot] = a.prompt

    def _grow(self, slot: int, first: int, blocks: list[int]) -> None:
        """The slot's table entries from `first` on name new blocks, zeroed before the request writes them."""
        self.kv.zero_blocks(blocks)
        self.paged.set_blocks(slot, first, blocks)

    def _save_window(self, slot: int, tokens: list[int]) -> None:
        """A hybrid model keeps the sliding-layer K/V of the blocks of `tokens` that the slot's ring holds."""
        if isinstance(self.cache, HybridCache) and self.kv.caching:
            row = self.cache.row(slot)
            self.kv.windows.save(block_keys(tokens), row.window, int(row.lens[0]))

    def release(self, slot: int) -> None:
        """The slot's request is done, aborted or preempted (its blocks went back to the pool with the scheduler; a
        hybrid model keeps the window its ring holds), and the slot is emptied."""
        self._save_window(slot, self.seq[slot, : int(self.cache.row(slot).lens[0])].tolist())
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        """Stop decoding the slot and empty its cache row, so that its length no longer widens the attention of the
        slots decoded with it."""
        self.live[slot] = False
        self.rows.set(slot, GREEDY, 0)  # an idle row rides along: keep it off the sampler's work
        self.cache.row(slot).clear()
        self.paged.unmap(slot)
        if self.drafter is not None:
            self.drafter.release(slot)

    def _move(self, src: int, dst: int) -> None:
        """Move a running request from slot src to the free slot dst: its tokens, limits, sampling and caches (the
        block table, a hybrid model's ring, and its draft cache row)."""
        n = int(self.n_tokens[src])
        self.seq[dst, :n] = self.seq[src, :n]
        for per_slot in (self.n_tokens, self.limit, self.use_eos, self.live):
            per_slot[dst] = per_slot[src]
        self.rows.copy_row(src, dst)
        self.prompts[dst] = self.prompts[src]
        self.cache.copy_row(src, dst)
        if self.drafter is not None:
            self.drafter.move(src, dst)
        self._clear(src)

    # --- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> StepResult:
        """Run the step's moves, assignments and prefill chunks, then its decode round; return the results on the
        host (one transfer)."""
        t0 = time.perf_counter()
        for slot in step.release:
            self.release(slot)
        for src, dst in step.moves:
            self._move(src, dst)
        for a in step.assign:
            self._assign(a)
        for grow in step.grow:
            self._grow(*grow)
        prefilled = [(work, *self._prefill(work)) for work in step.prefills]
        synchronize(self.device)
        t1 = time.perf_counter()
        n, draft_s = step.n_rows, 0.0
        asking = [i for i, p in enumerate(self.rows.params[:n]) if p.logprobs is not None]
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        decoded = (empty[:, None], empty, empty, empty, empty, None, None)
        if n:
            with scopes.scope(scopes.ROUND):
                *decoded, draft_s = self._decode(n, step.gamma, step.draft_stop, asking)
        first, outputs, prompt_logprobs = self._to_host(prefilled, *decoded, asking)
        t2 = time.perf_counter()
        return StepResult(first, outputs, t1 - t0, t2 - t1, draft_s, prompt_logprobs)

    def _to_host(self, prefilled: list[tuple[PrefillWork, Tensor | None, Logprobs | None, Logprobs | None]],
                 new: Tensor, kept: Tensor, finish: Tensor, accepted: Tensor, drafted: Tensor,
                 sure: Tensor | None, logprobs: Logprobs | None,
                 asking: list[int]) -> tuple[list[SlotOutput], list[SlotOutput], list[tuple[int, list[TokenLogprob]]]]:
        """The step's results in one copy to the host: the first tokens of the prefills that finished, the decoded
        slots' tokens, and the prompt tokens' log-probabilities of the chunks whose requests asked."""
        firsts = [(work.slot, first, lp) for work, first, lp, _ in prefilled if first is not None]
        prompts = [(work, lp) for work, _, _, lp in prefilled if lp is not None]
        device_lps = [lp for *_, lp in firsts] + [lp for _, lp in prompts] + [logprobs]
        host = iter(to_host([new, kept, finish, accepted, drafted, *([] if sure is None else [sure]),
                             *(f for _, f, _ in firsts),
                             *(part for lp in device_lps if lp is not None for part in lp.parts())]))
        tokens, kept, finish, accepted, drafted = (next(host).tolist() for _ in range(5))
        sure = None if sure is None else next(host).tolist()
        first_ids = [next(host).tolist() for _ in firsts]

        def fetch(lp: Logprobs | None) -> Logprobs | None:  # in the order of device_lps
            return None if lp is None else Logprobs(next(host), next(host), next(host))

        first = []
        for (slot, _, lp), (token, code) in zip(firsts, first_ids):
            lp = fetch(lp)
            entries = lp.entries(0, [token], self.rows.params[slot].logprobs) if lp is not None else None
            first.append(SlotOutput(slot, [token], code, logprobs=entries))
        prompt_logprobs = []
        for work, lp in prompts:
            ids = self.prompts[work.slot][work.start + 1 : work.start + 1 + lp.chosen.shape[1]]
            prompt_logprobs.append((work.slot, fetch(lp).entries(0, ids, self.rows.params[work.slot].prompt_logprobs)))
        lp, row_of = fetch(logprobs), {slot: j for j, slot in enumerate(asking)}
        decoded = []
        for i in range(len(kept)):
            if kept[i]:
                got = tokens[i][: kept[i]]
                entries = lp.entries(row_of[i], got, self.rows.params[i].logprobs) if i in row_of else None
                decoded.append(SlotOutput(i, got, finish[i], accepted[i], entries, drafted[i],
                                          None if sure is None else sure[i][: drafted[i]]))
        return first, decoded, prompt_logprobs

    def _prefill(self, work: PrefillWork) -> tuple[Tensor | None, Logprobs | None, Logprobs | None]:
        """Run one prefill chunk in the target and the drafter; after the last one, sample the first token and start
        decoding the slot. Returns (first token, finish code) [2] after the last chunk, else None; the first token's
        log-probabilities, and those of the chunk's prompt tokens, where the request asks for them (else None)."""
        slot, ids = work.slot, self.prompts[work.slot]
        T, params = len(ids), self.rows.params[work.slot]
        row, prompt = self.cache.row(slot), self.seq[slot, :T]
        observer = None
        if work.final and self.drafter is not None and self.drafter.needs_target_attention:
            observer = SnapKVObserver(self.model.cfg.n_layers)
        every = params.prompt_logprobs is not None
        # None: its prefix hit covered the chunk (never with prompt logprobs: such a request takes no hit, and its
        # chunks start at 0, so the target computes each from work.start)
        logits = prefill_upto(self.model, row, prompt, work.end, observer, every)
        prompt_lp = None
        if every:  # position p's logits give the log-probability of prompt token p + 1
            m = min(work.end, T - 1) - work.start
            prompt_lp = compute_logprobs(logits[None, :m], prompt[None, work.start + 1 : work.start + 1 + m],
                                         params.prompt_logprobs)
            logits = logits[-1:]
        if work.final:
            self._save_window(slot, ids)
        if self.drafter is not None:
            self.drafter.prefill(slot, prompt, work.end, row, observer)
        if not work.final:
            return None, None, prompt_lp
        pos = torch.full((1, 1), T, dtype=torch.long, device=self.device)
        first = sample_tokens(logits[:, None], self.rows.row(slot), pos)  # [1, 1]
        first_lp = compute_logprobs(logits[:, None], first, params.logprobs) if params.logprobs is not None else None
        one = slice(slot, slot + 1)
        self.live[slot] = True
        _, finish = self._emit(one, first, torch.ones(1, dtype=torch.long, device=self.device))
        self.live[slot] = finish[0] == RUNNING
        return torch.cat((first[0], finish)), first_lp, prompt_lp

    def _logprobs(self, logits: Tensor, tokens: Tensor, asking: list[int]) -> Logprobs | None:
        """The log-probabilities of tokens [n, k] under logits [n, k, V], for the rows that ask for them (None where
        none does: the other rows pay nothing)."""
        if not asking:
            return None
        index = torch.tensor(asking, device=self.device)
        return compute_logprobs(logits[index], tokens[index], max(self.rows.params[i].logprobs for i in asking))

    def _decode(self, n: int, gamma: int, stop: float | None,
                asking: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Logprobs | None,
                                            float]:
        """One round over slots [0, n): plain decoding (gamma 0) or draft (rows stopping at `stop`), verify and
        commit; returns the tokens [n, k], how many each row keeps, its finish code, its drafts accepted, its draft
        length, its drafted tokens' confidences (with `stop`), the log-probabilities of the rows in `asking`, and the
        drafting's seconds."""
        cache, rows, live = self.cache.head(n), self.rows.head(n), self.live[:n]
        n_tokens = self.n_tokens[:n].clone()
        last = self.seq[:n].gather(1, (n_tokens - 1).clamp_min(0)[:, None])  # [n, 1]
        positions = n_tokens[:, None] + torch.arange(gamma + 1, device=self.device)  # of the tokens predicted
        draft_s = 0.0
        lengths, sure = torch.zeros(n, dtype=torch.long, device=self.device), None
        if gamma:
            t = time.perf_counter()
            draft, lengths, sure = self.drafter.propose(n, gamma, self.seq[:n], n_tokens, live, rows, cache, stop)
            synchronize(self.device)
            draft_s = time.perf_counter() - t
            counts = torch.where(live, lengths + 1, 1)  # tokens each row verifies
            ragged = None
            if stop is not None:  # verify up to the longest draft; on the CPU, only the rows' real tokens
                host = counts.tolist()
                q = max(host)
                draft, positions = draft[:, : q - 1], positions[:, :q]
                ragged = Ragged(host, self.device) if self.graphs is None and min(host) < q else None
            with scopes.forward("verify", n, draft.shape[1] + 1, cache.lens):
                logits = self.forward(torch.cat((last, draft), dim=1), cache,
                                      shares=self.drafter.verification_shares(), ragged=ragged)
            with scopes.sampling("verify"):
                accepted, nxt = accept_drafts(self._targets(logits, rows, positions, ragged), draft, lengths * live)
                new = torch.cat((draft, nxt[:, None]), dim=1).scatter(1, accepted[:, None], nxt[:, None])
            if ragged is not None and asking:
                logits = ragged.pad(logits)
        else:
            with scopes.forward("plain", n, 1, cache.lens):
                logits = self.forward(last, cache)
            with scopes.sampling("plain"):
                new = sample_tokens(logits, rows, positions)
            accepted = torch.zeros(n, dtype=torch.long, device=self.device)
        cache.commit((accepted + 1) * live)
        kept, finish = self._emit(slice(0, n), new, accepted + 1)
        if gamma:
            self.drafter.accept(n, self.n_tokens[:n], live)
        return new, kept, finish, accepted, lengths, sure, self._logprobs(logits, new, asking), draft_s

    @staticmethod
    def _targets(logits: Tensor, rows: RowParams, positions: Tensor, ragged: Ragged | None) -> Tensor:
        """The target's token at each verified position, [n, q] (what plain decoding would produce there; 0 at a
        ragged verification's padding); logits [n, q, V], or a ragged verification's [N, V]."""
        if ragged is None:
            return sample_tokens(logits, rows, positions)
        packed = sample_tokens(logits[:, None], rows.select(ragged.owner), ragged.pick(positions)[:, None])
        return ragged.pad(packed[:, 0])

    def _emit(self, rows: slice, new: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """Append the first count[b] tokens of new [m, k] to live slots, stopping at EOS and max_tokens. Returns
        (tokens kept [m], finish code [m])."""
        live, n_tokens, limit = self.live[rows], self.n_tokens[rows], self.limit[rows]
        k = new.shape[1]
        idx = torch.arange(k, device=self.device)
        is_eos = torch.isin(new, self.eos) & (idx < count[:, None]) & self.use_eos[rows][:, None]
        upto_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, k)
        kept = torch.minimum(torch.minimum(count, upto_eos), limit - n_tokens) * live
        self.seq[rows].scatter_(1, (n_tokens[:, None] + idx).clamp_max(self.capacity - 1), new)
        n_tokens += kept
        stopped = (is_eos & (idx < kept[:, None])).any(1)
        finish = torch.where(stopped, STOPPED, torch.where(n_tokens >= limit, LENGTH, RUNNING)) * live
        return kept, finish
