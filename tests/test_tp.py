"""Tensor parallelism on CPU: 2 gloo ranks against one process, in fp32, one thread per rank.

Each rank is a process started with torchrun's environment (tests/tp_worker.py). Covered: logits within
tolerance and identical greedy tokens for plain decoding and every drafter on a ragged batch (a tiny model
with an uneven 2 + 1 KV-head and MLP split and a qkv bias, and the real default model, 3 KV heads: 2 + 1);
identical unseeded samples on both ranks; caches holding the local KV heads only; a rank killed or hung
mid-run ending the other with one error line within the timeout; ranks loading different models refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_llama_config
from magicdec.config import ModelConfig
from magicdec.distributed import check_shardable, local_config, shard_range
from magicdec.errors import InvalidRequestError

WORKER = Path(__file__).with_name("tp_worker.py")
HANG_TIMEOUT_S = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[list[str]], env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start one worker per entry of `args` as the ranks of one group, with torchrun's environment."""
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(len(args)), **(env or {})}
    return [subprocess.Popen([sys.executable, str(WORKER), *a], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r, a in enumerate(args)]


def launch(args: list[list[str]], env: dict[str, str] | None = None, timeout: float = 120, grace: float = 10):
    """Run the ranks of `args` (see `start`); wait for rank 0 and return (every rank's Popen, rank 0's stderr,
    seconds rank 0 took). The others are killed if they outlive rank 0 by `grace` seconds (a rank hung on
    purpose)."""
    procs = start(args, env)
    t0 = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=timeout)
        elapsed = time.monotonic() - t0
        for p in procs[1:]:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, err, elapsed


