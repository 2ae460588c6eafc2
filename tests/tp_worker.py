"""One rank of the tensor-parallel tests (tests/test_tp.py), started with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or alone for the TP=1 reference.

    python tests/tp_worker.py run MODEL DRAFT_MODEL OUT.json RUNS MAX_TOKENS  # logits, tokens of each run
    python tests/tp_worker.py auto MODEL PROFILE.json OUT.json  # `--draft auto` drafting; rank 1's policy disagrees
    python tests/tp_worker.py die|hang MODEL                    # rank 1 dies / hangs in its 3rd step
    python tests/tp_worker.py serve MODEL PORT [ARGS...]        # `magicdec serve`, its default drafting

`run` writes this rank's results to OUT.json.rank<R>; `die` and `hang` run `magicdec generate` through the
CLI, so the test sees the exit status and the error line a user would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)  # one rank per core

from magicdec import autoplan  # noqa: E402
from magicdec.engine import LLM, LLMEngine  # noqa: E402
from magicdec.kv import KVCache  # noqa: E402
from magicdec.sampling import SamplingParams  # noqa: E402
from magicdec.speculative import SpeculativeConfig  # noqa: E402

#: A ragged batch: prompts of different lengths, longer than the draft budget so the sparse caches evict.
LENGTHS = (21, 34, 27)
BUDGET = 16


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def run(model: str, draft_model: str, out: str, runs: str, max_tokens: int) -> None:
    """runs: comma separated, of the drafters none, self-streaming, self-snapkv, self-vegas, draft-stop
    (self-streaming with per-row draft lengths), model (greedy) and sampled (plain decoding, unseeded, temperature
    1)."""
    llm = LLM(model, device="cpu", dtype="fp32")
    ids = prompts(llm.model.cfg.vocab_size)
    # logits of a batch's prompt prefix, straight from the model
    cache = KVCache(llm.model.cfg, len(ids), max(LENGTHS), torch.float32, "cpu")
    tokens = torch.tensor([p[:min(LENGTHS)] for p in ids])
    with torch.inference_mode():
        logits = llm.model(tokens, cache)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = {"logits": logits.tolist(), "tokens": {}}
    drafters = [("none", None), ("self-streaming", SpeculativeConfig("self-streaming", budget=BUDGET, gamma=3)),
            ("self-snapkv", SpeculativeConfig("self-snapkv", budget=BUDGET, gamma=3)),
            ("self-vegas", SpeculativeConfig("self-vegas", budget=BUDGET, gamma=3)),
            ("draft-stop", SpeculativeConfig("self-streaming", budget=BUDGET, gamma=3, draft_stop=0.5))]
    if draft_model:
        drafters.append(("model", SpeculativeConfig("model", budget=BUDGET, gamma=2, draft_model=draft_model)))
    for name, spec in drafters:
        if name not in runs.split(","):
            continue
        outs = llm.generate(prompt_token_ids=ids, params=greedy, speculative=spec)
        results["tokens"][name] = [o.token_ids for o in outs]
    if "sampled" in runs:  # unseeded: the ranks must draw the same seeds
        unseeded = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        results["sampled"] = [o.token_ids for o in llm.generate(prompt_token_ids=ids, params=unseeded)]
    results["local_kv_heads"] = llm.model.cfg.n_kv_heads
    results["cache_kv_heads"] = KVCache(llm.model.cfg, 1, 1, torch.float32, "cpu").k.shape[2]
    with open(f"{out}.rank{int(os.environ.get('RANK', 0))}", "w") as f:
        json.dump(results, f)


def auto(model: str, profile: str, out: str) -> None:
    """`--draft auto` as `magicdec generate` wires it, planned with `profile` (one where drafting pays), over prompts of
    600-700 tokens. On rank 1 every plan says plain decoding, as on a rank whose share of the model or whose clock
    said drafting loses: the ranks must still draft as rank 0 chose, every step."""
    if int(os.environ.get("RANK", 0)) == 1:
        plan = autoplan.plan
        autoplan.plan = lambda *a, **kw: plan(*a, **{**kw, "strategies": ["ar"]})
    llm = LLM(model, device="cpu", dtype="fp32")
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, llm.model.cfg.vocab_size, (n,), generator=g).tolist() for n in (650, 700, 600)]
    outs = llm.generate(prompt_token_ids=ids, params=SamplingParams(max_tokens=12, ignore_eos=True),
                        speculative=SpeculativeConfig("auto", hardware=profile))
    assert llm.last_auto.speculative is not None, "the profile must make drafting pay"
    results = {"tokens": [o.token_ids for o in outs], "verify_steps": llm.last_stats.verify_steps}
    with open(f"{out}.rank{int(os.environ.get('RANK', 0))}", "w") as f:
        json.dump(results, f)


def fail_in_step(mode: str, model: str) -> int:
    from magicdec.cli import main

    if os.environ["RANK"] == "1":
        step, calls = LLMEngine.step, []

        def failing_step(self):
            calls.append(1)
            if len(calls) == 3:
                if mode == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            return step(self)

        LLMEngine.step = failing_step
    return main(["generate", "--model", model, "--device", "cpu", "--prompt", "a b c", "--max-tokens", "30",
                 "--ignore-eos"])


def serve(model: str, port: str, *args: str) -> int:
    from magicdec.cli import main

    return main(["serve", "--model", model, "--device", "cpu", "--port", port, "--max-running", "2",
                 "--log-level", "warning", "--dtype", "fp32", *args])


if __name__ == "__main__":
    if sys.argv[1] in ("run", "auto"):
        if sys.argv[1] == "run":
            run(*sys.argv[2:6], int(sys.argv[6]))
        else:
            auto(*sys.argv[2:5])
        # The results are written. Leave without the interpreter's teardown, in which torch's gloo group now and then
        # aborts the process (std::terminate: a thread still joinable) after a run that succeeded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    elif sys.argv[1] == "serve":
        sys.exit(serve(*sys.argv[2:]))
    else:
        sys.exit(fail_in_step(sys.argv[1], sys.argv[2]))
