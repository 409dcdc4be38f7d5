"""Overlap of communication with computation: DDP's gradient buckets and HiDup's duplex halves.

Gradient buckets. PyTorch DDP all-reduces gradients in buckets while backward still runs: the
parameters, in reverse order of use (the order their gradients become ready), fill buckets of
at most `FIRST_BUCKET_BYTES` (the first) and `BUCKET_CAP_BYTES` (the rest), as DDP's defaults
do; each bucket's all-reduce starts as soon as its last gradient is ready and the link is free.
Our slots are fixed over *all* parameters of the graph, whatever the program; a plan's bucket
is the Full parameters of one slot (a sharded parameter's gradient is not all-reduced). With
every parameter Full (data parallelism) these are exactly DDP's buckets, and fixed slots let the
search and the LP price a partial program bucket by bucket.

Ready point. Backward runs a stage's work in reverse, so a bucket is ready once its stage has
run the work from its earliest-used Full parameter's first consumer on (on every device: the
all-reduce waits for all), not at the end of the stage: data parallelism, one backward stage,
still overlaps all buckets but the first layer's. Activation collectives and buckets are not
modelled as contending for the link.

Closed forms (`price`, used by `engine.spmd.cost.evaluate`; tested against `engine.timeline.simulate`
through `predicted_timeline`): `ddp_backward_time` (compute chain and bucket queue),
`duplex_chain_time` (HiDup's Eq. 5 telescoped).
"""
from __future__ import annotations

from dataclasses import replace

from engine.model.graph import Graph
from engine.spmd.breakdown import Breakdown
from engine.spmd.program import LOAD, Instruction
from engine.theory.core import FULL
from engine.timeline import Task

BUCKET_CAP_BYTES = 25 * 2**20
"""DDP's `bucket_cap_mb=25`."""
FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): small, so that the first
all-reduce starts early in backward."""


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


# --- closed forms (engine.spmd.cost prices with these; tests check them against engine.timeline) ------


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


def price(b: Breakdown) -> Breakdown:
    """Fill in `b.total_s` and its buckets' ready, start and end times from its stages' times, its
    buckets' durations and its tail, by the closed form of `b.overlap` (see `engine.spmd.cost`)."""
    fwd = [i for i, s in enumerate(b.stages) if s.direction == "forward"]
    bwd = [i for i, s in enumerate(b.stages) if s.direction == "backward"]
    full = [c + max(t, default=0.0) for c, t in zip(b.stage_comm_s, b.stage_comp_s)]
    if b.overlap == "none":
        b.total_s = sum(b.stage_comm_s) + sum(max(t) for t in b.stage_comp_s)
        return b
    durations = [x.duration_s for x in b.buckets]
    if b.overlap == "ddp":
        forward = sum(full[i] for i in fwd)
        chain = sum(full[i] for i in bwd)
        ready = [forward + sum(full[i] for i in bwd if i > x.stage) + max(x.stage_left_s) for x in b.buckets]
        end = forward + ddp_backward_time(chain, [r - forward for r in ready], durations)
    else:
        psi = sum(duplex_chain_time(_chain(b, members)) for members in (fwd, bwd))
        ready = [psi] * len(durations)
        end = psi + sum(durations)
    queue = bucket_queue(ready, durations)
    b.buckets = [replace(x, ready_s=r, start_s=s, end_s=e) for x, r, (s, e) in zip(b.buckets, ready, queue)]
    b.tail_s = max(b.tail_device_s, default=0.0)
    b.total_s = end + b.tail_s
    return b


def _chain(b: Breakdown, members: list[int]) -> list[float]:
    """The duplex chain (m_0, c_0, m_1, c_1, ...) of one pass: each stage's per-half collective, then
    its slowest device's half computation."""
    xs: list[float] = []
    for i in members:
        xs += [b.stage_half_comm_s[i], max(b.stage_comp_s[i]) / 2]
    return xs


def duplex_problem(graph: Graph) -> str | None:
    """Why duplex cannot run this model (None when it can): training-mode batch norm normalises
    over the local batch, so two half-batches would change its statistics and the gradients."""
    bn = next((n for n in graph.nodes if n.op == "batch_norm"), None)
    if bn is None:
        return None
    return (f"duplex is refused: node '{bn.name}' is a training-mode batch norm, whose statistics change when "
            "the batch is split into two halves; use overlap 'ddp' or 'none'")


