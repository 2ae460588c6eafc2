"""What the planner plans with on this machine: the hardware profile and the acceptance table that `magicdec
calibrate` saved (where they live, how they are read back), the presets standing in for them when nothing was
measured, and the planner's shape of a model.

Both `autoplan` (which reads these files) and `calibrate` (which writes them) import this module.
"""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path
from typing import Callable, TypeVar

import torch

from magicdec import cpu, dtypes
from magicdec.config import SLIDING, ModelConfig
from magicdec.loading.cache import cache_root
from magicdec.model import attention_path, linear_path
from magicdec.planner import PRESETS, AcceptanceTable, HardwareProfile, ModelShape
from magicdec.planner.hardware import CPU_PRESETS, eager

#: The acceptance tables shipped with magicdec (package data) by model architecture, each measured on PG-19 with a
#: model of that family; other architectures plan with the first.
BUILTIN_ACCEPTANCE = {"LlamaForCausalLM": "acceptance_smollm2.json", "Gemma3ForCausalLM": "acceptance_gemma3.json"}
#: GPU name fragments (lower case) -> preset, for devices without a calibrated profile.
_GPU_PRESETS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"), ("l40s", "l40s"), ("l40", "l40"))
FALLBACK_GPU_PRESET = "a100-80gb"

T = TypeVar("T")


def default_profile_path(device: str | torch.device, dtype: str, kv: str | None = None) -> Path:
    """Where `magicdec calibrate` saves the profile of `device` measured in `dtype` (fp32, bf16) over a KV cache of
    `kv` (int8, fp8; None: stored as the weights): <cache>/hardware-<device>-<dtype>[-kv-<kv>].json, in the folder the
    converted weights live in."""
    key = str(device).replace(":", "-").replace("/", "-")
    return cache_root() / f"hardware-{key}-{dtype}{kv_suffix(dtype, kv)}.json"


def kv_suffix(dtype: str, kv: str | None) -> str:
    """What names a profile measured over a KV cache stored otherwise than the weights: "-kv-<kv>", else ""."""
    return f"-kv-{kv}" if kv not in (None, dtype) else ""


def default_acceptance_path(model_name: str) -> Path:
    """Where a measured acceptance table of `model_name` is saved: <cache>/acceptance-<name>.json."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    return cache_root() / f"acceptance-{safe}.json"


def model_key(source: str | None) -> str:
    """A short name for a model loaded from `source` (its file or folder name), for file names."""
    if not source:
        return "model"
    p = Path(source)
    return p.stem if p.suffix else p.name


def target_shape(cfg: ModelConfig) -> ModelShape:
    """The planner's shape of a model of `cfg`."""
    return ModelShape(
        name=cfg.architecture, n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings,
        sliding_layers=len(cfg.layers_of(SLIDING)), sliding_window=cfg.sliding_window or 0,
    )


def preset_for_device(device: str, dtype: str | None = None, graphs: bool = False) -> HardwareProfile:
    """The preset standing in for an uncalibrated device: for a CPU, the measured preset of the same dtype (fp32,
    bf16), from the same kind of CPU where there is one; for a GPU, the one matching its name, as the engine runs on it
    (replayed from CUDA graphs where `graphs`, else `eager`: kernels launched from Python); a common datacenter GPU's
    where there is no CUDA to ask."""
    if not device.startswith("cuda"):
        kind = cpu.cpu_kind()
        return PRESETS[min(CPU_PRESETS, key=lambda n: (PRESETS[n].dtype != dtype, not n.startswith(f"cpu-{kind}-")))]
    try:
        name = torch.cuda.get_device_name(torch.device(device)).lower()
    except Exception:  # no CUDA here (planning for another machine): a common datacenter GPU
        return PRESETS[FALLBACK_GPU_PRESET]
    preset = PRESETS[next((preset for fragment, preset in _GPU_PRESETS if fragment in name), FALLBACK_GPU_PRESET)]
    return preset if graphs else eager(preset)


def load_profile(device: str = "cpu", dtype: str | None = None, graphs: bool = False) -> HardwareProfile:
    """The profile `magicdec calibrate` saved for `device` in `dtype` (default: fp32 on CPU, bf16 on GPUs), else
    `preset_for_device` (`graphs`: the engine replays decode forwards from CUDA graphs)."""
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    for dev in dict.fromkeys((device, device.split(":")[0])):
        path = default_profile_path(dev, dtype)
        if path.is_file():
            hw = _read_calibrated(HardwareProfile.from_json, path)
            if _measured_with_these_kernels(hw, device, dtype):
                return hw
            warnings.warn(f"{path} was measured with other kernels (attention {hw.attention or 'older'}, linear "
                          f"{hw.linear or 'older'}) than this run's: planning with the preset; run `magicdec "
                          f"calibrate` again", stacklevel=2)
    return preset_for_device(device, dtype, graphs)


def _measured_with_these_kernels(hw: HardwareProfile, device: str, dtype: str) -> bool:
    """Whether a calibrated profile's rates were measured with the attention and linear layers this run uses (a
    profile from before a native kernel, or from a machine where it did not build, predicts the wrong costs)."""
    # torch's dtype from the short name here, not engine.parse_dtype: the engine plans with this module
    dev, dt = torch.device(device), getattr(torch, dtypes.TORCH_NAMES[dtype])
    attention, linear = attention_path(dev, dt), linear_path(dev, dt)
    return ((hw.attention == attention if hw.attention is not None else attention != "native")
            and (hw.linear == linear if hw.linear is not None else linear != "packed"))


def _read_calibrated(read: Callable[[Path], T], path: Path) -> T:
    """A file `magicdec calibrate` saved; a damaged one raises ValueError saying how to replace it."""
    try:
        return read(path)
    except ValueError as e:
        raise ValueError(f"{e}; run `magicdec calibrate` again, or delete the file") from None


def builtin_acceptance(architecture: str | None = None) -> AcceptanceTable:
    """The acceptance table shipped with magicdec for `architecture` (a config's, e.g. "Gemma3ForCausalLM": Gemma 3
    270M's), else SmolLM2-135M's: self-speculation on PG-19."""
    name = BUILTIN_ACCEPTANCE.get(architecture, BUILTIN_ACCEPTANCE["LlamaForCausalLM"])
    with resources.as_file(resources.files("magicdec") / "data" / name) as path:
        return AcceptanceTable.from_json(path)


def load_acceptance(model_name: str | None = None, architecture: str | None = None) -> AcceptanceTable:
    """The table `magicdec calibrate --acceptance` saved for the model named `model_name` (`model_key`), else the
    built-in one of its `architecture`."""
    if model_name is not None:
        path = default_acceptance_path(model_name)
        if path.is_file():
            return _read_calibrated(AcceptanceTable.from_json, path)
    return builtin_acceptance(architecture)
