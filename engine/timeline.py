"""The one timeline simulator: tasks on resources with dependencies, and when each starts and ends.

Every time figure that involves overlap is the makespan of a small task graph: a device's compute
stream and its network link are resources; the gradient buckets of data parallelism (DDP), the
two half-batches of duplex (HiDup) and the microbatches of a pipeline schedule (HAPT) are tasks
on them. The cost model keeps closed forms for speed (A* bounds, LP constraints); tests check
those against this simulator, and the Timeline page draws its output.

Semantics: each resource runs its tasks one at a time *in the order they are listed* (the order
is part of the schedule: 1F1B, a bucket queue, alternating halves); a task starts when its
resource has finished the task before it on that resource and all its dependencies have ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import PlanError


@dataclass(frozen=True)
class Task:
    """One piece of work: `duration_s` on `resource` after every task named in `after` has ended."""

    name: str
    resource: str
    duration_s: float
    after: tuple[str, ...] = ()
    kind: str = "compute"
    """What it is, for drawing: `compute`, `comm`, `grad_bucket`, `transfer`, ..."""
    info: dict = field(default_factory=dict, compare=False, hash=False)
    """Free-form labels carried to the output (stage, microbatch, half, device)."""


@dataclass(frozen=True)
class Span:
    """A task placed on the timeline."""

    task: Task
    start_s: float
    end_s: float


@dataclass
class Schedule:
    """The simulated timeline: every task's span, in the order given."""

    spans: list[Span]

    @property
    def makespan_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    def end_of(self, name: str) -> float:
        return next(s.end_s for s in self.spans if s.task.name == name)

    def busy_s(self, resource: str) -> float:
        """Seconds `resource` is working (the rest of the makespan it idles)."""
        return sum(s.end_s - s.start_s for s in self.spans if s.task.resource == resource)

    def rows(self) -> list[dict]:
        """One plain dict per span (for tables and charts)."""
        return [{"name": s.task.name, "resource": s.task.resource, "kind": s.task.kind, "start_s": s.start_s,
                 "end_s": s.end_s, **s.task.info} for s in self.spans]


def simulate(tasks: list[Task]) -> Schedule:
    """Place every task as early as its resource order and dependencies allow.

    Raises PlanError on a duplicate name, an unknown dependency, a negative duration, or a cycle
    (a dependency on a task that, through the resource orders, waits for the task itself)."""
    by_name: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if t.name in by_name:
            raise PlanError(f"timeline: two tasks are named '{t.name}'")
        if not t.duration_s >= 0:
            raise PlanError(f"timeline: task '{t.name}' has duration {t.duration_s}; durations must be >= 0")
        by_name[t.name] = i
    for t in tasks:
        missing = [d for d in t.after if d not in by_name]
        if missing:
            raise PlanError(f"timeline: task '{t.name}' waits for unknown task(s) {missing}")
    queues: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        queues.setdefault(t.resource, []).append(i)
    head = {r: 0 for r in queues}
    free = {r: 0.0 for r in queues}
    end: list[float | None] = [None] * len(tasks)
    start: list[float] = [0.0] * len(tasks)
    placed = 0
    while placed < len(tasks):
        progressed = False
        for r, queue in queues.items():
            while head[r] < len(queue):
                i = queue[head[r]]
                deps = [end[by_name[d]] for d in tasks[i].after]
                if any(e is None for e in deps):
                    break
                start[i] = max([free[r], *deps])
                end[i] = free[r] = start[i] + tasks[i].duration_s
                head[r] += 1
                placed += 1
                progressed = True
        if not progressed:
            stuck = [tasks[q[head[r]]].name for r, q in queues.items() if head[r] < len(q)]
            raise PlanError(f"timeline: the schedule deadlocks; these tasks wait on each other: {stuck[:6]}")
    return Schedule([Span(t, start[i], end[i]) for i, t in enumerate(tasks)])  # type: ignore[arg-type]


def chain(prefix: str, resource: str, durations: list[float], kind: str = "compute",
          after: tuple[str, ...] = ()) -> list[Task]:
    """Tasks that run one after another on one resource (names `prefix0`, `prefix1`, ...)."""
    out: list[Task] = []
    for k, d in enumerate(durations):
        out.append(Task(f"{prefix}{k}", resource, d, after if k == 0 else (), kind))
    return out
