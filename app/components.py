"""Reusable render pieces: pure data builders, graphviz DOT builders and Altair charts.

Everything above the "charts" section returns plain data (lists of dicts, DOT strings) so tests
can call it without Streamlit; the chart functions only turn such data into Altair specs.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Iterable

import altair as alt
import pandas as pd

from engine import Cluster, Graph, PipelinePlan, Plan
from engine.compare import LANES, lane_figures
from engine.planner import OVERLAP_MEANING, spmd_alternatives  # noqa: F401 (pages show OVERLAP_MEANING)
from engine.spmd.program import COMM, COMPUTE, LOAD
from engine.spmd.utilisation import percent
from engine.theory import COLLECTIVES, collectives_from, form_long, form_str, leaf_forms, op_rules
from engine.theory.core import FULL, PARTIAL

from app.runs import MetricsError, parse_metrics  # noqa: F401 (the Timeline page reads metrics with them)

GIB = 2**30
FORM_SENTENCES = {
    "Full": "Full(e): every device holds the whole reference tensor e (the paper's e | Identity).",
    "Shard(d)": "Shard(e, d): the devices hold slices of e along dim d, sized by the sharding ratios "
                "(e | All-Gather(d): an all-gather rebuilds e).",
    "Partial": "Partial(e): every device holds an addend and e is their sum (e | All-Reduce: an all-reduce rebuilds e).",
}
"""One sentence per property form (HAP §4.2)."""
FORM_COLORS = {"F": "#d9d9d9", "P": "#fdae6b"}
SHARD_COLORS = ["#9ecae1", "#a1d99b", "#bcbddc", "#fdd0a2", "#c6dbef", "#c7e9c0"]
KIND_COLORS = {"compute": "#4c78a8", "communication": "#e45756", "gradient bucket": "#f58518",
               "optimizer": "#54a24b", "idle": "#d9d9d9", "emulated": "#bab0ac"}
TASK_KINDS = {"compute": "compute", "comm": "communication", "grad_bucket": "gradient bucket", "tail": "optimizer"}
"""How the kinds of `engine.timeline.Task` (predicted) and of runner timeline segments (measured) are shown."""
NETWORK_KINDS = ("comm", "grad_bucket", "bucket")
"""Measured segment kinds that occupy the network lane (the rest occupy the compute lane)."""


def _q(text: str) -> str:
    """A DOT string literal."""
    return json.dumps(str(text), ensure_ascii=False)


def bandwidth_label(bps: float) -> str:
    """Bytes/s as GB/s (the unit datasheets use)."""
    return f"{bps / 1e9:.3g} GB/s"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 4 significant digits (tiny and large plans both stay readable)."""
    return f"{seconds * 1e3:.4g} ms"


def utilisation_metrics(plan: Plan | PipelinePlan) -> list[tuple[str, str, str]]:
    """(label, value, help) of the plan's compute bound and MFU (`engine.spmd.utilisation`), shown
    beside its predicted time; 'unknown' for a plan that records no peak FLOP/s."""
    u, precision = plan.utilisation, plan.options.precision
    bound = u.compute_bound_s
    why = (f"the model's {u.model_flops:.3g} FLOPs per iteration (forward and backward, recomputation not counted) "
           f"at the devices' summed {precision} peak of {u.peak_flops:.3g} FLOP/s: no plan is faster"
           if bound is not None else "the plan records no peak FLOP/s (made before plans recorded it): plan it again")
    return [("Compute bound", "unknown" if bound is None else ms(bound), why),
            ("MFU", percent(u.mfu), "model FLOPs utilisation: the compute bound over the predicted iteration")]


def in_percent(rows: list[dict[str, Any]], key: str = "mfu") -> list[dict[str, Any]]:
    """The rows with `key` (a fraction, e.g. an MFU) in percent, for a "%.3g%%" table column (None stays None)."""
    return [{**r, key: None if r.get(key) is None else r[key] * 100} for r in rows]


def form_color(form: str) -> str:
    if form in FORM_COLORS:
        return FORM_COLORS[form]
    return SHARD_COLORS[int(form[2:-1]) % len(SHARD_COLORS)]


# ----------------------------------------------------------------------------- model


def model_summary(graph: Graph) -> dict[str, Any]:
    """Headline figures of a model: parameters, flops per iteration (fwd + ~2x bwd), nodes, segments."""
    return {"parameters": graph.num_parameters, "forward_flops": graph.flops,
            "iteration_flops": 3 * graph.flops, "nodes": len(graph), "segments": graph.num_segments}


