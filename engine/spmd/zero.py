"""Sharded states, uneven (ZeRO stages 1-3, FSDP-style) for the weights a program keeps Full.

A Full parameter (the paper's `e | Identity`) is replicated on every device; its state need not be.
Per weight the plan picks a stage:

    stage 0  weight, gradient and optimizer state replicated (HAP as published)
    stage 1  the optimizer state (Adam's m, v) sharded: device j keeps z_j of it
    stage 2  and the gradient: reduce-scattered (not all-reduced), device j keeps z_j of it
    stage 3  and the weight at rest: all-gathered before its use in forward, freed, all-gathered
             again in backward; its gradient reduce-scattered

In HAP's terms these are programs of reduce-scatters and all-gathers on a weight's flattened
gradient and value (each the dual of the other, `engine.theory` collective rules); they do not
change the program Q, only how a Full weight's state is kept. So the stage is a property of the
weight chosen beside the A* search, and the shares z (one per device, sum 1) are LP variables
next to the ratios B (`engine.spmd.balance`), bounded by each device's memory and decoupled
from the compute ratios (a big-memory slow GPU holds more state than it computes).

How it fits the search (`engine.spmd.iteration.plan_spmd`): the stages are fixed before a Q<->B
loop runs (`shard_states=1|2|3`: every weight; `auto`: stage 0 when the plan fits, else the
lowest stage per weight, largest weights first, that makes the data-parallel program fit,
`choose_stages`). The search then sees a staged weight's memory as sharded (so models that only
fit sharded are found) and prices its gradient as the bucket all-reduce it replaces (a ring
all-reduce is a reduce-scatter then an all-gather: the same bytes); `evaluate` and the LP price it
exactly: the weight leaves the all-reduce buckets and `StatesTerms` adds, after backward,

    reduce-scatter of the staged gradients + all-gather of the updated stage-1/2 weights
        + (stage 3) an all-gather before forward and one per layer in backward
        + max_j [ (copies + sync inside a virtual device) of the staged bytes + z_j * update of them ]

each collective `latency + Z * bytes / bandwidth` with Z = max_j z_j (padded uneven collectives
move the largest share, the cluster's payload convention), from the cluster's `reduce_scatter`
and `all_gather` fits, with a latency per collective the runner issues (`comm_terms`). Memory per
GPU of device j, P the weight's bytes, F the optimizer's state bytes per parameter byte
(`STATE_BYTES_PER_PARAM_BYTE`, Adam 4 = 16 B a parameter):

    stage 1: 2 P + (F - 2) P z_j     stage 2: P + (F - 1) P z_j     stage 3: F P z_j

plus transients: stage 2 the gradients of one bucket (reduce-scattered when it holds
STAGE2_BUCKET_BYTES), stage 3 the largest layer's gathered weights and their full gradient. A
virtual device's GPUs hold its share whole (data-parallel inside, like its sharded parameters).
Everything stays linear in (B, z, Z), so the LP stays an LP.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import PlanError
from engine.model.graph import Graph
from engine.spmd.program import LOAD, Instruction
from engine.spmd.saved import requires_grad, root_of, saved_positions
from engine.theory.core import FULL, split_sizes

STAGES = (0, 1, 2, 3)

STAGE2_BUCKET_BYTES = 25 * 2**20
"""Stage-2 gradients are reduce-scattered during backward in buckets of at least this many bytes, as
autograd finishes them (DDP's default bucket cap); what is left joins the bucket after backward
(`runner.zero.RankStates`, `stage2_buckets`)."""


@dataclass(frozen=True)
class StateSharding:
    """The stage of every staged weight (absent: 0) and each device's share of their state."""

    stages: dict[int, int]
    """Parameter node id -> stage 1, 2 or 3."""
    shares: tuple[float, ...]
    """Each device's share z_j of every staged weight's sharded state (sums to 1)."""

    def stage(self, node: int) -> int:
        return self.stages.get(node, 0)

    def with_shares(self, shares: list[float] | tuple[float, ...]) -> "StateSharding":
        return StateSharding(self.stages, tuple(shares))


def memory_proportional_shares(memory: list[float]) -> tuple[float, ...]:
    """Shares in proportion to each device's memory: the LP's starting point."""
    total = sum(memory)
    return tuple(m / total for m in memory)


def state_memory(stage: int, nbytes: float, factor: float) -> tuple[float, float]:
    """(bytes every device keeps whole, bytes split by the shares) of one weight at `stage`;
    `factor` is the optimizer's state bytes per parameter byte (weight + gradient + its state)."""
    if stage == 0:
        return factor * nbytes, 0.0
    kept = {1: 2.0, 2: 1.0, 3: 0.0}[stage]  # stage 1 keeps weight and gradient, 2 the weight, 3 nothing
    return kept * nbytes, (factor - kept) * nbytes


@dataclass
class StatesTerms:
    """What a program's staged weights add outside its stages (`engine.spmd.cost.evaluate`, the LP)."""

    staged_bytes: float = 0.0
    """Bytes of the staged weights the program loads Full (their gradients are reduce-scattered)."""
    gathered_bytes: float = 0.0
    """Of those, the stage-1/2 bytes all-gathered after the update."""
    stage3_bytes: float = 0.0
    """Of those, the stage-3 bytes all-gathered in forward and again in backward."""
    backward_buckets: int = 0
    """Buckets of stage-2 gradients reduce-scattered during backward (`stage2_buckets`)."""
    final_bucket: bool = False
    """Whether gradients are left for the bucket after backward (stage 1, the rest of stage 2)."""
    stage3_params: int = 0
    """Stage-3 weights: all gathered in one bucket before forward, their gradients reduce-scattered
    in one bucket."""
    stage3_layers: int = 0
    """Layers whose stage-3 weights backward gathers again, in one bucket per layer (`saved_layers`)."""
    params: list[int] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return self.staged_bytes > 0


def states_terms(program: tuple[Instruction, ...], graph: Graph, states: StateSharding | None) -> StatesTerms:
    """The staged weights of `program` (loaded Full with stage >= 1) and their terms."""
    out = StatesTerms()
    if states is None:
        return out
    stage2: list[float] = []
    for ins in program:
        n = graph[ins.node]
        if ins.kind != LOAD or n.op != "parameter" or ins.post != FULL or not states.stage(ins.node):
            continue
        s, b = states.stage(ins.node), float(n.nbytes)
        out.params.append(ins.node)
        out.staged_bytes += b
        if s == 3:
            out.stage3_bytes += b
            out.stage3_params += 1
        else:
            out.gathered_bytes += b
            out.final_bucket |= s == 1
            if s == 2:
                stage2.append(b)
    out.backward_buckets, left = stage2_buckets(stage2[::-1])  # gradients finish in reverse order of use
    out.final_bucket |= left > 0
    three = [p for p in out.params if states.stage(p) == 3]
    out.stage3_layers = len(saved_layers(graph, three)) if three else 0
    return out


def saved_layers(graph: Graph, params: list[int]) -> set[int]:
    """The layers (`Node.segment`) of the weights of `params` that some instruction keeps for backward
    (`engine.spmd.saved.saved_positions`): the runner gathers a stage-3 layer again, in one bucket, when
    backward first reads one of them (`runner.zero`)."""
    grads = requires_grad(graph)
    saved = {root_of(graph, n.inputs[i]) for n in graph.nodes for i in saved_positions(n, grads)[0]}
    return {graph[p].segment for p in set(params) & saved}


def stage2_buckets(ready: list[float]) -> tuple[int, float]:
    """(buckets reduce-scattered during backward, bytes left for the bucket after it) of stage-2
    gradients of `ready` bytes each, in the order autograd finishes them: a bucket is sent as soon as it
    holds STAGE2_BUCKET_BYTES. The runner applies the same rule."""
    count, pending = 0, 0.0
    for b in ready:
        pending += b
        if pending >= STAGE2_BUCKET_BYTES:
            count, pending = count + 1, 0.0
    return count, pending


def transient_bytes(graph: Graph, states: StateSharding | None) -> float:
    """Transient bytes per GPU of the staged weights, whatever the program (an upper bound: a weight
    the program shards has none): the stage-2 gradients of a bucket not yet sent (under its cap plus the
    gradient that fills it), twice the largest layer's stage-3 weights."""
    if states is None:
        return 0.0
    layer3: dict[int, float] = {}
    largest2 = total2 = 0.0
    for p, s in states.stages.items():
        n = graph[p]
        if s == 3:
            layer3[n.segment] = layer3.get(n.segment, 0.0) + float(n.nbytes)
        elif s == 2:
            largest2, total2 = max(largest2, float(n.nbytes)), total2 + float(n.nbytes)
    return max(min(total2, STAGE2_BUCKET_BYTES + largest2), 2.0 * max(layer3.values(), default=0.0))


def comm_terms(t: StatesTerms, rs: tuple[float, float], ag: tuple[float, float]) -> tuple[float, float]:
    """(constant, per largest share Z) seconds of the staged weights' collectives, given the
    (latency, seconds per byte of the largest share) of one reduce-scatter `rs` and all-gather `ag`.
    A latency per collective the runner issues (`runner.zero`): the stage-2 buckets sent during backward,
    one bucket of the gradients left after it, one of the stage-1/2 weights after the update; for stage 3
    one bucket each way and a gather per layer in backward."""
    if not t.any:
        return 0.0, 0.0
    three = t.stage3_params > 0
    scatters = t.backward_buckets + int(t.final_bucket) + int(three)
    gathers = int(t.gathered_bytes > 0) + int(three) + t.stage3_layers
    const = scatters * rs[0] + gathers * ag[0]
    per = t.staged_bytes * rs[1] + t.gathered_bytes * ag[1] + 2 * t.stage3_bytes * ag[1]
    return const, per


def all_params_at(graph: Graph, stage: int) -> dict[int, int]:
    """Every parameter at `stage` (a parameter the program shards ignores it)."""
    return {} if stage == 0 else {n.id: stage for n in graph.parameters}


def choose_stages(graph: Graph, need: list[float], capacity: list[float], factor: float,
                  shares: tuple[float, ...]) -> dict[int, int] | None:
    """`auto`: the lowest stage per weight, largest weights first, that brings every device's bytes
    per GPU `need` (at stage 0) under its `capacity`, state split by `shares`. None when even stage 3
    everywhere does not fit."""
    params = sorted(graph.parameters, key=lambda n: (-n.nbytes, n.id))
    stages: dict[int, int] = {}
    need = list(need)
    for stage in (1, 2, 3):
        for n in params:
            if all(x <= cap for x, cap in zip(need, capacity)):
                return stages
            old_r, old_z = state_memory(stages.get(n.id, 0), float(n.nbytes), factor)
            new_r, new_z = state_memory(stage, float(n.nbytes), factor)
            need = [x - (old_r - new_r) - (old_z - new_z) * z for x, z in zip(need, shares)]
            stages[n.id] = stage
    return stages if all(x <= cap for x, cap in zip(need, capacity)) else None


# --- the plan's record ------------------------------------------------------------------------

def flat_sizes(numel: int, shares: tuple[float, ...] | list[float]) -> list[int]:
    """Integer elements of a staged weight's flattened numel on every device (sum exactly numel)."""
    return split_sizes(numel, list(shares))


def to_record(graph: Graph, program: tuple[Instruction, ...], states: StateSharding | None) -> dict:
    """The plan's `shard_states` field: stages and sizes of the staged weights the program loads
    Full, by name, and the shares; empty when none is staged (plans without it load unchanged)."""
    if states is None:
        return {}
    staged = states_terms(program, graph, states).params
    if not staged:
        return {}
    return {"stages": {graph[p].name: states.stage(p) for p in staged},
            "shares": list(states.shares),
            "sizes": {graph[p].name: flat_sizes(graph[p].numel, states.shares) for p in staged}}


def from_record(graph: Graph, record: dict) -> StateSharding | None:
    """The StateSharding of a plan's `shard_states` field (None when empty)."""
    if not record:
        return None
    by_name = {n.name: n.id for n in graph.parameters}
    try:
        stages = {by_name[name]: int(s) for name, s in record["stages"].items()}
    except KeyError as e:
        raise PlanError(f"shard_states.stages names {e.args[0]!r}, which is no parameter of the plan's graph; "
                        "regenerate the plan with `hap plan`") from None
    return StateSharding(stages, tuple(float(x) for x in record["shares"]))


def summary_line(record: dict, num_params: int) -> str:
    """`states: ZeRO-3 on 290 of 291 weights, shares 0.07..0.05` (the plan's summary)."""
    stages = record.get("stages", {})
    if not stages:
        return ""
    counts = {s: sum(1 for v in stages.values() if v == s) for s in (1, 2, 3)}
    parts = ", ".join(f"ZeRO-{s} on {c} of {num_params} weights" for s, c in counts.items() if c)
    shares = record.get("shares", [])
    return f"states: {parts}, shares {max(shares):.3g}..{min(shares):.3g}" if shares else f"states: {parts}"


# --- validation (engine.spmd.validate raises what these find) ---------------------------------

def record_schema_problem(record: Any) -> tuple[str, str] | None:
    """(path, problem) of the first malformed part of a plan's `shard_states` JSON, or None."""
    if not isinstance(record, dict):
        return "shard_states", f"must be an object, got {type(record).__name__}"
    if not record:
        return None
    for key, kind in (("stages", dict), ("shares", list), ("sizes", dict)):
        if not isinstance(record.get(key), kind):
            return f"shard_states.{key}", f"must be a {kind.__name__}"
    for name, s in record["stages"].items():
        if not _is_int(s) or s not in (1, 2, 3):
            return f"shard_states.stages[{json.dumps(name)}]", f"{s!r} is not a ZeRO stage (1, 2 or 3)"
    for j, z in enumerate(record["shares"]):
        if not _is_number(z) or not math.isfinite(z) or z < 0:
            return f"shard_states.shares[{j}]", f"{z!r} is not a finite non-negative number"
    for name, row in record["sizes"].items():
        if not isinstance(row, list) or not all(_is_int(x) and x >= 0 for x in row):
            return f"shard_states.sizes[{json.dumps(name)}]", "must be a list of non-negative integers"
    return None


def record_problem(graph: Graph, program: tuple[Instruction, ...], world: int, record: dict) -> tuple[str, str] | None:
    """(path, problem) where a plan's `shard_states` disagrees with its program and devices, or None:
    every staged weight is a parameter the program loads Full, one share per device summing to 1, and
    each weight's sizes are `flat_sizes` of its numel at those shares."""
    if not record:
        return None
    shares = record["shares"]
    if len(shares) != world:
        return "shard_states.shares", f"has {len(shares)} shares but the plan has {world} devices"
    if abs(math.fsum(shares) - 1) > 1e-6:
        return "shard_states.shares", f"shares sum to {math.fsum(shares):.9g}, not 1"
    full = {graph[i.node].name: graph[i.node] for i in program
            if i.kind == LOAD and i.post == FULL and graph[i.node].op == "parameter"}
    if set(record["sizes"]) != set(record["stages"]):
        return "shard_states.sizes", "must name exactly the weights of shard_states.stages"
    for name in record["stages"]:
        if name not in full:
            return f"shard_states.stages[{json.dumps(name)}]", "is no parameter the program loads Full"
        want = flat_sizes(full[name].numel, shares)
        if record["sizes"][name] != want:
            got = record["sizes"][name]
            return f"shard_states.sizes[{json.dumps(name)}]", f"{got} are not {want} ({full[name].numel} elements at the shares)"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
