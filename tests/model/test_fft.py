"""FFTs into (re, im) pairs (engine/model/capture.py `_c_fft`, rules in theory/fft.py): FNet's Fourier mixing, whose
transform's result may feed the next transform."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine.errors import UnsupportedOpError


class FourierMixing(nn.Module):
    """FNet's two mixings: `fftn(dim=(1, 2)).real`, and transformers' `fftn` helper, an `fft` per axis whose complex
    result feeds the next; with an inverse, a one-sided transform, and an in-place add (so the program is
    functionalized, which turns `.real` into view_as_real + select, as in FNet's capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.add_(1.0)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real
        out = h
        for axis in (2, 1):
            out = torch.fft.fft(out, axis=axis)
        back = torch.fft.ifftn(out * 0.5, dim=(0, 1), norm="ortho")
        half = torch.fft.rfft(mixed, dim=1, norm="forward")
        return mixed.pow(2).mean() + out.real.mean() + back.imag.pow(2).mean() + torch.view_as_real(half).sum()


def test_ffts_chain_as_pairs_with_rules_that_hold_on_uneven_shards_and_compute_torchs_values_and_gradients() -> None:
    from test_ecosystem import assert_lowered_like_torch

    torch.manual_seed(0)
    module, x = FourierMixing(), torch.randn(3, 5, 6, requires_grad=True)
    g = engine.load_model(module, (x,), fallback="strict")
    ffts = [n for n in g.nodes if n.op == "fft"]
    assert len(ffts) == 5 and any(n.attrs["pair"] for n in ffts) and engine.theory.missing_rules(g) == []
    assert not any(n.dtype.startswith("complex") for n in g.nodes) and "opaque" not in {n.op for n in g.nodes}
    assert_lowered_like_torch(g, module, (x,), [x, module.fc.weight], atol=1e-5, grad_rtol=1e-4)


class Sized(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x * 2, n=8).real.sum()


class Inverse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(x * 2)).sum()


def test_ffts_with_output_sizes_or_one_sided_inverses_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedOpError, match=r"aten\.fft_fft with output sizes"):
        engine.load_model(Sized(), (torch.randn(2, 6, requires_grad=True),), fallback="strict")
    with pytest.raises(UnsupportedOpError, match=r"aten\.fft_irfft of a complex tensor"):
        engine.load_model(Inverse(), (torch.randn(2, 6, requires_grad=True),), fallback="strict")
