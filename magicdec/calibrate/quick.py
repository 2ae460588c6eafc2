"""A quick measurement of this machine for the planner, on first use, where `magicdec calibrate` has not run.

Without a profile measured here, `--draft auto` would plan with a preset measured on another CPU: its choice of
strategy, budget and draft length rests on absolute costs, and a preset of a CPU with AMX predicts an AVX2 machine's
steps several times too fast. So the first `--draft auto` run (and `serve`) on a CPU with no calibrated profile for
its dtype takes `measure_hardware(quick=True)` of the model it loaded (about 30 s; progress on stderr) and keeps the
profile in the cache folder under a key of the CPU model, thread count, dtype, kernel path, the model's config and
magicdec's sources: a later run with the same reuses it, and one that changes any of them measures again. The model
counts because the profile's rates and overheads are measured on its forwards (Gemma 3's 262k-token head and hybrid
layers cost what SmolLM2's do not); the sources because a profile measured by other code (another sampler, other
kernels) predicts the old code's costs. `magicdec calibrate` remains the thorough measurement, and where it has saved
a profile for this device and dtype that one is used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import torch

from magicdec import dtypes
from magicdec.calibrate.hardware import measure_hardware
from magicdec.calibrate.machine import machine_info
from magicdec.config import ModelConfig
from magicdec.cpu import dtype_name
from magicdec.kernels import path_name
from magicdec.loading.cache import cache_root
from magicdec.model import Transformer, weight_dtype
from magicdec.planner import HardwareProfile
from magicdec.profiles import default_profile_path, kv_suffix


@functools.cache
def source_digest() -> str:
    """A digest of magicdec's sources (Python and native kernels) as installed."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for source in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        digest.update(source.relative_to(root).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


def quick_profile_path(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> Path:
    """Where the quick profile of this CPU model, thread count, `dtype` (and KV dtype, where it differs), kernel path,
    model config `cfg` and magicdec source is kept."""
    cpu, threads, kernels = machine_info("cpu")["cpu"], torch.get_num_threads(), path_name()
    model = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    kv = kv_suffix(dtype_name(dtype), dtypes.kv_short_name(kv_dtype))
    key = hashlib.sha256(f"{cpu}|{threads}|{dtype_name(dtype)}{kv}|{kernels}|{model}|{source_digest()}".encode())
    return cache_root() / f"hardware-quick-cpu-{kernels}-{threads}t-{dtype_name(dtype)}{kv}-{key.hexdigest()[:12]}.json"


def _progress(done: int, total: int, label: str) -> None:
    end = "\n" if done == total else ""
    print(f"\rmeasuring this machine for the planner (once): {done}/{total} {label:<24}", end=end, file=sys.stderr,
          flush=True)


def planning_profile(model: Transformer, kv_dtype: torch.dtype | None = None) -> HardwareProfile | None:
    """The profile `--draft auto` plans `model` over a KV cache of `kv_dtype` (None: as the weights are stored) with
    where nothing else says: None on a GPU or where `magicdec calibrate` saved one for this device and dtype
    (`autoplan.choose` loads it); for an 8-bit cache the one `magicdec calibrate --kv-cache-dtype` saved for it (the
    plain one measured attention over caches stored as the weights); else this CPU's quick profile, measured now on
    first use and kept (see the module docstring)."""
    if model.device.type != "cpu" or model.tp is not None:
        return None  # GPUs plan with their presets; tensor-parallel ranks calibrate with `magicdec calibrate`
    dtype = weight_dtype(model)
    kv_dtype = None if kv_dtype == dtype else kv_dtype
    if kv_dtype is None and default_profile_path("cpu", dtype_name(dtype)).is_file():
        return None
    kv = dtypes.kv_short_name(kv_dtype)
    calibrated = default_profile_path("cpu", dtype_name(dtype), kv)
    if kv_dtype is not None and calibrated.is_file():  # `magicdec calibrate --kv-cache-dtype`'s
        return HardwareProfile.from_json(calibrated)
    path = quick_profile_path(model.cfg, dtype, kv_dtype)
    if path.is_file():
        try:
            return HardwareProfile.from_json(path)
        except ValueError as e:  # kept by an older magicdec, whose profiles had other fields: measured again
            print(f"{e}: measuring again", file=sys.stderr)
    print("no hardware profile of this CPU: a quick measurement (about 30 s) instead of another CPU's preset; "
          "`magicdec calibrate` measures it thoroughly", file=sys.stderr)
    name = f"quick-cpu-{path_name()}-{torch.get_num_threads()}t-{dtype_name(dtype)}{kv_suffix(dtype_name(dtype), kv)}"
    profile = measure_hardware(model.device, quick=True, progress=_progress, model=model, name=name,
                               kv_dtype=kv_dtype).profile
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    return profile
