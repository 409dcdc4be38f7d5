"""Reduction rules (engine/theory/reduction.py): `sum` and `mean` over dim lists, keepdim or not."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import engine.model.ops
from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


@SETTINGS
@given(op=st.sampled_from(["sum", "mean"]), shape=shapes(1, 4), data=st.data(), keepdim=st.booleans(),
       ratios=ratios_st, seed=seeds)
def test_reduction_rules_hold(op: str, shape: tuple[int, ...], data: st.DataObject, keepdim: bool,
                              ratios: list[float], seed: int) -> None:
    dims = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    node, g = one_op(op, [shape], {"dims": dims, "keepdim": keepdim})
    check_all(node, g, ratios, seed)


def test_reduction_rule_forms() -> None:
    node, g = one_op("sum", [(4, 5, 6)], {"dims": [1], "keepdim": False})
    assert node.shape == (4, 6)
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0), ((1,), PARTIAL), ((2,), 1)}
    node, g = one_op("mean", [(4, 5, 6)], {"dims": [0, 2], "keepdim": True})
    assert node.shape == (1, 5, 1)
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), PARTIAL), ((1,), 1), ((2,), PARTIAL)}


def test_mean_over_sharded_dim_uses_global_count() -> None:
    node, g = one_op("mean", [(5, 6)], {"dims": [0], "keepdim": False})
    [r] = [r for r in check_all(node, g, UNEVEN) if r.rule.startswith("{S(0)}")]
    assert r.ok


def test_a_local_size_mean_would_be_caught(monkeypatch) -> None:
    """If the executor divided by the local (shard) size, the S(d)-reduced -> P rule must fail the check."""

    def local_mean(node, graph, x):
        out = x.sum(dim=node.attrs["dims"], keepdim=node.attrs["keepdim"])
        if node.op == "mean":
            out = out / max(1, int(torch.tensor([x.shape[d] for d in node.attrs["dims"]]).prod()))
        return out

    monkeypatch.setattr(engine.model.ops, "_reduce", local_mean)
    node, g = one_op("mean", [(5, 6)], {"dims": [0], "keepdim": False}, out_shape=(6,))
    assert check_rule(node, g, OpRule("reduce_sharded", (0,), PARTIAL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("replicate", (FULL,), FULL), UNEVEN).ok is True  # the full run is still right


def test_checker_rejects_wrong_reduction_rules() -> None:
    node, g = one_op("sum", [(4, 6)], {"dims": [1], "keepdim": True})
    assert check_rule(node, g, OpRule("reduced-as-shard", (1,), 1), UNEVEN).ok is False
    node, g = one_op("sum", [(4, 6)], {"dims": [1], "keepdim": False})
    assert check_rule(node, g, OpRule("reduced-as-full", (1,), FULL), UNEVEN).ok is False
    node, g = one_op("mean", [(4, 6)], {"dims": [0, 1], "keepdim": False})
    assert check_rule(node, g, OpRule("reduced-as-full", (0,), FULL), UNEVEN).ok is False
