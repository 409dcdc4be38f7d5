"""A plan in Hetu v2's HSPMD vocabulary (paper 003, §3): one annotation per tensor form of the program.

HSPMD annotates a tensor with a *DG union* (disjoint device subgroups), a *DS union* (the SPMD
distributed states inside each subgroup: `{dim: shards}`, -1 for duplicate, -2 for partial, as in
Hetu), *HSize* (the number of subgroups) and *HDim* (the tensor dimension split across the
subgroups, -1: every subgroup holds the whole tensor), the split across subgroups being allowed
to be uneven. A HAP form maps onto it as follows (devices are plan ranks):

- Full: one subgroup of every device, DS `{-1: n}`, HSize 1, HDim -1;
- Partial: one subgroup, DS `{-2: n}`, HSize 1, HDim -1;
- Shard(d) with the plan's integer sizes: each run of consecutive ranks holding equal sizes is a
  subgroup split evenly inside (`{d: k}`, or `{-1: 1}` for one device); the runs are split unevenly
  along HDim d (`hdim_sizes`: rows of dim d per subgroup). Even sizes: one subgroup, HSize 1, HDim -1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.spmd.plan import Plan
from engine.theory.core import FULL, PARTIAL, form_str

DUPLICATE, PARTIAL_KEY = -1, -2
"""Hetu's DS keys for a duplicated and a partial tensor."""


@dataclass(frozen=True)
class Annotation:
    """One tensor in one form, annotated the HSPMD way."""

    tensor: str
    form: str
    """The HAP form: F, P or S(d)."""
    shape: list[int]
    dg_union: list[list[int]]
    """Disjoint device subgroups (plan ranks)."""
    ds_union: list[dict[int, int]]
    """Per subgroup, its distributed states: `{dim: shards}` (-1 duplicate, -2 partial)."""
    hsize: int
    hdim: int
    hdim_sizes: list[int]
    """Rows of HDim each subgroup holds ([] when HDim is -1)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ds_union"] = [{str(k): v for k, v in ds.items()} for ds in self.ds_union]  # JSON keys
        return d


def runs(sizes: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive ranks holding equal sizes."""
    out: list[list[int]] = []
    for rank, size in enumerate(sizes):
        if out and sizes[out[-1][0]] == size:
            out[-1].append(rank)
        else:
            out.append([rank])
    return out


def annotate_form(name: str, shape: list[int], form: int, world: int, sizes: list[int] | None) -> Annotation:
    """The annotation of one tensor form; `sizes` are the plan's per-rank sizes of a sharded dim."""
    everyone = [list(range(world))]
    if form in (FULL, PARTIAL):
        key = DUPLICATE if form == FULL else PARTIAL_KEY
        return Annotation(name, form_str(form), shape, everyone, [{key: world}], 1, -1, [])
    groups = runs(sizes or [])
    if len(groups) == 1:
        return Annotation(name, form_str(form), shape, everyone, [{form: world}], 1, -1, [])
    ds = [{form: len(g)} if len(g) > 1 else {DUPLICATE: 1} for g in groups]
    return Annotation(name, form_str(form), shape, groups, ds, len(groups), form,
                      [sum(sizes[r] for r in g) for g in groups])  # type: ignore[index]


def annotate(plan: Plan) -> list[Annotation]:
    """Every tensor form the plan's program produces, in program order, each once."""
    seen: set[tuple[int, int]] = set()
    out = []
    for ins in plan.program:
        key = (ins.node, ins.post)
        if key in seen:
            continue
        seen.add(key)
        node = plan.graph[ins.node]
        sizes = plan.sizes(ins.node, ins.post) if ins.post >= 0 else None
        out.append(annotate_form(node.name, list(node.shape), ins.post, plan.world_size, sizes))
    return out


def annotations_json(plan: Plan) -> dict[str, Any]:
    """The JSON `hap export --annotations` writes: the devices by rank, then every annotation."""
    return {"kind": "hap.hspmd_annotations", "model": plan.graph.name, "devices": list(plan.device_names),
            "tensors": [a.to_dict() for a in annotate(plan)]}