def graph_dot(graph: Graph, *, expand: Iterable[int] | None = None, forms: dict[int, str] | None = None,
              comms: dict[int, list[str]] | None = None) -> str:
    """The model graph in DOT. Segments (layers) not in `expand` collapse into one box each (all
    expanded when `expand` is None); `forms` colours tensors by sharding form, `comms` annotates
    the collectives run on a tensor."""
    shown = None if expand is None else set(expand)
    forms, comms = forms or {}, comms or {}
    lines = ["digraph model {", "rankdir=TB; node [shape=box, style=\"rounded,filled\", fontsize=10, fillcolor=white];"]
    rep = {}
    for seg, members in _by_segment(graph).items():
        if shown is None or seg in shown:
            for n in members:
                rep[n.id] = f"n{n.id}"
                lines.append(f"n{n.id} [label={_q(_node_label(n, forms.get(n.id), comms.get(n.id)))}, "
                             f"fillcolor={_q(form_color(forms[n.id]) if n.id in forms else '#ffffff')}"
                             f"{', shape=ellipse' if n.is_leaf else ''}];")
        else:
            for n in members:
                rep[n.id] = f"seg{seg}"
            hist = Counter(n.op for n in members if not n.is_leaf)
            top = ", ".join(f"{op} x{k}" for op, k in hist.most_common(3))
            label = f"layer {seg} ({len(members)} nodes)\n{top}"
            lines.append(f"seg{seg} [label={_q(label)}, shape=box3d, fillcolor=\"#f0f0f0\"];")
    edges = dict.fromkeys((rep[i], rep[n.id]) for n in graph.nodes for i in n.inputs if rep[i] != rep[n.id])
    lines += [f"{a} -> {b};" for a, b in edges]
    lines.append("}")
    return "\n".join(lines)


def _by_segment(graph: Graph) -> dict[int, list]:
    out: dict[int, list] = {}
    for n in graph.nodes:
        out.setdefault(n.segment, []).append(n)
    return out


def _node_label(n, form: str | None, comm: list[str] | None) -> str:
    shape = "x".join(str(s) for s in n.shape) or "scalar"
    head = f"{n.name}\n{n.op} [{shape}]"
    if form:
        head += f"\n{form}"
    if comm:
        head += "\n" + "\n".join(f"⇄ {c}" for c in comm)
    return head


# ----------------------------------------------------------------------------- cluster


FLOPS_COLUMN = "flops_per_gpu_"
"""Prefix of the table columns of a device's mixed-precision rates (`flops_per_gpu_bf16`, `flops_per_gpu_fp16`):
a table cell holds no map, so `flops_per_gpu` shows the fp32 rate and each dtype has a column."""


def device_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """Devices as editable table rows (the JSON fields of a device, less the Slurm hints: a nested object no table
    cell holds; `services.cluster_with_edits` keeps them by device name; a per-dtype `flops_per_gpu` is spread
    over one column per dtype, `flops_map` folds it back)."""
    rows = []
    for d in cluster.devices:
        row: dict[str, Any] = {}
        for k, v in d.to_dict().items():
            if k == "flops_per_gpu":
                row[k] = d.flops_per_gpu
                row.update({f"{FLOPS_COLUMN}{dtype}": rate for dtype, rate in d.flops_by_dtype})
            elif k != "slurm":
                row[k] = v
        rows.append(row)
    return rows


def flops_map(row: dict[str, Any]) -> dict[str, Any]:
    """A table row with its per-dtype rate columns folded back into `flops_per_gpu` (the inverse of `device_rows`)."""
    rates = {k[len(FLOPS_COLUMN):]: row[k] for k in row if k.startswith(FLOPS_COLUMN)}
    out = {k: v for k, v in row.items() if not k.startswith(FLOPS_COLUMN)}
    if rates and "flops_per_gpu" in out:
        out["flops_per_gpu"] = {"fp32": out["flops_per_gpu"], **rates}
    return out


