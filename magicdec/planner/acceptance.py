"""Acceptance model: how many tokens a speculative step yields, per drafter, budget and context."""

from __future__ import annotations

import bisect
import json
import math
import os

MODES = ("greedy", "sampling")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per speculative step: (1 - alpha^(gamma+1)) / (1 - alpha).

    `alpha` is the per-token acceptance rate and `gamma` the draft length; the step always
    yields at least the target's own token, so gamma=0 or alpha=0 gives 1 and alpha=1 gives
    gamma + 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _interpolate_log(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation of ys over log(xs) at log(x), clamped at both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def _none_first(item: tuple[int | None, object]) -> int:
    """Sort key for (budget or context, value) pairs: None (dense / any context) first."""
    return -1 if item[0] is None else item[0]


class AcceptanceTable:
    """Per-token acceptance rates keyed by drafter, draft KV budget, mode and context length.

    Drafter names: "self-streaming" and "self-snapkv" for self-speculation; for a standalone
    draft model, "<model name>:<cache>" with cache "dense", "streaming" or "snapkv". Dense
    caches have no budget (`budget=None`).

    Lookups interpolate linearly in log(context) between measured contexts (clamped at the
    ends; an entry without a context holds at every context) and in log(budget) between
    measured budgets. A budget above the largest measured one gets that one's rate, which
    is conservative since a larger cache only helps; a budget below the smallest measured
    one is unknown (KeyError) because a smaller cache could be much worse.
    """

    def __init__(self) -> None:
        # (drafter, mode) -> budget -> {context or None: alpha}
        self._data: dict[tuple[str, str], dict[int | None, dict[int | None, float]]] = {}

    def add(
        self,
        drafter: str,
        alpha: float,
        budget: int | None = None,
        mode: str = "greedy",
        context: int | None = None,
    ) -> None:
        """Record a measured rate; `context=None` means it holds at every context length."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be positive or None, got {budget}")
        if context is not None and context < 1:
            raise ValueError(f"context must be positive or None, got {context}")
        curve = self._data.setdefault((drafter, mode), {}).setdefault(budget, {})
        if curve and (context is None) != (None in curve):
            raise ValueError(f"{drafter} budget {budget} {mode}: mixing rates with and without a context")
        curve[context] = alpha

    def drafters(self) -> list[str]:
        """Names of the drafters with at least one rate."""
        return sorted({drafter for drafter, _ in self._data})

    def alpha(self, drafter: str, budget: int | None, context: int, mode: str = "greedy") -> float:
        """Acceptance rate of `drafter` with a cache of `budget` at `context` tokens.

        Raises KeyError when the table cannot answer: unknown drafter or mode, a budget below
        every measured one, or a dense lookup (`budget=None`) without a dense entry.
        """
        curves = self._data.get((drafter, mode))
        if curves is None:
            raise KeyError(f"no acceptance rate for drafter {drafter!r} in {mode} mode")
        if budget is None:
            if None not in curves:
                raise KeyError(f"no dense-cache acceptance rate for {drafter!r} in {mode} mode")
            return self._at_context(curves[None], context)
        budgets = sorted(b for b in curves if b is not None)
        if not budgets or budget < budgets[0]:
            raise KeyError(f"no acceptance rate for {drafter!r} at budget {budget} or below in {mode} mode")
        values = [self._at_context(curves[b], context) for b in budgets]
        return _interpolate_log(budget, [float(b) for b in budgets], values)

    @staticmethod
    def _at_context(curve: dict[int | None, float], context: int) -> float:
        if None in curve:
            return curve[None]
        contexts = sorted(c for c in curve if c is not None)
        return _interpolate_log(context, [float(c) for c in contexts], [curve[c] for c in contexts])

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the table as {"entries": [{drafter, mode, budget, context, alpha}, ...]}."""
        entries = [
            {"drafter": drafter, "mode": mode, "budget": budget, "context": context, "alpha": alpha}
            for (drafter, mode), curves in sorted(self._data.items())
            for budget, curve in sorted(curves.items(), key=_none_first)
            for context, alpha in sorted(curve.items(), key=_none_first)
        ]
        with open(path, "w") as f:
            json.dump({"entries": entries}, f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> AcceptanceTable:
        """Read a table written by `to_json`."""
        with open(path) as f:
            data = json.load(f)
        table = cls()
        for entry in data["entries"]:
            table.add(
                entry["drafter"],
                entry["alpha"],
                budget=entry.get("budget"),
                mode=entry.get("mode", "greedy"),
                context=entry.get("context"),
            )
        return table

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AcceptanceTable) and self._data == other._data

    @classmethod
    def paper_default(cls) -> AcceptanceTable:
        """Rates published with MagicDec (arXiv 2408.11049 and its blog), greedy decoding on PG-19.

        - StreamingLLM self-speculation, budget 512: measured on Llama-3.1-8B at 4k..100k
          context. We use the same curve for every target (e.g. Llama-2-7B-32K), which the
          paper does not measure.
        - TinyLlama-1.1B drafting Llama-2-7B-32K with a StreamingLLM cache: about 0.8 and
          roughly flat in context. The budget is not tabulated; 256 is the one in the
          authors' example command.
        """
        table = cls()
        for context, alpha in ((4000, 0.84), (8000, 0.83), (16000, 0.82), (32000, 0.81), (64000, 0.79), (100000, 0.79)):
            table.add("self-streaming", alpha, budget=512, mode="greedy", context=context)
        table.add("tinyllama-1.1b:streaming", 0.8, budget=256, mode="greedy")
        return table
