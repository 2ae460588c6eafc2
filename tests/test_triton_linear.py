"""The batch-invariant Triton linear kernel (magicdec.kernels.triton_linear) under Triton's interpreter on CPU tensors:
against torch's matmul, and a row's bits whatever the rows beside it (see tests/test_triton_attention.py for why
TRITON_INTERPRET=1 is set here, before triton is imported). On a CUDA machine benchmarks/gpu_check.py runs it."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from conftest import use_triton_interpreter

use_triton_interpreter()

from magicdec import model as model_mod  # noqa: E402
from magicdec.kernels import triton_attention, triton_linear  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def tlin() -> ModuleType:
    """The module with its kernel decorated under Triton's interpreter. It takes `triton` from triton_attention,
    which another test of this worker may have imported before TRITON_INTERPRET was set (then without triton):
    that module is reloaded first."""
    if triton_attention.triton is None:
        importlib.reload(triton_attention)
    module = triton_linear if triton_linear.interpreted() else importlib.reload(triton_linear)
    assert module.interpreted()
    return module


def operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) / K**0.5).to(dtype),
            torch.randn(N, generator=g).to(dtype))


# shapes off the 64-wide tiles in every dimension (masked edges), and a K of several steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, N, K", [(1, 72, 40), (5, 130, 200), (70, 64, 64)])
def test_matches_torch(tlin, dtype, M, N, K):
    x, w, b = operands(M, N, K, dtype)
    want = x.float() @ w.float().T + b.float()
    got = tlin.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    logits = tlin.linear(x, w, fp32=True)  # an LM head's: fp32 sums returned as they are
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ w.float().T, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_batch(tlin, dtype):
    """Rows computed alone, in a verification-sized batch, or among 100 (two row tiles) are bit-identical, as greedy
    speculation on a GPU needs: a verification row must round as the one-token step's."""
    x, w, b = operands(100, 96, 136, dtype, seed=1)
    full = tlin.linear(x, w, b)
    for rows in (slice(0, 1), slice(3, 8), slice(63, 65), slice(99, 100)):
        assert torch.equal(tlin.linear(x[rows], w, b), full[rows])
    assert torch.equal(tlin.linear(x.view(4, 25, 136), w, b).view(100, 96), full)  # leading dims flattened


def test_replaces_nn_linear_on_cuda_only(tlin, monkeypatch):
    """`pack_linears` puts TritonLinear where `supported` (CUDA, MAGICDEC_TRITON not 0), with the same weights and
    outputs; on this CPU a fp32 layer stays nn.Linear."""
    layer = torch.nn.Linear(40, 72)
    assert model_mod.packed(layer, torch.float32) is layer
    monkeypatch.setattr(model_mod.triton_linear, "supported", lambda device, dtype: True)
    swapped = model_mod.packed(layer, torch.float32)
    assert isinstance(swapped, model_mod.triton_linear.TritonLinear)
    x = torch.randn(3, 40)
    torch.testing.assert_close(swapped(x), layer(x).detach(), atol=1e-5, rtol=1e-5)
