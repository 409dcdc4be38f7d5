"""Gantt rows of an SPMD iteration: the predicted schedule (`engine.compare.predicted_schedule`) and a
measured step (the runner's `--timing` records), a compute and a network lane per device."""
from __future__ import annotations

from typing import Any

from engine.cluster.spec import Cluster
from engine.compare import LANES, lane_figures, predicted_schedule
from engine.errors import HapError
from engine.spmd.plan import Plan

MAX_ROWS = 5000
"""Bars a Gantt chart carries at most: Altair's own limit on the rows a chart embeds (a 48-layer plan has more
tasks than that; `coarsen` merges them)."""

KIND_COLORS = {"compute": "#4c78a8", "communication": "#e45756", "gradient bucket": "#f58518",
               "optimizer": "#54a24b", "idle": "#d9d9d9", "emulated": "#bab0ac"}
TASK_KINDS = {"compute": "compute", "comm": "communication", "grad_bucket": "gradient bucket", "tail": "optimizer"}
"""How the kinds of `engine.timeline.Task` (predicted) and of runner timeline segments (measured) are shown."""
NETWORK_KINDS = ("comm", "grad_bucket", "bucket")
"""Measured segment kinds that occupy the network lane (the rest occupy the compute lane)."""


def measured_rows(records: list[dict[str, Any]], step: int | None = None) -> list[dict[str, Any]]:
    """Gantt bars of one measured step (the last by default) from `--timing` records: per rank, its
    compute, communication (waiting for slower ranks included) and emulated-slowdown segments."""
    timed = [r for r in records if r.get("timeline")]
    if not timed:
        raise ValueError("metrics file: no 'timeline' in any record; record it with `hap run PLAN --timing --metrics FILE`")
    step = max(r["step"] for r in timed) if step is None else step
    rows = []
    for r in sorted((r for r in timed if r["step"] == step), key=lambda r: r["rank"]):
        for seg, half in _rank_segments(r):
            device = f"rank {r['rank']}"
            lane = seg.get("lane") or ("network" if seg["kind"] in NETWORK_KINDS else "compute")
            rows.append({"device": device, "lane": lane, "row": lane_label(device, lane),
                         "kind": TASK_KINDS.get(seg["kind"], seg["kind"]), "phase": seg["phase"], "name": seg["name"],
                         "half": half, "start_ms": seg["start_s"] * 1e3, "end_ms": (seg["start_s"] + seg["s"]) * 1e3})
    return rows


DEVICE_WAIT = "(device busy)"
"""A duplex half waiting for the rank's device while the other half computes (runner.timing): no work, drawn as a gap."""


