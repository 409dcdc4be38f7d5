"""Search page: running the planner with a budget, the live frontier, the Q<->B history."""
from __future__ import annotations

from ui_helpers import (TINY_GPT, app, cpu_cluster, no_exception, open_page, tiny_graph,  # noqa: F401 (fixtures)
                        tiny_plan)

from app.services import Keys
from engine import views


def test_run_search_makes_a_plan_with_frontier_and_history(app, tiny_graph, cpu_cluster):
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "search")
    assert any("No plan" in i.value for i in at.info)
    at.slider(key="search.budget_slider").set_value(2.5)
    at.button(key="search.run").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert plan is not None and plan.graph == tiny_graph and plan.cluster_fingerprint == cpu_cluster.fingerprint()
    points = at.session_state[Keys.FRONTIER]
    assert points, "the progress callback never reported"
    assert {p["iteration"] for p in points} == set(range(plan.search["iterations"]))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Predicted iteration"] == views.ms(plan.predicted_time_s)
    assert metrics["States expanded"] == str(plan.search["expanded"])
    charts = at.get("vega_lite_chart")
    assert len(charts) == 2  # frontier and Q<->B history
    assert "Search frontier" in charts[0].proto.spec and "Q<->B iterations" in charts[1].proto.spec
    assert len(at.dataframe[0].value) == len(plan.history)


def test_search_with_segments_asks_the_engine_for_them(app):
    import engine

    app.session_state[Keys.GRAPH] = engine.load_model("zoo:gpt", **{**TINY_GPT, "layers": 2})
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "search")
    at.number_input(key="search.segments").set_value(2)
    at.button(key="search.run").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert any(h.get("segments") == 2 for h in plan.history), "the planner iterated with two segments"
    assert {m.label: m.value for m in at.metric}["Segments"] == str(len(plan.ratios))


def test_frontier_rows_accumulate_expansions_over_iterations():
    pts = [{"expanded": 64, "queue_size": 5, "best_cost": float("inf"), "lowest_open_score": 0.1, "iteration": 0},
           {"expanded": 128, "queue_size": 2, "best_cost": 0.3, "lowest_open_score": 0.2, "iteration": 0},
           {"expanded": 64, "queue_size": 7, "best_cost": 0.25, "lowest_open_score": 0.2, "iteration": 1}]
    rows = views.frontier_rows(pts)
    assert [r["expansions"] for r in rows] == [64, 128, 192]
    assert rows[0]["best_ms"] is None and rows[1]["best_ms"] == 300.0
    # plan.search["frontier"] has no iteration field: a drop in `expanded` starts the next search
    rows = views.frontier_rows([{k: v for k, v in p.items() if k != "iteration"} for p in pts])
    assert [r["expansions"] for r in rows] == [64, 128, 192]


def test_history_rows_follow_plan_history(tiny_plan):
    rows = views.history_rows(tiny_plan)
    assert [r["predicted_ms"] for r in rows] == [h["predicted_time_s"] * 1e3 for h in tiny_plan.history]
    assert rows[0]["step"] == "0:Q"


def test_search_asks_the_engine_for_the_chosen_overlap_mode(app):
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "search")
    assert at.selectbox(key="search.overlap_mode").value == "auto"
    at.selectbox(key="search.overlap_mode").set_value("ddp")
    at.button(key="search.run").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert plan.overlap == "ddp" and plan.search["overlap_request"] == "ddp"
    assert {m.label: m.value for m in at.metric}["Overlap"] == "ddp"


def test_search_asks_the_engine_for_the_chosen_precision_and_gradient_dtype(app):
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "search")
    assert at.selectbox(key=f"{Keys.PRECISION}_choice").value == "fp32"
    at.selectbox(key=f"{Keys.PRECISION}_choice").set_value("bf16").run()
    at.button(key="search.run").click().run()  # the P100s have no bf16: refused, naming them
    assert at.session_state[Keys.PLAN] is None
    assert any("p100-0, p100-1 (P100-PCIE-16GB)" in e.value and "fp16" in e.value for e in at.error)
    at.selectbox(key=f"{Keys.PRECISION}_choice").set_value("fp16")
    at.selectbox(key=f"{Keys.GRAD_DTYPE}_choice").set_value("bf16")
    at.button(key="search.run").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert plan.options.precision == "fp16" and plan.options.grad_dtype == "bf16"


def test_the_optimality_caption_claims_only_what_the_searches_proved(app, tiny_plan):
    """Issue 28: 'proven optimal' only when every search was exact, and then for each step's ratios."""
    import dataclasses

    for optimal, says in ((False, "not proven optimal"), (True, "Every search was exact")):
        app.session_state[Keys.PLAN] = dataclasses.replace(tiny_plan, search={**tiny_plan.search, "optimal": optimal})
        at = open_page(app, "search")
        no_exception(at)
        assert any(says in c.value for c in at.caption), [c.value for c in at.caption]