def duplex_run_problem(graph: Graph) -> str | None:
    """Why the runner cannot train this model in two half-batches (None when it can): the cost
    model's reason (`duplex_problem`), or a model it cannot rebuild at half the batch (a model
    file or graph JSON fixes its batch), a batch of one sample, or a loss that is not a mean
    cross-entropy over kept targets (the halves reweigh their losses by those counts). The
    planner skips duplex for these, so `auto` never picks a plan `hap run` would refuse."""
    problem = duplex_problem(graph)
    if problem:
        return problem
    origin = graph.origin
    if "zoo" not in origin and "hf" not in origin:
        return ("duplex is refused: the model is not rebuilt at another batch size (a model file or graph JSON "
                "fixes its batch); use overlap 'ddp' or 'none'")
    batch = int((origin.get("config", {}) if "zoo" in origin else origin.get("inputs", {})).get("batch", 0) or 0)
    if batch < 2:
        return "duplex is refused: the batch has fewer than two samples, which cannot be split into two halves"
    loss = graph[graph.loss]
    if loss.op != "cross_entropy" or len(loss.inputs) < 3:
        return (f"duplex is refused: the loss '{loss.name}' is '{loss.op}', not a mean cross-entropy over kept "
                "targets that two halves can reweigh; use overlap 'ddp' or 'none'")
    return None


def batch_derived(graph: Graph) -> list[bool]:
    """For every node, whether it depends on an input (has a placeholder ancestor, or is one): such a
    tensor splits with the batch, so each duplex half moves half of it; a tensor derived from
    parameters alone is whole in each half."""
    out: list[bool] = []
    for n in graph.nodes:
        out.append(n.op == "placeholder" or any(out[i] for i in n.inputs))
    return out


# --- the predicted timeline ------------------------------------------------------------------


def predicted_timeline(b: Breakdown, graph: Graph | None = None) -> list[Task]:
    """The tasks of one predicted iteration, whose simulated makespan (`engine.timeline.simulate`)
    is `b.total_s`: per device a lane `compute:<device>` and a lane `network:<device>` (activation
    collectives; duplex's buckets), and in ddp a lane `buckets:<device>` for the gradient buckets
    (the model lets them overlap the activation collectives, so they get a lane of their own).

    Every stage starts when every device has finished the stage before (a collective synchronises
    them; the cost model's max over devices per stage assumes it everywhere). Duplex runs the two
    halves in lockstep phases: in each, one half communicates while the other computes, and a
    phase ends when every device and both halves are done (zero-length barriers: dependencies)."""
    lanes = _Lanes(b, graph)
    if b.overlap == "duplex":
        lanes.duplex()
    else:
        lanes.sequential()
    lanes.buckets()
    lanes.tail()
    return lanes.tasks


