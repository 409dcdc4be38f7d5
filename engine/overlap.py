"""Overlap of communication with computation: DDP's gradient buckets and HiDup's duplex halves.

Gradient buckets. PyTorch DDP all-reduces gradients in buckets while backward still runs: the
parameters, in reverse order of use (the order their gradients become ready), fill buckets of
at most `FIRST_BUCKET_BYTES` (the first) and `BUCKET_CAP_BYTES` (the rest), as DDP's defaults
do; each bucket's all-reduce starts as soon as its last gradient is ready and the link is free.
Our slots are fixed over *all* parameters of the graph, whatever the program; a plan's bucket
is the Full parameters of one slot (a sharded parameter's gradient is not all-reduced). With
every parameter Full (data parallelism) these are exactly DDP's buckets, and fixed slots let the
search and the LP price a partial program bucket by bucket.
"""
from __future__ import annotations

from .graph import Graph
from .program import LOAD, Instruction
from .theory.core import FULL

BUCKET_CAP_BYTES = 25 * 2**20
"""DDP's `bucket_cap_mb=25`."""
FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): small, so that the first
all-reduce starts early in backward."""
OVERLAP_MODES = ("none", "ddp", "duplex")
"""`none`: one bucket after backward; `ddp`: buckets overlapped with backward; `duplex`: two
half-batches, each one's communication overlapped with the other's computation (HiDup)."""


def first_use(graph: Graph) -> list[int]:
    """For every node, the position (in topological order) of its first consumer; -1 when unused."""
    out = [-1] * len(graph)
    for n in graph.nodes:
        for i in n.inputs:
            if out[i] < 0:
                out[i] = n.id
    return out


def bucket_slots(graph: Graph, first_cap: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_CAP_BYTES) -> list[list[int]]:
    """Parameter node ids grouped into DDP's buckets, in launch order (the last used first).

    A bucket closes once it holds at least its cap (DDP's rule: a tensor larger than the cap
    gets a bucket of its own). Parameters used nowhere come last, in one bucket of their own."""
    use = first_use(graph)
    params = [n for n in graph.parameters if use[n.id] >= 0]
    params.sort(key=lambda n: (-use[n.id], -n.id))
    slots: list[list[int]] = []
    current: list[int] = []
    size = 0
    for n in params:
        current.append(n.id)
        size += n.nbytes
        if size >= (first_cap if not slots else cap):
            slots.append(current)
            current, size = [], 0
    if current:
        slots.append(current)
    unused = [n.id for n in graph.parameters if use[n.id] < 0]
    return slots + ([unused] if unused else [])


def grad_buckets(graph: Graph, program: tuple[Instruction, ...]) -> list[list[int]]:
    """The plan's gradient buckets, in launch order: each slot's parameters that the program loads
    Full (their gradients are all-reduced); slots with none are dropped."""
    full = {ins.node for ins in program if ins.kind == LOAD and ins.post == FULL and graph[ins.node].op == "parameter"}
    return [b for b in ([p for p in slot if p in full] for slot in bucket_slots(graph)) if b]


# --- closed forms (engine.cost prices with these; tests check them against engine.timeline) ------


def bucket_queue(ready_s: list[float], durations_s: list[float]) -> list[tuple[float, float]]:
    """(start, end) of every bucket's all-reduce: one after another on the link, in launch order,
    each as soon as it is ready and the previous one has ended."""
    out: list[tuple[float, float]] = []
    free = 0.0
    for r, d in zip(ready_s, durations_s):
        start = max(r, free)
        free = start + d
        out.append((start, free))
    return out


def ddp_backward_time(chain_s: float, ready_s: list[float], durations_s: list[float]) -> float:
    """Backward with bucketed gradient all-reduces overlapped: the later of the compute chain's end
    (`chain_s`, W) and the last bucket's end, max_k (r_k + sum_{j>=k} d_j)."""
    queue = bucket_queue(ready_s, durations_s)
    return max(chain_s, queue[-1][1] if queue else 0.0)


def duplex_chain_time(xs: list[float]) -> float:
    """HiDup's Eq. 5 telescoped: two half-batches in lockstep through the alternating chain
    x = (m_0, c_0, m_1, c_1, ..., m_n, c_n) of per-half communication and computation; while one
    half runs x_{k+1} the other runs x_k. psi = x_0 + sum_k max(x_k, x_{k+1}) + x_last (the same
    read backwards, so the backward pass, which runs the chain in reverse, uses it too)."""
    if not xs:
        return 0.0
    return xs[0] + sum(max(a, b) for a, b in zip(xs, xs[1:])) + xs[-1]


def duplex_problem(graph: Graph) -> str | None:
    """Why duplex cannot run this model (None when it can): training-mode batch norm normalises
    over the local batch, so two half-batches would change its statistics and the gradients."""
    bn = next((n for n in graph.nodes if n.op == "batch_norm"), None)
    if bn is None:
        return None
    return (f"duplex is refused: node '{bn.name}' is a training-mode batch norm, whose statistics change when "
            "the batch is split into two halves; use overlap 'ddp' or 'none'")


def batch_derived(graph: Graph) -> list[bool]:
    """For every node, whether it depends on an input (has a placeholder ancestor, or is one): such a
    tensor splits with the batch, so each duplex half moves half of it; a tensor derived from
    parameters alone is whole in each half."""
    out: list[bool] = []
    for n in graph.nodes:
        out.append(n.op == "placeholder" or any(out[i] for i in n.inputs))
    return out
