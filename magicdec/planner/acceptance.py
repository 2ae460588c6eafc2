"""Acceptance model: how many tokens a speculative step yields, per drafter, budget and context."""

from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path
from statistics import NormalDist

from magicdec.jsonfile import read_json_object

MODES = ("greedy", "sampling")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per speculative step: (1 - alpha^(gamma+1)) / (1 - alpha).

    `alpha` is the per-token acceptance rate and `gamma` the draft length; the step always yields at least the
    target's own token, so gamma=0 or alpha=0 gives 1 and alpha=1 gives gamma + 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_max_normal(n: int) -> float:
    """Expected largest of n standard normal draws (Blom's approximation; 0 for n = 1)."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def check_mode(mode: str) -> None:
    """Raise ValueError unless `mode` is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


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


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _count(value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"expected an integer or null, got {value!r}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a name, got {value!r}")
    return value


class AcceptanceTable:
    """Per-token acceptance rates keyed by drafter, draft KV budget, mode and context length.

    Drafter names: "self-streaming" and "self-snapkv" for self-speculation; for a standalone draft model, "<model
    name>:<cache>" with cache "dense", "streaming" or "snapkv". Dense caches have no budget (`budget=None`).

    Lookups interpolate linearly in log(context) between measured contexts (clamped at the ends; an entry without a
    context holds at every context) and in log(budget) between measured budgets. A budget above the largest measured
    one gets that one's rate, which is conservative since a larger cache only helps; a budget below the smallest
    measured one is unknown (KeyError) because a smaller cache could be much worse.

    Sequences differ: some texts are easier to draft than others. The table can hold, per drafter and mode, the
    standard deviation of per-sequence rates around the rate of their batch (`set_row_spread`); `alpha(..., rows=n)`
    then gives the expected rate of the slowest of n sequences, which is what sets the number of rounds a static
    batch takes."""

    def __init__(self) -> None:
        # (drafter, mode) -> budget -> {context or None: alpha}
        self._data: dict[tuple[str, str], dict[int | None, dict[int | None, float]]] = {}
        self._row_spread: dict[tuple[str, str], float] = {}

    def add(self, drafter: str, alpha: float, budget: int | None = None, mode: str = "greedy",
            context: int | None = None) -> None:
        """Record a measured rate; `context=None` means it holds at every context length."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        check_mode(mode)
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be positive or None, got {budget}")
        if context is not None and context < 1:
            raise ValueError(f"context must be positive or None, got {context}")
        curve = self._data.setdefault((drafter, mode), {}).setdefault(budget, {})
        if curve and (context is None) != (None in curve):
            raise ValueError(f"{drafter} budget {budget} {mode}: mixing rates with and without a context")
        curve[context] = alpha

    def set_row_spread(self, drafter: str, sd: float, mode: str = "greedy") -> None:
        """Record the standard deviation of per-sequence acceptance rates of `drafter` in `mode`."""
        if not 0.0 <= sd <= 1.0:
            raise ValueError(f"row spread must be in [0, 1], got {sd}")
        check_mode(mode)
        self._row_spread[(drafter, mode)] = sd

    def row_spread(self, drafter: str, mode: str = "greedy") -> float:
        """The per-sequence spread of `drafter` in `mode` (0 when not measured)."""
        return self._row_spread.get((drafter, mode), 0.0)

    def drafters(self) -> list[str]:
        """Names of the drafters with at least one rate."""
        return sorted({drafter for drafter, _ in self._data})

    def alpha(self, drafter: str, budget: int | None, context: int, mode: str = "greedy", rows: int = 1) -> float:
        """Acceptance rate of `drafter` with a cache of `budget` at `context` tokens.

        With `rows` > 1: the expected rate of the slowest of that many sequences, the mean rate less the row spread
        times the expected largest of `rows` standard normal draws.

        Raises KeyError when the table cannot answer: unknown drafter or mode, a budget below every measured one, or
        a dense lookup (`budget=None`) without a dense entry."""
        mean = self._mean_alpha(drafter, budget, context, mode)
        return max(0.0, mean - self.row_spread(drafter, mode) * expected_max_normal(rows))

    def _mean_alpha(self, drafter: str, budget: int | None, context: int, mode: str) -> float:
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

    def to_json(self, path: str | os.PathLike[str], meta: dict | None = None) -> None:
        """Write the table as {"entries": [{drafter, mode, budget, context, alpha}, ...], "row_spread": [{drafter,
        mode, sd}, ...]}, with `meta` (how it was measured) beside them."""
        entries = [
            {"drafter": drafter, "mode": mode, "budget": budget, "context": context, "alpha": alpha}
            for (drafter, mode), curves in sorted(self._data.items())
            for budget, curve in sorted(curves.items(), key=_none_first)
            for context, alpha in sorted(curve.items(), key=_none_first)
        ]
        spread = [{"drafter": drafter, "mode": mode, "sd": sd} for (drafter, mode), sd in sorted(self._row_spread.items())]
        data: dict = {"entries": entries, "row_spread": spread}
        if meta is not None:
            data["meta"] = meta
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> AcceptanceTable:
        """Read a table written by `to_json`; a malformed or empty one raises ValueError naming the file."""
        data = read_json_object(path, "acceptance table")
        table = cls()
        try:
            for entry in data["entries"]:
                table.add(_text(entry["drafter"]), _number(entry["alpha"]), budget=_count(entry.get("budget")),
                          mode=entry.get("mode", "greedy"), context=_count(entry.get("context")))
            for entry in data.get("row_spread", []):
                table.set_row_spread(_text(entry["drafter"]), _number(entry["sd"]), mode=entry.get("mode", "greedy"))
        except KeyError as e:
            raise ValueError(f"{path}: an acceptance table entry lacks {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a valid acceptance table ({e})") from None
        if not table._data:
            raise ValueError(f"{path}: the acceptance table holds no rates")
        return table

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AcceptanceTable) and (self._data, self._row_spread) == (other._data, other._row_spread)

    @classmethod
    def paper_default(cls) -> AcceptanceTable:
        """Rates published with MagicDec (arXiv 2408.11049 and its blog), greedy decoding on PG-19.

        - StreamingLLM self-speculation, budget 512: measured on Llama-3.1-8B at 4k..100k context. We use the same
          curve for every target (e.g. Llama-2-7B-32K), which the paper does not measure.
        - TinyLlama-1.1B drafting Llama-2-7B-32K with a StreamingLLM cache: about 0.8 and roughly flat in context.
          The budget is not tabulated; 256 is the one in the authors' example command."""
        table = cls()
        for context, alpha in ((4000, 0.84), (8000, 0.83), (16000, 0.82), (32000, 0.81), (64000, 0.79), (100000, 0.79)):
            table.add("self-streaming", alpha, budget=512, mode="greedy", context=context)
        table.add("tinyllama-1.1b:streaming", 0.8, budget=256, mode="greedy")
        return table
