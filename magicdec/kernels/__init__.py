"""Native CPU kernels, compiled on first use for the CPU at hand, one set per instruction-set path.

`decode_attention` is attention over a 16-bit KV cache, or an int8 one (magicdec.kv.quant; the avx512bf16 path, with
VNNI), for decode and verification (a few new tokens per row) and for prefill chunks. torch's two 16-bit matmuls read
the cache well below the memory bandwidth at one new token and are compute-bound at verification shapes; the kernel
reads each cached K/V element once, whatever the number of queries (benchmarks/README.md, "Decode and verification
attention over a bf16 cache"), and with no scores tensor between two matmuls it also runs prefill chunks faster than
they do ("Prefill chunks").

`linear` is a linear layer over 16-bit weights packed once at load time (`pack_linear`). torch's matmul reads the
weights well below the memory bandwidth at a few rows, and rounds a row differently at different row counts; the
kernel reads each weight once per call, which pays most at a few rows, where the weights are what a forward reads
(benchmarks/README.md, "Packed bf16 linear layers"), and gives a row the same bits in any batch, so that a
one-token step and a verification forward agree exactly in the linear layers.

The paths (`PATHS`), in order of preference; the first whose CPU flags this CPU has runs:
- `avx512bf16`: bf16 products with `vdpbf16ps` (Intel Xeons since Cooper Lake, AMD Zen 4). The model computes in bf16
  (activations, norms) and stores weights and KV cache in bf16. Where the CPU also has AMX-BF16 (Intel Xeons since
  Sapphire Rapids), both kernels' products run on AMX tiles (`tiles`): the linear layers over the same packed
  weights, as fast at one row and 2-4x faster from 16 rows up, where the vector instructions are compute-bound; the
  attention's scores and P @ V for up to 16 query rows per KV head at the cost of about one (a verification forward
  of a large batch; benchmarks/README.md, "Attention on AMX tiles at Gemma 3's shape").
- `avx2`: AVX2 + FMA + F16C, most other x86 CPUs (AMD Zen 2/3, Intel client cores, many cloud VMs). They have no 16-bit
  products and torch's bf16 runs slowly there, so the model computes in fp32 and only storage is 16-bit: the kernels
  widen each weight and cached K/V element to fp32 as they read it, halving the bytes a step reads. fp16 is the
  default storage, bf16 the alternative: widening costs about the same (F16C's `vcvtph2ps` against a shift), and
  fp16's 10 mantissa bits against bf16's 7 flip far fewer greedy tokens against fp32 (benchmarks/README.md, "fp16 or
  bf16 storage under the AVX2 kernels"); the values a Llama-family model stores (weights, keys and values) lie far
  inside fp16's range.
An ARM path (NEON with fp16 arithmetic) would be one more entry with its own flags, compiler flags and sources.

Each path's kernels are built into one library with torch's C++ extension tooling (a C++ compiler and ninja; once
per torch version, cached under TORCH_EXTENSIONS_DIR), with its path's instruction-set flags only (not -march=native:
a build forced onto a path must not use the host's wider instructions). Where the CPU lacks the instructions or a
build fails, the path's kernels are off, the reason is logged, and torch's operators run instead. MAGICDEC_NATIVE=0 turns the kernels off;
MAGICDEC_ISA=<path> forces a path (say `avx2` on a CPU with AVX-512, to run and test it there), `none` none;
MAGICDEC_AMX=0 keeps both kernels on vector instructions.

Rows whose context holds the same blocks of the pool (a shared prompt prefix) attend over each such chunk in one task,
their query rows together, so that each K/V tile is read, transposed and interleaved once for all of them, and on AMX
tiles up to 16 query rows cost about one (`groups`; MAGICDEC_CASCADE=0 turns it off; benchmarks/README.md, "Rows that
share a prompt: one pass over its blocks"). A row's bits are those of its own pass.

Beside the two, each path's library holds small operators of a decoder layer (`rms_norm` with the residual add fused,
`rope`, `glu`: the MLP's activation times its up projection, `store_kv` of a forward's new K/V rows into the block
pool; kernels/layer.h), which a decode-sized forward would otherwise run as chains of torch operators, each paying
its dispatch, and the runs of them and the linear layers before a layer's attention and after it in one call each
(`attention_in`, `attention_out`; MAGICDEC_FUSED=ops runs them a call at a time): they run where the path computes in
the model's dtype (`fuses`), and MAGICDEC_FUSED=0 gives those layers back to torch's operators; a Vegas draft's
selection (`top_positions`, `selects`), which MAGICDEC_FUSED=0 gives back to torch's topk; and the CPU sampler's draw
from a row's most probable tokens (`sample`, `samples`; kernels/sampler.h), which MAGICDEC_FUSED=0 gives back to the
same draw in torch's operators (magicdec.sampling).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from magicdec.cpu import DtypeChoice, auto_dtype, cpu_flags, dtype_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IsaPath:
    """One instruction-set path of the native kernels."""

    name: str
    flags: tuple[str, ...]  # CPU flags it needs, as /proc/cpuinfo names them
    cflags: tuple[str, ...]  # what its sources are compiled with
    suffix: str  # its sources: <kernel><suffix>.cpp beside this module
    compute: torch.dtype  # the dtype its kernels take and return: the model's activations
    storage: tuple[torch.dtype, ...]  # weight and KV cache dtypes its kernels read; the first is the default
    group: int  # output columns per packed weight group (kGroup in its linear source)
    pairs: bool  # whether a group's weights are packed by input pairs (bf16 dot products)
    int8: bool  # whether its attention kernel reads int8 KV caches (magicdec.kv.quant)


# Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and later) has AVX512-VNNI too.
AVX512_BF16 = IsaPath("avx512bf16", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
                      ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                       "-mamx-tile", "-mamx-bf16"), "",
                      torch.bfloat16, (torch.bfloat16,), 64, True, True)
AVX2 = IsaPath("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "_avx2",
               torch.float32, (torch.float16, torch.bfloat16), 16, False, False)
#: In order of preference.
PATHS = (AVX512_BF16, AVX2)
HEAD_DIMS = (64, 128, 256)
#: The kernels of every path: <kernel><suffix>.cpp beside this module, built together.
KERNELS = ("decode_attention", "linear")
#: Context positions per task. Fixed, so that the chunks a query row is split into, and with them its
#: arithmetic, do not depend on how many positions the forward attends: a verification forward and the
#: one-token steps over the same tokens give bit-identical outputs.
CHUNK = 1024
#: Age after which a build lock is taken to be left by a killed build (a build takes a minute at most).
STALE_LOCK_S = 600


@functools.cache
def isa_path() -> IsaPath | None:
    """The path the kernels run on in this process: the one MAGICDEC_ISA names (if this CPU has its flags), else the
    first of `PATHS` this CPU has the flags of; None where MAGICDEC_NATIVE=0, MAGICDEC_ISA=none or no path fits.
    Decided once: a model's weights are packed for the path it was loaded on."""
    if os.environ.get("MAGICDEC_NATIVE", "1") == "0":
        return None
    forced = os.environ.get("MAGICDEC_ISA", "").strip().lower()
    if forced == "none":
        return None
    if forced:
        by_name = {p.name: p for p in PATHS}
        if forced not in by_name:
            raise ValueError(f"MAGICDEC_ISA={forced!r}: choose from {', '.join(by_name)} or none")
        candidates = [by_name[forced]]
    else:
        candidates = list(PATHS)
    for path in candidates:
        if all(f in cpu_flags() for f in path.flags):
            return path
    for path in candidates:
        log.info("native %s kernels off: this CPU lacks %s", path.name,
                 ", ".join(f for f in path.flags if f not in cpu_flags()))
    return None


