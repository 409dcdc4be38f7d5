"""Shape rules (engine/theory/shape.py): `cat`, `narrow`, `select`, `expand`, and their capture."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import engine
from engine.model.ops import run_node
from engine.theory import missing_rules
from engine.theory.check import check_node, check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


@SETTINGS
@given(shape=shapes(1, 4), data=st.data(), ratios=ratios_st, seed=seeds)
def test_cat_rules_hold(shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    sides = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    operands = [shape[:dim] + (s,) + shape[dim + 1:] for s in sides]
    node, g = one_op("cat", operands, {"dim": dim})
    check_all(node, g, ratios, seed)
    assert all(dim not in ins and out != dim for ins, out in rule_set(node, g)), "the cat dim stays whole"


@SETTINGS
@given(shape=shapes(1, 4, min_side=2), data=st.data(), ratios=ratios_st, seed=seeds)
def test_narrow_rules_hold(shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    start = data.draw(st.integers(0, shape[dim] - 1))
    end = data.draw(st.integers(start + 1, shape[dim]))
    step = data.draw(st.integers(1, 3))
    node, g = one_op("narrow", [shape], {"dim": dim, "start": start, "end": end, "step": step})
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(1, 4), data=st.data(), ratios=ratios_st, seed=seeds)
def test_select_rules_hold(shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    index = data.draw(st.integers(0, shape[dim] - 1))
    node, g = one_op("select", [shape], {"dim": dim, "index": index})
    assert node.shape == shape[:dim] + shape[dim + 1:]
    check_all(node, g, ratios, seed)


@st.composite
def expand_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An operand shape with some size-1 dims and a target with those dims (and new leading ones) grown."""
    out = draw(shapes(1, 4, max_side=5))
    keep = draw(st.integers(1, len(out)))
    src = tuple(1 if draw(st.booleans()) else s for s in out[len(out) - keep:])
    return src, out


@SETTINGS
@given(pair=expand_pair(), ratios=ratios_st, seed=seeds)
def test_expand_rules_hold(pair: tuple, ratios: list[float], seed: int) -> None:
    src, out = pair
    node, g = one_op("expand", [src], {"shape": list(out)}, out_shape=out)
    check_all(node, g, ratios, seed)


def test_shape_rule_forms() -> None:
    cat, g = one_op("cat", [(4, 2, 6), (4, 3, 6)], {"dim": 1})
    assert rule_set(cat, g) == {((FULL, FULL), FULL), ((PARTIAL, PARTIAL), PARTIAL), ((0, 0), 0), ((2, 2), 2)}
    sel, g = one_op("select", [(4, 5, 6)], {"dim": 1, "index": 0})
    assert rule_set(sel, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0), ((2,), 1)}
    exp, g = one_op("expand", [(1, 1, 8)], {"shape": [6, 1, 8]}, out_shape=(6, 1, 8))
    assert rule_set(exp, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((FULL,), 0), ((2,), 2)}
    check_all(exp, g, UNEVEN)


def test_checker_rejects_wrong_shape_rules() -> None:
    cat, g = one_op("cat", [(4, 6), (4, 6)], {"dim": 0})
    assert check_rule(cat, g, OpRule("cat-dim", (0, 0), 0), UNEVEN).ok is False
    nar, g = one_op("narrow", [(6, 4)], {"dim": 0, "start": 1, "end": 5, "step": 1})
    assert check_rule(nar, g, OpRule("own-dim", (0,), 0), UNEVEN).ok is False
    sel, g = one_op("select", [(6, 4)], {"dim": 1, "index": 2})
    assert check_rule(sel, g, OpRule("mixed", (PARTIAL,), FULL), UNEVEN).ok is False
    exp, g = one_op("expand", [(1, 4)], {"shape": [6, 4]}, out_shape=(6, 4))
    assert check_rule(exp, g, OpRule("partial-from-full", (FULL,), PARTIAL), UNEVEN).ok is False


class Pieces(nn.Module):
    """A class token, concatenation, chunk/split/unbind and indexing, as ViTs and BERTs write them."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 3, 8)
        a, b = t.chunk(2, dim=2)
        c, d = torch.split(t, [3, 5], dim=2)
        e, f = torch.split(t, 5, dim=-1)
        t = torch.cat([a, b], dim=2) + torch.cat([c, d], 2) + torch.cat([e, f], -1)
        first, _, last = t.unbind(1)
        z = t[:, 0] + t[:, 1:2].sum(1) + t.narrow(2, 0, 8).mean(1) + first * last + t[:, -2:, ::2].sum((1, 2))[:, None]
        return nn.functional.cross_entropy(self.fc(z), y)


def test_shape_operators_capture_and_every_rule_holds() -> None:
    module = Pieces()
    x, y = torch.randn(6, 2, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    g = engine.load_model(module, (x, y))
    ops = {n.op for n in g.nodes}
    assert {"cat", "narrow", "select", "expand"} <= ops
    assert missing_rules(g) == []
    for n in g.nodes:
        if not n.is_leaf:
            results = check_node(n, g, UNEVEN)
            assert all(r.ok for r in results), [str(r) for r in results if not r.ok]
    assert _replay(g, module, x, y) == pytest.approx(float(module(x, y)), rel=1e-6)


def _replay(g: engine.Graph, module: nn.Module, *inputs: torch.Tensor) -> float:
    """Run the captured graph with the reference executor on the module's own parameters."""
    params = dict(module.named_parameters())
    vals: list[torch.Tensor] = []
    for n in g.nodes:
        if n.op == "parameter":
            vals.append(params[n.attrs["target"]].detach())
        elif n.op == "placeholder":
            vals.append(inputs[n.attrs["index"]])
        else:
            vals.append(run_node(n, g, [vals[i] for i in n.inputs], n.shape))
    return float(vals[g.loss])
