"""A training run as its metrics file shows it: loss, eval-loss, learning-rate, grad-norm and speed series,
summary figures, and its measured step time beside a plan's predicted iteration.

The file is the JSON lines `hap run PLAN --metrics FILE` appends (runner.launch): a step record per step
and rank (`loss` is the step's global loss, the same on every rank), an evaluation record of rank 0 per
evaluation (`eval_loss`, `eval_tokens`, no `loss`), and events (`{"event": ...}`, elastic switches).
Files written before lr, grad_norm and evaluations were recorded load too: a missing field is a missing
point. Pure data, no Streamlit or Altair, so the Runs page and bench/plot_metrics.py read runs alike.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from engine.errors import HapError
from engine.readers import check_size, parse_json

STEP_FIELDS = ("loss", "step_time_s", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu")
"""Numeric fields of a step record the Runs page draws or sums up (each optional but `loss`)."""
EVAL_FIELDS = ("eval_loss", "eval_tokens")
SERIES_CHARTS = (("lr", "Learning rate", "lr"), ("grad_norm", "Gradient norm", "before clipping"),
                 ("tokens_per_s", "Throughput", "tokens/s"))
"""(StepPoint field, chart title, axis title) of the figures drawn beside the loss."""
LOSS_COLUMNS = ("first_loss", "last_loss", "min_loss", "first_eval_loss", "last_eval_loss")
"""Columns of `summary_rows` that hold losses."""


class MetricsError(HapError, ValueError):
    """An uploaded metrics file is not the JSON lines `hap run --metrics` writes."""


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """Records of a runner metrics file (JSON lines, one per step and rank; see runner.launch), each
    line parsed within engine.readers' bounds (the upload is a user's file like any other). Event
    records (`{"event": ...}`, an elastic switch) need no step or rank."""
    check_size(len(text), "metrics file", MetricsError)
    records = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_json(line, f"metrics file line {k}", MetricsError)
        if not isinstance(rec, dict) or ("event" not in rec and ("rank" not in rec or "step" not in rec)):
            raise MetricsError(f"metrics file line {k}: a record needs 'step' and 'rank' (written by `hap run --metrics`)")
        records.append(rec)
    if not records:
        raise MetricsError("metrics file: empty; run `hap run PLAN --metrics FILE --timing` to record one")
    return records


@dataclass(frozen=True)
class StepPoint:
    """One optimiser step: rank 0's figures, and the slowest rank's step time (the step waits for it)."""

    step: int
    loss: float | None
    step_time_s: float | None
    lr: float | None = None
    grad_norm: float | None = None
    tokens: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None


@dataclass(frozen=True)
class EvalPoint:
    step: int
    eval_loss: float | None
    eval_tokens: float | None = None


@dataclass(frozen=True)
class Run:
    """A metrics file read as one run, its steps and evaluations in step order."""

    name: str
    steps: tuple[StepPoint, ...]
    evals: tuple[EvalPoint, ...]
    events: tuple[dict[str, Any], ...]
    world_size: int
    """Ranks of the run's last stretch: after its last elastic switch, the switch's new world."""
    since_step: int
    """First step run at `world_size` (0 unless an elastic switch changed the world)."""
    grad_accum: int | None
    """Microsteps per step when the records say (`grad_accum`); a plan's iteration is one microstep."""
    nonfinite_steps: tuple[int, ...]
    """Steps whose loss was NaN or infinite (drawn as gaps)."""

    @property
    def steady_steps(self) -> tuple[StepPoint, ...]:
        """The steps at the final world size, after the first (which pays allocation and warm-up)."""
        timed = [s for s in self.steps if s.step >= self.since_step and s.step_time_s is not None]
        return tuple(timed[1:] or timed)


def load_run(name: str, text: str) -> Run:
    """The run in a metrics file's text; MetricsError naming the file, line or record when it is not one."""
    try:
        return run_from_records(name, parse_metrics(text))
    except MetricsError as e:
        raise MetricsError(f"{name}: {e}") from None


