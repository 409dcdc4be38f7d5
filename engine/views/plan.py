"""Rows of an SPMD plan (forms, collectives, ratios, memory), of its search (frontier, Q<->B history) and
of a re-plan's report."""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from engine.cluster.spec import Cluster
from engine.spmd.plan import Plan
from engine.spmd.program import COMM, COMPUTE, LOAD
from engine.theory import form_str
from engine.views.figures import GIB, ms, utilisation_metrics


def plan_forms(plan: Plan) -> dict[int, str]:
    """The form every tensor is loaded or computed in (short notation, `S(1)`)."""
    return {ins.node: form_str(ins.post) for ins in plan.program if ins.kind in (LOAD, COMPUTE)}


def plan_collectives(plan: Plan) -> dict[int, list[str]]:
    """For each tensor, the collectives the program runs on it, e.g. `all_gather.padded S(2)->F`."""
    out: dict[int, list[str]] = {}
    for ins in plan.program:
        if ins.kind == COMM:
            pre = ", ".join(form_str(f) for _, f in ins.pre)
            out.setdefault(ins.node, []).append(f"{ins.rule} {pre}->{form_str(ins.post)}")
    return out


def form_counts(plan: Plan) -> list[dict[str, Any]]:
    """How many tensors the plan holds in each form, and how many collectives of each kind it runs."""
    c = Counter(plan_forms(plan).values())
    rows = [{"what": f"tensors {k}", "count": v} for k, v in sorted(c.items())]
    coll = Counter(ins.rule for ins in plan.program if ins.kind == COMM)
    return rows + [{"what": k, "count": v} for k, v in sorted(coll.items())]


def ratio_rows(plan: Plan) -> list[dict[str, Any]]:
    """Sharding ratio per segment and device (`plan.ratios` is keyed by segment)."""
    return [{"segment": seg, "device": dev, "ratio": r}
            for seg, ratios in plan.ratios.items() for dev, r in zip(plan.device_names, ratios)]


def memory_rows(plan: Plan, cluster: Cluster) -> list[dict[str, Any]]:
    """Predicted peak memory per GPU of every plan device against its capacity, joined by device name
    (never by position: a cluster that is not the plan's has other devices in other places). A plan
    device the cluster lacks has no capacity (None)."""
    by_name = {d.name: d.memory_bytes_per_gpu for d in cluster.devices}
    return [{"device": name, "predicted_gib": m / GIB,
             "capacity_gib": by_name[name] / GIB if name in by_name else None,
             "fits": name in by_name and m <= by_name[name]} for name, m in zip(plan.device_names, plan.memory_bytes)]


# ----------------------------------------------------------------------------- search


def frontier_rows(points: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Frontier points with expansions made cumulative over the Q<->B iterations (each search
    restarts its own count): best complete cost and lowest open score in ms, queue size."""
    rows, offset, last, last_it = [], 0, 0, None
    for p in points:
        it = p.get("iteration")
        if (it is not None and last_it is not None and it != last_it) or p["expanded"] < last:
            offset += last
        last, last_it = p["expanded"], it
        best = p["best_cost"]
        rows.append({"expansions": offset + p["expanded"], "queue_size": p["queue_size"],
                     "best_ms": best * 1e3 if best != float("inf") else None,
                     "lowest_open_ms": p["lowest_open_score"] * 1e3 if p["lowest_open_score"] != float("inf") else None,
                     "iteration": it if it is not None else 0})
    return rows


def history_rows(plan: Plan) -> list[dict[str, Any]]:
    """The Q<->B iteration history: predicted time after each synthesis (Q) and balancing (B) step."""
    return [{"step": f"{h['iteration']}:{h['step']}", "order": k, "kind": h["step"], "predicted_ms": h["predicted_time_s"] * 1e3}
            for k, h in enumerate(plan.history)]


def replan_ratio_rows(report: Any) -> list[dict[str, Any]]:
    """One row per device: its ratios (per segment) before and after a re-plan ('-' where absent)."""
    names = dict.fromkeys([*report.ratios_before, *report.ratios_after])
    return [{"device": n, "before": _ratios_text(report.ratios_before.get(n)),
             "after": _ratios_text(report.ratios_after.get(n)),
             "change": "removed" if n in report.removed else "added" if n in report.added else ""} for n in names]


def _ratios_text(ratios: list[float] | None) -> str:
    return "-" if ratios is None else " / ".join(f"{x:.3f}" for x in ratios)


def replan_traffic_rows(report: Any) -> list[dict[str, Any]]:
    """Bytes each device sends and receives to switch to the new plan (parameters and optimizer state)."""
    names = dict.fromkeys([*report.sent_bytes, *report.received_bytes])
    return [{"device": n, "sends_bytes": report.sent_bytes.get(n, 0), "receives_bytes": report.received_bytes.get(n, 0)}
            for n in names]


def best_baseline(plan: Plan) -> tuple[str, float] | None:
    """(name, predicted s) of the fastest data-parallel baseline the plan's search priced, or None."""
    base = {k: v for k, v in plan.search.get("baselines_s", {}).items() if isinstance(v, (int, float)) and v > 0}
    return None if not base else min(base.items(), key=lambda kv: kv[1])


def plan_figures(plan: Plan, cluster: Cluster | None = None) -> list[tuple[str, str, str]]:
    """(label, value, help) of an SPMD plan's headline figures, as the Plan page shows them: predicted time,
    speed-up over the best baseline, compute bound and MFU, and (given its cluster) the memory headroom."""
    out = [("Predicted iteration", ms(plan.predicted_time_s), f"{plan.world_size} devices, overlap {plan.overlap}")]
    best = best_baseline(plan)
    if best is not None and plan.predicted_time_s > 0:
        out.append((f"vs best baseline ({best[0]})", f"{best[1] / plan.predicted_time_s:.2f}x faster",
                    f"{best[0]}: {ms(best[1])}, priced as a PyTorch DDP run"))
    out += utilisation_metrics(plan)
    if cluster is not None:
        rows = [r for r in memory_rows(plan, cluster) if r["capacity_gib"] is not None]
        if rows:
            tight = min(rows, key=lambda r: r["capacity_gib"] - r["predicted_gib"])
            out.append(("Memory headroom", f"{tight['capacity_gib'] - tight['predicted_gib']:.3g} GiB",
                        f"on the fullest device for its capacity, {tight['device']}: {tight['predicted_gib']:.3g} of "
                        f"{tight['capacity_gib']:.3g} GiB"))
    return out
