"""`runner.optim.total_norm`: the global gradient norm every clip and metric uses, against an fp64 sum."""

from __future__ import annotations

import torch

from runner.optim import NORM_ROW, total_norm


def _exact(grads: list[torch.Tensor]) -> float:
    return float(sum(g.double().square().sum() for g in grads).sqrt())


def test_total_norm_matches_the_fp64_sum_across_rows_tails_and_layouts() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1024, 1024, generator=gen) * 3.0,  # whole rows only
             torch.randn(NORM_ROW * 2 + 17, generator=gen),  # rows and a tail
             torch.randn(5, generator=gen),  # a tail only
             torch.randn(300, 700, generator=gen).t(),  # not contiguous
             torch.randn(64, 64, generator=gen).to(torch.bfloat16)]  # low precision, accumulated in fp32
    got = float(total_norm(grads))
    want = _exact(grads)
    assert abs(got - want) <= 2e-7 * want  # fp32 output: within about one ulp of the fp64 sum
    assert got == float(total_norm(g.clone() for g in grads))  # deterministic, takes any iterable


def test_total_norm_of_nothing_and_of_zeros_is_zero() -> None:
    assert float(total_norm([])) == 0.0
    assert float(total_norm([torch.zeros(NORM_ROW * 3)])) == 0.0