def link_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """Link levels and their bandwidth as editable table rows."""
    return [{"level": k, "bandwidth_Bps": v} for k, v in cluster.network.bandwidth_Bps.items()]


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Table rows as JSON-style dicts: empty cells left out (the engine then names the missing
    field), numpy scalars as Python numbers."""
    out = []
    for row in df.to_dict("records"):
        out.append({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if not _empty(v)})
    return out


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v) or v is pd.NA or v is pd.NaT


def cluster_dot(cluster: Cluster) -> str:
    """The cluster as DOT: devices boxed by machine, a switch per link level, edges labelled with bandwidth."""
    bw = cluster.network.bandwidth_Bps
    lines = ["graph cluster {", "rankdir=TB; node [fontsize=10, style=filled, fillcolor=white]; edge [fontsize=9];"]
    machines: dict[str, list] = {}
    for j, d in enumerate(cluster.devices):
        machines.setdefault(d.machine, []).append((j, d))
    groups = sorted({d.group for d in cluster.devices if d.group})
    top = "net"
    lines.append(f"net [shape=diamond, label={_q('network')}, fillcolor=\"#fff2cc\"];")
    for g in groups:
        lines.append(f"grp_{_ident(g)} [shape=diamond, label={_q(f'group {g}')}, fillcolor=\"#fff2cc\"];")
        lines.append(f"grp_{_ident(g)} -- net [label={_q(bandwidth_label(bw.get('inter_group', 0)))}];")
    for k, (m, devs) in enumerate(machines.items()):
        lines.append(f"subgraph cluster_m{k} {{ label={_q(f'machine {m}')}; style=rounded; color=\"#888888\";")
        for j, d in devs:
            inside = f"\n{d.num_gpus} GPUs, {bandwidth_label(d.intra_bandwidth_Bps)} inside" if d.num_gpus > 1 else ""
            label = f"{d.name}\n{d.gpu_model}\n{d.flops / 1e12:.3g} TFLOP/s, {d.memory_bytes_per_gpu / GIB:.3g} GiB/GPU{inside}"
            lines.append(f"d{j} [shape=box, label={_q(label)}, fillcolor=\"#dae8fc\"];")
        hub = f"d{devs[0][0]}"
        if len(devs) > 1:
            hub = f"bus{k}"
            lines.append(f"bus{k} [shape=point, width=0.15];")
            lines += [f"d{j} -- bus{k} [label={_q(bandwidth_label(bw.get('intra_machine', 0)))}];" for j, _ in devs]
        lines.append("}")
        up = f"grp_{_ident(devs[0][1].group)}" if devs[0][1].group else top
        if len(machines) > 1 or groups:
            lines.append(f"{hub} -- {up} [label={_q(bandwidth_label(bw.get('inter_machine', 0)))}];")
    lines.append("}")
    return "\n".join(lines)


def _ident(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


# ----------------------------------------------------------------------------- theory


def theory_rows(graph: Graph) -> list[dict[str, Any]]:
    """Every Hoare triple of the background theory T of `graph` (HAP §4.2): leaf loads, compute
    rules and collectives, one row each."""
    rows = []
    for n in graph.nodes:
        if n.is_leaf:
            for f in leaf_forms(n):
                kind = "Parameter" if n.op == "parameter" else "Placeholder"
                name = f"{kind}-{'Full' if f == FULL else f'Shard({f})'}"
                rows.append(_triple(n, "leaf", n.op, name, "", "{}", form_str(f)))
        else:
            for r in op_rules(n, graph):
                pre = ", ".join(f"{graph[i].name}:{form_str(f)}" for i, f in zip(n.inputs, r.inputs))
                rows.append(_triple(n, "compute", n.op, r.name, "", f"{{{pre}}}", form_str(r.output)))
    rows += collective_rows(graph)
    return rows


def collective_rows(graph: Graph) -> list[dict[str, Any]]:
    """The communication triples of every computed tensor, from each of its forms (leaves are never communicated)."""
    rows = []
    for n in graph.nodes:
        if n.is_leaf:
            continue
        for f in [FULL, PARTIAL] + list(range(n.rank)):
            for coll, g in collectives_from(f, n.shape):
                rows.append(_triple(n, "collective", n.op, coll.key, coll.key, f"{{{n.name}:{form_str(f)}}}", form_str(g)))
    return rows


def _triple(n, kind: str, op: str, rule: str, collective: str, pre: str, post: str) -> dict[str, Any]:
    return {"tensor": n.name, "op": op, "kind": kind, "rule": rule, "collective": collective,
            "triple": f"{pre} {rule} {{{n.name}:{post}}}", "post": post, "segment": n.segment}


def rule_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How many triples of each kind and rule."""
    c = Counter((r["kind"], r["rule"]) for r in rows)
    return [{"kind": k, "rule": r, "triples": v} for (k, r), v in sorted(c.items())]


# ----------------------------------------------------------------------------- plan


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


# ----------------------------------------------------------------------------- timeline


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


# ----------------------------------------------------------------------------- pipelines

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


# ----------------------------------------------------------------------------- charts


def _kind_scale() -> alt.Scale:
    return alt.Scale(domain=list(KIND_COLORS), range=list(KIND_COLORS.values()))


