"""Shared helpers of the theory tests: hand-built one-operator graphs and hypothesis strategies.

A test graph holds leaves (placeholders) followed by exactly one compute node, the node under test.
Leaves of a float dtype get float64 random data in the checker, leaves of an int dtype get ids in
{0, 1}; so index-like operands (embedding ids, cross-entropy targets) are declared "int64".
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from engine.model.graph import Graph, Node
from engine.model.ops import run_node
from engine.theory import FULL, PARTIAL, OpRule, op_rules
from engine.theory.check import CheckResult, check_rule

# HAP_TEST_EXAMPLES=500 for a deeper (slower) search; 25 keeps the suite fast
SETTINGS = settings(max_examples=int(os.environ.get("HAP_TEST_EXAMPLES", "25")), deadline=None, suppress_health_check=[HealthCheck.too_slow])

dim_size = st.integers(1, 6)
ratios_st = st.lists(st.floats(0.05, 1.0, allow_nan=False, allow_infinity=False), min_size=2, max_size=4)
seeds = st.integers(0, 2**16)
UNEVEN = [0.5, 0.3, 0.2]


def shapes(min_rank: int = 1, max_rank: int = 4, min_side: int = 1, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


def leaf(i: int, shape: Sequence[int], dtype: str = "float64", op: str = "placeholder") -> Node:
    return Node(id=i, name=f"in{i}", op=op, inputs=(), shape=tuple(int(s) for s in shape), dtype=dtype)


def _dummy(shape: Sequence[int], dtype: str) -> torch.Tensor:
    if dtype.startswith("int"):
        return torch.zeros(tuple(shape), dtype=torch.int64)
    return torch.randn(tuple(shape), dtype=torch.float64)


def one_op(op: str, operands: Sequence[tuple[Sequence[int], str] | Sequence[int]], attrs: dict[str, Any] | None = None,
           out_shape: Sequence[int] | None = None, dtype: str = "float64") -> tuple[Node, Graph]:
    """A graph `leaves -> op`; the output shape is inferred by running the executor unless given."""
    specs = [(tuple(o[0]), o[1]) if len(o) == 2 and isinstance(o[1], str) else (tuple(o), "float64") for o in operands]
    leaves = [leaf(i, s, dt) for i, (s, dt) in enumerate(specs)]
    attrs = dict(attrs or {})
    n = len(leaves)
    if out_shape is None:
        probe = Node(id=n, name=op, op=op, inputs=tuple(range(n)), shape=(), dtype=dtype, attrs=attrs)
        g0 = Graph(nodes=tuple(leaves) + (probe,), loss=n)
        out_shape = tuple(run_node(probe, g0, [_dummy(s, dt) for s, dt in specs], ()).shape)
    node = Node(id=n, name=op, op=op, inputs=tuple(range(n)), shape=tuple(out_shape), dtype=dtype, attrs=attrs)
    return node, Graph(nodes=tuple(leaves) + (node,), loss=n)


def check_all(node: Node, graph: Graph, ratios: Sequence[float], seed: int = 0, min_rules: int = 1) -> list[CheckResult]:
    """Assert that every rule the registry returns for `node` holds numerically; returns the results."""
    rules = op_rules(node, graph)
    assert len(rules) >= min_rules, f"{node.op}: expected at least {min_rules} rules, got {[str(r) for r in rules]}"
    results = [check_rule(node, graph, r, ratios, seed) for r in rules]
    bad = [str(r) for r in results if not r.ok]
    shapes_ = [graph[i].shape for i in node.inputs]
    assert not bad, f"{node.op} {node.attrs} inputs {shapes_} -> {node.shape}, ratios {list(ratios)}: wrong rules: {bad}"
    return results


def rule_set(node: Node, graph: Graph) -> set[tuple[tuple[int, ...], int]]:
    return {(r.inputs, r.output) for r in op_rules(node, graph)}


def rules_named(node: Node, graph: Graph, name: str) -> list[OpRule]:
    return [r for r in op_rules(node, graph) if r.name == name]


def sharded_dims_of_input(node: Node, graph: Graph, k: int = 0) -> set[int]:
    return {r.inputs[k] for r in op_rules(node, graph) if r.inputs[k] >= 0}


__all__ = ["SETTINGS", "dim_size", "ratios_st", "seeds", "UNEVEN", "shapes", "leaf", "one_op", "check_all",
           "rule_set", "rules_named", "sharded_dims_of_input", "FULL", "PARTIAL", "OpRule"]
