"""The distributed program Q (HAP §4.1, Fig. 8): a list of instructions every device runs.

An instruction either loads a leaf (`Placeholder-Shard`, `Parameter-Shard`, or their Full forms),
computes one node of the single-device graph by one of its rules, or runs a collective on a
reference tensor. Each instruction records the properties it consumes and the one it establishes,
so a program can be checked against the theory and replayed by the cost model and the runner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from engine.model.graph import Graph
from engine.theory.core import Form, form_str, parse_form

LOAD, COMPUTE, COMM = "load", "compute", "comm"


@dataclass(frozen=True)
class Instruction:
    """One step of the distributed program."""

    kind: str
    """`load`, `compute` or `comm`."""
    node: int
    """The reference tensor this instruction produces, loads or communicates."""
    rule: str
    """Rule (compute), `parameter`/`placeholder` (load), or collective key such as `all_gather.padded` (comm)."""
    pre: tuple[tuple[int, Form], ...]
    """Properties it consumes: (reference tensor, form) pairs."""
    post: Form
    """Form of `node` that holds afterwards."""

    def render(self, graph: Graph) -> str:
        """One readable line, e.g. `linear_4 = linear.column(layer_norm_1:F, fc_weight:S(0)) -> S(2)`."""
        name = graph[self.node].name
        args = ", ".join(f"{graph[t].name}:{form_str(f)}" for t, f in self.pre)
        if self.kind == LOAD:
            return f"{name} = {self.rule}() -> {form_str(self.post)}"
        if self.kind == COMM:
            return f"{name} = {self.rule}({args}) -> {form_str(self.post)}"
        return f"{name} = {graph[self.node].op}.{self.rule}({args}) -> {form_str(self.post)}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "rule": self.rule,
                "pre": [[t, form_str(f)] for t, f in self.pre], "post": form_str(self.post)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Instruction":
        return Instruction(kind=d["kind"], node=int(d["node"]), rule=d["rule"],
                           pre=tuple((int(t), parse_form(f)) for t, f in d["pre"]), post=parse_form(d["post"]))


Program = tuple[Instruction, ...]


def render(program: Iterable[Instruction], graph: Graph) -> str:
    return "\n".join(ins.render(graph) for ins in program)