class _Lanes:
    """Builds the task list of `predicted_timeline`; `frontier` holds, per device, the tasks the next
    stage waits for."""

    def __init__(self, b: Breakdown, graph: Graph | None) -> None:
        self.b, self.graph = b, graph
        self.devices = b.devices or [f"device {j}" for j in range(len(b.memory_bytes))]
        self.tasks: list[Task] = []
        self.frontier: tuple[str, ...] = ()
        self.bucket_deps: dict[int, tuple[str, ...]] = {}

    def _label(self, i: int) -> str:
        s = self.b.stages[i]
        what = s.comm or "compute"
        if self.graph is not None and s.comm_node >= 0:
            what += f" {self.graph[s.comm_node].name}"
        return what

    def _add(self, name: str, resource: str, duration: float, after: tuple[str, ...], kind: str, **info) -> str:
        self.tasks.append(Task(name, resource, max(0.0, duration), after, kind, info))
        return name

    def _collective(self, name: str, duration: float, after: tuple[str, ...], kind: str = "comm", **info) -> tuple[str, ...]:
        return tuple(self._add(f"{name} @{d}", f"network:{d}", duration, after, kind, device=d, **info) for d in self.devices)

    def sequential(self) -> None:
        """Modes none and ddp: forward stages (collective, then computation) in order, then backward
        stages in reverse (computation, then the dual collective); a ddp bucket's parameter is
        reached part-way through its stage's computation."""
        b = self.b
        anchors: dict[int, list[int]] = {}
        if b.overlap == "ddp":
            for k, x in enumerate(b.buckets):
                anchors.setdefault(x.stage, []).append(k)
        fwd = [i for i, s in enumerate(b.stages) if s.direction == "forward"]
        bwd = [i for i, s in enumerate(b.stages) if s.direction == "backward"]
        for i in fwd:
            info = dict(stage=i, direction="forward", half="")
            if b.stages[i].comm:
                self.frontier = self._collective(f"forward {i} {self._label(i)}", b.stage_comm_s[i], self.frontier, **info)
            self.frontier = self._compute(f"forward {i}", i, [[t] for t in self._comp(i)], self.frontier, **info)
        for i in reversed(bwd):
            info = dict(stage=i, direction="backward", half="")
            cuts = sorted(anchors.get(i, []), key=lambda k: max(b.buckets[k].stage_left_s))
            pieces = []
            for j, total in enumerate(self._comp(i)):
                marks = [min(b.buckets[k].stage_left_s[j], total) for k in cuts] + [total]
                pieces.append([hi - lo for lo, hi in zip([0.0] + marks, marks)])
            self.frontier = self._compute(f"backward {i}", i, pieces, self.frontier, cuts=cuts, **info)
            if b.stages[i].comm:
                kind = "grad_bucket" if b.stages[i].comm == "grad_all_reduce" else "comm"
                self.frontier = self._collective(f"backward {i} {self._label(i)}", b.stage_comm_s[i], self.frontier,
                                                 kind, **info)

    def _comp(self, i: int) -> list[float]:
        return self.b.stage_comp_s[i]

    def _compute(self, name: str, i: int, pieces: list[list[float]], after: tuple[str, ...], cuts: list[int] = (),
                 **info) -> tuple[str, ...]:
        """Stage i's computation on every device, in pieces; bucket `cuts[q]` waits for every device's piece q."""
        last = []
        for j, d in enumerate(self.devices):
            prev = after
            for q, t in enumerate(pieces[j]):
                prev = (self._add(f"{name} part {q} @{d}" if len(pieces[j]) > 1 else f"{name} @{d}", f"compute:{d}", t,
                                  prev, "compute", device=d, **info),)
            last.append(prev[0])
        for q, k in enumerate(cuts):
            self.bucket_deps[k] = tuple(f"{name} part {q} @{d}" for d in self.devices)
        return tuple(last)

    def duplex(self) -> None:
        """Both passes' chains (m_0, c_0, m_1, c_1, ...) run by halves A and B in lockstep phases."""
        b = self.b
        for direction in ("forward", "backward"):
            members = [i for i, s in enumerate(b.stages) if s.direction == direction]
            chain: list[tuple[int, str]] = []  # (stage, "comm" | "compute") in the order the pass runs them
            for i in members:
                chain += [(i, "comm"), (i, "compute")]
            if direction == "backward":
                chain.reverse()
            for phase in range(len(chain) + 1):
                made: list[str] = []
                for half, k in (("A", phase), ("B", phase - 1)):
                    if 0 <= k < len(chain):
                        made += self._half(direction, chain[k], half, self.frontier)
                self.frontier = tuple(made)

    def _half(self, direction: str, element: tuple[int, str], half: str, after: tuple[str, ...]) -> list[str]:
        i, what = element
        info = dict(stage=i, direction=direction, half=half)
        name = f"{direction} {i} half {half}"
        if what == "comm":
            return list(self._collective(f"{name} {self._label(i)}", self.b.stage_half_comm_s[i], after, **info))
        return [self._add(f"{name} @{d}", f"compute:{d}", t / 2, after, "compute", device=d, **info)
                for d, t in zip(self.devices, self._comp(i))]

    def buckets(self) -> None:
        """The gradient buckets, one after another: ddp's on their own lane once ready; duplex's after both halves."""
        b = self.b
        if b.overlap == "none" or not b.buckets:
            return
        prev: tuple[str, ...] = ()
        ends = []
        for k, x in enumerate(b.buckets):
            after = self.bucket_deps.get(k, self.frontier) if b.overlap == "ddp" else self.frontier + prev
            lane = "buckets" if b.overlap == "ddp" else "network"
            prev = tuple(self._add(f"bucket {k} @{d}", f"{lane}:{d}", x.duration_s, after, "grad_bucket", device=d,
                                   bucket=k, params=len(x.params)) for d in self.devices)
            ends = list(prev)
        self.frontier = self.frontier + tuple(ends)

    def tail(self) -> None:
        """Per device, the per-parameter-byte work after every device's backward and the last bucket."""
        if self.b.overlap == "none":
            return
        for d, t in zip(self.devices, self.b.tail_device_s):
            self._add(f"tail @{d}", f"compute:{d}", t, self.frontier, "tail", device=d)
