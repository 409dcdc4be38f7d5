"""Rows of the background theory T of a graph (HAP §4.2): one per Hoare triple, and the forms in words."""
from __future__ import annotations

from collections import Counter
from typing import Any

from engine.model.graph import Graph
from engine.theory import collectives_from, form_str, leaf_forms, op_rules
from engine.theory.core import FULL, PARTIAL

FORM_SENTENCES = {
    "Full": "Full(e): every device holds the whole reference tensor e (the paper's e | Identity).",
    "Shard(d)": "Shard(e, d): the devices hold slices of e along dim d, sized by the sharding ratios "
                "(e | All-Gather(d): an all-gather rebuilds e).",
    "Partial": "Partial(e): every device holds an addend and e is their sum (e | All-Reduce: an all-reduce rebuilds e).",
}
"""One sentence per property form (HAP §4.2)."""


def model_summary(graph: Graph) -> dict[str, Any]:
    """Headline figures of a model: parameters, flops per iteration (fwd + ~2x bwd), nodes, segments."""
    return {"parameters": graph.num_parameters, "forward_flops": graph.flops,
            "iteration_flops": 3 * graph.flops, "nodes": len(graph), "segments": graph.num_segments}


def theory_rows(graph: Graph) -> list[dict[str, Any]]:
    """Every Hoare triple of the background theory T of `graph` (HAP §4.2): leaf loads, compute
    rules and collectives, one row each."""
    rows = []
    for n in graph.nodes:
        if n.is_leaf:
            for f in leaf_forms(n):
                kind = "Parameter" if n.op == "parameter" else "Placeholder"
                name = f"{kind}-{'Full' if f == FULL else f'Shard({f})'}"
                rows.append(_triple(n, "leaf", n.op, name, "", "{}", form_str(f)))
        else:
            for r in op_rules(n, graph):
                pre = ", ".join(f"{graph[i].name}:{form_str(f)}" for i, f in zip(n.inputs, r.inputs))
                rows.append(_triple(n, "compute", n.op, r.name, "", f"{{{pre}}}", form_str(r.output)))
    rows += collective_rows(graph)
    return rows


def collective_rows(graph: Graph) -> list[dict[str, Any]]:
    """The communication triples of every computed tensor, from each of its forms (leaves are never communicated)."""
    rows = []
    for n in graph.nodes:
        if n.is_leaf:
            continue
        for f in [FULL, PARTIAL] + list(range(n.rank)):
            for coll, g in collectives_from(f, n.shape):
                rows.append(_triple(n, "collective", n.op, coll.key, coll.key, f"{{{n.name}:{form_str(f)}}}", form_str(g)))
    return rows


def _triple(n, kind: str, op: str, rule: str, collective: str, pre: str, post: str) -> dict[str, Any]:
    return {"tensor": n.name, "op": op, "kind": kind, "rule": rule, "collective": collective,
            "triple": f"{pre} {rule} {{{n.name}:{post}}}", "post": post, "segment": n.segment}


def rule_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How many triples of each kind and rule."""
    c = Counter((r["kind"], r["rule"]) for r in rows)
    return [{"kind": k, "rule": r, "triples": v} for (k, r), v in sorted(c.items())]