def reference(args: list[str]) -> subprocess.Popen:
    """Start the TP=1 run: the same worker, one process, no launcher environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.DEVNULL,
                            env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def compare(tmp_path: Path, model: str, draft: str, drafters: list[str], max_tokens: int, sampled: bool) -> None:
    ref_out, tp_out = str(tmp_path / "tp1.json"), str(tmp_path / "tp2.json")
    runs = ",".join(drafters + ["sampled"] * sampled)
    one = reference(["run", model, draft, ref_out, runs, str(max_tokens)])  # beside the ranks: it uses one core
    procs, err, _ = launch([["run", model, draft, tp_out, runs, str(max_tokens)]] * 2)
    assert [p.returncode for p in procs] == [0, 0], err
    assert one.wait(timeout=120) == 0
    ref = json.loads(Path(ref_out + ".rank0").read_text())
    ranks = [json.loads(Path(f"{tp_out}.rank{r}").read_text()) for r in (0, 1)]
    assert list(ref["tokens"]) == drafters
    for tp in ranks:
        logits, want = torch.tensor(tp["logits"]), torch.tensor(ref["logits"])
        assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
        assert tp["tokens"] == ref["tokens"]  # every drafter, greedy
        assert tp.get("sampled") == ranks[0].get("sampled")  # unseeded: the same seeds on every rank
    assert ranks[0]["logits"] == ranks[1]["logits"]  # all-reduced: the very same numbers on both ranks
    assert [tp["local_kv_heads"] for tp in ranks] == [tp["cache_kv_heads"] for tp in ranks] == [2, 1]
    assert ref["cache_kv_heads"] == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_checkpoint) -> tuple[str, str]:
    """(target, draft) checkpoints: the target has 3 KV heads of 2 query heads, 101 MLP columns and a qkv bias,
    so TP=2 splits every dimension unevenly."""
    root = tmp_path_factory.mktemp("tp")
    tiny_checkpoint(root / "target", tiny_llama_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                                       intermediate_size=101, attention_bias=True), seed=3)
    tiny_checkpoint(root / "draft", tiny_llama_config(), seed=4)
    return str(root / "target"), str(root / "draft")


def test_tp2_matches_one_process_tiny(tmp_path, tiny):
    # self-vegas: each rank selects the positions its own KV heads attended to; draft-stop: every rank stops each row's
    # draft where rank 0 does (the confidences come from the all-reduced logits) and verifies the same ragged rows
    compare(tmp_path, *tiny, ["none", "self-streaming", "self-snapkv", "self-vegas", "draft-stop", "model"],
            max_tokens=10, sampled=True)


@pytest.mark.slow
def test_tp2_matches_one_process_default_model(tmp_path, default_path):
    # plain decoding and SnapKV, whose selection is per KV head: each rank selects for its own heads
    compare(tmp_path, str(default_path), "", ["none", "self-snapkv"], max_tokens=6, sampled=False)


def test_tp2_draft_auto_runs_rank_0s_draft_lengths(tmp_path, tiny, kv_bound_profile):
    """`--draft auto` drafts under TP with rank 0's plan and rank 0's draft length every step, even where a rank's own
    plans would differ (rank 1's always say plain decoding): the ranks finish, agree, and give TP=1's tokens."""
    one = reference(["auto", tiny[0], kv_bound_profile, str(tmp_path / "tp1.json")])
    procs, err, _ = launch([["auto", tiny[0], kv_bound_profile, str(tmp_path / "tp2.json")]] * 2,
                           env={"MAGICDEC_TP_TIMEOUT": "20"})
    assert [p.returncode for p in procs] == [0, 0], err
    assert one.wait(timeout=120) == 0
    ref = json.loads((tmp_path / "tp1.json.rank0").read_text())
    ranks = [json.loads((tmp_path / f"tp2.json.rank{r}").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["tokens"] == ref["tokens"]
    assert ranks[0]["verify_steps"] > 0  # it drafted


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_lost_rank_ends_the_others_with_one_line(tiny, mode):
    procs, err, elapsed = launch([[mode, tiny[0]]] * 2, env={"MAGICDEC_TP_TIMEOUT": str(HANG_TIMEOUT_S)}, grace=0)
    assert procs[0].returncode == 3, err
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("magicdec: error: rank 0 of 2: a collective failed"), err
    assert elapsed < 90 + HANG_TIMEOUT_S  # start-up and two steps on a busy machine, then the timeout (not 3600 s)


def test_ranks_loading_different_models_are_refused(tmp_path, tiny):
    procs, err, _ = launch([["run", tiny[r], "", str(tmp_path / "x.json"), "none", "1"] for r in (0, 1)])
    assert procs[0].returncode != 0 and "ranks disagree on the model" in err


# --- the split, without processes ---------------------------------------------------------------------------
def test_uneven_splits_give_the_first_ranks_one_more():
    assert [shard_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [shard_range(8, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    cfg = ModelConfig(vocab_size=100, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, ffn_dim=1536)  # SmolLM2-135M
    shards = [local_config(cfg, 2, r) for r in range(2)]
    assert [(c.n_heads, c.n_kv_heads, c.ffn_dim, c.head_dim) for c in shards] == [(6, 2, 768, 64), (3, 1, 768, 64)]


def test_more_ranks_than_kv_heads_is_refused():
    cfg = ModelConfig(vocab_size=100, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, ffn_dim=1536)
    check_shardable(cfg, 3)
    with pytest.raises(InvalidRequestError, match="at least 4 KV heads.*has 3"):
        check_shardable(cfg, 4)


def test_serve_under_tp_answers_as_one_process_and_stops_every_rank(tiny, kv_bound_profile):
    """Rank 0 serves HTTP and sends each turn to rank 1, drafting as `serve`'s default (`--draft auto`) plans on a
    machine where drafting pays; idle longer than the heartbeat; SIGTERM to rank 0 (as torchrun would send) ends it
    gracefully and rank 1 with it."""
    import signal
    import urllib.request

    from magicdec.engine import LLM
    from magicdec.sampling import SamplingParams

    port = free_port()
    procs = start([["serve", tiny[0], str(port), "--max-model-len", "1024", "--hardware", kv_bound_profile]] * 2,
                  env={"MAGICDEC_TP_TIMEOUT": "20"})
    try:
        prompt = torch.randint(3, 320, (800,), generator=torch.Generator().manual_seed(2)).tolist()
        want = LLM(tiny[0], device="cpu", dtype="fp32", tp=False).generate(
            prompt_token_ids=[prompt], params=SamplingParams(max_tokens=16, ignore_eos=True))
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].stderr.read()
                time.sleep(0.5)
        time.sleep(22)  # idle past the timeout: only the heartbeats (every 20 s / 4) keep the follower waiting
        body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert answer["choices"][0]["text"] == want[0].text
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("magicdec:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, drafts  # it drafted
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after shutting down
        assert procs[1].wait(timeout=30) == 0  # told by rank 0 that serving is over
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
