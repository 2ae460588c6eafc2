"""Native CPU kernels, compiled on first use for the CPU at hand.

`decode_attention` is attention over a bf16 KV cache on CPUs with AVX512-BF16, for decode and
verification (a few new tokens per row) and for prefill chunks. torch's two bf16 matmuls read the cache
at 40-70% of the memory bandwidth at one new token and are compute-bound at verification shapes; the
kernel reads each cached K/V element once with `vdpbf16ps`, whatever the number of queries
(benchmarks/README.md, "A decode attention kernel"), and with no scores tensor between two matmuls it
also runs a 512-token prefill chunk 1.5-2x faster than they do ("Prefill chunks on the kernel"). It is
built with torch's C++ extension tooling (a C++ compiler and ninja; about 30 s, once per torch version,
cached under TORCH_EXTENSIONS_DIR). Where the CPU lacks the instructions or the build fails, `supported`
is False, the reason is logged, and attention runs on torch's operators. MAGICDEC_NATIVE=0 turns the
kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from magicdec.cpu import cpu_flags

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.cpp")
#: CPU flags the kernel is compiled for (and that the CPU must have): AVX-512 with bf16 dot products.
ISA = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
HEAD_DIMS = (64, 128)
#: Context positions per task at most; shorter where that leaves a thread without work.
CHUNK = 1024


def _build_dir(flags: list[str]) -> Path:
    """One build folder per torch version, source and flags (torch's own cache key ignores the version)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    return root / f"magicdec-torch{torch.__version__.replace('+', '_')}-{key}"


@functools.cache
def _extension() -> Any | None:
    """The compiled extension, or None (the reason logged) where it cannot run here."""
    if os.environ.get("MAGICDEC_NATIVE", "1") == "0":
        return None
    missing = [f for f in ISA if f not in cpu_flags()]
    if missing:
        log.info("native decode attention off: this CPU lacks %s", ", ".join(missing))
        return None
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel installs its binary beside the module, not always on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    flags = ["-O3", "-fopenmp"] + ["-m" + f.replace("_", "") for f in ISA]
    build_dir = _build_dir(flags)
    if not build_dir.exists():
        log.info("compiling the native decode-attention kernel for this CPU (once, about 30 s)")
        build_dir.mkdir(parents=True)
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for runs on the OpenMP pool torch itself uses (its libgomp is loaded first)
        return load(name="magicdec_decode_attention", sources=[str(_SOURCE)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: torch's operators still work
        log.warning("native decode attention off: building it failed: %s", str(e).strip().splitlines()[0])
        return None


def supported(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether attention over a cache of this dtype on this device runs the native kernel (building it
    on the first call)."""
    return device.type == "cpu" and kv_dtype == torch.bfloat16 and _extension() is not None


def takes(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> bool:
    """Whether `decode_attention` takes these operands (see `supported`; a supported head size, contiguous
    last dimensions)."""
    return (keys.shape[-1] in HEAD_DIMS and keys.stride(-1) == 1 and values.stride(-1) == 1 and bias.stride(-1) == 1
            and values.dtype == bias.dtype == keys.dtype and supported(keys.device, keys.dtype))


def decode_attention(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """Softmax attention of queries [B, KV, M, hd] over K/V [B, KV, L, hd] (bf16) with an additive bias
    [B, 1, M, L] (bf16, 0 or -inf); returns [B, KV, M, hd] fp32. Call only where `takes` is True."""
    B, KV, _, _ = xq.shape
    splits = -(-4 * torch.get_num_threads() // (B * KV))  # chunks per (row, KV head): work for every thread
    chunk = min(CHUNK, max(16, -(-keys.shape[2] // splits)))
    return _extension().decode_attention(xq, keys, values, bias, -(-chunk // 16) * 16)
