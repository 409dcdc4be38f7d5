"""Loss rules (engine/theory/loss.py): mean `cross_entropy` and `mse_loss` give Partial on sharded samples."""
from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.model.ops import run_node
from engine.theory.check import check_rule

from ._helpers import (FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, dim_size, one_op, ratios_st, rule_set, seeds,
                       shapes)


def _ce(n: int, v: int):
    return one_op("cross_entropy", [((n, v), "float64"), ((n,), "int64")], {"count": n})


def _mse(shape: tuple[int, ...]):
    return one_op("mse_loss", [shape, shape], {"count": math.prod(shape)})


@SETTINGS
@given(n=dim_size, v=st.integers(2, 6), ratios=ratios_st, seed=seeds)
def test_cross_entropy_rules_hold(n: int, v: int, ratios: list[float], seed: int) -> None:
    node, g = _ce(n, v)
    assert node.shape == ()
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(1, 4), ratios=ratios_st, seed=seeds)
def test_mse_rules_hold(shape: tuple[int, ...], ratios: list[float], seed: int) -> None:
    node, g = _mse(shape)
    assert node.shape == ()
    check_all(node, g, ratios, seed)


def test_loss_rule_forms() -> None:
    node, g = _ce(8, 5)
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, 0), PARTIAL)}
    node, g = _mse((4, 1, 3))
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((0, 0), PARTIAL), ((2, 2), PARTIAL)}


def test_checker_rejects_wrong_loss_rules() -> None:
    node, g = _ce(8, 5)
    assert check_rule(node, g, OpRule("samples-as-full", (0, 0), FULL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("full-as-partial", (FULL, FULL), PARTIAL), UNEVEN).ok is False  # m copies
    node, g = _mse((4, 6))
    assert check_rule(node, g, OpRule("partial-inputs", (PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False



def _ce_counted(n: int, v: int):
    """Captured cross-entropy: logits, targets and the Full count of targets that are not ignored."""
    return one_op("cross_entropy", [((n, v), "float64"), ((n,), "int64"), ((), "int64")], {"ignore_index": -100})


@SETTINGS
@given(n=dim_size, v=st.integers(2, 6), ratios=ratios_st, seed=seeds)
def test_cross_entropy_with_a_count_operand_rules_hold(n: int, v: int, ratios: list[float], seed: int) -> None:
    node, g = _ce_counted(n, v)
    check_all(node, g, ratios, seed)
    assert rule_set(node, g) == {((FULL,) * 3, FULL)} | ({((0, 0, FULL), PARTIAL)} if n >= 2 else set())


def test_the_count_must_be_the_whole_batchs() -> None:
    node, g = _ce_counted(8, 5)
    assert check_rule(node, g, OpRule("count-addends", (0, 0, PARTIAL), PARTIAL), UNEVEN).ok is False


class _Flat(torch.nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@SETTINGS
@given(rows=st.integers(2, 9), ratios=ratios_st, seed=seeds)
def test_sharded_mean_with_ignored_targets_is_exact(rows: int, ratios: list[float], seed: int) -> None:
    """The captured chain ne -> sum -> (all-reduce) -> cross_entropy on split samples sums to torch's
    mean over the targets that are not -100, whatever their number and place (all ignored: nan both)."""
    import engine
    from engine.theory.check import split_sizes

    gen = torch.Generator().manual_seed(seed)
    logits, target = torch.randn(rows, 5, generator=gen, dtype=torch.float64), torch.randint(0, 5, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) < 0.4] = -100
    g = engine.load_model(_Flat(), (logits.float(), target))
    loss = g[g.loss]
    count, kept = g[loss.inputs[2]], g[g[loss.inputs[2]].inputs[0]]
    sizes = split_sizes(rows, ratios)
    shards = list(zip(torch.split(logits, sizes), torch.split(target, sizes)))
    total = sum(run_node(count, g, [run_node(kept, g, [t], t.shape)], ()) for _, t in shards)  # the all-reduce
    addends = [run_node(loss, g, [x, t, total], ()) for x, t in shards]
    expected = torch.nn.functional.cross_entropy(logits, target)
    assert torch.allclose(sum(addends), expected, equal_nan=True)
