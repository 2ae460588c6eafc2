"""`magicdec calibrate`: measure this machine (and acceptance) into the profiles the planner loads."""

import json
import os
import sys
from pathlib import Path

from magicdec.calibrate.acceptance import calibrate_acceptance
from magicdec.calibrate.allreduce import measure_allreduce, measure_local_allreduce, with_allreduce
from magicdec.calibrate.hardware import measure_hardware
from magicdec.commands.generate import dtype_line
from magicdec.corpus import load_texts
from magicdec.cpu import auto_dtype, dtype_name
from magicdec.distributed import init_tp
from magicdec.engine import LLM
from magicdec.errors import InvalidRequestError
from magicdec.planner import HardwareProfile
from magicdec.profiles import default_acceptance_path, default_profile_path, model_key


def run(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return calibrate_allreduce(args)
    texts = load_texts(args.corpus) if args.acceptance else []  # checked before minutes of measuring
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    print(dtype_line(llm), file=sys.stderr)

    def progress(done: int, total: int, label: str) -> None:
        print(f"[{done}/{total}] {label}", file=sys.stderr)

    cal = measure_hardware(llm.model.device, quick=args.quick, progress=progress, model=llm.model,
                           kv_dtype=llm.kv_dtype)
    print("all-reduce between local processes (for tensor parallelism)", file=sys.stderr)
    allreduce = measure_local_allreduce(llm.model.device)
    if allreduce is not None:
        cal.profile = with_allreduce(cal.profile, allreduce)
        cal.measurements["allreduce"] = allreduce
    path = cal.save(args.output)
    print(json.dumps(cal.profile.__dict__, indent=1, default=str))
    check = cal.measurements["check"]
    print(f"profile check: {len(cal.measurements['forwards'])} forwards predicted within "
          f"{100 * check['median_relative_error']:.0f}% (median), {100 * check['worst_relative_error']:.0f}% (worst)",
          file=sys.stderr)
    print(f"hardware profile written to {path}", file=sys.stderr)
    if args.acceptance:
        quick = dict(contexts=(1024, 2048), budgets=(64, 256), n_prompts=2, new_tokens=32) if args.quick else {}
        table = calibrate_acceptance(llm, texts, progress=progress, **quick)
        out = default_acceptance_path(model_key(llm.loaded.source))
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_json(out)
        print(f"acceptance table written to {out}", file=sys.stderr)
    return 0


def calibrate_allreduce(args) -> int:
    """`calibrate` under torchrun: measure the all-reduce of the launched ranks (any number of nodes) and write its
    latency and bandwidth into the profile that `magicdec calibrate` made on one process (in the same --dtype)."""
    tp = init_tp(args.device)
    dtype = dtype_name(auto_dtype(tp.device).dtype) if args.dtype == "auto" else args.dtype
    path = Path(args.output) if args.output else default_profile_path(tp.device.type, dtype)
    if not path.is_file():
        raise InvalidRequestError(f"no hardware profile at {path}: run `magicdec calibrate` as one process first")
    result = measure_allreduce(tp)
    if tp.is_main:
        try:
            profile = with_allreduce(HardwareProfile.from_json(path), result)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        profile.to_json(path)
        print(json.dumps(result, indent=1))
        print(f"all-reduce over {tp.world_size} ranks ({tp.backend}): {result['latency_s'] * 1e6:.0f} us + "
              f"{result['bus_bandwidth'] / 1e9:.2f} GB/s bus bandwidth, written to {path}", file=sys.stderr)
    return 0