def gantt_chart(rows: list[dict[str, Any]], title: str, tooltip: list[str]) -> alt.Chart:
    """Horizontal bars over time, one row per device (or per device lane, where rows carry `row`),
    coloured by compute / communication / gradient bucket / idle."""
    y = "row" if rows and "row" in rows[0] else "device"
    height = max(160, 34 * len({r[y] for r in rows}))
    return alt.Chart(pd.DataFrame(rows), title=title).mark_bar().encode(
        x=alt.X("start_ms:Q", title="time (ms)"), x2="end_ms:Q",
        y=alt.Y(f"{y}:N", sort=None, title=None),
        color=alt.Color("kind:N", scale=_kind_scale(), title=None),
        tooltip=tooltip).properties(height=height)


def frontier_chart(rows: list[dict[str, Any]]) -> alt.VConcatChart:
    """The search frontier: best complete cost and lowest open score vs expansions, and the queue size."""
    df = pd.DataFrame(rows)
    cost = df.melt(id_vars=["expansions", "iteration"], value_vars=["best_ms", "lowest_open_ms"],
                   var_name="series", value_name="ms").dropna()
    cost["series"] = cost["series"].map({"best_ms": "best complete cost", "lowest_open_ms": "lowest open score"})
    top = alt.Chart(cost, title="Search frontier").mark_line(point=True).encode(
        x=alt.X("expansions:Q", title="states expanded"), y=alt.Y("ms:Q", title="predicted ms", scale=alt.Scale(zero=False)),
        color=alt.Color("series:N", title=None), tooltip=["expansions", "series", "ms", "iteration"]).properties(height=220)
    queue = alt.Chart(df).mark_area(opacity=0.5).encode(
        x=alt.X("expansions:Q", title="states expanded"), y=alt.Y("queue_size:Q", title="queue size"),
        tooltip=["expansions", "queue_size"]).properties(height=110)
    return alt.vconcat(top, queue)


def history_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    return alt.Chart(pd.DataFrame(rows), title="Q<->B iterations").mark_line(point=True).encode(
        x=alt.X("step:N", sort=None, title="iteration:step"), y=alt.Y("predicted_ms:Q", scale=alt.Scale(zero=False)),
        color=alt.value("#4c78a8"), tooltip=["step", "predicted_ms"]).properties(height=220)


def ratios_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    return alt.Chart(pd.DataFrame(rows), title="Sharding ratios").mark_bar().encode(
        x=alt.X("device:N", sort=None), xOffset="segment:N", y="ratio:Q", color=alt.Color("segment:N"),
        tooltip=["segment", "device", "ratio"]).properties(height=240)


def memory_chart(rows: list[dict[str, Any]]) -> alt.LayerChart:
    df = pd.DataFrame(rows)
    bars = alt.Chart(df, title="Memory per GPU vs capacity").mark_bar().encode(
        x=alt.X("device:N", sort=None), y=alt.Y("predicted_gib:Q", title="GiB"),
        color=alt.condition("datum.fits", alt.value("#4c78a8"), alt.value("#e45756")),
        tooltip=["device", "predicted_gib", "capacity_gib"])
    cap = alt.Chart(df).mark_tick(color="black", thickness=2, size=30).encode(x=alt.X("device:N", sort=None), y="capacity_gib:Q")
    return (bars + cap).properties(height=240)


def histogram_chart(hist: dict[str, int]) -> alt.Chart:
    df = pd.DataFrame([{"op": k, "count": v} for k, v in hist.items()])
    return alt.Chart(df, title="Operators").mark_bar().encode(
        x=alt.X("count:Q"), y=alt.Y("op:N", sort="-x"), tooltip=["op", "count"]).properties(height=max(120, 18 * len(df)))


def compare_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    df = pd.DataFrame([r for r in rows if r["predicted_ms"] is not None])
    return alt.Chart(df, title="Predicted iteration time, same cost model").mark_bar().encode(
        x=alt.X("predicted_ms:Q", title="ms"), y=alt.Y("strategy:N", sort=None),
        color=alt.condition(alt.datum.plan, alt.value("#e45756"), alt.value("#4c78a8")),
        tooltip=["strategy", "what", "predicted_ms", "plan_speedup"]).properties(height=60 + 36 * len(df))


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


def replan_traffic_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    long = [{"device": r["device"], "direction": d, "bytes": r[f"{d}_bytes"]} for r in rows for d in ("sends", "receives")]
    return alt.Chart(pd.DataFrame(long)).mark_bar().encode(
        x=alt.X("device:N", sort=None), xOffset="direction:N", y="bytes:Q", color="direction:N",
        tooltip=["device", "direction", "bytes"]).properties(title="Bytes to move per device")


