"""The compute dtype: `dtype="auto"` from the CPU's flags; attention over a bf16 cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from magicdec import cpu
from magicdec.model import attend, attention_bias


# --- dtype="auto" ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [{"avx512f", "amx_bf16", "amx_tile"}, {"avx512f", "avx512_bf16"}])
def test_auto_picks_bf16_where_the_cpu_multiplies_bf16(monkeypatch, flags):
    monkeypatch.setattr(cpu, "bf16_matmul_speedup", lambda: 3.0)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset(flags))
    assert choice.dtype == torch.bfloat16 and choice.name == "bf16"
    assert ("amx_bf16" if "amx_bf16" in flags else "avx512_bf16") in str(choice)


def test_auto_picks_fp32_without_bf16_hardware(monkeypatch):
    def never() -> float:
        raise AssertionError("no timing needed without the flags")

    monkeypatch.setattr(cpu, "bf16_matmul_speedup", never)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset({"avx2", "fma", "avx512f"}))  # e.g. a Zen 3
    assert choice.dtype == torch.float32 and "no AMX-BF16 or AVX512-BF16" in choice.reason


def test_auto_picks_fp32_where_bf16_measures_slower(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_matmul_speedup", lambda: 0.01)
    choice = cpu.auto_dtype(torch.device("cpu"), frozenset({"avx512_bf16"}))
    assert choice.dtype == torch.float32 and "100.0x slower" in choice.reason


def test_auto_keeps_bf16_on_cuda():
    assert cpu.auto_dtype(torch.device("cuda"), frozenset()).dtype == torch.bfloat16


def test_bf16_matmul_speedup_is_measured_once():
    first = cpu.bf16_matmul_speedup()
    assert first > 0 and cpu.bf16_matmul_speedup() == first
    assert cpu.bf16_matmul_speedup.cache_info().currsize == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_and_llm_follow_auto(monkeypatch, tiny_llama, dtype):
    from magicdec.engine import LLM

    monkeypatch.setattr("magicdec.loading.auto_dtype", lambda device: cpu.DtypeChoice(dtype, "mocked"))
    llm = LLM(tiny_llama[0].source, device="cpu", dtype="auto")
    assert llm.model.dtype == dtype and llm.kv_dtype == dtype
    assert llm.loaded.dtype_choice == cpu.DtypeChoice(dtype, "mocked")
    explicit = LLM(tiny_llama[0].source, device="cpu", dtype="fp32")
    assert explicit.model.dtype == torch.float32 and explicit.loaded.dtype_choice.reason == "requested"


def test_machine_info_records_cpu_flags(monkeypatch):
    from magicdec.calibrate import machine_info

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"fma", "avx512_bf16", "sse2", "amx_bf16"}))
    assert machine_info("cpu")["cpu_flags"] == ["amx_bf16", "avx512_bf16", "fma"]


# --- bf16 attention -------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [1, 4, 9])
def test_bf16_attention_matches_sdpa_in_fp32(q):
    """The matmul path over a bf16 cache (ragged rows) against fp32 SDPA over the same values."""
    g = torch.Generator().manual_seed(q)
    B, KV, G, L, hd = 3, 3, 3, 300, 64
    xq, k, v = (torch.randn(B, KV, n, hd, generator=g).bfloat16() for n in (G * q, L, L))
    lens = torch.tensor([L - q, L - q - 50, 7])
    mask = (torch.arange(L)[None, None, None, :] <= (lens[:, None] + torch.arange(q))[:, None, :, None])
    out = attend(xq, k, v, attention_bias(mask, G, torch.bfloat16))
    ref = F.scaled_dot_product_attention(xq.float(), k.float(), v.float(), attn_mask=mask.repeat(1, 1, G, 1))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.01  # measured 0.003-0.005; a lost mask or scale gives ~1
