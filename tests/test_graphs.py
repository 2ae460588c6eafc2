"""The decode loop's forwards as CUDA graphs replay them: the static-buffer discipline, checked on the CPU.

A CUDA graph repeats the kernels and memory of its capture: whatever the forward took from the host then (a length, a
shape) is frozen, and only tensors updated in place carry the next call's state. No GPU runs here, so the graphs are
stood in for by `ReplayingGraphs`: `magicdec.graphs.CudaGraphs` with its capture replaced by a closure that, at each
replay, runs the forward again over the static input buffers and the cache view of the capture, whose host-side state
(`max_len`, the per-forward indices) is as stale as a graph's. Through the engine, with the caches in static mode
(attention over the whole capacity, lengths read on the device), every output equals an eager run's over the same static
caches token for token: plain and speculative (self-speculation, 4-bit drafts, a standalone draft model), greedy and
seeded sampled, on the default model and on a hybrid Gemma 3. A static forward equals the dynamic one bit for bit where
the native kernels attend, and reads no host length on any path. The real capture (`torch.cuda.graph`) runs in
`benchmarks/gpu_check.py` on a GPU, against `enforce_eager`. """

from __future__ import annotations

import copy

import pytest
import torch

import magicdec.runner as runner_mod
from conftest import run_engine
from magicdec.config import EngineConfig
from magicdec.drafters import ModelDrafter, SelfQuantDrafter, SelfSpecDrafter
from magicdec.graphs import Captured, CudaGraphs
from magicdec.kv.blocks import KVManager
from magicdec.kv.hybrid import paged_cache
from magicdec.prefill import prefill_row
from magicdec.sampling import SamplingParams
from test_gemma import tiny_gemma  # noqa: F401 (a fixture)

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5)


class Replay:
    """A stand-in for a captured graph: each replay runs the forward again on the capture's buffers and cache view,
    writing into the captured output."""

    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self) -> None:
        self.out.copy_(self.run())
        self.replays += 1


class ReplayingGraphs(CudaGraphs):
    def __init__(self, max_tokens: int):  # noqa: no CUDA pool on the CPU
        self.max_tokens, self.graphs, self.capture_s, self.memory_bytes = max_tokens, {}, 0.0, 0

    def _capture(self, model, tokens, cache, logits_at, head):
        tokens, logits_at = tokens.clone(), None if logits_at is None else logits_at.clone()

        def run():
            return model(tokens, cache, logits_at, None, head)

        out = run()  # the warm-up forward of a real capture
        return Captured(Replay(run, out), tokens, logits_at, out, cache)


class StaticEager(ReplayingGraphs):
    """Caches in static mode, every forward eager: the reference a replay must equal on any path (torch's operators
    round a longer span differently, so a dynamic run is the reference only where the native kernels attend)."""

    def wrap(self, model):
        return model


