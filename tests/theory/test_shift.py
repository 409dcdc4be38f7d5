"""Shift rules (engine/theory/shift.py): `roll`, and its capture beside constant `pad` (Swin)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import engine
from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


@SETTINGS
@given(shape=shapes(1, 4, min_side=2), data=st.data(), ratios=ratios_st, seed=seeds)
def test_roll_rules_hold(shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), max_size=2, unique_by=lambda d: d % len(shape)))
    shifts = data.draw(st.lists(st.integers(-5, 5), min_size=max(1, len(dims)), max_size=max(1, len(dims))))
    node, g = one_op("roll", [shape], {"shifts": shifts, "dims": dims})
    check_all(node, g, ratios, seed, min_rules=2)
    moved = set(range(len(shape))) if not dims else {d % len(shape) for d in dims}
    assert all(ins[0] not in moved for ins, _ in rule_set(node, g)), "a rolled dim stays whole"


def test_shift_rule_forms() -> None:
    roll, g = one_op("roll", [(4, 5, 6)], {"shifts": [2, -1], "dims": [1, 2]})
    assert rule_set(roll, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0)}
    flat, g = one_op("roll", [(4, 5)], {"shifts": [3], "dims": []})
    assert rule_set(flat, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL)}, "a flat roll moves every dim"


def test_checker_rejects_wrong_shift_rules() -> None:
    roll, g = one_op("roll", [(6, 4)], {"shifts": [1], "dims": [0]})
    assert check_rule(roll, g, OpRule("shard", (0,), 0), UNEVEN).ok is False


class Shifted(nn.Module):
    """Swin's shifted window in miniature: pad to whole windows, roll, a linear map, roll back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.pad(x, (0, 0, 0, 1))  # (B, 5, 4): the window dim padded from 4 to 5
        h = torch.roll(self.fc(torch.roll(h, shifts=2, dims=1)), shifts=-2, dims=1)
        return F.mse_loss(h.flatten(1), y)


def test_roll_and_pad_capture_with_rules_and_plan_batch_parallel() -> None:
    g = engine.load_model(Shifted(), (torch.randn(6, 4, 4), torch.randn(6, 20)), fallback="strict")
    ops = [n.op for n in g.nodes]
    assert ops.count("roll") == 2 and ops.count("pad") == 1 and "opaque" not in ops
    pad = next(n for n in g.nodes if n.op == "pad")
    assert pad.attrs == {"pad": [0, 0, 0, 1], "value": 0.0} and pad.shape == (6, 5, 4)
    roll = next(n for n in g.nodes if n.op == "roll")
    assert roll.attrs == {"shifts": [2], "dims": [1]}
    p = engine.plan(g, engine.load_cluster("sample_clusters/cpu_4_uneven.json"))
    sharded = {ins.node for ins in p.program if ins.kind == "compute" and ins.post >= 0}
    assert {n.id for n in g.nodes if n.op in ("roll", "pad")} <= sharded, "shifts run on batch shards"


def test_the_runner_emits_roll() -> None:
    """Every rank's generated program of a plan with roll builds (Swin failed with 'no emitter')."""
    from runner.program import build_rank_program

    g = engine.load_model(Shifted(), (torch.randn(6, 4, 4), torch.randn(6, 20)))
    p = engine.plan(g, engine.load_cluster("sample_clusters/cpu_4_uneven.json"))
    for rank in range(4):
        assert "roll" in build_rank_program(p, rank).module.code
