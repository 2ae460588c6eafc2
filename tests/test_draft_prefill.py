"""A standalone draft model prefills prompts in the target's chunks, within the per-step prefill budget.

On a tiny random model (its own draft model: a copy with the same weights), with `prefill_chunk` and
`max_prefill_tokens` 128: two requests are decoding when a 1600-token prompt arrives. Every step, the draft model's
prefill forwards read no more tokens than the step's scheduled prefill chunks (before, its whole prompt ran in the
step of the target's final chunk), and the running requests gain tokens in every step of the long prefill. Then, with
prefix caching, a chat's next turn (the target's blocks hold the last turn's output too, the draft model's K/V in
them only its prompt: the chunks start where the draft model's hit ends), and a prompt whose blocks hold the target's
K/V alone (prefilled without the drafter). Each model computes only what its own hit lacks, no K/V is copied, and
every output equals plain decoding's greedy tokens; a dense draft cache, the target's twin, has every draft
accepted.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import kv_pool

from magicdec.config import EngineConfig, ModelConfig
from magicdec.drafters import ModelDrafter
from magicdec.engine import LLMEngine
from magicdec.kv.blocks import BLOCK_SIZE, KVManager
from magicdec.model import Transformer
from magicdec.sampling import SamplingParams
from magicdec.scheduler import FixedGamma, Status
from magicdec.speculative import Speculation

V = 96
CHUNK = 128  # prefill_chunk and max_prefill_tokens
GAMMA = 2
MAX_MODEL_LEN = 2100
SHORT = SamplingParams(max_tokens=100, ignore_eos=True)  # outlasts the long prefill at 3 tokens a round
LONG = SamplingParams(max_tokens=90, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=4096)
    model = Transformer(cfg)
    with torch.no_grad():
        model.output.weight.mul_(4.0)  # peaked distributions: greedy ties are rare
    return model.eval().requires_grad_(False)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_for(model: Transformer, speculation: Speculation | None = None, kv: KVManager | None = None):
    config = EngineConfig(max_num_seqs=3, max_model_len=MAX_MODEL_LEN, prefill_chunk=CHUNK, max_prefill_tokens=CHUNK,
                          enable_prefix_caching=kv is not None)
    return LLMEngine(model, config, speculation=speculation, kv=kv)


def plain(model: Transformer, prompt: list[int], params: SamplingParams) -> list[int]:
    """The reference: plain greedy decoding of `prompt` alone, prefilled cold."""
    return engine_for(model).generate([prompt], params)[0].output_ids


class DraftPrefillMeter:
    """Counts, per engine step, the prompt tokens scheduled for prefill and the tokens the draft model's prefill
    forwards read (a drafting round feeds at most 2 tokens per forward at gamma 2; every prefill forward here reads
    at least 8)."""

    def __init__(self, engine: LLMEngine, draft: Transformer):
        self.steps: list[tuple[int, int]] = []  # (scheduled prefill tokens, draft prefill tokens)
        self.draft_tokens = 0
        runner = engine.runner
        execute, forward = runner.execute, draft.forward

        def counting_forward(tokens, *args, **kwargs):
            if tokens.shape[1] > GAMMA:
                self.draft_tokens += tokens.numel()
            return forward(tokens, *args, **kwargs)

        def metered_execute(step):
            self.draft_tokens = 0
            result = execute(step)
            self.steps.append((sum(w.end - w.start for w in step.prefills), self.draft_tokens))
            return result

        draft.forward, runner.execute = counting_forward, metered_execute

    def drafted(self, since: int) -> int:
        """Draft prefill tokens of the steps from `since` on."""
        return sum(d for _, d in self.steps[since:])


def run_until_done(engine: LLMEngine, requests) -> None:
    while not all(r.finished for r in requests):
        engine.step()


@pytest.mark.parametrize("kind", ["dense", "streaming", "snapkv"])
def test_draft_model_prefill_is_chunked_within_the_budget(target, kind):
    draft = copy.deepcopy(target)  # a distinct draft model with the target's weights
    drafter = ModelDrafter(draft, kind, 64, GAMMA, reindex=True)
    cache = kv_pool(target, 1 << 26, target.dtype)
    engine = engine_for(target, Speculation(drafter, FixedGamma(GAMMA)), cache)
    meter = DraftPrefillMeter(engine, draft)
    shorts = [ids(40, 1), ids(70, 2)]
    long = ids(1600, 3)

    # a long arrival while two requests decode: the draft model's prefill is spread over the steps
    running = [engine.add_request(str(i), p, SHORT) for i, p in enumerate(shorts)]
    engine.step()
    engine.step()
    arrival = engine.add_request("long", long, LONG)
    stalled = []
    while arrival.status is not Status.RUNNING:
        before = [len(r.output_ids) for r in running]
        engine.step()
        stalled += [r.request_id for r, n in zip(running, before) if len(r.output_ids) == n]
    prefill_steps = meter.steps[2:]
    assert len(prefill_steps) >= len(long) // CHUNK and not stalled
    for scheduled, drafted in meter.steps:
        assert drafted <= scheduled <= CHUNK + CHUNK, meter.steps
    assert meter.drafted(2) == len(long)
    run_until_done(engine, running + [arrival])
    for r, p, params in zip(running + [arrival], shorts + [long], [SHORT, SHORT, LONG]):
        assert r.output_ids == plain(target, p, params), r.request_id

    # the next turn: the target's hit covers the last output, the draft model's only the long prompt
    turn = long + arrival.output_ids + ids(300, 4)
    start = len(meter.steps)
    follow = engine.add_request("turn", turn, SamplingParams(max_tokens=8, ignore_eos=True))
    run_until_done(engine, [follow])
    draft_hit = len(long) // BLOCK_SIZE * BLOCK_SIZE  # its blocks were stored once its prompt was prefilled
    assert follow.cached_tokens == (len(long) + len(arrival.output_ids)) // BLOCK_SIZE * BLOCK_SIZE > draft_hit
    assert meter.drafted(start) == len(turn) - draft_hit  # exactly what the draft model's hit lacks
    assert all(d <= s <= 2 * CHUNK for s, d in meter.steps[start:])
    assert follow.output_ids == plain(target, turn, follow.params)

    # the target's K/V alone: a prompt prefilled without the drafter, then read again with it
    other = ids(300, 5) + ids(200, 6)
    engine.set_speculation(None)
    engine.generate([other[:300]], SamplingParams(max_tokens=1))
    engine.set_speculation(Speculation(drafter, FixedGamma(GAMMA)))
    start = len(meter.steps)
    request = engine.add_request("other", other, SamplingParams(max_tokens=8, ignore_eos=True))
    run_until_done(engine, [request])
    assert request.cached_tokens == 288 and meter.drafted(start) == len(other)  # the draft model computes it all
    assert all(d <= s <= 2 * CHUNK for s, d in meter.steps[start:])
    assert request.output_ids == plain(target, other, request.params)
    # its blocks now hold the draft model's K/V too: a third reader's draft model computes its tail alone
    start = len(meter.steps)
    third = engine.add_request("third", other + ids(40, 7), SamplingParams(max_tokens=8, ignore_eos=True))
    run_until_done(engine, [third])
    assert third.cached_tokens == 480 and meter.drafted(start) == len(third.prompt_ids) - 480
    assert third.output_ids == plain(target, third.prompt_ids, third.params)

    # an abort mid-prefill leaves no draft row and no blocks behind
    aborted = engine.add_request("aborted", ids(700, 8), SamplingParams(max_tokens=8))  # no hit: 6 chunks
    engine.step()
    slot = aborted.slot
    engine.abort_request("aborted")
    assert aborted.finished and int(drafter.dense.lens[slot]) == 0 and "aborted" not in cache.held

    if kind == "dense":  # the draft is the target's twin over the whole context: its prefill was exact
        stats = engine.stats
        assert stats.accepted_hist[GAMMA] == stats.verify_steps, stats.accepted_hist
