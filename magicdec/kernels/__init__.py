"""Native CPU kernels, compiled on first use for the CPU at hand.

`decode_attention` is attention over a bf16 KV cache on CPUs with AVX512-BF16, for decode and verification (a few new
tokens per row) and for prefill chunks. torch's two bf16 matmuls read the cache well below the memory bandwidth at
one new token and are compute-bound at verification shapes; the kernel reads each cached K/V element once with
`vdpbf16ps`, whatever the number of queries (benchmarks/README.md, "A decode attention kernel"), and with no scores
tensor between two matmuls it also runs prefill chunks faster than they do ("Prefill chunks on the kernel").

`linear` is a bf16 linear layer over weights packed once at load time (`pack_linear`). torch's bf16 matmul reads the
weights well below the memory bandwidth at a few rows, and rounds a row differently at different row counts; the
kernel reads each weight once per call, which pays most at a few rows, where the weights are what a forward reads
(benchmarks/README.md, "A packed bf16 linear kernel"), and gives a row the same bits in any batch, so that a
one-token step and a verification forward agree exactly in the linear layers.

Each kernel is built with torch's C++ extension tooling (a C++ compiler and ninja; once per torch version, cached
under TORCH_EXTENSIONS_DIR). Where the CPU lacks the instructions or a build fails, that kernel is off, the reason is
logged, and torch's operators run instead. MAGICDEC_NATIVE=0 turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from magicdec.cpu import cpu_flags

log = logging.getLogger(__name__)

#: CPU flags the kernels are compiled for (and that the CPU must have): AVX-512 with bf16 dot products.
ISA = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
HEAD_DIMS = (64, 128, 256)
#: Context positions per task. Fixed, so that the chunks a query row is split into, and with them its
#: arithmetic, do not depend on how many positions the forward attends: a verification forward and the
#: one-token steps over the same tokens give bit-identical outputs.
CHUNK = 1024
#: Output columns per packed weight group (kGroup in linear.cpp).
LINEAR_GROUP = 64
#: Age after which a build lock is taken to be left by a killed build (a build takes a minute at most).
STALE_LOCK_S = 600


def _build_dir(name: str, source: Path, flags: list[str]) -> Path:
    """One build folder per kernel, torch version, source (its text and its path: two checkouts do not rebuild each
    other's) and flags (torch's own cache key ignores the version)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    key = hashlib.sha256(source.read_bytes() + f"{source.resolve()} {' '.join(flags)}".encode()).hexdigest()[:12]
    return root / f"magicdec-{name}-torch{torch.__version__.replace('+', '_')}-{key}"


@functools.cache
def _extension(name: str) -> Any | None:
    """The compiled kernel `name` (the source file `name`.cpp beside this module), or None (the reason logged) where
    it cannot run here."""
    if os.environ.get("MAGICDEC_NATIVE", "1") == "0":
        return None
    what = f"native {name.replace('_', ' ')}"
    missing = [f for f in ISA if f not in cpu_flags()]
    if missing:
        log.info("%s off: this CPU lacks %s", what, ", ".join(missing))
        return None
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel installs its binary beside the module, not always on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    flags = ["-O3", "-fopenmp"] + ["-m" + f.replace("_", "") for f in ISA]
    source = Path(__file__).with_name(f"{name}.cpp")
    build_dir = _build_dir(name, source, flags)
    if not build_dir.exists():
        log.info("compiling the %s kernel for this CPU (once, about 30 s)", what)
        build_dir.mkdir(parents=True)
    lock = build_dir / "lock"  # torch waits on it forever; a build killed midway leaves it behind
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        log.warning("removing %s, left by an interrupted build", lock)
        lock.unlink(missing_ok=True)
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for runs on the OpenMP pool torch itself uses (its libgomp is loaded first)
        return load(name=f"magicdec_{name}", sources=[str(source)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: torch's operators still work
        log.warning("%s off: building it failed: %s", what, str(e).strip().splitlines()[0])
        return None


def supported(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether attention over a cache of this dtype on this device runs the native kernel (building it on the first
    call)."""
    return device.type == "cpu" and kv_dtype == torch.bfloat16 and _extension("decode_attention") is not None


def linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers of this dtype on this device run the native kernel (building it on the first call)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _extension("linear") is not None


def pack_linear(weight: Tensor) -> Tensor:
    """A linear layer's weight [N, K] (bf16, K even) in the kernel's layout [ceil(N / 64), K / 2, 64, 2]: for each
    group of 64 output columns and each pair of inputs, the columns' two weights side by side (columns past N are
    zero)."""
    n, k = weight.shape
    groups = -(-n // LINEAR_GROUP)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, groups * LINEAR_GROUP - n))
    return padded.view(groups, LINEAR_GROUP, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ W^T (+ bias) in bf16 with W packed by `pack_linear`; returns [..., out_features]. Call only where
    `linear_supported` is True."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _extension("linear").linear(rows, packed, out_features, bias).view(*x.shape[:-1], out_features)


def takes(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> bool:
    """Whether `decode_attention` takes these operands (see `supported`; a supported head size, contiguous last
    dimensions)."""
    return (keys.shape[-1] in HEAD_DIMS and keys.stride(-1) == 1 and values.stride(-1) == 1 and bias.stride(-1) == 1
            and values.dtype == bias.dtype == keys.dtype and supported(keys.device, keys.dtype))


def decode_attention(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """Softmax attention of queries [B, KV, M, hd] over K/V [B, KV, L, hd] (bf16) with an additive bias [B, 1, M, L]
    (bf16, 0 or -inf); returns [B, KV, M, hd] fp32. Call only where `takes` is True."""
    return _extension("decode_attention").decode_attention(xq, keys, values, bias, CHUNK)
