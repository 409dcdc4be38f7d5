"""A forced duplex is a constraint, not a gamble (issue 28, item 6): the duplex search space holds
only programs the runner's two half-batch streams can run, and each half keeps the plan's shard
sizes where they do not follow the batch (engine/spmd/duplex_space.py, engine/spmd/halves.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import ZOO_SMALL, cluster_dict

import engine
from engine.errors import PlanError
from engine.options import PlanOptions
from engine.spmd.cost import CostModel
from engine.spmd.duplex_space import (batch_sized_dims, captured_batch_dims, duplex_space, links_batch_to_fixed,
                                      propagated_batch_dims)
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



# --- the batch-sized dims read off the rules --------------------------------------------------------------------

PROPAGATED = {**ZOO_SMALL, "vgg19": {**ZOO_SMALL["vgg19"], "batch_norm": False},
              "gpt_issue": {"zoo": "gpt", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 16,
                            "batch": 16}}
"""Every zoo family at test sizes where some dims equal the batch without following it (vgg19 without batch
norm: training-mode batch norm ties the batch to the channels, and duplex refuses it anyway), and issue 28's gpt,
whose batch, sequence and head dim are all 16."""


@pytest.mark.parametrize("name", sorted(PROPAGATED))
def test_the_rules_tell_the_batch_sized_dims_of_every_zoo_model_as_a_capture_at_half_the_batch_does(name):
    """The duplex space no longer needs the model captured at half its batch (seconds at 24 layers) where the rules
    tell which dims follow the batch, and they must tell exactly the dims that capture finds."""
    knobs = dict(PROPAGATED[name])
    graph = engine.load_model(f"zoo:{knobs.pop('zoo', name)}", **knobs)
    propagated = propagated_batch_dims(graph)
    assert propagated is not None
    assert propagated == captured_batch_dims(graph)
    assert batch_sized_dims(graph) == propagated


def _with_batch(graph, batch: int):
    return replace(graph, origin={"inputs": {"batch": batch}})


class _FoldsTheBatchBelow(torch.nn.Module):
    """Transposes its activations and flattens them with the batch as the minor factor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 5)

    def forward(self, x):
        return (self.linear(x).t().reshape(-1) ** 2).sum()


class _ExpandsToTheBatch(torch.nn.Module):
    """Expands a [1, 6] buffer to the batch from the input's size, which the graph keeps only as a number."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.register_buffer("offsets", torch.arange(6.0).reshape(1, 6))

    def forward(self, x):
        return (self.linear(x) ** 2).sum() + self.offsets.expand(x.shape[0], 6).cumsum(0).sum()


@pytest.mark.parametrize("module", [_FoldsTheBatchBelow, _ExpandsToTheBatch])
def test_where_the_rules_cannot_tell_the_batch_sized_dims_are_left_to_the_capture(module):
    """A view that folds the batch below another dim (no rule splits the batch there, yet the merged dim follows
    it), and a dim an operator makes from a number (expand to x.shape[0]) that no rule links onward: the rules
    cannot tell whether they follow the batch, so the answer is None and `batch_sized_dims` captures."""
    graph = _with_batch(engine.load_model(module(), (torch.randn(4, 6),)), 4)
    assert propagated_batch_dims(graph) is None
