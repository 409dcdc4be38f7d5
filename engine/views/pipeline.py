"""Rows of a pipeline plan: its stages, boundaries, schedules and the Gantt of a simulated iteration."""
from __future__ import annotations

from typing import Any

from engine.cluster.spec import Cluster
from engine.pipeline.partition import schedule_input
from engine.pipeline.plan import PipelinePlan
from engine.pipeline.schedule import run_schedule
from engine.planner import spmd_alternatives
from engine.views.figures import GIB, ms, utilisation_metrics

PIPELINE_KINDS = {"forward": "forward", "backward": "backward", "transfer": "transfer", "grad_sync": "gradient sync",
                  "bubble": "bubble (idle)"}
"""How the tasks of `engine.pipeline.schedule.pipeline_tasks` are shown, and the idle gaps of a stage's lane."""
PIPELINE_COLORS = {"forward": "#4c78a8", "backward": "#72b7b2", "transfer": "#e45756", "gradient sync": "#54a24b",
                   "bubble (idle)": "#eeeeee"}


def pipeline_rows(schedule_rows: list[dict[str, Any]], num_stages: int) -> list[dict[str, Any]]:
    """Gantt bars of a simulated pipeline iteration (`run_schedule(...).timeline.rows()`): a lane per
    stage (one box per microbatch forward and backward, the gradient sync, and the idle gaps as
    bubbles) and a lane per link direction (one box per microbatch transfer), in stage order."""
    end = max((r["end_s"] for r in schedule_rows), default=0.0)
    rows, order = [], {}
    for s in range(num_stages):
        order[f"stage{s}"] = (s, 0)
        order[f"link{s}>{s + 1}"], order[f"link{s + 1}>{s}"] = (s, 1), (s, 2)
    for r in schedule_rows:
        if r["end_s"] <= r["start_s"] or r["resource"] not in order:
            continue
        rows.append(_pipeline_bar(r["resource"], PIPELINE_KINDS.get(r["kind"], r["kind"]), r["name"],
                                  r.get("microbatch"), r["start_s"], r["end_s"]))
    for s in range(num_stages):
        busy = sorted((r["start_s"], r["end_s"]) for r in schedule_rows if r["resource"] == f"stage{s}")
        t = 0.0
        for a, b in [*busy, (end, end)]:
            if a > t + 1e-12:
                rows.append(_pipeline_bar(f"stage{s}", PIPELINE_KINDS["bubble"], "idle", None, t, a))
            t = max(t, b)
    return sorted(rows, key=lambda r: (order[r["resource"]], r["start_ms"]))


def pipeline_gantt_rows(plan: PipelinePlan, schedule: str | None = None) -> list[dict[str, Any]]:
    """Gantt rows of a pipeline plan's iteration under `schedule` (default: its own), simulated on the plan's
    stage and transfer times (`engine.pipeline.schedule.run_schedule`). The plan's own schedule uses its
    warm-up counts (those checked against memory)."""
    schedule = schedule or plan.schedule
    warmup = tuple(s.warmup for s in plan.stages) if schedule == plan.schedule else None
    run = run_schedule(schedule_input(plan), schedule, warmup=warmup)
    return pipeline_rows(run.timeline.rows(), len(plan.stages))


def _pipeline_bar(resource: str, kind: str, name: str, microbatch: int | None, start_s: float, end_s: float) -> dict:
    if resource.startswith("stage"):
        lane = f"stage {resource[5:]}"
    else:
        a, b = resource[4:].split(">")
        lane = f"link {a}→{b}" if int(a) < int(b) else f"link {b}←{a}"
    return {"row": lane, "resource": resource, "kind": kind, "name": name,
            "microbatch": "" if microbatch is None else str(microbatch),
            "start_ms": start_s * 1e3, "end_ms": end_s * 1e3}


