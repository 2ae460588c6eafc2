"""The transformer, in plain PyTorch: embeddings, RMSNorm, RoPE, grouped-query attention, SwiGLU, LM head; and the
conventions of Gemma 3 as config switches: sliding-window and global layers with a RoPE base each, QK-norm, norms
after attention and MLP, GeGLU, scaled embeddings, the attention scale and final logit soft-capping.

Weights use fused projections (one `wqkv` and one `w13` matmul per layer) because on small models the per-op overhead
of eager PyTorch, not arithmetic, dominates a decode step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from magicdec import kernels, scopes
from magicdec.config import GLOBAL, SLIDING, ModelConfig
from magicdec.kernels import triton_attention, triton_linear
from magicdec.kv import quant
from magicdec.kv.paged import gather

# Called with (layer index, rotated queries [B, H, q, hd], keys [B, KV, L, hd], mask [B, 1, q, L]).
AttentionObserver = Callable[[int, Tensor, Tensor, Tensor], None]


class SharesRecorder(Protocol):
    """Where a forward's attention leaves each cached position's share of one token's attention (see `attend`):
    `row` is the token (its index among the forward's q), `buffer` an fp32 [B, KV, L] tensor for a layer's shares, or
    None for a layer it does not record (magicdec.kv.vegas)."""

    row: int

    def buffer(self, layer: int, shape: tuple[int, int, int]) -> Tensor | None: ...


class Cache(Protocol):
    """What the model needs from a KV cache (see magicdec.kv)."""

    def rope_positions(self, q: int) -> Tensor: ...  # [B, q] positions used to rotate new q/k

    # [B, 1, q, L] True where a key is visible; a cache of a hybrid model gives one mask per layer kind
    def attn_mask(self, q: int) -> Tensor | dict[str, Tensor]: ...

    # K, V to attend: [B, KV, L, hd] and None, or a layer's block pool [blocks, KV, BLOCK_SIZE, hd] and the block
    # table [B, n] to read it through (magicdec.kv.paged)
    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]: ...

    @property
    def dtype(self) -> torch.dtype: ...  # storage dtype of K/V; attention runs in it


def rope_inv_freq(cfg: ModelConfig, kind: str = GLOBAL) -> Tensor:
    """Inverse frequencies of RoPE for the layers of one kind, with Llama 3 frequency scaling when the config asks for
    it."""
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if kind == SLIDING and cfg.rope_local_theta is not None else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.float()
    factor = rs["factor"]
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [..., hd] for integer positions [...] (negative positions rotate backwards)."""
    angles = positions[..., None].float() * inv_freq  # [..., hd/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def matmul_attention(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether `attend` uses two matmuls (a bf16 cache on CPU) rather than SDPA where the native kernel does not run
    (a CPU without AVX512-BF16).

    Over a bf16 cache on CPU, two bf16 matmuls with a bf16 softmax between them (the kernel computes in fp32 inside)
    are faster than with the scores converted to fp32 for the softmax (that conversion is three extra passes over the
    scores), with the same output but for rare one-ulp roundings (the QK^T product is already rounded to bf16, and a
    power-of-two scale and a 0 / -inf bias add no rounding), and faster than SDPA's flash kernel, which converts the
    bf16 cache as it reads it; over an fp32 cache SDPA is the faster one, as it is on GPUs (measurements:
    benchmarks/README.md, "Decode and verification attention over a bf16 cache")."""
    return device.type == "cpu" and kv_dtype == torch.bfloat16


def attention_path(device: torch.device, kv_dtype: torch.dtype) -> str:
    """How decode and verification attention run over a cache of this dtype: "native" (the kernel of
    magicdec.kernels for this CPU's path, built here on the first call), "triton" (CUDA: magicdec.kernels.
    triton_attention; prefill chunks run SDPA), "matmul" or "sdpa"."""
    if triton_attention.supported(device, kv_dtype):
        return "triton"
    if kernels.supported(device, kv_dtype):
        return "native"
    return "matmul" if matmul_attention(device, kv_dtype) else "sdpa"


def linear_path(device: torch.device, storage: torch.dtype) -> str:
    """How linear layers whose weights are stored in this dtype run: "packed" (the native kernel of
    magicdec.kernels, see `pack_linears`) or "torch"."""
    path = kernels.isa_path()
    return "packed" if path is not None and kernels.linear_supported(device, path.compute, storage) else "torch"


def weight_dtype(model: Transformer) -> torch.dtype:
    """The dtype the model's linear weights are stored in: the packed one where `pack_linears` packed them, else the
    model's."""
    packed = next((m.packed.dtype for m in model.modules() if isinstance(m, PackedLinear)), None)
    return packed or model.dtype


#: SDPA's kernels on CUDA. Not cuDNN's: it builds an execution plan for each new key length, which in decoding is
#: every step (on an H200, 1.2 ms of host time a call: a plain round of Gemma 3 270M at B=32 x 8k took 100 ms in the
#: engine with it, 11.6 ms without; benchmarks/README.md, "The CUDA path on an H200").
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_bias(mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """Bool mask [B, 1, q, L] -> additive bias [B, 1, groups*q, L] (0 or -inf) for grouped queries, in the dtype
    attention computes in (`quant.attention_dtype`; on CPU an additive bias is markedly faster than a bool mask for
    SDPA). Built once per forward; groups 1 for the native kernel, which maps a KV head's G*q query rows to the q rows
    itself (at B=32 x 32k the repeat alone cost a Gemma 3 verification forward 18 ms)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1) if groups > 1 else bias


class Ragged:
    """The rows of a forward of q = max(counts) new tokens each, of which row b's first counts[b] (>= 1) are real: a
    verification of drafts of different lengths. The linear layers, norms and LM head run over the N real tokens only,
    packed in row order; attention runs each group of rows of one count with that many queries (`attend_ragged`). The
    padding tokens' K/V are written past the real ones, where nothing reads them before they are rewritten."""

    def __init__(self, counts: list[int], device: torch.device | str):
        self.B, self.q = len(counts), max(counts)
        # [N] into the flattened [B * q], and each real token's row
        self.index = torch.tensor([b * self.q + j for b, n in enumerate(counts) for j in range(n)], device=device)
        self.owner = self.index // self.q
        self.groups = [(c, torch.tensor([b for b, n in enumerate(counts) if n == c], device=device))
                       for c in sorted(set(counts))]
        self._parts: dict[int, tuple[Tensor, list[Tensor | None]]] = {}

    def pick(self, x: Tensor) -> Tensor:
        """x [B, q, ...] -> the real tokens' [N, ...]."""
        return x.reshape(self.B * self.q, *x.shape[2:]).index_select(0, self.index)

    def pad(self, x: Tensor, fill: float = 0) -> Tensor:
        """x [N, ...] -> [B, q, ...], `fill` at the padding tokens."""
        out = x.new_full((self.B * self.q, *x.shape[1:]), fill)
        return out.index_copy_(0, self.index, x).view(self.B, self.q, *x.shape[1:])

    def parts(self, t: Tensor | None, tokens_dim: int | None = None, once: bool = False) -> list[Tensor | None]:
        """t [B, ...] cut into each group's rows (and its first c of the q entries of dimension `tokens_dim`, where
        that dimension holds q tokens, or a multiple of q ordered head then token). `once`: a tensor every layer
        passes (a bias, a block table), cut at its first call of the forward."""
        if t is None:
            return [None] * len(self.groups)
        if once and id(t) in self._parts and self._parts[id(t)][0] is t:
            return self._parts[id(t)][1]
        cut = []
        for c, rows in self.groups:
            part = t.index_select(0, rows)
            if tokens_dim is not None and c < self.q:
                per_token = part.unflatten(tokens_dim, (part.shape[tokens_dim] // self.q, self.q))
                part = per_token.narrow(tokens_dim + 1, 0, c).flatten(tokens_dim, tokens_dim + 1)
            cut.append(part.contiguous())
        if once:
            self._parts[id(t)] = (t, cut)
        return cut


def attend_ragged(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor, ragged: Ragged,
                  shares: Tensor | None = None, share_row: int = 0) -> Tensor:
    """`attend` of a `Ragged` forward's queries [B, KV, G*q, hd] over a block pool read through `table`: each group
    of rows of count c attends with its first c tokens' queries alone (a query row's output has the same bits
    whatever the other rows and tokens, see magicdec.kernels), so a padding token costs no attention. Returns
    [B, KV, G*q, hd], 0 at the padding tokens' rows."""
    B, KV, M, hd = xq.shape
    out = None
    pieces = zip(ragged.groups, ragged.parts(xq, 2), ragged.parts(bias, 2, once=True), ragged.parts(table, once=True))
    for (c, rows), xq_c, bias_c, table_c in pieces:
        shares_c = None if shares is None else shares.new_empty((len(rows), *shares.shape[1:]))
        got = attend(xq_c, keys, values, bias_c, table_c, shares_c, share_row, c)  # [b, KV, G*c, hd]
        if out is None:
            out = got.new_zeros(B, KV, M // ragged.q, ragged.q, hd)
        out[rows, :, :, :c] = got.unflatten(2, (M // ragged.q, c))
        if shares is not None:
            shares.index_copy_(0, rows, shares_c)
    return out.flatten(2, 3)


def attend(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor, table: Tensor | None = None,
           shares: Tensor | None = None, share_row: int = 0, tokens: int = 1) -> Tensor:
    """Attention of queries [B, KV, G*q, hd] (the model's dtype) over cached K/V [B, KV, L, row], or over a block
    pool read through `table` (see `Cache.update`), with an additive bias [B, 1, *, L] from `attention_bias`; returns
    [B, KV, G*q, hd], fp32 from the native kernel, else the bias's dtype. The native kernel reads the blocks (and
    8-bit rows) in place; torch's operators attend over a gathered copy, converted back from 8 bits
    (`magicdec.kv.quant`).

    `shares` (fp32 [B, KV, L]): filled with each position's share of the attention of token `share_row` of the
    `tokens` new ones, its G query heads' probabilities summed (`attention_shares`); the output is the same with or
    without."""
    if kernels.takes(xq, keys, values, bias, table):  # queries as they are: fp32 on the AVX2 path
        return kernels.decode_attention(xq, keys, values, bias, table, shares=shares, share_row=share_row)
    if triton_attention.takes(xq, keys, values, bias, table):
        return triton_attention.attend(xq, keys, values, bias, table, shares, share_row)
    if table is not None:
        keys, values = gather(keys, table, bias.shape[-1]), gather(values, table, bias.shape[-1])
    if quant.quantized(keys.dtype):
        keys, values = quant.load(keys, bias.dtype), quant.load(values, bias.dtype)
    if shares is not None:
        shares.copy_(attention_shares(xq, keys, bias, share_row, tokens))
    if bias.shape[2] != xq.shape[2]:  # one row per token (built for the native kernel, which did not take these)
        bias = bias.repeat(1, 1, xq.shape[2] // bias.shape[2], 1)
    xq = xq.to(keys.dtype)
    if matmul_attention(keys.device, keys.dtype):
        return matmul_attend(xq, keys, values, bias)
    with sdpa_kernel(CUDA_ATTENTION) if keys.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(xq, keys, values, attn_mask=bias)


def attention_shares(xq: Tensor, keys: Tensor, bias: Tensor, share_row: int, tokens: int) -> Tensor:
    """Each position's share of the attention of token `share_row` of `tokens`, [B, KV, L] fp32: the softmax
    probabilities of its G query heads (rows share_row, share_row + tokens, ... of xq [B, KV, G*tokens, hd]) over keys
    [B, KV, L, hd] with the bias [B, 1, *, L] (its row share_row is the token's), summed over the heads. In fp32, from
    the queries and keys as given: torch's reference of what the native kernels return."""
    rows = xq[:, :, share_row::tokens].float()  # [B, KV, G, hd]
    scores = rows @ keys.float().transpose(-1, -2) * xq.shape[-1] ** -0.5 + bias[:, :, share_row, None].float()
    return scores.softmax(-1).sum(2)


def matmul_attend(xq: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """`attend` as two matmuls with the softmax on the scores in their own dtype (see `matmul_attention`)."""
    scores = torch.matmul(xq, keys.transpose(-1, -2)).mul_(xq.shape[-1] ** -0.5).add_(bias)
    return torch.matmul(scores.softmax(-1), values)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., hd] by cos / sin (broadcasting to it) in the half-split (Hugging Face) convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` of a layer's queries or keys x [B, h, q, hd] by cos / sin [B, 1, q, hd]: in one pass where the
    layer operators run (`kernels.rope`, the same bits)."""
    if kernels.fuses(x):
        return kernels.rope(x, cos[:, 0], sin[:, 0])
    return apply_rope(x, cos, sin)


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight is packed in 16 bits for the native kernel (`kernels.linear`): it
    reads each weight once per call, where torch's matmul reads them well below the memory bandwidth at the few rows
    of a decode step (benchmarks/README.md, "Packed bf16 linear layers"), and a row gets the same bits in any
    batch. `pack_linears` puts it in place of nn.Linear at load time. `fp32`: outputs in fp32 (an LM head: logits are
    wanted in fp32, and the kernel's sums are)."""

    def __init__(self, linear: nn.Linear, storage: torch.dtype, fp32: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fp32 = linear.in_features, linear.out_features, fp32
        self.packed = nn.Parameter(kernels.pack_linear(linear.weight.detach(), storage), requires_grad=False)
        # in fp32 once, as the kernel adds it to its fp32 sums (not converted in every forward)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.packed, self.out_features, self.bias, fp32=self.fp32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if kernels.fuses(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """(x + h, its norm): the residual stream's add and this norm, in one pass where the layer operators run
        (which add h into x in place)."""
        if kernels.fuses(x) and x.is_contiguous() and h.shape == x.shape:
            return x, kernels.rms_norm(h, self.weight, self.eps, residual=x)
        x = x + h
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.normed_qk = cfg.qk_norm
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps), RMSNorm(cfg.head_dim, cfg.norm_eps)
        # `attend` scales scores by head_dim^-0.5; a config's other scale is folded into the queries
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = None if scalar is None or scalar == cfg.head_dim else (cfg.head_dim / scalar) ** 0.5

    def forward(
        self,
        x: Tensor,  # [B, q, dim]
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,  # [B, 1, q, L] bool, True where visible
        bias: Tensor,  # [B, 1, G*q, L] the same mask as an additive bias (one row per token, [B, 1, q, L], natively)
        cache: Cache,
        observer: AttentionObserver | None,
        shares: SharesRecorder | None = None,
        ragged: Ragged | None = None,  # x holds the real tokens alone, [N, dim]
    ) -> Tensor:
        B, _, q, _ = mask.shape
        H, KV, hd = self.n_heads, self.n_kv, self.hd
        qkv = self.wqkv(x)
        if ragged is not None:
            qkv = ragged.pad(qkv)
        qkv = qkv.view(B, q, H + 2 * KV, hd).transpose(1, 2)  # [B, H+2KV, q, hd]
        xq, xk, xv = qkv.split((H, KV, KV), dim=1)
        if self.normed_qk:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = rotate(xq, cos, sin), rotate(xk, cos, sin)
        if self.q_scale is not None:
            xq = xq * self.q_scale
        out = self.attend_cached(xq, xk, xv, mask, bias, cache, observer, shares, ragged)
        out = out.to(x.dtype).reshape(B, H, q, hd).transpose(1, 2).reshape(B, q, H * hd)
        return self.wo(out if ragged is None else ragged.pick(out))

    def attend_cached(self, xq: Tensor, xk: Tensor, xv: Tensor, mask: Tensor, bias: Tensor, cache: Cache,
                      observer: AttentionObserver | None, shares: SharesRecorder | None = None,
                      ragged: Ragged | None = None) -> Tensor:
        """The new tokens' K/V xk, xv [B, KV, q, hd] into `cache`, and the queries xq [B, H, q, hd] (rotated, scaled)
        attending over it: [B, KV, G*q, hd] (see `attend`)."""
        B, _, q, _ = mask.shape
        keys, values, table = cache.update(self.layer, xk, xv)
        if observer is not None:
            seen = keys if table is None else gather(keys, table, mask.shape[-1])
            observer(self.layer, xq, quant.load(seen, xq.dtype) if quant.quantized(seen.dtype) else seen, mask)
        # Grouped-query attention without repeating K/V: the G query heads of a KV head become G*q rows of one
        # attention over that head, so each cached K/V element is read once.
        xq = xq.reshape(B, self.n_kv, (self.n_heads // self.n_kv) * q, self.hd)
        layer_shares = None if shares is None else shares.buffer(self.layer, (B, self.n_kv, bias.shape[-1]))
        share_row = 0 if shares is None else shares.row
        with scopes.scope(scopes.ATTENTION):
            if ragged is not None and table is not None:
                return attend_ragged(xq, keys, values, bias, table, ragged, layer_shares, share_row)
            return attend(xq, keys, values, bias, table, layer_shares, share_row, q)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        h = self.w13(x)
        if kernels.fuses(h):
            return self.w2(kernels.glu(h, self.gelu))
        gate, up = h.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(gate * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:  # Gemma: each sublayer's output is normalized before it joins the residual
            self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, bias, cache, observer, shares=None, ragged=None):
        if self._in_two_calls(x):
            return self._forward_native(x, cos, sin, mask, bias, cache, observer, shares, ragged)
        h = self.attention(self.attention_norm(x), cos, sin, mask, bias, cache, observer, shares, ragged)
        x, normed = self.ffn_norm.add_and_norm(x, self.post_attention_norm(h) if self.sandwich else h)
        h = self.feed_forward(normed)
        return x + (self.post_ffn_norm(h) if self.sandwich else h)

    def _in_two_calls(self, x: Tensor) -> bool:
        """Whether the layer runs as the path's two sublayer operators around its attention (`_forward_native`):
        where they take x (`kernels.sublayers`), over packed linear layers, and no hook (tensor parallelism's
        all-reduce) waits on a sublayer's output."""
        a, f = self.attention, self.feed_forward
        return (kernels.sublayers(x) and not (a._forward_hooks or f._forward_hooks)
                and all(isinstance(m, PackedLinear) for m in (a.wqkv, a.wo, f.w13, f.w2)))

    def _forward_native(self, x, cos, sin, mask, bias, cache, observer, shares, ragged):
        """`forward` in two native calls around the attention (`kernels.attention_in`, `kernels.attention_out`):
        the operators the modules run, in their order, so the same bits, for one dispatch each where a decode-sized
        forward paid a dozen."""
        a, f, eps = self.attention, self.feed_forward, self.attention_norm.eps  # every norm of a layer: cfg.norm_eps
        real = None if ragged is None else ragged.index
        normed_qk = (a.q_norm.weight, a.k_norm.weight) if a.normed_qk else (None, None)
        xq, xk, xv = kernels.attention_in(x, self.attention_norm.weight, eps, a.wqkv.packed, a.wqkv.bias, a.n_heads,
                                          a.n_kv, cos, sin, *normed_qk, a.q_scale, real)
        out = a.attend_cached(xq, xk, xv, mask, bias, cache, observer, shares, ragged)
        post = (self.post_attention_norm.weight, self.post_ffn_norm.weight) if self.sandwich else (None, None)
        return kernels.attention_out(x, out, xq.shape[2], a.wo.packed, post[0], self.ffn_norm.weight, eps,
                                     f.w13.packed, f.w13.out_features // 2, f.w2.packed, f.gelu, post[1], real)


class Transformer(nn.Module):
    """A Llama-family decoder. `forward(tokens [B, q], cache) -> logits`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Under tensor parallelism `cfg` is this rank's share and these hold the whole model's shape and the process
        # group (set by magicdec.distributed.apply_tp).
        self.full_cfg = cfg
        self.tp = None
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, SLIDING), persistent=False)

    def reset_rope(self, device: torch.device | str) -> None:
        """Compute the RoPE frequencies, in fp32 on `device` whatever the model's dtype (a model built on the meta
        device has none)."""
        self.inv_freq = rope_inv_freq(self.cfg).to(device)
        self.inv_freq_local = rope_inv_freq(self.cfg, SLIDING).to(device)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(
        self,
        tokens: Tensor,  # [B, q]
        cache: Cache,
        logits_at: Tensor | None = None,  # [B, n] indices into q; None: all q positions
        observer: AttentionObserver | None = None,
        head: nn.Module | None = None,  # in place of the LM head (a draft head over part of the vocabulary)
        shares: SharesRecorder | None = None,  # where attention leaves one token's shares of each position
        ragged: Ragged | None = None,  # rows whose last tokens are padding (not with logits_at)
    ) -> Tensor:
        """Run q new tokens per sequence through the model, writing their K/V into `cache`.

        Returns logits [B, n, vocab] (n = q unless `logits_at` picks positions; vocab: `head`'s outputs where one is
        given), or with `ragged` the real tokens' [N, vocab]. The cache's lengths are not advanced: the caller
        commits how many of the q tokens to keep (see `KVCache.commit`)."""
        x = self.tok_embeddings(tokens if ragged is None else ragged.pick(tokens))
        if self.cfg.scale_embeddings:  # by sqrt(dim) rounded to the model's dtype, as Gemma does
            x = x * torch.tensor(self.cfg.dim**0.5, dtype=x.dtype)
        contexts = self._layer_contexts(cache, tokens.shape[1], x.dtype)
        for layer, kind in zip(self.layers, self.cfg.kinds):
            x = layer(x, *contexts[kind], cache, observer, shares, ragged)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        logits = (self.output if head is None else head)(self.norm(x)).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layer_contexts(self, cache: Cache, q: int, dtype: torch.dtype) -> dict[str, tuple[Tensor, ...]]:
        """Per layer kind: RoPE cos/sin [B, 1, q, hd] (the kind's base), the cache's mask and its additive bias."""
        masks = cache.attn_mask(q)
        if not isinstance(masks, dict):
            if self.cfg.hybrid:
                raise TypeError("a model with sliding-window layers needs a cache that follows the layer kinds "
                                "(magicdec.kv.hybrid)")
            masks = {GLOBAL: masks}
        positions = cache.rope_positions(q)[:, None]
        native = attention_path(cache.device, cache.dtype) in ("native", "triton")  # one bias row per token
        groups = 1 if native else self.cfg.n_heads // self.cfg.n_kv_heads
        bias_dtype = quant.attention_dtype(cache.dtype, dtype)
        contexts = {}
        for kind, mask in masks.items():
            inv_freq = self.inv_freq_local if kind == SLIDING else self.inv_freq
            cos, sin = rope_cos_sin(inv_freq, positions, dtype)
            contexts[kind] = (cos, sin, mask, attention_bias(mask, groups, bias_dtype))
        return contexts


def pack_linears(model: Transformer, storage: torch.dtype | None = None) -> None:
    """Swap the model's nn.Linear layers for `PackedLinear` where the native linear kernel runs (a bf16 model on a
    CPU with AVX512-BF16, an fp32 model with AVX2 when `storage` names one of its 16-bit dtypes), and for
    `triton_linear.TritonLinear` on CUDA; elsewhere nothing changes. `storage`: the dtype the packed weights are
    stored in (None: the model's). A load-time transform: run it last (tensor parallelism shards nn.Linear weights
    first). A tied LM head gets its own packed copy of the embedding table; the head returns fp32 logits."""
    storage = storage or model.dtype
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, packed(child, storage, fp32=child is model.output))


def packed(linear: nn.Linear, storage: torch.dtype, fp32: bool = False) -> nn.Module:
    """`linear` as a `PackedLinear` whose weights are stored in `storage` (`fp32`: with fp32 outputs), where the
    native linear kernel takes it (see `pack_linears`); on CUDA as a `TritonLinear` (batch-invariant, as the packed
    kernel is); elsewhere `linear` itself."""
    weight = linear.weight
    if kernels.linear_supported(weight.device, weight.dtype, storage) and kernels.packable(linear.in_features):
        return PackedLinear(linear, storage, fp32)
    if triton_linear.supported(weight.device, weight.dtype):
        return triton_linear.TritonLinear(linear, fp32)
    return linear