#: CPU flags of the AMX tiles the avx512bf16 path's kernels multiply on where the CPU has them.
TILE_FLAGS = ("amx_tile", "amx_bf16")


@functools.cache
def tiles() -> bool:
    """Whether the kernels multiply on AMX tiles: on the avx512bf16 path, where the CPU has AMX-BF16 and the OS grants
    the tile state; MAGICDEC_AMX=0 keeps them on vector instructions. Decided once per process: every call must take
    the same instructions, or a verification forward would not give the one-token steps' bits."""
    if isa_path() is not AVX512_BF16 or os.environ.get("MAGICDEC_AMX", "1") == "0":
        return False
    if not all(f in cpu_flags() for f in TILE_FLAGS):
        return False
    ops = _ops()
    return ops is not None and bool(ops.tiles_ready())


def groups() -> bool:
    """Whether the attention kernels attend over the blocks that rows share (a prompt prefix the prefix cache hands to
    several requests, or to the samples of one) once for all of them, their query rows together (cascade attention;
    the same bits); MAGICDEC_CASCADE=0 gives each row its own pass over them. Read at every call, so that a benchmark
    can alternate the two in one process."""
    return os.environ.get("MAGICDEC_CASCADE", "1") != "0"


def path_name() -> str:
    """The kernel path's name for stats and results: "avx512bf16" (with "-amx" where the kernels multiply on tiles),
    "avx2", or "torch" (no native kernels)."""
    path = isa_path()
    if path is None:
        return "torch"
    return path.name + ("-amx" if tiles() else "")


