"""What a run of the engine did: token counts, time by phase, and speculation statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from magicdec.kv.blocks import BLOCK_SIZE
from magicdec.step import ScheduledStep, StepResult


@dataclass
class GenerationStats:
    """Totals over the engine steps of one `LLM.generate` call (or a server's lifetime). Seconds are wall time.

    Decode throughput counts the tokens decode rounds produced over the time of those rounds: each request's first
    token comes from its prefill and is counted there."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of prefilled
    preemptions: int = 0  # requests sent back to the queue for lack of KV blocks
    generated_tokens: int = 0  # every output token, the first ones (from prefill) included
    decode_tokens: int = 0  # output tokens produced by decode rounds
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    steps: int = 0  # decode rounds
    max_batch: int = 0  # most sequences decoded together
    gamma: int = 0  # the largest draft length used
    accepted_hist: list[int] = field(default_factory=list)  # verify rounds (per sequence) by drafts accepted
    drafted_tokens: int = 0
    gamma_changes: list[tuple[int, int]] = field(default_factory=list)  # (round, draft length from then on)
    peak_memory_bytes: int = 0
    dtype: str = ""
    cuda_graphs: int = 0  # forwards captured as CUDA graphs so far (the engine's, not only this run's)
    graph_capture_s: float = 0.0
    graph_memory_bytes: int = 0
    phases: dict | None = None  # where the profiled decode rounds' time went (`magicdec.phases`), if profiled

    @property
    def verify_s(self) -> float:
        return self.decode_s - self.draft_s

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens prefilled (not found in the prefix cache) per second of prefill."""
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def verify_steps(self) -> int:
        return sum(self.accepted_hist)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted over every verify round and sequence."""
        return sum(i * c for i, c in enumerate(self.accepted_hist))

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verify round and sequence."""
        n = self.verify_steps
        return self.accepted_tokens / n if n else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def verified_per_token(self) -> float:
        """Tokens the verifications ran (each sequence's drafts and the token before them) per token they produced."""
        rounds = self.verify_steps
        produced = self.accepted_tokens + rounds
        return (self.drafted_tokens + rounds) / produced if produced else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per verify round and sequence (accepted + 1)."""
        return self.mean_accepted + 1 if self.verify_steps else 1.0

    def record(self, step: ScheduledStep, result: StepResult) -> None:
        """Count one engine step from its results."""
        self.prefill_s += result.prefill_s
        self.cached_tokens += BLOCK_SIZE * sum(len(a.cached) for a in step.assign)
        self.preemptions += len(step.release)
        decoded = sum(len(out.tokens) for out in result.decoded)
        self.generated_tokens += len(result.first) + decoded
        if result.decoded:  # (a round can find every row gone: first tokens that were EOS)
            self.decode_s += result.decode_s
            self.draft_s += result.draft_s
            self.decode_tokens += decoded
            self._count_round(step.gamma, [out.accepted for out in result.decoded],
                              [out.drafted for out in result.decoded])

    def _count_round(self, gamma: int, accepted: list[int], drafted: list[int]) -> None:
        """Record a decode round of draft length `gamma` whose live sequences drafted `drafted` tokens each (gamma,
        or fewer where drafts stop per row) and accepted `accepted`."""
        live = len(accepted)
        self.steps += 1
        self.max_batch = max(self.max_batch, live)
        if not self.gamma_changes or self.gamma_changes[-1][1] != gamma:
            self.gamma_changes.append((self.steps - 1, gamma))
        if gamma:
            self.gamma = max(self.gamma, gamma)
            self.drafted_tokens += sum(drafted)
            self.accepted_hist.extend([0] * (gamma + 1 - len(self.accepted_hist)))
            for n in accepted:
                self.accepted_hist[n] += 1

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("verify_s", "prefill_tok_s", "decode_tok_s", "mean_accepted", "acceptance_rate", "verified_per_token",
                  "tokens_per_step"):
            d[k] = getattr(self, k)
        return d
