"""The mechanical rule checker: run a rule on simulated shards and compare with the full result.

For m simulated devices and given ratios, inputs are built to satisfy the precondition (slices for
`Shard`, copies for `Full`, random addends for `Partial`), the operator runs on every device's
local tensors, and the postcondition is checked against the single-device output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.model.graph import Graph, Node
from engine.model.ops import run_node
from engine.theory.core import FULL, PARTIAL, Form, OpRule, form_str, split_sizes

DOMAINS = {
    **dict.fromkeys(("sqrt", "rsqrt", "log", "log2", "log10", "log1p", "pow"), lambda t: t.abs() + 0.1),
    "acosh": lambda t: t.abs() + 1.1,
    **dict.fromkeys(("asin", "acos", "atanh"), lambda t: torch.tanh(t) * 0.9),
}
"""Operators defined on part of the reals: random operands are mapped into their domain."""


@dataclass
class CheckResult:
    node: str
    rule: str
    ok: bool
    max_error: float

    def __str__(self) -> str:
        return f"{self.node}: {self.rule}: {'ok' if self.ok else 'WRONG'} (max error {self.max_error:.2e})"


def _dim_sizes(node: Node, graph: Graph, r: OpRule, ratios: Sequence[float]) -> dict[tuple[int, int], list[int]]:
    """Shard sizes for every (operand index or -1 for output, dim) of the rule, on common units."""
    linked = [(k, f, graph[i].shape[f]) for k, (i, f) in enumerate(zip(node.inputs, r.inputs)) if f >= 0]
    if r.output >= 0:
        linked.append((-1, r.output, node.shape[r.output]))
    if not linked:
        return {}
    units = math.gcd(*[s for _, _, s in linked])
    unit_sizes = split_sizes(units, ratios)
    return {(k, f): [u * (s // units) for u in unit_sizes] for k, f, s in linked}


def _index_bound(node: Node, graph: Graph) -> int:
    """Integer operands are drawn from [0, bound): the whole index range where the op has one, so a
    vocabulary-parallel lookup meets ids of every device's range; {0, 1} otherwise (valid targets)."""
    if node.op == "embedding":
        return graph[node.inputs[0]].shape[0]
    if node.op == "one_hot":
        return node.attrs["num_classes"]
    if node.op == "gather":
        return graph[node.inputs[0]].shape[node.attrs["dim"]]
    if node.op in ("index_add", "scatter_add", "scatter"):
        return graph[node.inputs[0]].shape[node.attrs["dim"]]
    if node.op == "index":
        x = graph[node.inputs[0]]
        return min(x.shape[d] for d, used in enumerate(node.attrs["slots"]) if used)
    return 2


def _random_input(x: Node, users_bound: int, gen: torch.Generator) -> torch.Tensor:
    if x.dtype.startswith("int"):
        return torch.randint(0, users_bound, x.shape, generator=gen)
    return torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _local(t: torch.Tensor, form: Form, sizes: list[int] | None, m: int, gen: torch.Generator) -> list[torch.Tensor]:
    if form == FULL:
        return [t.clone() for _ in range(m)]
    if form == PARTIAL:
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.is_floating_point()
                 else torch.randint(-3, 3, t.shape, generator=gen) for _ in range(m - 1)]
        return parts + [t - sum(parts)]
    return list(torch.split(t, sizes, dim=form))


def check_rule(node: Node, graph: Graph, r: OpRule, ratios: Sequence[float], seed: int = 0) -> CheckResult:
    """Verify one rule of `node` numerically on len(ratios) simulated devices."""
    gen = torch.Generator().manual_seed(seed)
    m = len(ratios)
    sizes = _dim_sizes(node, graph, r, ratios)
    full_in = [_random_input(graph[i], _index_bound(node, graph), gen) for i in node.inputs]
    if node.op in DOMAINS:
        full_in = [DOMAINS[node.op](t) for t in full_in]
    if node.op == "cross_entropy" and len(full_in) == 3:  # a count of kept targets is at least 1
        full_in[2] = full_in[2] + 1
    if node.op == "where":  # the condition is boolean
        full_in[0] = full_in[0] > 0
    ref = run_node(node, graph, full_in, node.shape)
    local_in = [_local(t, f, sizes.get((k, f)), m, gen) for k, (t, f) in enumerate(zip(full_in, r.inputs))]
    outs = []
    for j in range(m):
        shape = list(node.shape)
        if r.output >= 0:
            shape[r.output] = sizes[(-1, r.output)][j]
        offsets = [sum(sizes[(k, f)][:j]) if f >= 0 else 0 for k, f in enumerate(r.inputs)]
        out_offset = sum(sizes[(-1, r.output)][:j]) if r.output >= 0 else 0
        try:
            outs.append(run_node(node, graph, [li[j] for li in local_in], shape, offsets, out_offset=out_offset))
        except (RuntimeError, IndexError):  # the local operands do not fit the operator (a whole mask on split rows, an index past a slice)
            return CheckResult(node.name, str(r), False, math.inf)
    err = _combine_error(ref, outs, r.output)
    tol = 1e-9 * max(1.0, float(ref.double().abs().max()) if ref.numel() else 1.0)
    return CheckResult(node.name, str(r), err <= tol, err)


def _combine_error(ref: torch.Tensor, outs: list[torch.Tensor], form: Form) -> float:
    ref, outs = ref.double(), [o.double() for o in outs]  # bool and int results compare as numbers
    if form == FULL:
        return max(float((o - ref).abs().max()) if ref.numel() else 0.0 for o in outs)
    try:
        combined = sum(outs) if form == PARTIAL else torch.cat(outs, dim=form)
    except RuntimeError:  # the shards do not even fit together
        return math.inf
    if combined.shape != ref.shape:
        return math.inf
    return float((combined - ref).abs().max()) if ref.numel() else 0.0


def check_node(node: Node, graph: Graph, ratios: Sequence[float], seed: int = 0) -> list[CheckResult]:
    """Check every rule of a node."""
    from engine.theory.core import op_rules

    return [check_rule(node, graph, r, ratios, seed) for r in op_rules(node, graph)]


def describe(results: list[CheckResult]) -> str:
    bad = [r for r in results if not r.ok]
    return "\n".join(str(r) for r in bad) or f"all {len(results)} rules hold"


__all__ = ["split_sizes", "check_rule", "check_node", "CheckResult", "describe", "form_str"]
