"""as_strided lowered as ruled views (engine/model/strided.py): Longformer's and LED's overlapping attention chunks."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
from engine.errors import UnsupportedOpError
from engine.model.strided import NotAView, as_strided_steps


def _apply(steps: list, x: torch.Tensor) -> torch.Tensor:
    """The chain on a real tensor, each step's shape checked."""
    for op, attrs, shape in steps:
        if op == "view":
            x = x.reshape(attrs["shape"])
        elif op == "permute":
            x = x.permute(attrs["dims"])
        elif op == "narrow":
            x = x[(slice(None),) * attrs["dim"] + (slice(attrs["start"], attrs["end"], attrs["step"]),)]
        elif op == "unfold":
            x = x.unfold(attrs["dim"], attrs["size"], attrs["step"])
        else:
            assert op == "expand"
            x = x.expand(attrs["shape"])
        assert tuple(x.shape) == shape, (op, attrs)
    return x


def test_the_chain_reads_what_as_strided_reads_on_random_strides_of_permuted_operands() -> None:
    rng, checked = random.Random(0), 0
    while checked < 400:
        base = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        perm = rng.sample(range(len(base)), len(base))
        x = torch.arange(float(torch.tensor(base).prod())).reshape(base).permute(perm)
        size = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        stride = [rng.choice([0, 1, 2, 3, 4, 6, 8, 12]) for _ in size]
        offset = rng.randint(0, 3)
        if offset + sum((n - 1) * s for n, s in zip(size, stride)) >= x.numel():
            continue
        steps = as_strided_steps(tuple(x.shape), x.stride(), 0, tuple(size), tuple(stride), offset)
        assert torch.equal(_apply(steps, x), x.as_strided(size, stride, offset)), (x.shape, x.stride(), size, stride)
        checked += 1


def test_longformer_chunks_are_one_unfold_and_a_permute() -> None:
    """`_chunk` (chunks of 2w overlapping by w) and the value chunks of 3w every w: unfold along the sequence."""
    x = torch.randn(6, 4, 8, 3)  # (batch * heads, chunks, 2w, head dim), w = 4
    steps = as_strided_steps(tuple(x.shape), x.stride(), 0, (6, 7, 8, 3), (96, 12, 3, 1), 0)
    assert [op for op, _, _ in steps] == ["view", "unfold", "permute"]
    assert steps[1][1] == {"dim": 1, "size": 8, "step": 4}
    assert torch.equal(_apply(steps, x), x.as_strided((6, 7, 8, 3), (96, 12, 3, 1)))


def test_reads_outside_the_operand_or_of_an_operand_that_is_not_dense_have_no_chain() -> None:
    with pytest.raises(NotAView, match="outside"):
        as_strided_steps((4, 3), (3, 1), 0, (4, 3), (4, 1), 0)
    with pytest.raises(NotAView, match="not dense"):
        as_strided_steps((4, 3), (0, 1), 0, (2, 3), (3, 1), 0)  # an expanded operand


class SlidingChunks(nn.Module):
    """Longformer's sliding-window scores: queries and keys cut into chunks of 2w overlapping by w with as_strided,
    a product per chunk, and values padded by w on both sides read in chunks of 3w every w."""

    def __init__(self, w: int = 2) -> None:
        super().__init__()
        self.w, self.q, self.v = w, nn.Linear(4, 4), nn.Linear(4, 4)

    def chunk(self, h: torch.Tensor) -> torch.Tensor:
        h = h.view(h.size(0), h.size(1) // (2 * self.w), 2 * self.w, h.size(2))
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return h.as_strided(size=size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).transpose(0, 1).reshape(x.shape[1], x.shape[0], 4).transpose(0, 1)  # (batch, seq, dim), strided
        scores = torch.einsum("bcxd,bcyd->bcxy", self.chunk(q.contiguous()), self.chunk(self.q(x)))
        padded = F.pad(self.v(x), (0, 0, self.w, self.w), value=-1)
        n, s = padded.shape[1] // self.w - 2, padded.stride()
        values = padded.as_strided((x.shape[0], n, 3 * self.w, 4), (s[0], self.w * s[1], s[1], s[2]))
        return scores.pow(2).mean() + values.sin().mean()


def test_sliding_chunks_capture_with_rules_and_compute_torchs_values_and_gradients() -> None:
    from test_ecosystem import assert_lowered_like_torch

    torch.manual_seed(0)
    module, x = SlidingChunks(), torch.randn(3, 8, 4, requires_grad=True)
    g = engine.load_model(module, (x,), fallback="strict")
    assert "unfold" in {n.op for n in g.nodes} and engine.theory.missing_rules(g) == []
    assert_lowered_like_torch(g, module, (x,), [x, module.q.weight, module.v.weight],
                              checked=("unfold", "narrow", "permute"))


class Overread(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).expand(2, 4, 3).as_strided((2, 3), (3, 1)).sum()


def test_an_as_strided_that_is_no_window_view_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedOpError, match=r"aten\.as_strided .*no window view of its operand: .*not dense"):
        engine.load_model(Overread(), (torch.randn(4, 3),), fallback="strict")