class Graphed:
    """Switches graphs on for engines built after `on()`: their caches static, their decode forwards replayed from
    `ReplayingGraphs` (in `made`), or eager with `replay=False`."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.made = monkeypatch, []

    def on(self, replay: bool = True) -> None:
        def make(max_tokens: int) -> ReplayingGraphs:
            self.made.append(ReplayingGraphs(max_tokens) if replay else StaticEager(max_tokens))
            return self.made[-1]

        self.monkeypatch.setattr(runner_mod, "uses_graphs", lambda model, kv_dtype, config: not config.enforce_eager)
        self.monkeypatch.setattr(runner_mod, "CudaGraphs", make)


@pytest.fixture
def graphed(monkeypatch) -> Graphed:
    return Graphed(monkeypatch)


def drafter_for(name: str, model):
    if name == "self-streaming":
        return SelfSpecDrafter(model, "streaming", 64, 3, True)
    if name == "self-quant":
        return SelfQuantDrafter(model, 3)
    if name == "model-dense":
        return ModelDrafter(copy.deepcopy(model), "dense", 0, 3, False)
    return None


def compare(model, prompts, drafter_name, graphed, params):
    """One run eager, one replayed from graphs, both over static caches: the same tokens."""
    gamma = 3 if drafter_name else 0
    graphed.on(replay=False)
    eager, _ = run_engine(model, prompts, params, drafter=drafter_for(drafter_name, model), gamma=gamma)
    graphed.on()
    replayed, stats = run_engine(model, prompts, params, drafter=drafter_for(drafter_name, model), gamma=gamma)
    for a, b in zip(eager, replayed):
        assert a.output_ids == b.output_ids
    graphs = graphed.made[-1]
    assert graphs.count >= (2 if drafter_name else 1)  # a decode or verification forward, and each draft forward's
    assert all(g.graph.replays for g in graphs.graphs.values())
    return stats


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["", "self-streaming", "self-quant", "model-dense"])
def test_replayed_forwards_equal_eager_ones_on_the_default_model(default_model, corpus_prompt, graphed, drafter,
                                                                 params):
    model = default_model.model
    prompts = [corpus_prompt(n, book=b) for n, b in ((90, 1), (300, 2), (40, 3))]
    stats = compare(model, prompts, drafter, graphed, params)
    assert stats.gamma == (3 if drafter else 0)


@pytest.mark.parametrize("drafter", ["", "self-streaming", "self-quant"])
def test_replayed_forwards_equal_eager_ones_on_a_hybrid_model(tiny_gemma, graphed, drafter):  # noqa: F811
    model = tiny_gemma[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (70, 200, 20)]
    compare(model, prompts, drafter, graphed, GREEDY)


def test_enforce_eager_captures_nothing(default_model, graphed):
    from magicdec.engine import LLMEngine

    graphed.on()
    engine = LLMEngine(default_model.model, EngineConfig(max_num_seqs=2, max_model_len=256, enforce_eager=True))
    engine.generate([[1, 2, 3]], GREEDY)
    assert engine.runner.graphs is None and not engine.runner.cache.static and not graphed.made


def test_no_graphs_on_a_cpu(default_model):
    """On a CPU every forward is eager and attends over the filled prefix only."""
    assert not runner_mod.uses_graphs(default_model.model, torch.bfloat16, EngineConfig())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["native", "torch"])
def test_a_static_forward_reads_no_host_length(default_model, kv_dtype):
    """In static mode a forward's shapes come from the capacity and its visibility from the device lengths: with the
    host's `max_len` stale, the logits are the same bit for bit. They equal the dynamic forward's bit for bit where
    the native kernels attend (bf16 K/V: masked tiles add nothing); torch's operators over the longer span round
    differently."""
    from magicdec import kernels

    model = default_model.model
    native = kernels.attends(torch.device("cpu"), kv_dtype, model.cfg.head_dim)
    if kv_dtype == torch.bfloat16 and not native:
        pytest.skip("no native attention kernel on this CPU")
    kv = KVManager(model.cfg, 40, kv_dtype, "cpu", caching=False)
    cache = paged_cache(model.cfg, kv, 2, 512, 8)
    for row, n in enumerate((70, 150)):
        blocks = kv.grow(str(row), n + 8)
        kv.zero_blocks(blocks)
        cache.set_blocks(row, 0, blocks)
        prefill_row(model, cache.row(row), torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(row)),
                    64)
    cache.truncate(cache.lens.clone())  # the rows' views committed: the host's max_len follows
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    dynamic = model(tokens, cache)
    cache.static = True
    static = model(tokens, cache)
    cache.max_len = 0  # stale, as at a graph's capture
    assert torch.equal(model(tokens, cache), static)
    if native:
        assert torch.equal(static, dynamic)
    else:
        torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)


def test_a_server_captures_the_decode_step_of_every_bucket_at_start(default_model, corpus_prompt, graphed):
    """`LLMEngine.capture_graphs` (serve's start-up) captures the plain decode forward of every row bucket before any
    request; the requests then replay them and give the tokens of an eager run over static caches."""
    from magicdec.engine import LLMEngine

    model = default_model.model
    prompts = [corpus_prompt(n, book=b) for n, b in ((60, 4), (130, 5), (90, 6))]
    config = EngineConfig(max_num_seqs=3, max_model_len=256)
    graphed.on(replay=False)
    eager = LLMEngine(model, config).generate(prompts, GREEDY)
    graphed.on()
    engine = LLMEngine(model, config)
    stats = engine.capture_graphs()
    graphs = graphed.made[-1]
    assert stats.cuda_graphs == graphs.count == 3  # rows 1, 2, 3 (a CPU's buckets), one token each
    assert {key[3] for key in graphs.graphs} == {(1, 1), (2, 1), (3, 1)}
    replayed = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in replayed] == [r.output_ids for r in eager]
    assert graphs.count == 3 and any(g.graph.replays for g in graphs.graphs.values())  # none captured anew
    engine.add_request("late", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="before any request"):
        engine.capture_graphs()
