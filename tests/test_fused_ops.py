"""Fused Triton ops equal their torch references (CPU: Triton's interpreter; GPU: natively, bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import spruce.ops.fused as F  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def force_triton():
    F._FORCE_TRITON[0] = True
    yield
    F._FORCE_TRITON[0] = False


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype).to(DEVICE)
    out, res = F.add_rms_norm(x, r, w, 1e-5)
    s = x + r
    assert torch.equal(res, s)
    ref = F.rms_norm_reference(s, w, 1e-5)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert (F.rms_norm(x, w, 1e-5).float() - F.rms_norm_reference(x, w, 1e-5).float()).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    from spruce.models.rope import Rotary

    rot = Rotary(32, 128, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, 32, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 3, 17, 64, 127], device=DEVICE)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    ref = F.rotary_reference(x, cos, sin, pos)
    out = F.rotary_(x.clone(), cos, sin, pos)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 2 * 80, generator=g).to(dtype).to(DEVICE)
    out = F.silu_and_mul(x)
    ref = F.silu_and_mul_reference(x)
    assert (out.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_empty_inputs():
    w = torch.ones(16, device=DEVICE)
    assert F.rms_norm(torch.zeros(0, 16, device=DEVICE), w, 1e-5).shape == (0, 16)
    assert F.silu_and_mul(torch.zeros(0, 32, device=DEVICE)).shape == (0, 16)