def _build_dir(name: str, sources: list[Path], flags: list[str]) -> Path:
    """One build folder per path, torch version, sources (their text and the kernel's path: two checkouts do not
    rebuild each other's) and flags (torch's own cache key ignores the version)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    text = b"".join(s.read_bytes() for s in sources)
    key = hashlib.sha256(text + f"{sources[0].resolve()} {' '.join(flags)}".encode()).hexdigest()[:12]
    return root / f"magicdec-{name}-torch{torch.__version__.replace('+', '_')}-{key}"


def _ensure_ninja() -> None:
    """The `ninja` wheel installs its binary beside the module, not always on PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _ops() -> Any | None:
    """The operators of this CPU's path (`torch.ops.magicdec_<path>`: `decode_attention`, `linear`), or None (the
    reason logged)."""
    path = isa_path()
    return _build(path) if path is not None else None


@functools.cache
def _build(path: IsaPath) -> Any | None:
    """`path`'s kernels compiled into one library and loaded (once per process, and once per source and torch
    version on disk), or None where they do not build (the reason logged once)."""
    what = f"native {path.name} kernels"
    _ensure_ninja()
    flags = ["-O3", "-fopenmp", *path.cflags]
    here = Path(__file__).parent
    sources = [here / f"{kernel}{path.suffix}.cpp" for kernel in KERNELS]
    build_dir = _build_dir(path.name, [*sources, *sorted(here.glob("*.h"))], flags)
    if not build_dir.exists():
        log.info("compiling the %s for this CPU (once, about 30 s)", what)
        build_dir.mkdir(parents=True, exist_ok=True)  # another process may build it too
    lock = build_dir / "lock"  # torch waits on it forever; a build killed midway leaves it behind
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        log.warning("removing %s, left by an interrupted build", lock)
        lock.unlink(missing_ok=True)
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for runs on the OpenMP pool torch itself uses (its libgomp is loaded first).
        # The library registers its operators when loaded; ninja compiles the sources side by side.
        # The library is named after its build folder, one name per folder: under one name, torch renames a build
        # whose flags changed within the process (name_v1) into the same folder, and a second process building there
        # under the first name then failed to load its library.
        load(name=build_dir.name.replace("-", "_").replace(".", "_"), sources=[str(s) for s in sources],
             extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
             verbose=False)
        return getattr(torch.ops, f"magicdec_{path.name}")
    except Exception as e:  # no compiler, no ninja, a failed build: torch's operators still work
        log.warning("%s off: building them failed: %s", what, str(e).strip().splitlines()[0])
        return None