def run_from_records(name: str, records: list[dict[str, Any]]) -> Run:
    """Group records by step; a later record of the same step and rank replaces an earlier one (a step
    run again after a resume)."""
    events = tuple(r for r in records if "event" in r)
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    evals: dict[int, EvalPoint] = {}
    for r in records:
        if "event" in r:
            continue
        step, rank = _int(r, "step"), _int(r, "rank")
        if "eval_loss" in r and "loss" not in r:
            evals[step] = EvalPoint(step, *(_number(r, f) for f in EVAL_FIELDS))
        else:
            by_step.setdefault(step, {})[rank] = r
    if not any("loss" in r for ranks in by_step.values() for r in ranks.values()):
        raise MetricsError("no record has a 'loss'; it is not a training run's metrics (`hap run PLAN --metrics FILE`)")
    steps = tuple(_step_point(step, by_step[step]) for step in sorted(by_step))
    world, since = _final_world(events, by_step)
    return Run(name=name, steps=steps, evals=tuple(evals[s] for s in sorted(evals)), events=events,
               world_size=world, since_step=since, grad_accum=_grad_accum(by_step),
               nonfinite_steps=tuple(s.step for s in steps if s.loss is None and _has_loss(by_step[s.step])))


def _step_point(step: int, ranks: dict[int, dict[str, Any]]) -> StepPoint:
    first = ranks[min(ranks)]
    times = [t for t in (_number(r, "step_time_s") for r in ranks.values()) if t is not None]
    values = {f: _number(first, f) for f in STEP_FIELDS if f != "step_time_s"}
    return StepPoint(step=step, step_time_s=max(times) if times else None, **values)


def _has_loss(ranks: dict[int, dict[str, Any]]) -> bool:
    return ranks[min(ranks)].get("loss") is not None


def _final_world(events: tuple[dict[str, Any], ...], by_step: dict[int, dict[int, dict]]) -> tuple[int, int]:
    """(world size, first step) of the run's last stretch: the last switch's `new_world` from its
    `resume_step` on, else every rank that recorded a step."""
    switches = [e for e in events if _count(e.get("new_world")) >= 1 and _count(e.get("resume_step")) >= 0]
    if switches:
        return switches[-1]["new_world"], switches[-1]["resume_step"]
    return len({rank for ranks in by_step.values() for rank in ranks}), 0


def _grad_accum(by_step: dict[int, dict[int, dict]]) -> int | None:
    """The one microsteps-per-step count every record that has one agrees on, else None (ask the user)."""
    counts = {_count(r["grad_accum"]) for ranks in by_step.values() for r in ranks.values()
              if r.get("grad_accum") is not None}
    return counts.pop() if len(counts) == 1 and min(counts) >= 1 else None


def _count(v: Any) -> int:
    """`v` when it is a whole number (not a bool), else -1."""
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _int(record: dict[str, Any], field: str) -> int:
    v = record.get(field)
    if _count(v) < 0:
        raise MetricsError(f"record {_where(record)}: '{field}' is {v!r}, not a step or rank number (>= 0)")
    return v


def _number(record: dict[str, Any], field: str) -> float | None:
    """A field as a finite float; None when absent, null or not finite (NaN loss of a diverged step)."""
    v = record.get(field)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise MetricsError(f"record {_where(record)}: '{field}' is {v!r}, not a number or null")
    return float(v) if math.isfinite(v) else None


def _where(record: dict[str, Any]) -> str:
    return f"of step {record.get('step')!r}, rank {record.get('rank')!r}"


# ----------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Summary:
    """The figures a run is judged by; None where the file does not record them."""

    steps: int
    ranks: int
    first_loss: float | None
    last_loss: float | None
    min_loss: float | None
    first_eval_loss: float | None
    last_eval_loss: float | None
    eval_drop_pct: float | None
    """How far evaluation loss fell from the first evaluation to the last, in % of the first."""
    mean_tokens_per_s: float | None
    mean_step_time_s: float | None
    """Over the steady steps (see `Run.steady_steps`)."""
    mean_mfu: float | None


def summarise(run: Run) -> Summary:
    losses = [s.loss for s in run.steps if s.loss is not None]
    evals = [e.eval_loss for e in run.evals if e.eval_loss is not None]
    steady = run.steady_steps
    return Summary(steps=len(run.steps), ranks=run.world_size,
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   min_loss=min(losses, default=None),
                   first_eval_loss=evals[0] if evals else None, last_eval_loss=evals[-1] if evals else None,
                   eval_drop_pct=drop_pct(evals[0], evals[-1]) if len(evals) > 1 else None,
                   mean_tokens_per_s=_mean(s.tokens_per_s for s in steady),
                   mean_step_time_s=_mean(s.step_time_s for s in steady),
                   mean_mfu=_mean(s.mfu for s in steady))


def drop_pct(first: float, last: float) -> float | None:
    """(first - last) / first in %; None when the first is not positive (a drop of it means nothing)."""
    return 100.0 * (first - last) / first if first > 0 else None


