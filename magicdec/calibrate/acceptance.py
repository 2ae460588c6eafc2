"""Per-token acceptance rates of the self-speculative drafters, measured on real text.

`calibrate_acceptance` cuts prompts from inside long books, prefills them once per context length and decodes with
every (drafter, budget, mode) from the same prefill; the rate is the maximum-likelihood estimate from the histogram
of accepted draft counts (`acceptance_mle`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from magicdec.corpus import cut_prompts
from magicdec.planner import AcceptanceTable
from magicdec.sampling import SamplingParams
from magicdec.speculative import SpeculativeConfig

#: progress(done, total, label): `done` of `total` units of the current stage, described by `label`.
CalibrationProgress = Callable[[int, int, str], None]


def acceptance_mle(hist: Sequence[int]) -> float:
    """Per-token acceptance rate from a histogram of accepted draft counts (hist[k]: steps accepting k).

    The accepted count of a step with draft length gamma = len(hist) - 1 is a geometric variable truncated at gamma:
    P(k) = alpha^k (1 - alpha) for k < gamma and alpha^gamma for k = gamma. Its likelihood is
    alpha^(sum k n_k) (1 - alpha)^(sum_{k<gamma} n_k), maximised at
    alpha = sum k n_k / (sum k n_k + sum_{k<gamma} n_k)."""
    if len(hist) < 2:
        raise ValueError("need a histogram over 0..gamma accepted drafts with gamma >= 1")
    if any(n < 0 for n in hist):
        raise ValueError("histogram counts must be non-negative")
    accepted = sum(k * n for k, n in enumerate(hist))
    rejections = sum(hist[:-1])
    if accepted + rejections == 0:
        raise ValueError("empty histogram")
    return accepted / (accepted + rejections)


def sampling_params(mode: str, new_tokens: int, seed: int = 0) -> SamplingParams:
    """The decode settings of a calibration mode: greedy, or temperature 0.7 / top-p 0.9 sampling."""
    if mode == "greedy":
        return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=seed)
    if mode == "sampling":
        return SamplingParams(max_tokens=new_tokens, temperature=0.7, top_p=0.9, ignore_eos=True, seed=seed)
    raise ValueError(f"unknown mode {mode!r}; choose greedy or sampling")


def calibrate_acceptance(
    llm, texts: Sequence[str], drafters: Iterable[str] = ("self-streaming", "self-snapkv"),
    budgets: Iterable[int] = (64, 128, 256, 512, 1024), contexts: Iterable[int] = (1024, 2048, 4096, 8192),
    modes: Iterable[str] = ("greedy", "sampling"), gamma: int = 4, n_prompts: int = 4, new_tokens: int = 64,
    progress: CalibrationProgress | None = None, *, records: list[dict[str, Any]] | None = None, seed: int = 0,
) -> AcceptanceTable:
    """Measure acceptance rates of self-speculative drafters on `texts` with `llm` (an `LLM`).

    For each context length, `n_prompts` prompts of that many tokens are cut from inside the texts and prefilled once
    into the LLM's prefix cache; every (drafter, budget, mode) then decodes `new_tokens` tokens per prompt (EOS ignored)
    from copies of that prefill with draft length `gamma`. The rate stored for (drafter, budget, mode, context) is
    `acceptance_mle` of the summed histogram; each (drafter, mode) also gets the spread of per-sequence rates around
    their batch's rate (`row_spread`), which the planner uses for the slowest sequence of a batch. Budgets not below the
    context are skipped (the planner treats them as dense); self-quant, which reads the whole context, is measured once
    per context and mode, without a budget. A context that does not fit the model (context + new tokens
    + gamma + 2 beyond its max_seq_len) is shortened to fit, and stored under the length actually used.

    `records`, when given, receives one dict per decode (histogram, alpha, timings)."""
    drafters, budgets, modes = list(drafters), sorted(set(budgets)), list(modes)
    for mode in modes:
        sampling_params(mode, 1)  # validates
    contexts = sorted(set(contexts))
    limit = llm.max_model_len - new_tokens
    report = progress or (lambda done, total, label: None)
    table = AcceptanceTable()
    deviations: dict[tuple[str, str], list[float]] = {}  # (drafter, mode) -> per-row rate minus batch rate
    jobs = [(c, d, b, mo) for c in contexts for d in drafters for b in _budgets(d, budgets, min(c, limit))
            for mo in modes]
    done = 0
    for context in contexts:
        ctx = min(context, limit)
        todo = [(d, b, mo) for c, d, b, mo in jobs if c == context]
        if not todo:
            continue
        report(done, len(jobs), f"prefill {n_prompts} x {ctx}")
        prompts = cut_prompts(llm.tokenizer, texts, n_prompts, ctx)
        llm.generate(prompt_token_ids=prompts, params=sampling_params("greedy", 1))
        for drafter_name, budget, mode in todo:
            report(done, len(jobs), f"{drafter_name} budget {budget} {mode} at {ctx}")
            record = _decode_prefilled(llm, prompts, drafter_name, budget, mode, ctx, gamma, new_tokens, seed)
            table.add(drafter_name, record["alpha"], budget=budget, mode=mode, context=ctx)
            deviations.setdefault((drafter_name, mode), []).extend(a - record["alpha"] for a in record["row_alphas"])
            if records is not None:
                records.append(record)
            done += 1
    llm.clear_prefix_cache()
    for (drafter_name, mode), devs in deviations.items():
        if len(devs) > 1:
            table.set_row_spread(drafter_name, row_spread(devs), mode=mode)
    report(done, len(jobs), "done")
    return table


def _budgets(drafter: str, budgets: list[int], context: int) -> list[int | None]:
    """The budgets a drafter is measured at: below the context, or none for self-quant (the whole context)."""
    return [None] if drafter == "self-quant" else [b for b in budgets if b < context]


def _decode_prefilled(llm, prompts: list[list[int]], drafter: str, budget: int | None, mode: str, context: int,
                      gamma: int, new_tokens: int, seed: int) -> dict[str, Any]:
    """Decode `prompts` (prefilled in the LLM's prefix cache) with one drafter; the run's record."""
    spec = SpeculativeConfig.drafting(drafter, budget, gamma=gamma)
    outs = llm.generate(prompt_token_ids=prompts, params=sampling_params(mode, new_tokens, seed), speculative=spec)
    stats = llm.last_stats
    return {"drafter": drafter, "budget": budget, "mode": mode, "context": context, "gamma": gamma, "batch": len(prompts),
            "accepted_hist": list(stats.accepted_hist), "alpha": acceptance_mle(stats.accepted_hist),
            "row_alphas": [acceptance_mle(o.accepted_hist) for o in outs if sum(o.accepted_hist)],
            "decode_s": stats.decode_s, "draft_s": stats.draft_s, "verify_s": stats.verify_s,
            "tokens_per_step": stats.tokens_per_step}


def row_spread(deviations: Sequence[float]) -> float:
    """Standard deviation of per-sequence acceptance rates, from their deviations from their batch's rate (pooled
    over batches; the batch rates are estimated, hence n - 1)."""
    if len(deviations) < 2:
        raise ValueError("need at least two per-sequence rates")
    return min(1.0, (sum(d * d for d in deviations) / (len(deviations) - 1)) ** 0.5)