def build() -> str:
    """Compile this CPU's kernels now rather than on first use (`scripts/setup.sh` does); the path that runs
    (`path_name`)."""
    _ops()
    return path_name()


def supported(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether attention over a cache of this dtype on this device runs the native kernel (building it on the first
    call)."""
    path = isa_path()
    return (device.type == "cpu" and path is not None
            and (kv_dtype in path.storage or (kv_dtype == torch.int8 and path.int8)) and _ops() is not None)


def linear_supported(device: torch.device, dtype: torch.dtype, storage: torch.dtype | None = None) -> bool:
    """Whether linear layers of a model of this dtype on this device, their weights stored in `storage` (None:
    `dtype`), run the native kernel (building it on the first call): the path's compute dtype (bf16 with
    AVX512-BF16, fp32 with AVX2) over one of its storage dtypes."""
    path = isa_path()
    return (device.type == "cpu" and path is not None and dtype == path.compute
            and (storage or dtype) in path.storage and _ops() is not None)


def default_kv_dtype(device: torch.device, dtype: torch.dtype, storage: torch.dtype) -> torch.dtype:
    """The KV cache dtype of a model of `dtype` whose weights are stored in `storage`, when none is asked for: the
    weights' where the attention kernel reads it (16-bit under an fp32 model with AVX2), else the model's."""
    return storage if storage != dtype and supported(device, storage) else dtype


def auto_kernel_dtype(device: torch.device) -> DtypeChoice:
    """`dtype="auto"` with the kernel path in view: fp32 where the path computes in fp32 (AVX2: its kernels store
    16-bit, and torch's bf16 is slow there even on a CPU that would pass `magicdec.cpu.auto_dtype`, as under
    MAGICDEC_ISA=avx2), else `magicdec.cpu.auto_dtype`."""
    path = isa_path()
    if device.type == "cpu" and path is not None and path.compute == torch.float32:
        storage = dtype_name(path.storage[0])
        return DtypeChoice(torch.float32, f"auto: the {path.name} kernels' arithmetic, {storage} storage",
                           storage=path.storage[0])
    return auto_dtype(device)


def packable(in_features: int) -> bool:
    """Whether `pack_linear` takes a weight of this many inputs on this CPU's path (an even number for bf16 pairs)."""
    path = isa_path()
    return path is not None and (in_features % 2 == 0 or not path.pairs)


