"""Pipeline schedules (HAPT §4): GPipe, 1F1B, Eager-1F1B and H-1F1B as task lists for the timeline.

A pipeline of S stages runs B microbatches. Stage i (1-indexed, as in the paper) spends t_f[i]
on a microbatch's forward and t_b[i] on its backward; c_i is the transfer time of one microbatch's
boundary tensor between stages i and i+1, the same both ways (activations forward, their
gradients backward). Every stage is a compute resource; every link is two resources, one per
direction (full duplex, HAPT §4.2.1: transfers in one direction queue). The schedule is the order
in which each stage runs its tasks: N_i forwards of warm-up, then one backward and one forward in
turn, then the remaining backwards. The warm-up counts N_i distinguish the schedules:

    GPipe       N_i = B                      (all forwards, then all backwards)
    1F1B        N_i = S - i + 1              (Narayanan et al. 2019; HAPT §2.1)
    Eager-1F1B  N_i = 2(S - i) + 1           (Zhuang et al. 2023; HAPT §2.3.1)
    H-1F1B      N_S = 1, N_i = N_{i+1} + delta_i, delta_i = ceil(1 + 2 c_i / t_max)   (HAPT Eq. 1, 10, 11)

each capped at B; t_max = max_i (t_f[i] + t_b[i]). `engine.timeline.simulate` is the ground
truth of the iteration time; `closed_form_s` is HAPT Eq. 13, T = sum_i (t_i + 2 c_i) + (B - 1) t_max,
which HAPT derives for every c_i <= t_max with the faster stages "stretched" to t_max (§4.2.4).
Checked against the simulator (tests/test_schedule.py): with equal stages, t_b >= t_f and B >= N_1
it is exact whenever every c_i <= t_max / 2; for t_max / 2 < c_i <= t_max the steady phase stays
bubble-free but stage 1's N_1 warm-up forwards can outlast microbatch 1's round trip, so Eq. 13
comes out a little low (a few percent). With unequal stages it is an estimate; the planner ranks
its finalists by the simulator.

HAPT Eq. 2 also lets delta_i = 1 when c_i <= epsilon * t_max for "a small positive constant"
epsilon (it trades a steady-phase bubble of at most c_i per microbatch for one microbatch less
of activations); `warmup_counts(..., epsilon=)` takes it, 0 by default (the exact rule).

Peak activation memory of a stage = the most microbatches it holds at once (forward started,
backward not yet ended) times its activations per microbatch. A stage's `sync_s` (its gradient
all-reduce and optimizer step) runs after its last backward and counts in the iteration time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import PlanError
from engine.timeline import Schedule, Task, simulate

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "h-1f1b")
"""Schedule names, in the order the Compare page lists them."""


@dataclass(frozen=True)
class StageTimes:
    """What the schedule needs to know of one stage, per microbatch."""

    forward_s: float
    """Seconds of one microbatch's forward on this stage (t_f)."""
    backward_s: float
    """Seconds of one microbatch's backward on this stage (t_b)."""
    activation_bytes: float = 0.0
    """Bytes kept from one microbatch's forward until its backward, per device of the stage."""
    sync_s: float = 0.0
    """Seconds after the stage's last backward: gradient all-reduce inside its group and optimizer step."""

    @property
    def total_s(self) -> float:
        """t_i = t_f + t_b (HAPT §4.1)."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Pipeline:
    """Stages, the transfers between neighbours and the number of microbatches."""

    stages: tuple[StageTimes, ...]
    transfer_s: tuple[float, ...]
    """c_i for i = 1 .. S-1: seconds to send one microbatch's boundary tensor from stage i to i+1 (or back)."""
    microbatches: int

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError("pipeline: stages is empty; a pipeline has at least one stage")
        if len(self.transfer_s) != len(self.stages) - 1:
            raise PlanError(f"pipeline: transfer_s has {len(self.transfer_s)} entries for {len(self.stages)} stages; "
                            f"give one per boundary ({len(self.stages) - 1})")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"pipeline: microbatches = {self.microbatches!r}; it must be a positive integer")
        times = [x for s in self.stages for x in (s.forward_s, s.backward_s, s.sync_s)] + list(self.transfer_s)
        if not all(math.isfinite(x) and x >= 0 for x in times):
            raise PlanError("pipeline: every stage time and transfer time must be a finite number >= 0")

    @property
    def t_max(self) -> float:
        """The slowest stage's forward + backward per microbatch."""
        return max(s.total_s for s in self.stages)