def _rank_segments(record: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(segment, half) of one rank's step: a duplex rank's "duplex" phase, which its own timeline
    records as one segment, is replaced by both halves' segments (`halves`, each timed from its own
    start, placed from that segment's start)."""
    halves = [h for h in record.get("halves") or [] if h.get("timeline")]
    out = []
    for seg in record["timeline"]:
        if seg["phase"] == "duplex" and halves:
            out += [({**s, "start_s": seg["start_s"] + s["start_s"]}, half)
                    for h, half in zip(halves, "AB") for s in h["timeline"] if s["name"] != DEVICE_WAIT]
        else:
            out.append((seg, ""))
    return out


def lane_label(device: str, lane: str) -> str:
    """The Gantt row of one device's lane."""
    return f"{device} · {lane}"


def predicted_lane_rows(schedule_rows: list[dict[str, Any]], *, group: bool = False) -> list[dict[str, Any]]:
    """Gantt bars of a predicted schedule (`engine.compare.predicted_schedule(...).rows()`): per device a
    compute lane, a network lane and (ddp) a buckets lane; with `group`, runs of devices with identical
    lanes share one set."""
    rows = []
    for r in schedule_rows:
        lane, _, device = r["resource"].partition(":")
        if lane not in LANES or not device or r["end_s"] <= r["start_s"]:
            continue  # zero-length tasks (barriers, empty pieces) draw nothing
        rows.append({"device": device, "lane": lane, "kind": TASK_KINDS.get(r["kind"], r["kind"]), "name": r["name"],
                     "stage": r.get("stage"), "half": r.get("half"), "direction": r.get("direction"),
                     "start_ms": r["start_s"] * 1e3, "end_ms": r["end_s"] * 1e3})
    if group:
        rows = _grouped_lanes(rows)
    return [{**r, "row": lane_label(r["device"], r["lane"])} for r in rows]


def plan_lane_rows(plan: Plan, cluster: Cluster, *, group: bool = False) -> list[dict[str, Any]]:
    """Gantt bars of the plan's predicted iteration on `cluster` (`engine.compare.predicted_schedule`)."""
    return predicted_lane_rows(predicted_schedule(plan, cluster).rows(), group=group)


def _grouped_lanes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the first device of each run of consecutive devices whose bars are identical, renamed for the run."""
    order = list(dict.fromkeys(r["device"] for r in rows))
    sig = {d: tuple((r["lane"], r["kind"], r["start_ms"], r["end_ms"]) for r in rows if r["device"] == d) for d in order}
    runs: list[list[str]] = []
    for d in order:
        if runs and sig[runs[-1][-1]] == sig[d]:
            runs[-1].append(d)
        else:
            runs.append([d])
    name = {run[0]: run[0] if len(run) == 1 else f"{run[0]} .. {run[-1]} ({len(run)})" for run in runs}
    return [{**r, "device": name[r["device"]]} for r in rows if r["device"] in name]


def lane_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per device: ms computing and communicating (network and buckets lanes), how much of them
    overlaps (communication hidden behind computation, `engine.compare.lane_figures`) and the idle rest."""
    spans = [(r["device"], r["lane"], r["start_ms"], r["end_ms"]) for r in rows]
    return [{"device": f.device, "compute_ms": f.compute_s, "network_ms": f.network_s, "overlapped_ms": f.overlapped_s,
             "idle_ms": f.idle_s, "hidden_%": 100 * f.hidden_share} for f in lane_figures(spans)]


def focus_end_ms(rows: list[dict[str, Any]]) -> float | None:
    """Where the forward and backward end (the last bar that is no optimizer step): the end of the time axis of a
    focus view, so millisecond compute is visible beside a long optimizer step. None when no optimizer step is drawn."""
    if not any(r["kind"] == TASK_KINDS["tail"] for r in rows):
        return None
    return max((r["end_ms"] for r in rows if r["kind"] != TASK_KINDS["tail"]), default=None)


class TooManyBars(HapError, ValueError):
    """A Gantt has more bars than a chart carries even with every run of one kind in a lane merged."""


def coarsen(rows: list[dict[str, Any]], max_rows: int = MAX_ROWS) -> list[dict[str, Any]]:
    """Gantt bars merged until at most `max_rows` remain: in each lane, consecutive bars of one kind closer than a
    gap merge into one bar named for how many tasks it holds; the gap starts at 1/2000 of the iteration (below
    what a chart's pixels show) and doubles until the rows fit. The rows themselves when they already fit."""
    if len(rows) <= max_rows:
        return rows
    span = max(r["end_ms"] for r in rows) - min(r["start_ms"] for r in rows)
    gap = span / 2000
    while True:
        merged = _merge_close(rows, gap)
        if len(merged) <= max_rows:
            return merged
        if gap > span:
            raise TooManyBars(f"a Gantt of {len(rows)} bars keeps {len(merged)} (over {max_rows}) with every run of "
                              "one kind in a lane merged: draw fewer devices (group=True) or a part of the iteration")
        gap *= 2


def _merge_close(rows: list[dict[str, Any]], gap: float) -> list[dict[str, Any]]:
    """Per lane (`row`, else `device`), bars of the same kind less than `gap` apart as one bar."""
    key = "row" if "row" in rows[0] else "device"
    out: list[dict[str, Any]] = []
    last: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: (str(r[key]), r["start_ms"])):
        prev = last.get((r[key], r["kind"]))
        if prev is not None and out[-1] is prev and r["start_ms"] - prev["end_ms"] < gap:
            prev["end_ms"] = max(prev["end_ms"], r["end_ms"])
            prev["tasks"] += 1
            prev["name"] = f"{prev['tasks']} tasks"
            if "microbatch" in prev:
                prev["microbatch"] = ""
            continue
        bar = {**r, "tasks": 1}
        out.append(bar)
        last[(r[key], r["kind"])] = bar
    order = list(dict.fromkeys(r[key] for r in rows))
    return sorted(out, key=lambda r: (order.index(r[key]), r["start_ms"]))
