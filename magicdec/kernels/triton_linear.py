"""Batch-invariant linear layers in Triton, for CUDA: a row's output bits do not depend on the other rows.

cuBLAS picks its tiling, split-K and reduction order by the matrix shapes, so the same row multiplied in a batch of 1,
of 5 (a verification of 4 drafts) or of 64 can round differently, and greedy speculation then drifts from plain
decoding at near ties. This kernel fixes its tiles (`BLOCK_M` x `BLOCK_N`, over K in `BLOCK_K` steps, in order, no
split-K), so an output element is the same sum in the same order whatever M: the approach of SGLang's deterministic
mode and vLLM's batch-invariant mode. Rows past M are masked to zero and never mix with the others.

`pack_linears` puts `TritonLinear` in place of nn.Linear on CUDA (where `supported`); MAGICDEC_TRITON=0 turns it off
with the attention kernels. Without a GPU the kernel runs under Triton's interpreter on CPU tensors
(`tests/test_triton_linear.py`), bf16 operands widened to fp32 first, as `magicdec.kernels.triton_attention` does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from magicdec.kernels.triton_attention import switched_on, triton

#: Tile shape: fixed, so a row's arithmetic never depends on how many rows share the call.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
#: Weight dtypes the kernel reads.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers with weights of this dtype on this device run this kernel."""
    return device.type == "cuda" and dtype in DTYPES and switched_on()


def interpreted() -> bool:
    """Whether the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return triton is not None and not isinstance(_linear_kernel, triton.runtime.JITFunction)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, fp32: bool = False) -> Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) in fp32 sums, returned in x's dtype (`fp32`: in fp32)."""
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    out = torch.empty(M, N, dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](
        rows, weight, bias if bias is not None else weight, out, M, N, K,
        rows.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        UPCAST=interpreted() and weight.dtype == torch.bfloat16, IEEE=weight.dtype == torch.float32)
    return out.view(*x.shape[:-1], N)


class TritonLinear(nn.Module):
    """An nn.Linear computed by `linear`: the same weights, a row's bits independent of the batch. `fp32`: outputs in
    fp32 (an LM head)."""

    def __init__(self, layer: nn.Linear, fp32: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fp32 = layer.in_features, layer.out_features, fp32
        self.weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.fp32)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, sy,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """One BM x BN tile of y = x @ w.T (+ b), its K steps in order."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sx + ks[None, :],
                        mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :].to(tl.int64) * sw + ks[:, None],
                        mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BK, BN]: w.T's tile
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
else:
    _linear_kernel = None
