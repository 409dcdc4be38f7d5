"""The model graph and the cluster as graphviz DOT text (drawn by `st.graphviz_chart` or any graphviz),
tensors coloured by the form a plan holds them in."""
from __future__ import annotations

import json
from collections import Counter
from typing import Iterable

from engine.cluster.spec import Cluster
from engine.model.graph import Graph
from engine.views.figures import GIB, bandwidth_label

FORM_COLORS = {"F": "#d9d9d9", "P": "#fdae6b"}
SHARD_COLORS = ["#9ecae1", "#a1d99b", "#bcbddc", "#fdd0a2", "#c6dbef", "#c7e9c0"]


def _q(text: str) -> str:
    """A DOT string literal."""
    return json.dumps(str(text), ensure_ascii=False)


def form_color(form: str) -> str:
    if form in FORM_COLORS:
        return FORM_COLORS[form]
    return SHARD_COLORS[int(form[2:-1]) % len(SHARD_COLORS)]


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