@dataclass
class PipelineRun:
    """One schedule of a pipeline, simulated."""

    schedule: str
    warmup: tuple[int, ...]
    """N_i per stage (capped at B)."""
    iteration_s: float
    """Makespan of the simulated iteration (syncs included)."""
    in_flight: tuple[int, ...]
    """Most microbatches each stage holds at once."""
    peak_activation_bytes: tuple[float, ...]
    """in_flight x activations per microbatch, per stage."""
    timeline: Schedule


def warmup_counts(schedule: str, pipeline: Pipeline, epsilon: float = 0.0) -> tuple[int, ...]:
    """N_i of `schedule` for every stage (index 0 is the paper's stage 1), capped at B."""
    S, B = len(pipeline.stages), pipeline.microbatches
    if schedule == "gpipe":
        raw = [B] * S
    elif schedule == "1f1b":
        raw = [S - i for i in range(S)]  # S - i + 1 with 1-indexed i
    elif schedule == "eager-1f1b":
        raw = [2 * (S - 1 - i) + 1 for i in range(S)]
    elif schedule == "h-1f1b":
        raw = h1f1b_counts(pipeline.transfer_s, pipeline.t_max, epsilon)
    else:
        raise PlanError(f"unknown pipeline schedule {schedule!r} (choose one of: {', '.join(SCHEDULES)})")
    return tuple(min(n, B) for n in raw)


def h1f1b_counts(transfer_s: tuple[float, ...] | list[float], t_max: float, epsilon: float = 0.0) -> list[int]:
    """H-1F1B warm-up counts before the cap (HAPT Eq. 1, 2, 10): N_S = 1, N_i = N_{i+1} + delta_i."""
    counts = [1]
    for c in reversed(transfer_s):
        counts.append(counts[-1] + h1f1b_delta(c, t_max, epsilon))
    return counts[::-1]


def h1f1b_delta(c: float, t_max: float, epsilon: float = 0.0) -> int:
    """Extra forwards stage i launches over stage i+1: ceil(1 + 2 c_i / t_max), or 1 when c_i <= epsilon t_max."""
    if c <= epsilon * t_max or c == 0:
        return 1
    if t_max <= 0:
        raise PlanError("h-1f1b: every stage takes 0 s per microbatch, so no transfer can be hidden behind it")
    return math.ceil(1 + 2 * c / t_max)


def stage_order(warmup: int, microbatches: int) -> list[tuple[str, int]]:
    """A stage's tasks in run order: `warmup` forwards, then backward/forward in turn, then the backwards left."""
    warmup = min(warmup, microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches):
        order.append(("B", m))
        if warmup + m < microbatches:
            order.append(("F", warmup + m))
    return order


def pipeline_tasks(pipeline: Pipeline, warmup: tuple[int, ...]) -> list[Task]:
    """The task graph of one iteration (HAPT §4.2.1: F, B, C^F, C^B nodes) on stage and link resources."""
    S, B = len(pipeline.stages), pipeline.microbatches
    if len(warmup) != S or any(not 1 <= n <= B for n in warmup):
        raise PlanError(f"pipeline: warm-up counts {warmup} must give each of the {S} stages 1..{B} forwards")
    tasks: list[Task] = []
    for s, stage in enumerate(pipeline.stages):
        for kind, m in stage_order(warmup[s], B):
            tasks.append(_compute_task(kind, s, m, stage, S))
        if stage.sync_s:
            tasks.append(Task(f"sync{s}", f"stage{s}", stage.sync_s, (), "grad_sync", {"stage": s}))
    for s, c in enumerate(pipeline.transfer_s):
        for m in range(B):
            tasks.append(Task(f"CF{s}.{m}", f"link{s}>{s + 1}", c, (f"F{s}.{m}",), "transfer",
                              {"stage": s, "microbatch": m, "direction": "forward"}))
        for m in range(B):
            tasks.append(Task(f"CB{s}.{m}", f"link{s + 1}>{s}", c, (f"B{s + 1}.{m}",), "transfer",
                              {"stage": s + 1, "microbatch": m, "direction": "backward"}))
    return tasks


