"""Prometheus metrics with vLLM's names under `magicdec:`, updated on the engine thread after every step.

Each app gets its own CollectorRegistry, so several servers (tests) can live in one process. Acceptance length reads
off the speculation counters: 1 + accepted_tokens / drafts per drafter (one server runs one drafter, named by
`magicdec:spec_decode_info`), and per request from the `magicdec:request_acceptance_length` histogram. Engine time
splits into `magicdec:prefill_seconds` and `magicdec:decode_seconds` (the engine's own step timings, GenerationStats).
"""

from __future__ import annotations

import time
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from magicdec.engine import LLMEngine
from magicdec.scheduler import Request

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 17.0)


class ServerMetrics:
    """The server's metrics in `self.registry`; `observe_step`/`observe_idle` are the engine thread's hooks."""

    def __init__(self, model_name: str, drafter: str, budget: int | None):
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def metric(kind: type, name: str, doc: str, more_labels: Sequence[str] = (), **kwargs):
            """A `kind` metric named magicdec:`name`, labelled with the model (the other labels left open)."""
            m = kind(f"magicdec:{name}", doc, names + list(more_labels), registry=r, **kwargs)
            return m if more_labels else m.labels(**labels)

        self.running = metric(Gauge, "num_requests_running", "Requests holding a slot (prefilling or decoding).")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests queued for a slot.")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Fraction of the KV blocks held by requests (1 = all).")
        self.preemptions = metric(Counter, "num_preemptions", "Requests sent back to the queue for lack of KV blocks "
                                  "(prefilled again when readmitted).")
        self.gamma = metric(Gauge, "spec_decode_gamma", "Draft length of the latest decode round (0: plain decoding).")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests that started.")
        self.prefix_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Output tokens generated.")
        self.prefill_seconds = metric(Counter, "prefill_seconds", "Engine time in prefill forwards (wall seconds).")
        self.decode_seconds = metric(Counter, "decode_seconds",
                                     "Engine time in decode rounds, drafting included (wall seconds).")
        self._success = metric(Counter, "request_success", "Requests finished, by reason.", ["finished_reason"])
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS)
        self.itl = metric(Histogram, "inter_token_latency_seconds", "Time between a request's engine steps that gave "
                          "it tokens (a speculative step can give several).", buckets=TOKEN_BUCKETS)
        self.tpot = metric(Histogram, "time_per_output_token_seconds",
                           "Per request: (e2e - TTFT) / (output tokens - 1).", buckets=TOKEN_BUCKETS)
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS)
        self.drafts = metric(Counter, "spec_decode_num_drafts", "Verify rounds, counted per request.")
        self.draft_tokens = metric(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = metric(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = metric(Counter, "spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft (0 = first).", ["position"])
        self.acceptance = metric(Histogram, "request_acceptance_length",
                                 "Per finished speculative request: mean tokens per verify round.",
                                 buckets=ACCEPTANCE_BUCKETS)
        info = metric(Gauge, "spec_decode_info", "The drafter this server runs (value 1).", ["drafter", "budget"])
        info.labels(**labels, drafter=drafter, budget=str(budget or 0)).set(1)
        self._labels = labels
        self._last_token: dict[str, float] = {}  # request id -> when its latest tokens arrived
        self._hist_seen: list[int] = []  # the engine's accepted-length histogram at the last step
        self._drafted_seen = 0
        self._seconds_seen = (0.0, 0.0)  # the engine's prefill and decode seconds at the last step
        self._preemptions_seen = 0

    def observe_idle(self, engine: LLMEngine) -> None:
        """Queue and slot gauges (after commands and steps alike, so aborts show at once)."""
        self.running.set(sum(r is not None for r in engine.scheduler.slots))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(engine.kv.usage)
        self.preemptions.inc(engine.kv.preemptions - self._preemptions_seen)
        self._preemptions_seen = engine.kv.preemptions

    def observe_step(self, engine: LLMEngine, gained: Sequence[tuple[Request, int]]) -> None:
        """Queue and slot gauges, token counters, latencies and speculation counters of one step."""
        self.observe_idle(engine)
        now = time.monotonic()
        for request, n in gained:
            if not n:
                continue
            self.generation_tokens.inc(n)
            last = self._last_token.get(request.request_id)
            if last is None:
                self.prompt_tokens.inc(len(request.prompt_ids))
                self.prefix_queries.inc(len(request.prompt_ids))
                self.prefix_hits.inc(request.cached_tokens)
                self.ttft.observe(request.first_token_time - request.arrival_time)
            else:
                self.itl.observe(now - last)
            self._last_token[request.request_id] = now
        for request, _ in gained:
            if request.finished:
                self._observe_finished(request)
        self._observe_speculation(engine)
        self._observe_time(engine)

    def observe_aborted(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)
        self._success.labels(**self._labels, finished_reason="abort").inc()

    def _observe_finished(self, request: Request) -> None:
        self._last_token.pop(request.request_id, None)
        self._success.labels(**self._labels, finished_reason=request.finish_reason).inc()
        e2e = request.finish_time - request.arrival_time
        self.e2e.observe(e2e)
        if len(request.output_ids) > 1:
            self.tpot.observe((request.finish_time - request.first_token_time) / (len(request.output_ids) - 1))
        hist = request.accepted_hist
        if sum(hist):
            self.acceptance.observe(1 + sum(i * c for i, c in enumerate(hist)) / sum(hist))

    def _observe_time(self, engine: LLMEngine) -> None:
        """Prefill and decode seconds from the difference of the engine's totals since the last step."""
        prefill, decode = engine.stats.prefill_s, engine.stats.decode_s
        self.prefill_seconds.inc(max(0.0, prefill - self._seconds_seen[0]))
        self.decode_seconds.inc(max(0.0, decode - self._seconds_seen[1]))
        self._seconds_seen = (prefill, decode)

    def _observe_speculation(self, engine: LLMEngine) -> None:
        """Counters from the difference of the engine's totals since the last step."""
        stats = engine.stats
        if stats.gamma_changes:
            self.gamma.set(stats.gamma_changes[-1][1])
        hist = stats.accepted_hist
        delta = [c - (self._hist_seen[i] if i < len(self._hist_seen) else 0) for i, c in enumerate(hist)]
        self._hist_seen = list(hist)
        self.draft_tokens.inc(stats.drafted_tokens - self._drafted_seen)
        self._drafted_seen = stats.drafted_tokens
        if not any(delta):
            return
        self.drafts.inc(sum(delta))
        self.accepted_tokens.inc(sum(i * c for i, c in enumerate(delta)))
        for pos in range(len(delta) - 1):  # a round that accepted k drafts accepted positions 0..k-1
            self._per_pos.labels(**self._labels, position=str(pos)).inc(sum(delta[pos + 1 :]))
