"""`PlanOptions`: every choice that shapes a plan, checked once and passed down the plan path whole.

`engine.plan`, the CLI and the workbench build one `PlanOptions`; the planner hands it to the SPMD
loop, the pipeline planner and the stages' searches unchanged (or `replace`d for one field, e.g. a
stage's share of the time budget), and the plan records it in `search["options"]`, so a plan says
how it was made. A concern that crosses capabilities (precision, recompute, state sharding) is one
more field here and one term in the cost and memory models.

This module is on the ground floor: it imports nothing of the engine but errors and limits, so the
vocabularies below are the one place the names live (the cost model keys its tables by them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine import limits
from engine.errors import PlanError

OPTIMIZERS = ("adam", "sgd", "none")
"""Optimizers the cost model prices (their state per parameter and their update traffic)."""
OVERLAP_MODES = ("none", "ddp", "duplex")
"""How communication overlaps computation: `none` (gradients all-reduced after backward), `ddp`
(gradient buckets all-reduced during backward) or `duplex` (two half-batches, HiDup)."""
PLAN_OVERLAPS = ("auto", *OVERLAP_MODES)
"""What `overlap=` accepts: `auto` plans in ddp and in duplex and keeps the faster."""
PARALLELISMS = ("spmd", "pipeline", "auto")
"""What `parallelism=` accepts: `auto` plans an SPMD and a pipeline plan and keeps the faster."""
DEFAULT_BEAM_WIDTH = 16
"""States kept per graph position by the A* search (None: exact search, exponential on real models)."""
MAX_BEAM_WIDTH = 1_000_000
MAX_ITERATIONS = 1000
"""Q<->B iterations of one loop; it stops much earlier, when Q repeats."""
MAX_MICROBATCHES = 2**20
PRECISIONS = ("fp32", "bf16", "fp16")
"""Training precisions: `fp32`, or mixed precision under `torch.autocast` in bf16 or fp16 (fp16 with a
dynamic loss scaler). Parameters, gradients and optimizer state stay fp32 under autocast."""
GRAD_DTYPES = ("fp32", "bf16")
"""The dtype gradients are all-reduced in: fp32, or bf16 as DDP's bf16 compression hook does."""
RECOMPUTE = ("auto", "none", "all")
"""Activation recomputation per layer: `auto` recomputes only where memory binds (the fewest, cheapest
layers that make the plan fit), `none` keeps every activation, `all` recomputes every layer."""
SHARD_STATES = ("auto", 0, 1, 2, 3)
"""Sharding of a replicated weight's states across its devices (ZeRO stages): 0 none, 1 optimizer state,
2 and its gradient (reduce-scatter), 3 and the weight itself at rest (all-gathered on use); `auto` picks
the stage per weight where it is needed to fit."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How to plan: each field is checked in `__post_init__`, and a bad one raises one `PlanError`
    line naming it and the values it takes."""

    optimizer: str = "adam"
    """The optimizer the plan is priced for: its state is kept per parameter and its update timed."""
    time_budget_s: float | None = None
    """Seconds the whole search may take (None: until it finishes); the best plan found is returned."""
    overlap: str = "auto"
    """The overlap mode to plan in (`PLAN_OVERLAPS`)."""
    parallelism: str = "spmd"
    """SPMD (HAP), a pipeline of SPMD stages (HAPT), or `auto`: both, the faster kept (`PARALLELISMS`)."""
    microbatches: int | None = None
    """A pipeline's microbatch count B (None: searched); only for `pipeline` and `auto`."""
    segments: int = 1
    """Runs of layers with their own ratios (HAP §5.2); 1 is one ratio vector for the whole model."""
    beam_width: int | None = DEFAULT_BEAM_WIDTH
    """States the A* search keeps per graph position (None: exact)."""
    max_iterations: int = 6
    """Q<->B iterations at most per loop (HAP §3.1)."""
    report_every: int = 500
    """States expanded between two progress reports of a search (the workbench's live frontier)."""
    precision: str = "fp32"
    """`fp32`, or mixed precision under autocast: `bf16` or `fp16` (`PRECISIONS`)."""
    grad_dtype: str = "fp32"
    """The dtype gradients are all-reduced in (`GRAD_DTYPES`)."""
    recompute: str = "auto"
    """Which layers recompute their activations in backward (`RECOMPUTE`)."""
    shard_states: str | int = "auto"
    """ZeRO stage of replicated weights' states, 0-3, or `auto` per weight (`SHARD_STATES`)."""

    def __post_init__(self) -> None:
        problem = limits.time_budget_problem(self.time_budget_s, "time_budget_s")
        if problem:
            raise PlanError(problem)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("overlap", self.overlap, PLAN_OVERLAPS)
        _choice("parallelism", self.parallelism, PARALLELISMS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("grad_dtype", self.grad_dtype, GRAD_DTYPES)
        _choice("recompute", self.recompute, RECOMPUTE)
        if isinstance(self.shard_states, str) and self.shard_states in ("0", "1", "2", "3"):
            object.__setattr__(self, "shard_states", int(self.shard_states))  # the CLI's spelling
        if isinstance(self.shard_states, bool) or self.shard_states not in SHARD_STATES:
            raise PlanError(f"shard_states {self.shard_states!r} is not known (choose one of: auto, 0, 1, 2, 3)")
        _count("segments", self.segments, limits.MAX_SEGMENTS)
        _count("max_iterations", self.max_iterations, MAX_ITERATIONS)
        _count("report_every", self.report_every, limits.MAX_STEPS)
        if self.beam_width is not None:
            _count("beam_width", self.beam_width, MAX_BEAM_WIDTH, "or None for an exact search")
        if self.microbatches is not None:
            _count("microbatches", self.microbatches, MAX_MICROBATCHES, "or None to search")
            if self.parallelism == "spmd":
                raise PlanError("microbatches applies to pipeline plans; use parallelism='pipeline' or 'auto' "
                                "(an SPMD plan runs the whole batch at once)")

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON-ready data (what a plan records in `search["options"]`)."""
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "PlanOptions":
        """Options recorded by a plan; unknown keys are refused by name, missing ones take their defaults."""
        if not isinstance(d, dict):
            raise PlanError(f"options must be an object of option names to values, got {type(d).__name__}")
        known = {f.name for f in fields(PlanOptions)}
        extra = sorted(set(d) - known)
        if extra:
            raise PlanError(f"option {extra[0]!r} is not known (the options are: {', '.join(sorted(known))})")
        return PlanOptions(**d)

    def with_budget(self, time_budget_s: float | None) -> "PlanOptions":
        """The same options with another time budget (a share of the whole, for one part of the search)."""
        return replace(self, time_budget_s=time_budget_s)


def options_of(options: PlanOptions | None, **overrides: Any) -> PlanOptions:
    """`options` with `overrides` (keyword arguments of the old flat signatures) applied, or new
    options from the overrides alone; each is checked by `PlanOptions`."""
    known = {f.name for f in fields(PlanOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise PlanError(f"option {unknown[0]!r} is not known (the options are: {', '.join(sorted(known))})")
    return replace(options, **overrides) if options is not None else PlanOptions(**overrides)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise PlanError(f"{name} {value!r} is not known (choose one of: {', '.join(allowed)})")


def _count(name: str, value: Any, high: int, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        extra = f" {alternative}" if alternative else ""
        raise PlanError(f"{name} = {value!r}; give an integer from 1 to {high}{extra}")
