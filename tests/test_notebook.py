"""engine.notebook: the display of each type (an HTML summary, then a Vega-Lite chart with an SVG fallback),
`plan.show(view)`, the what-if sliders and the coarsened Gantt of a large plan, on the plans stored in
tests/fixtures (no search). The tour notebook itself runs in tests/test_tour.py."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("IPython", reason="the notebook extra is not installed: pip install -e '.[notebook]'")
pytest.importorskip("vl_convert", reason="the notebook extra is not installed: pip install -e '.[notebook]'")

import engine  # noqa: E402
import engine.display  # noqa: E402
import engine.notebook as nb  # noqa: E402
from engine import compare, views  # noqa: E402
from engine.spmd.synthesis import SearchProgress, SearchResult  # noqa: E402
from engine.views.requires import ViewsUnavailable, require  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "written_by_66fbce9"


@pytest.fixture(scope="module")
def shell():
    """An IPython shell with the displays registered (as `import engine.notebook` does inside a kernel)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    nb.register(ip)
    yield ip
    ip.user_ns.clear()


@pytest.fixture(scope="module")
def cpu2():
    return engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json")


@pytest.fixture(scope="module")
def spmd():
    """zoo:mlp planned on cpu_2 (its search's frontier and Q<->B history recorded)."""
    return engine.load_plan(FIXTURES / "spmd_plan.json")


@pytest.fixture(scope="module")
def pipeline():
    return engine.load_plan(FIXTURES / "pipeline_plan.json")


def displayed(shell, obj) -> list[dict]:
    """The MIME bundles IPython displays for `obj` (as the last expression of a cell)."""
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        shell.display_formatter.format(obj)
    return [o.data for o in cap.outputs]


def assert_card(outputs: list[dict], title: str) -> None:
    """A summary naming `title`, then a chart as Vega-Lite with an SVG fallback."""
    assert len(outputs) == 2, [sorted(o) for o in outputs]
    summary, chart = outputs
    assert title in summary["text/html"] and "<table>" in summary["text/html"]
    assert chart[nb.VEGA_LITE]["$schema"].startswith("https://vega.github.io/schema/vega-lite/v")
    assert chart["image/svg+xml"].lstrip().startswith("<svg")


def test_graph_cluster_plans_search_and_comparison_display_a_summary_and_a_chart(shell, cpu2, spmd, pipeline):
    assert_card(displayed(shell, spmd.graph), "Model mlp")
    assert_card(displayed(shell, cpu2), "Cluster cpu_2")
    assert_card(displayed(shell, spmd), "SPMD plan of mlp on cpu_2")
    assert_card(displayed(shell, pipeline), "Pipeline plan of mlp")
    frontier = [SearchProgress(64 * k, 10 - k, 1e-3 / k, 1e-4 * k, 0.01 * k) for k in range(1, 4)]
    assert_card(displayed(shell, SearchResult((), 1e-3, True, 192, 400, 20, 0.03, frontier)), "Program search")
    rows = [compare.Row("ddp", "data parallel", 2e-4), compare.Row("Q+B+C", "the plan", 1.3e-4, is_plan=True)]
    outputs = displayed(shell, compare.Comparison(1.3e-4, rows, 1e-5))  # as compare.compare returns it
    assert_card(outputs, "against the baselines")
    assert "vs best baseline (ddp)" in outputs[0]["text/html"] and "1.54x faster" in outputs[0]["text/html"]
    assert repr(spmd).count("\n") == 0 and len(repr(spmd)) < 200  # only the rich display draws


def test_load_ext_registers_the_displays(shell, cpu2):
    shell.display_formatter.ipython_display_formatter.pop(type(cpu2), None)
    assert displayed(shell, cpu2) == []  # the plain repr only
    shell.extension_manager.load_extension("engine.notebook")
    assert_card(displayed(shell, cpu2), "Cluster cpu_2")


def test_a_plan_draws_its_timeline_with_the_notebooks_cluster_else_says_how(shell, cpu2, spmd):
    plan = dataclasses.replace(spmd, cluster_fingerprint=cpu2.fingerprint())  # cpu_2.json changed since it was made
    shell.user_ns.pop("cluster", None)
    card = nb.plan_card(plan)
    assert card.figure.name == "ratios" and "plan.show('timeline', cluster=cluster)" in card.summary.note
    shell.user_ns["other"] = engine.load_cluster(ROOT / "sample_clusters" / "cpu_3_uneven.json")
    assert nb.plan_card(plan).figure.name == "ratios"  # not the plan's cluster
    shell.user_ns["cluster"] = engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json")
    card = nb.plan_card(plan)
    assert card.figure.name == "timeline" and not card.summary.note
    assert "Memory headroom" in [label for label, _, _ in card.summary.figures]
    shell.user_ns.pop("cluster"), shell.user_ns.pop("other")