def _compute_task(kind: str, s: int, m: int, stage: StageTimes, S: int) -> Task:
    """F{s}.{m} waits for its activations from stage s-1; B{s}.{m} for its gradient from stage s+1."""
    if kind == "F":
        after = (f"CF{s - 1}.{m}",) if s > 0 else ()
        return Task(f"F{s}.{m}", f"stage{s}", stage.forward_s, after, "forward", {"stage": s, "microbatch": m})
    after = (f"CB{s}.{m}",) if s < S - 1 else ()
    return Task(f"B{s}.{m}", f"stage{s}", stage.backward_s, after, "backward", {"stage": s, "microbatch": m})


def in_flight(warmup: int, microbatches: int) -> int:
    """Most microbatches a stage holds at once under its order (a forward allocates, its backward frees)."""
    held = peak = 0
    for kind, _ in stage_order(warmup, microbatches):
        held += 1 if kind == "F" else 0
        peak = max(peak, held)
        held -= 1 if kind == "B" else 0
    return peak


def run_schedule(pipeline: Pipeline, schedule: str, epsilon: float = 0.0,
                 warmup: tuple[int, ...] | None = None) -> PipelineRun:
    """Simulate `schedule` on `pipeline`: iteration time, warm-up counts and peak activations per stage.
    `warmup` overrides the schedule's counts (e.g. H-1F1B computed for a larger t_max, to fit memory)."""
    warmup = warmup if warmup is not None else warmup_counts(schedule, pipeline, epsilon)
    timeline = simulate(pipeline_tasks(pipeline, warmup))
    held = tuple(in_flight(n, pipeline.microbatches) for n in warmup)
    peak = tuple(h * s.activation_bytes for h, s in zip(held, pipeline.stages))
    return PipelineRun(schedule, warmup, timeline.makespan_s, held, peak, timeline)


def closed_form_s(pipeline: Pipeline) -> float:
    """HAPT Eq. 13: T = sum_i (t_i + 2 c_i) + (B - 1) t_max, for H-1F1B when every c_i <= t_max (syncs excluded)."""
    t_max = pipeline.t_max
    if any(c > t_max for c in pipeline.transfer_s):
        raise PlanError(f"closed form: a transfer ({max(pipeline.transfer_s):.3g} s) exceeds t_max ({t_max:.3g} s), "
                        "so it cannot be hidden; use run_schedule (the simulator) instead")
    return (sum(s.total_s for s in pipeline.stages) + 2 * sum(pipeline.transfer_s)
            + (pipeline.microbatches - 1) * t_max)


def steady_idle_s(run: PipelineRun, stage: int) -> float:
    """Idle seconds of `stage` between its first backward's start and its last forward's end (the steady phase)."""
    spans = [s for s in run.timeline.spans
             if s.task.resource == f"stage{stage}" and s.task.kind in ("forward", "backward")]
    first_b = next((k for k, s in enumerate(spans) if s.task.kind == "backward"), None)
    last_f = max((k for k, s in enumerate(spans) if s.task.kind == "forward"), default=None)
    if first_b is None or last_f is None or last_f < first_b:
        return 0.0
    window = spans[first_b:last_f + 1]
    return (window[-1].end_s - window[0].start_s) - sum(s.end_s - s.start_s for s in window)