def pack_linear(weight: Tensor, storage: torch.dtype) -> Tensor:
    """A linear layer's weight [N, K] in the path's layout, stored in `storage` (one of the path's), for `linear`.
    AVX512-BF16 (K even): [ceil(N / 64), K / 2, 64, 2], for each group of 64 output columns and each pair of inputs
    the columns' two weights side by side. AVX2: [ceil(N / 16), K, 16], for each group of 16 columns and each input
    the columns' weights side by side. Columns past N are zero."""
    path = isa_path()
    assert path is not None, "pack_linear needs a native kernel path"
    n, k = weight.shape
    groups = -(-n // path.group)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, groups * path.group - n)).to(storage)
    if path.pairs:
        return padded.view(groups, path.group, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(groups, path.group, k).transpose(1, 2).contiguous()


def unpack_linear(packed: Tensor, out_features: int) -> Tensor:
    """The weight [out_features, K] that `pack_linear` packed, in its storage dtype."""
    if packed.dim() == 4:  # pairs: [groups, K / 2, group, 2]
        groups, half, group, _ = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(groups * group, 2 * half)[:out_features]
    groups, k, group = packed.shape
    return packed.transpose(1, 2).reshape(groups * group, k)[:out_features]


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None, *, fp32: bool = False,
           on_tiles: bool | None = None) -> Tensor:
    """x [..., K] @ W^T (+ bias) with W packed by `pack_linear`; returns [..., out_features] in x's dtype (the path's
    compute dtype), or in fp32 where `fp32` (the LM head's logits: the sums are fp32, so this skips a rounding and a
    conversion). Call only where `linear_supported` is True. `on_tiles`: AMX tiles or vector instructions (None:
    this process's choice, `tiles()`; a benchmark compares the two)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    op = _ops().linear_tiles if (tiles() if on_tiles is None else on_tiles) else _ops().linear
    return op(rows, packed, out_features, bias, fp32).view(*x.shape[:-1], out_features)


@functools.cache
def _layer_ops(path: IsaPath, switch: str) -> bool:
    """Whether the layer operators run on `path` under MAGICDEC_FUSED=`switch` (built with the path's kernels)."""
    return switch != "0" and _build(path) is not None


def _layer_ops_run() -> bool:
    """Whether the layer operators run in this process (a native path, built, unless MAGICDEC_FUSED=0)."""
    path = isa_path()
    return path is not None and _layer_ops(path, os.environ.get("MAGICDEC_FUSED", "1"))


def fuses(x: Tensor) -> bool:
    """Whether `rms_norm` and `rope` take x: a CPU tensor of the path's compute dtype (bf16 on avx512bf16, fp32 on
    avx2), unless MAGICDEC_FUSED=0."""
    path = isa_path()
    return path is not None and x.dtype == path.compute and x.device.type == "cpu" and _layer_ops_run()


def sublayers(x: Tensor) -> bool:
    """Whether a decoder layer's operators before its attention and after it run as one call each (`attention_in`,
    `attention_out`): where `fuses(x)`, unless MAGICDEC_FUSED=ops (the same operators a call at a time, to compare)."""
    return fuses(x) and os.environ.get("MAGICDEC_FUSED", "1") != "ops"


def selects(scores: Tensor) -> bool:
    """Whether `top_positions` takes these scores: contiguous fp32 on the CPU, where the layer operators run."""
    return (scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.is_contiguous()
            and _layer_ops_run())


def top_positions(scores: Tensor, hi: Tensor, lo: int, k: int) -> Tensor:
    """Per row r of scores [R, H, L], summed over its H heads (in order, as torch's `sum` adds them): the k positions
    of largest sum in [lo, hi[r % B]) (hi [B] int64), ascending, -1 in the leading entries where there are fewer; ties
    to the lower position. [R, k] int64. Call only where `selects(scores)`."""
    return _ops().top_positions(scores, hi, lo, k)


def glu(x: Tensor, gelu: bool) -> Tensor:
    """The gated MLP's act(gate) * up from the fused projection's output x [..., 2H] (gate, then up) -> [..., H]; act:
    SiLU, or GELU's tanh approximation where `gelu`, rounded to x's dtype before the product as torch rounds it. Call
    only where `fuses(x)`."""
    return _ops().glu(x, gelu)


def samples(logits: Tensor) -> bool:
    """Whether `sample` takes these logits: fp32 on the CPU with a contiguous last dim, where the layer operators
    run."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and _layer_ops_run())


def sample(logits: Tensor, greedy: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
           position: Tensor, ids: Tensor | None, candidates: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The exponential race of `magicdec.sampling` over each row's `candidates` most probable tokens (the counts
    tried in turn), where that is the race over the whole vocabulary. logits [B, q, V]; greedy / temperature / top_k /
    top_p / seed [B] (bool, fp32, int64, fp32, int64); position [B, q]; ids [V] (the token id of each logit) or None
    -> (tokens [B, q] int64, done [B, q] bool): a row of temperature alone races every token; a row not done (a wide
    nucleus, top-k past the candidates, NaN or +inf logits) is left to the full path; greedy rows are done with token 0.
    Call only where `samples(logits)`."""
    return _ops().sample(logits, greedy, temperature, top_k, top_p, seed, position, ids, list(candidates))


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of x [..., dim] times weight [dim] (x's dtype); with `residual` (contiguous, x's shape), residual += x
    first, in place, and its norm is returned: the residual stream's add and the next norm in one pass. Call only
    where `fuses(x)`."""
    return _ops().rms_norm(x, weight, eps, residual)


def store_kv(kc: Tensor, vc: Tensor, k: Tensor, v: Tensor, block: Tensor, offset: Tensor) -> None:
    """kc[block[b, t], :, offset[b, t]] = k[b, :, t] (and v into vc): new K/V rows [B, KV, q, D] into block pools
    [NB, KV, BS, D] of their dtype, as `index_put_` writes them. Call only where `fuses(k)` and the pools are of k's
    dtype."""
    _ops().store_kv(kc, vc, k, v, block, offset)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, q, D] (a contiguous last dim) rotated by cos / sin [B, q, D] in the half-split convention, with
    torch's roundings (`magicdec.model.apply_rope`'s bits); contiguous. Call only where `fuses(x)`."""
    return _ops().rope(x, cos, sin)


def attention_in(x: Tensor, norm: Tensor, eps: float, wqkv: Tensor, bias: Tensor | None, heads: int, kv_heads: int,
                 cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, q_scale: float | None,
                 real: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer up to its attention, in one call: x [B, q, dim] -> queries [B, heads, q, hd] and keys [B,
    kv_heads, q, hd] rotated by cos / sin [B, 1, q, hd], and values [B, kv_heads, q, hd] (a view): the attention's
    RMSNorm (weight `norm`), the QKV projection packed by `pack_linear` (with `bias` where given), the Q/K norms and
    the queries' scale where given, RoPE: the operators `magicdec.model.Attention` calls, with their bits. `real` [N]
    (a ragged forward's real tokens, `magicdec.model.Ragged.index`): x holds their [N, dim] alone, the padding tokens'
    projections are zeros. Call only where `fuses(x)`."""
    return _ops().attention_in(x, norm, eps, wqkv, bias, heads, kv_heads, cos, sin, q_norm, k_norm, q_scale, real,
                               tiles())


def attention_out(x: Tensor, attn: Tensor, tokens: int, wo: Tensor, post_attention_norm: Tensor | None,
                  ffn_norm: Tensor, eps: float, w13: Tensor, ffn_dim: int, w2: Tensor, gelu: bool,
                  post_ffn_norm: Tensor | None, real: Tensor | None = None) -> Tensor:
    """A decoder layer after its attention, in one call: the residual stream x [B, q, dim] (added into in place where
    contiguous) and attention's output [B, KV, G*q, hd] for q = `tokens` -> the layer's output [B, q, dim]: the output
    projection (its norm where given), the residual add with the MLP's RMSNorm, the gated MLP over packed `w13` (gate,
    then up, of `ffn_dim` each; GELU where `gelu`, else SiLU) and `w2` (its norm where given), the residual add: the
    operators of `magicdec.model.Block`, with their bits. `real` [N]: x holds a ragged forward's real tokens alone (see
    `attention_in`), and so does the output. Call only where `fuses(x)`."""
    return _ops().attention_out(x, attn, tokens, wo, post_attention_norm, ffn_norm, eps, w13, ffn_dim, w2, gelu,
                                post_ffn_norm, real, tiles())


def attends(device: torch.device, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over a cache of this dtype and head size on this device runs the native kernel (see
    `supported`), which reads a strided prefix of a cache buffer as fast as a whole one."""
    return head_dim in HEAD_DIMS and supported(device, kv_dtype)


def takes(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor | None = None) -> bool:
    """Whether `decode_attention` takes these operands (see `attends`; contiguous last dimensions; a bias in K's
    dtype, or in bf16 over int8 K/V; with a block `table`, int32 [B, nblk] over pools of blocks of a power of two
    positions, 1 included, or of one block a row of any length (a row table), enough for the bias's L)."""
    if table is not None:
        bs = keys.shape[2]
        if not (table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == xq.shape[0]
                and bs >= 1 and (bs & (bs - 1) == 0 or table.shape[1] == 1) and values.shape[2] == bs
                and table.shape[1] * bs >= bias.shape[-1]):
            return False
    bias_dtype = torch.bfloat16 if keys.dtype == torch.int8 else keys.dtype
    return (keys.stride(-1) == 1 and values.stride(-1) == 1 and bias.stride(-1) == 1
            and xq.shape[2] % bias.shape[2] == 0 and values.dtype == keys.dtype and bias.dtype == bias_dtype
            and attends(keys.device, keys.dtype, xq.shape[-1]))


def token_view(pool: Tensor) -> tuple[Tensor, int]:
    """A block pool [NB, KV, BS, hd] (any strides but a contiguous last dim) viewed in place as blocks of one position,
    for a token table (`decode_attention`), and the view's rows per block: position `offset` of block `block` is row
    block * step + offset of the view (step = BS for a pool stored [NB, BS, KV, hd], KV * BS for one stored
    [NB, KV, BS, hd]). The view's rows overlap the pool's other heads; the kernel reads head h of a row only."""
    NB, KV, BS, hd = pool.shape
    step, rest = divmod(pool.stride(0), pool.stride(2))
    if rest or step < BS:
        raise ValueError(f"a pool of strides {pool.stride()}: its blocks are no whole number of positions apart")
    rows = (NB - 1) * step + BS
    return pool.as_strided((rows, KV, 1, hd), (pool.stride(2), pool.stride(1), pool.stride(2), 1)), step


def decode_attention(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor | None = None, *,
                     shares: Tensor | None = None, share_row: int = 0, on_tiles: bool | None = None) -> Tensor:
    """Softmax attention of queries [B, KV, M, hd] (any float dtype) over K/V [B, KV, L, hd] (16-bit), or over int8
    rows [B, KV, L, hd + 4] (`magicdec.kv.quant`: the queries are quantized per 32 dims, and the products run on VNNI
    instructions, never on tiles), with an additive bias [B, 1, R, L] (K's dtype, bf16 over int8; 0 or -inf; R
    divides M, and query row m takes bias row m % R: one row per new token serves the grouped query heads, rows
    ordered head then token); returns [B, KV, M, hd] fp32. Call only
    where `takes` is True. `on_tiles`: AMX tiles or vector instructions (None: this process's choice, `tiles()`).

    Paged (vLLM's "HND" layout): with a block `table` [B, nblk] (int32), K/V are pools [NB, KV, BS, hd] of NB blocks
    of BS positions (a power of two; any strides but a contiguous last dim), row b's j-th block of BS positions being
    pool[table[b, j]]: position l of row b, KV head h is pool[table[b, l // BS], h, l % BS]. L is the bias's last
    dimension (nblk * BS >= L); every id in the table must name a block of the pool, but the blocks of positions the
    bias hides from all of a row's queries are not read. A row's output has the bits it has over the same positions
    stored contiguously. BS may be below 16, down to 1: a token table [B, L], each entry naming one position's row,
    reads arbitrary positions of a block pool in place through its `token_view` (entries block * step + offset). A
    row table [B, 1] takes blocks of any length: some rows of a larger cache [B', KV, L', hd] read in place.
    Blocks of fewer than 16 positions run on vector instructions (a tile reads 16 positions of one block). Rows whose
    chunk of `CHUNK` positions is the same blocks behind the same bias attend over it in one task (`groups`).

    `shares` (fp32, contiguous [B, KV, L]), where given, receives the attention shares of new token `share_row` (a
    bias row, in [0, R)): shares[b, h, l] = the sum over the query rows m of KV head h with m % R == share_row (the G
    query heads of that token) of their softmax probability at l, 0 where the bias hides l from them. A row of shares
    sums to about G. The output has the same bits with shares as without."""
    extra = (shares, share_row, groups())
    if keys.dtype == torch.int8:
        return _ops().decode_attention_int8(xq, keys, values, bias, CHUNK, table, *extra)
    if on_tiles is None:
        on_tiles = tiles()
    if table is not None and keys.shape[2] < 16:  # a tile of 16 positions reads one block's rows
        on_tiles = False
    op = _ops().decode_attention_tiles if on_tiles else _ops().decode_attention
    return op(xq, keys, values, bias, CHUNK, table, *extra)