def bubble_share(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage lane: ms busy and ms idle (bubbles) over the iteration."""
    out = []
    for lane in dict.fromkeys(r["row"] for r in rows if r["resource"].startswith("stage")):
        mine = [r for r in rows if r["row"] == lane]
        idle = sum(r["end_ms"] - r["start_ms"] for r in mine if r["kind"] == PIPELINE_KINDS["bubble"])
        busy = sum(r["end_ms"] - r["start_ms"] for r in mine if r["kind"] != PIPELINE_KINDS["bubble"])
        out.append({"stage": lane, "busy_ms": busy, "bubble_ms": idle, "bubble_%": 100 * idle / max(busy + idle, 1e-12)})
    return out


def pipeline_stage_rows(plan: PipelinePlan, cluster: Cluster) -> list[dict[str, Any]]:
    """One row per stage: its devices, layers, warm-up count, per-microbatch times, peak memory and program
    (the devices' GPU models and capacity joined by device name)."""
    by_name = {d.name: d for d in cluster.devices}
    rows = []
    for i, s in enumerate(plan.stages):
        devs = [by_name[plan.device_names[j]] for j in s.devices if plan.device_names[j] in by_name]
        rows.append({"stage": i, "devices": ", ".join(plan.device_names[j] for j in s.devices),
                     "gpus": ", ".join(sorted({d.gpu_model for d in devs})), "sub_cluster": s.sub_cluster,
                     "layers": f"{s.layers[0]}-{s.layers[1] - 1}", "warmup": s.warmup,
                     "forward_ms": s.forward_s * 1e3, "backward_ms": s.backward_s * 1e3, "sync_ms": s.sync_s * 1e3,
                     "peak_gib": s.peak_memory_bytes / GIB,
                     "capacity_gib": min(d.memory_bytes_per_gpu for d in devs) / GIB if devs else None,
                     "program": s.program_summary()})
    return rows


def pipeline_boundary_rows(plan: PipelinePlan) -> list[dict[str, Any]]:
    """One row per boundary: the cut layer, bytes each way, the link level and the transfer per microbatch."""
    return [{"between": f"{i} → {i + 1}", "cut_at_layer": b.cut, "forward_mib": b.forward_bytes / 2**20,
             "backward_mib": b.backward_bytes / 2**20, "link": b.link, "transfer_ms": b.transfer_s * 1e3}
            for i, b in enumerate(plan.boundaries)]


def pipeline_schedule_rows(plan: PipelinePlan) -> list[dict[str, Any]]:
    """The plan's partition under every schedule (time, warm-up and peak memory per stage, fits), and the
    SPMD plans the planner priced on the same hardware (`parallelism="auto"`: `engine.planner.spmd_alternatives`)."""
    rows = []
    for name, r in plan.schedules.items():
        row = {"strategy": f"pipeline, {name}", "predicted_ms": r.iteration_s * 1e3,
               "mfu": plan.utilisation.mfu_at(r.iteration_s),
               "warmup": " ".join(map(str, r.warmup)), "fits": r.fits, "plan": name == plan.schedule}
        row.update({f"stage {i} peak GiB": m / GIB for i, m in enumerate(r.peak_memory_bytes)})
        rows.append(row)
    for alt in spmd_alternatives(plan):
        rows.append({"strategy": alt.label, "predicted_ms": alt.predicted_time_s * 1e3,
                     "mfu": plan.utilisation.mfu_at(alt.predicted_time_s), "warmup": "", "fits": True, "plan": False})
    return rows


def pipeline_figures(plan: PipelinePlan) -> list[tuple[str, str, str]]:
    """(label, value, help) of a pipeline plan's headline figures, as the Plan page shows them: predicted time,
    stages, schedule and microbatches, speed-up over the best SPMD plan (when planned), compute bound and MFU."""
    out = [("Predicted iteration", ms(plan.predicted_time_s), f"t_max {ms(plan.t_max_s)}"),
           ("Stages", str(len(plan.stages)), f"{plan.world_size} devices"),
           ("Schedule, microbatches", f"{plan.schedule}, B = {plan.microbatches}", "HAPT §4")]
    alternatives = spmd_alternatives(plan)
    if alternatives:
        best = alternatives[0]
        ratio = best.predicted_time_s / plan.predicted_time_s
        out.append(("vs the best SPMD plan on this hardware",
                    f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower",
                    f"{best.label}: {ms(best.predicted_time_s)}"))
    return out + utilisation_metrics(plan)
