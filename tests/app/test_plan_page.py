"""Plan page: listing, graph coloured by sharding with collectives, ratios and memory per device."""
from __future__ import annotations

import json

from ui_helpers import app, cpu_cluster, no_exception, open_page, tiny_plan  # noqa: F401 (fixtures)

from engine import views
from engine.spmd.program import COMM


def test_plan_page_shows_the_plan(app, tiny_plan):
    at = open_page(app, "plan")
    no_exception(at)
    assert at.metric[0].value == views.ms(tiny_plan.predicted_time_s)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Overlap"] == tiny_plan.overlap
    base = tiny_plan.search["baselines_s"]
    best = min(base, key=lambda k: base[k])
    assert metrics[f"vs best baseline ({best})"] == f"{base[best] / tiny_plan.predicted_time_s:.2f}x faster"
    assert at.code[0].value == tiny_plan.listing()
    dot = at.get("graphviz_chart")[0].proto.spec
    forms = views.plan_forms(tiny_plan)
    for node, form in forms.items():
        assert f'fillcolor="{views.form_color(form)}"' in dot
    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    titles = [s.get("title") or s.get("layer", [{}])[0].get("title") for s in specs]
    assert "Sharding ratios" in titles and "Memory per GPU vs capacity" in titles


def test_forms_and_collectives_of_a_plan(tiny_plan):
    forms = views.plan_forms(tiny_plan)
    assert set(forms) == {n.id for n in tiny_plan.graph.nodes}  # every tensor loaded or computed once
    comms = views.plan_collectives(tiny_plan)
    assert sum(len(v) for v in comms.values()) == sum(ins.kind == COMM for ins in tiny_plan.program)
    dot = views.graph_dot(tiny_plan.graph, forms=forms, comms=comms)
    assert dot.count("⇄") == sum(len(v) for v in comms.values())


def test_ratio_and_memory_rows(tiny_plan, cpu_cluster):
    rows = views.ratio_rows(tiny_plan)
    assert len(rows) == len(tiny_plan.ratios) * tiny_plan.world_size
    assert abs(sum(r["ratio"] for r in rows if r["segment"] == "0") - 1) < 1e-9
    mem = views.memory_rows(tiny_plan, cpu_cluster)
    assert [m["device"] for m in mem] == tiny_plan.device_names and all(m["fits"] for m in mem)
    assert mem[0]["predicted_gib"] * views.GIB == tiny_plan.memory_bytes[0]
