"""The end of a pipeline stage (HAPT §5, HAP inside a stage): `stage_output`, the goal of a stage's search.

A stage that is not the model's last ends in tensors the next stage receives, not in a loss. Its
subgraph (`engine.pipeline.stages.StageGraph.subgraph`) ends in one `stage_output` node whose operands are
those tensors and whose `forms` attribute says the form each must be held in at the boundary (the
form the next stage loads it in, e.g. Shard(0) for rows of the batch). Its one rule asks exactly
those forms and yields a Partial scalar, so the search's goal, the "loss" held Partial, is reached
only by programs that deliver every boundary tensor in its form. Its value is zero: it computes
nothing, and the runner returns its operands instead of running it.
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import PARTIAL, OpRule, rule


@rule("stage_output")
def stage_output_rules(node: Node, graph: Graph) -> list[OpRule]:
    forms = tuple(int(f) for f in node.attrs["forms"])
    if len(forms) != len(node.inputs):
        raise ValueError(f"{len(forms)} forms for {len(node.inputs)} operands")
    return [OpRule("boundary", forms, PARTIAL)]