def _mean(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summary_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One table row per run."""
    rows = []
    for run in runs:
        s = summarise(run)
        rows.append({"run": run.name, "ranks": s.ranks, "steps": s.steps, "first_loss": s.first_loss,
                     "last_loss": s.last_loss, "min_loss": s.min_loss, "first_eval_loss": s.first_eval_loss,
                     "last_eval_loss": s.last_eval_loss, "eval_drop_%": s.eval_drop_pct,
                     "tokens_per_s": s.mean_tokens_per_s,
                     "step_ms": None if s.mean_step_time_s is None else s.mean_step_time_s * 1e3,
                     "mfu_%": None if s.mean_mfu is None else s.mean_mfu * 100})
    return rows


def run_notes(runs: list[Run]) -> list[str]:
    """What a reader should know before trusting the curves: diverged steps, elastic switches."""
    notes = []
    for run in runs:
        if run.nonfinite_steps:
            shown = ", ".join(map(str, run.nonfinite_steps[:5])) + (" ..." if len(run.nonfinite_steps) > 5 else "")
            notes.append(f"{run.name}: the loss was NaN or infinite at step {shown} (drawn as gaps): the run diverged")
        for e in run.events:
            if "new_world" in e:
                notes.append(f"{run.name}: elastic switch from {e.get('old_world')} to {e.get('new_world')} ranks, "
                             f"continuing after step {e.get('resume_step')}; step times are compared from there on")
    return notes


# ----------------------------------------------------------------------------- series


def loss_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Long-form points of training and evaluation loss against step, one series per run and kind."""
    rows = [{"run": run.name, "series": "loss", "step": s.step, "value": s.loss}
            for run in runs for s in run.steps if s.loss is not None]
    return rows + [{"run": run.name, "series": "eval loss", "step": e.step, "value": e.eval_loss}
                   for run in runs for e in run.evals if e.eval_loss is not None]


def field_rows(runs: list[Run], field: str, scale: float = 1.0) -> list[dict[str, Any]]:
    """Long-form points of one StepPoint field (times `scale`, e.g. 1e3 for ms) against step, only
    the steps that record it."""
    return [{"run": run.name, "step": s.step, "value": getattr(s, field) * scale}
            for run in runs for s in run.steps if getattr(s, field) is not None]


def recorded(runs: list[Run], field: str) -> bool:
    """Whether any step of any run records `field` (older files have no lr or grad_norm)."""
    return any(getattr(s, field) is not None for run in runs for s in run.steps)


# ----------------------------------------------------------------------------- against the plan


@dataclass(frozen=True)
class PlanComparison:
    """A run's steady step time beside a plan's predicted iteration (x microsteps per step)."""

    run: str
    measured_s: float | None
    predicted_s: float
    """The plan's predicted iteration x the run's microsteps per step."""

    @property
    def ratio(self) -> float | None:
        return self.measured_s / self.predicted_s if self.measured_s and self.predicted_s > 0 else None


def world_mismatch(run: Run, plan_world_size: int) -> str | None:
    """Why a plan's prediction says nothing about the run, or None. A different number of ranks proves
    the run executed another plan (same-size plans of other models cannot be told apart from metrics)."""
    if run.world_size == plan_world_size:
        return None
    return (f"{run.name} ran on {run.world_size} ranks, the plan in this session has {plan_world_size} devices: "
            "the metrics come from another plan, so its predicted time says nothing about them")


def compare_to_plan(run: Run, predicted_time_s: float, grad_accum: int = 1) -> PlanComparison:
    """The run's mean steady step beside the plan's iteration times the microsteps per step (the
    run's own `grad_accum` when its records carry one, else `grad_accum`)."""
    return PlanComparison(run=run.name, measured_s=summarise(run).mean_step_time_s,
                          predicted_s=predicted_time_s * (run.grad_accum or grad_accum))


def comparison_rows(comparisons: list[PlanComparison]) -> list[dict[str, Any]]:
    return [{"run": c.run, "measured_ms": None if c.measured_s is None else c.measured_s * 1e3,
             "predicted_ms": c.predicted_s * 1e3, "measured / predicted": c.ratio} for c in comparisons]


def unique_names(names: list[str]) -> list[str]:
    """Upload names made distinct (two runs' files are often both called metrics.jsonl)."""
    out: list[str] = []
    for name in names:
        unique, k = name, 1
        while unique in out:
            k += 1
            unique = f"{name} ({k})"
        out.append(unique)
    return out
