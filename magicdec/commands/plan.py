"""`magicdec plan`: the planner's strategy per (batch, context) from the cost model alone (torch-free)."""

import json
import sys
from pathlib import Path

from magicdec import dtypes
from magicdec.errors import InvalidRequestError
from magicdec.planner import (AcceptanceTable, Workload, format_table, get_model_shape, get_profile, plan_table,
                              plot_speedup)


def run(args) -> int:
    try:
        target = get_model_shape(args.model)
        draft = get_model_shape(args.draft_model) if args.draft_model else None
        hw = get_profile(args.hardware)
        acceptance = AcceptanceTable.from_json(args.acceptance) if args.acceptance else AcceptanceTable.paper_default()
    except ValueError as e:  # the planner is torch-free and raises ValueError; OSError is main's
        raise InvalidRequestError(str(e)) from None
    nbytes = dtypes.BYTES[args.dtype]
    grid = [Workload(target, hw, b, c, nbytes, nbytes, args.tp) for c in args.context for b in args.batch]
    rows = plan_table(grid, acceptance, draft=draft, mode=args.mode, rows=1 if args.steady_state else None)
    cols = ["batch", "context", "strategy", "budget", "gamma", "predicted_speedup", "predicted_throughput",
            "verify_dominant", "draft_dominant"]
    print(format_table(rows, [c for c in cols if c in rows[0]]))
    if args.plot:
        plot_speedup(rows, args.plot, x="batch", y="predicted_speedup", group="context",
                     title=f"{target.name} on {hw.name}: planned speedup", ylabel="speedup over AR", logx=True)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0