def pipeline_gantt_chart(rows: list[dict[str, Any]], title: str) -> alt.LayerChart:
    """One lane per stage and link direction, a box per microbatch forward/backward/transfer labelled
    with its microbatch, idle gaps of a stage drawn as bubbles."""
    df = pd.DataFrame(rows)
    base = alt.Chart(df).encode(
        x=alt.X("start_ms:Q", title="time (ms)"), y=alt.Y("row:N", sort=None, title=None))
    bars = base.mark_bar(stroke="white", strokeWidth=0.5).encode(
        x2="end_ms:Q", color=alt.Color("kind:N", title=None, scale=alt.Scale(domain=list(PIPELINE_COLORS),
                                                                           range=list(PIPELINE_COLORS.values()))),
        tooltip=["row", "kind", "name", "microbatch", "start_ms", "end_ms"])
    labels = base.transform_calculate(mid="(datum.start_ms + datum.end_ms) / 2").mark_text(
        fontSize=9, color="white").encode(x="mid:Q", text="microbatch:N")
    return (bars + labels).properties(title=title, height=max(160, 30 * len(set(df["row"])) if len(df) else 160))


def pipeline_schedule_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    """Predicted iteration time of the pipeline under each schedule beside the SPMD plan."""
    return alt.Chart(pd.DataFrame(rows), title="Pipeline schedules and the SPMD plan").mark_bar().encode(
        x=alt.X("predicted_ms:Q", title="ms"), y=alt.Y("strategy:N", sort=None, title=None),
        color=alt.condition(alt.datum.plan, alt.value("#e45756"), alt.value("#4c78a8")),
        tooltip=["strategy", "predicted_ms", "warmup", "fits"]).properties(height=60 + 36 * len(rows))


def _step_axis() -> alt.X:
    """Steps are whole numbers: no 0.5 ticks on a short run."""
    return alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1))


def _run_color(names: list[str], legend: bool = True) -> alt.Color:
    """A distinct colour per run (the default theme's shades of blue are hard to tell apart), the same
    run the same colour in every chart of the page (`names` are all the page's runs)."""
    return alt.Color("run:N", title=None, scale=alt.Scale(domain=names, scheme="tableau10"),
                     legend=alt.Legend(orient="right") if legend else None)


def loss_chart(rows: list[dict[str, Any]], names: list[str]) -> alt.LayerChart:
    """Training loss (solid) and evaluation loss (dashed, a point per evaluation) against step, a colour per run."""
    base = alt.Chart(pd.DataFrame(rows), title="Loss").encode(
        x=_step_axis(), y=alt.Y("value:Q", title="loss", scale=alt.Scale(zero=False)),
        color=_run_color(names), tooltip=["run", "series", "step", "value"])
    lines = base.mark_line().encode(strokeDash=alt.StrokeDash(
        "series:N", title=None, scale=alt.Scale(domain=["loss", "eval loss"], range=[[1, 0], [6, 3]])))
    points = base.transform_filter(alt.datum.series == "eval loss").mark_point(filled=True)
    return (lines + points).properties(height=300)


def step_series_chart(rows: list[dict[str, Any]], names: list[str], title: str, y_title: str, *,
                      legend: bool = False) -> alt.Chart:
    """One recorded figure (learning rate, grad norm, tokens/s) against step, a line per run (coloured as
    in the loss chart, whose legend names them)."""
    return alt.Chart(pd.DataFrame(rows), title=title).mark_line().encode(
        x=_step_axis(), y=alt.Y("value:Q", title=y_title, scale=alt.Scale(zero=False)),
        color=_run_color(names, legend), tooltip=["run", "step", "value"]).properties(height=220)


def step_time_chart(rows: list[dict[str, Any]], names: list[str],
                    predicted: list[dict[str, Any]]) -> alt.Chart | alt.LayerChart:
    """Measured step time per step (a line per run) beside the plan's predicted step (a dashed rule per
    run, `predicted_ms`, absent when there is nothing to compare with)."""
    measured = step_series_chart(rows, names, "Measured step time against the plan's prediction", "ms", legend=True)
    if not predicted:
        return measured
    rule = alt.Chart(pd.DataFrame(predicted)).mark_rule(strokeDash=[6, 3]).encode(
        y="predicted_ms:Q", color=_run_color(names), tooltip=["run", "predicted_ms"])
    return measured + rule
