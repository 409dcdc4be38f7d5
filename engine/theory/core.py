"""Properties, Hoare triples and the rule registry (HAP §4.2, Fig. 9).

A *property* relates a distributed tensor to a reference tensor `e` of the single-device graph:

- `Full(e)`: every device holds `e` (the paper's `e | Identity`);
- `Shard(e, d)`: devices hold slices of `e` along dim `d` (`e | All-Gather(d)`);
- `Partial(e)`: devices hold addends whose sum is `e` (`e | All-Reduce`).

A form is encoded as an int: `FULL = -1`, `PARTIAL = -2`, `d >= 0` for `Shard(d)`. A rule for an
operator lists every legal way to run it on distributed inputs: the forms of its inputs (the
precondition) and the form of its output (the postcondition). Family modules register rules with
`@rule("op", ...)`; an operator with no rule is reported by `missing_rules`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.errors import HapError, ModelError
from engine.model.graph import Graph, Node

FULL = -1
PARTIAL = -2
Form = int


def form_str(form: Form) -> str:
    """Short human form: `F`, `P`, `S(1)`."""
    return {FULL: "F", PARTIAL: "P"}.get(form, f"S({form})")


def split_sizes(total: int, ratios: list[float]) -> list[int]:
    """Integer sizes proportional to `ratios` summing exactly to `total` (HAP §5.1); the theory's checker and the plan shard by it alike: round to
    nearest, then move one unit at a time where the rounding error is largest."""
    s = sum(ratios)
    exact = [total * r / s for r in ratios]
    sizes = [round(x) for x in exact]
    while sum(sizes) > total:
        j = max((i for i in range(len(sizes)) if sizes[i] > 0), key=lambda i: (sizes[i] - exact[i], -i))
        sizes[j] -= 1
    while sum(sizes) < total:
        j = max(range(len(sizes)), key=lambda i: (exact[i] - sizes[i], -i))
        sizes[j] += 1
    return sizes


def form_long(form: Form) -> str:
    """Machine-ish form: `Full`, `Partial`, `Shard(dim=1)`."""
    return {FULL: "Full", PARTIAL: "Partial"}.get(form, f"Shard(dim={form})")


def parse_form(text: str) -> Form:
    text = text.strip()
    if text in ("F", "Full"):
        return FULL
    if text in ("P", "Partial"):
        return PARTIAL
    inner = text.removeprefix("Shard(dim=").removeprefix("S(").rstrip(")")
    return int(inner)


@dataclass(frozen=True)
class OpRule:
    """One way to run an operator: input forms (pre) -> output form (post)."""

    name: str
    """Rule name shown to people, e.g. `column`, `row`, `batch`, `replicate`."""
    inputs: tuple[Form, ...]
    """Required form of each tensor operand, aligned with `Node.inputs`."""
    output: Form
    """Form of the result."""

    @property
    def sharded(self) -> bool:
        """Whether the work is split across devices (it then scales with each device's ratio)."""
        return self.output >= 0 or any(f >= 0 for f in self.inputs)

    def __str__(self) -> str:
        pre = ", ".join(form_str(f) for f in self.inputs)
        return f"{{{pre}}} {self.name} {{{form_str(self.output)}}}"


RuleFn = Callable[[Node, Graph], list[OpRule]]
_REGISTRY: dict[str, RuleFn] = {}


def rule(*ops: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule generator for one or more canonical operators."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            assert op not in _REGISTRY, f"two rule generators for op '{op}'"
            _REGISTRY[op] = fn
        return fn

    return deco


def registered_ops() -> list[str]:
    return sorted(_REGISTRY)


def rule_family(op: str) -> str | None:
    """The family module that registers `op`'s rules (`pointwise`, `reduction`, ...), None when none does."""
    fn = _REGISTRY.get(op)
    return fn.__module__.rsplit(".", 1)[-1] if fn is not None else None


def op_rules(node: Node, graph: Graph) -> list[OpRule]:
    """All rules for a compute node, deduplicated, in a stable order."""
    fn = _REGISTRY.get(node.op)
    if fn is None:
        return []
    seen: dict[tuple, OpRule] = {}
    try:
        for r in fn(node, graph):
            key = (r.inputs, r.output)
            if key not in seen and _shards_are_real(r, node, graph):
                seen[key] = r
    except HapError:
        raise
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError,
            AssertionError) as e:
        raise _misfit(node, graph, e) from None  # a rule's shape invariant broken by the graph, not by the rule
    return list(seen.values())


def _misfit(node: Node, graph: Graph, e: Exception) -> ModelError:
    """A node whose shape or attrs contradict its operator (only a hand-edited graph JSON has one)."""
    inputs = ", ".join(str(list(graph[i].shape)) for i in node.inputs if 0 <= i < len(graph))
    attrs = json.dumps(node.attrs, default=str)
    return ModelError(f"node {node.id} ({node.name!r}, {node.op}): output shape {list(node.shape)} and attrs "
                      f"{attrs[:120]} do not fit the operator with inputs of shapes [{inputs[:120]}] "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:80]}); recapture the model or fix the graph JSON")


def _shards_are_real(r: OpRule, node: Node, graph: Graph) -> bool:
    """Only shard dims of size >= 2: a size-1 dim cannot be split."""
    dims_ok = all(f < 0 or graph[i].shape[f] >= 2 for i, f in zip(node.inputs, r.inputs))
    return dims_ok and (r.output < 0 or node.shape[r.output] >= 2)


def missing_rules(graph: Graph) -> list[Node]:
    """Compute nodes whose operator has no rule at all (capture should have rejected them)."""
    return [n for n in graph.nodes if not n.is_leaf and not op_rules(n, graph)]


def leaf_forms(node: Node) -> list[Form]:
    """Forms a leaf can be loaded in: Full, or sharded on any dim of size >= 2 (Placeholder-Shard, Parameter-Shard).
    A pipeline stage's input from the previous stage (`cut` placeholder) arrives in one form, its `form`."""
    if "form" in node.attrs:
        return [int(node.attrs["form"])]
    return [FULL] + [d for d, s in enumerate(node.shape) if s >= 2]


def shard_rules(name: str, n_inputs: int, dims: Iterable[tuple[tuple[Form, ...], Form]]) -> list[OpRule]:
    """Helper: build named rules from (input forms, output form) pairs."""
    out = []
    for ins, o in dims:
        assert len(ins) == n_inputs
        out.append(OpRule(name, tuple(ins), o))
    return out


def replicate(node: Node) -> OpRule:
    """The all-Full rule: every device runs the whole operator (enables sufficient-factor broadcasting, §4.4)."""
    return OpRule("replicate", tuple(FULL for _ in node.inputs), FULL)
