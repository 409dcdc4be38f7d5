"""A forced duplex is a constraint, not a gamble (issue 28, item 6): the duplex search space holds
only programs the runner's two half-batch streams can run, and each half keeps the plan's shard
sizes where they do not follow the batch (engine/spmd/duplex_space.py, engine/spmd/halves.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import cluster_dict

import engine
from engine.errors import PlanError
from engine.options import PlanOptions
from engine.spmd.cost import CostModel
from engine.spmd.duplex_space import batch_sized_dims, duplex_space, links_batch_to_fixed
from engine.spmd.halves import capture_at, half_plan
from engine.spmd.iteration import plan_of
from engine.spmd.program import COMPUTE, LOAD
from engine.spmd.sizes import shard_classes, shard_key
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import OpRule, op_rules


def _node(graph, name: str) -> int:
    return next(n.id for n in graph.nodes if n.name == name)


def test_batch_sized_dims_are_the_dims_half_the_batch_changes(tiny_mlp):
    dims = batch_sized_dims(tiny_mlp)
    assert (_node(tiny_mlp, "x"), 0) in dims and (_node(tiny_mlp, "relu"), 0) in dims
    assert (_node(tiny_mlp, "x"), 1) not in dims and (_node(tiny_mlp, "relu"), 1) not in dims
    assert not any(t == p.id for t, _ in dims for p in tiny_mlp.parameters)


def test_the_space_leaves_out_rules_linking_the_batch_to_a_fixed_dim_and_hierarchical_collectives(tiny_mlp):
    """The linear's own rules (batch, column, row) stay; a rule that would split a weight's rows like
    the batch is left out, so no weight's shard can differ between the halves."""
    mm = _node(tiny_mlp, "linear_mm")
    dims = batch_sized_dims(tiny_mlp)
    assert not any(links_batch_to_fixed(tiny_mlp, dims, mm, r) for r in op_rules(tiny_mlp[mm], tiny_mlp))
    tied = OpRule("tied", (0, 0), 0)  # x on its batch dim and the weight on its rows, linked
    space = duplex_space(tiny_mlp, SearchSpace())
    assert links_batch_to_fixed(tiny_mlp, dims, mm, tied) and not space.rule_filter(mm, tied)
    assert all(space.rule_filter(mm, r) for r in op_rules(tiny_mlp[mm], tiny_mlp))
    assert space.collectives == SearchSpace().collectives - {"all_reduce.hier", "reduce_scatter.hier",
                                                               "all_gather.hier"}
    narrowed = duplex_space(tiny_mlp, SearchSpace(rule_filter=lambda node, r: r.name != "column"))
    assert not any(narrowed.rule_filter(mm, r) for r in op_rules(tiny_mlp[mm], tiny_mlp) if r.name == "column")


def _column_plan(graph):
    """The tiny MLP with its first weight split by rows (linear.column), on two even devices."""
    cluster = engine.load_cluster(cluster_dict([1e10, 1e10]))
    weight = _node(graph, "p_layers_0_weight")
    space = SearchSpace(param_forms=lambda n, f: n != weight or f == 0)
    cm = CostModel(graph, cluster, [0.5, 0.5], PlanOptions(optimizer="sgd"))
    return plan_of(synthesize(graph, cm, space=space).program, graph, cluster, [0.5, 0.5]), weight


def test_a_half_keeps_the_plans_sizes_of_batch_free_dims(tiny_mlp):
    """The plan stores the LP's ratios rounded and then the ratios those sizes realise, which need not
    round back to the same sizes: a half takes a batch-free class's sizes from the plan (the weights
    are shared by the halves) and splits only the batch-sized dims at the half's batch."""
    plan, weight = _column_plan(tiny_mlp)
    seg = plan.segmentation
    cls = next(c for c in shard_classes(plan.program, tiny_mlp, seg) if (weight, 0, 0) in c)
    stored = {**plan.shard_sizes, **{shard_key(tiny_mlp, seg, t, d, k): [5, 3] for t, d, k in cls}}
    plan = replace(plan, shard_sizes=stored)  # not what ratios 0.5/0.5 round to
    half = half_plan(plan, capture_at(tiny_mlp, 2))
    assert half.shard_sizes["p_layers_0_weight:0"] == [5, 3] == half.shard_sizes["relu:1"]
    assert half.shard_sizes["linear_1:0"] == [1, 1] and plan.shard_sizes["linear_1:0"] == [2, 2]


def test_a_half_refuses_a_weight_linked_to_the_batch(tiny_mlp):
    """A program whose instruction links a weight's dim to the batch (no rule of the theory does, and
    the duplex space leaves such rules out) is still refused by the halves, naming the weight."""
    plan, _ = _column_plan(tiny_mlp)
    mm, x, w = _node(tiny_mlp, "linear_mm"), _node(tiny_mlp, "x"), _node(tiny_mlp, "p_layers_0_weight")
    program = tuple(replace(i, pre=((x, 0), (w, 0)), post=0) if i.kind == COMPUTE and i.node == mm else
                    replace(i, post=0) if i.kind == LOAD and i.node == x else i for i in plan.program)
    with pytest.raises(PlanError, match="'p_layers_0_weight' is linked to the batch"):
        half_plan(replace(plan, program=program), capture_at(tiny_mlp, 2))