def test_plan_show_draws_each_view_and_names_the_views_it_has(spmd, pipeline, cpu2):
    for view in nb.VIEWS[type(spmd)]:
        figure = spmd.show(view, cluster=cpu2)
        assert nb.VEGA_LITE in figure._repr_mimebundle_(), view
    assert spmd.show(cluster=cpu2).name == "timeline"  # the main view
    assert pipeline.show().name == "pipeline timeline" and pipeline.show("schedules").name == "schedules"
    with pytest.raises(nb.ViewError, match="choose one of timeline, memory, ratios, frontier, history"):
        spmd.show("gantt")
    with pytest.raises(nb.ViewError, match=r"plan.show\('memory', cluster=cluster\)"):
        spmd.show("memory")


def test_show_before_any_front_end_says_to_import_the_notebook_module(spmd, monkeypatch):
    monkeypatch.setattr(engine.display, "_drawers", [])
    with pytest.raises(engine.display.NoDrawer, match=r"import engine.notebook.*pip install -e \"\.\[notebook\]\""):
        spmd.show("timeline")


def test_a_missing_optional_package_names_the_pip_command():
    with pytest.raises(ViewsUnavailable, match=r"pip install -e \"\.\[notebook\]\""):
        require("no_such_package_for_hap_views")


def test_theory_table_lists_one_tensors_triples_and_names_the_tensors_otherwise(spmd):
    node = next(n for n in spmd.graph.nodes if not n.is_leaf)
    table = nb.theory(spmd.graph, node.name)
    assert set(table["tensor"]) == {node.name} and {"compute", "collective"} <= set(table["kind"])
    with pytest.raises(nb.ViewError, match="no tensor named 'nope'"):
        nb.theory(spmd.graph, "nope")


def test_what_if_sliders_replan_at_their_values_and_draw_the_result(shell, spmd, cpu2):
    panel = nb.what_if_widget(spmd, cpu2, time_budget_s=1)
    assert panel.last is None
    panel.controls["flops"].value = 2.0  # observed: re-plans and redraws
    w = panel.last
    assert w.changes == [f"{cpu2.devices[0].gpu_model} flops x2"]
    outputs = displayed(shell, w)
    assert_card(outputs, "What if: ")
    assert "Re-planned, changed cluster" in outputs[0]["text/html"]


def _synthetic_lanes(layers: int = 48, devices: int = 16) -> list[dict]:
    """Predicted-schedule rows of a `layers`-layer iteration: per device and layer a forward and a backward compute
    task on the compute lane and a collective after each on the network lane (a 48-layer plan's task count)."""
    rows, t = [], 0.0
    for layer in range(2 * layers):
        for d in range(devices):
            rows.append({"resource": f"compute:dev{d}", "kind": "compute", "name": f"layer {layer}",
                         "start_s": t, "end_s": t + 1e-4})
            for k in range(3):
                rows.append({"resource": f"network:dev{d}", "kind": "comm", "name": f"collective {layer}.{k}",
                             "start_s": t + 1e-4 + k * 2e-5, "end_s": t + 1e-4 + (k + 1) * 2e-5 - 1e-7})
        t += 2e-4
    return views.predicted_lane_rows(rows)


def test_a_48_layer_gantt_is_coarsened_below_altairs_row_limit():
    import altair as alt

    from engine.views import charts

    rows = _synthetic_lanes()
    with pytest.raises(alt.MaxRowsError):  # why: Altair refuses to embed them all
        charts.gantt_chart(rows, "48 layers", ["name"]).to_dict()
    figure = nb.gantt_figure(rows, "48 layers")
    data = figure.spec()["datasets"]
    assert 0 < sum(len(v) for v in data.values()) <= views.MAX_ROWS
    merged = views.coarsen(rows)
    for lane in {r["row"] for r in rows}:  # every lane keeps its span, nothing drawn outside it
        mine, theirs = [r for r in merged if r["row"] == lane], [r for r in rows if r["row"] == lane]
        assert min(r["start_ms"] for r in mine) == min(r["start_ms"] for r in theirs)
        assert max(r["end_ms"] for r in mine) == max(r["end_ms"] for r in theirs)
    assert sum(r["tasks"] for r in merged) == len(rows)


def test_coarsen_refuses_bars_it_cannot_merge():
    rows = [{"row": "a", "kind": "compute" if k % 2 else "communication", "name": str(k), "start_ms": k,
             "end_ms": k + 1} for k in range(30)]
    assert views.coarsen(rows[:10], max_rows=10) == rows[:10]
    with pytest.raises(views.TooManyBars, match="group=True"):
        views.coarsen(rows, max_rows=10)
