"""Pipeline plans in the workbench: Search (parallelism option), Plan (stages), Timeline (Gantt per
stage with bubbles), Compare (every schedule beside the SPMD plan), Export (the pipeline plan file and its bundle)."""
from __future__ import annotations

import functools
import json

import pytest
from ui_helpers import MAIN, ROOT, TIMEOUT_S, no_exception, open_page

from app.services import Keys
from engine import views
from engine.pipeline.partition import schedule_input
from engine.pipeline.schedule import SCHEDULES, run_schedule

PIPE_GPT = {"layers": 4, "hidden": 512, "heads": 8, "ffn": 2048, "vocab": 4096, "seq_len": 128, "batch": 32}
"""Small enough to plan in seconds; on a100x2_p100x2 `auto` picks a pipeline of several stages."""


@functools.cache
def _pipeline() -> tuple:
    import engine

    graph = engine.load_model("zoo:gpt", **PIPE_GPT)
    cluster = engine.load_cluster(ROOT / "sample_clusters" / "a100x2_p100x2.json")
    return graph, cluster, engine.plan(graph, cluster, time_budget_s=2, parallelism="auto")


@pytest.fixture
def pipe_plan():
    plan = _pipeline()[2]
    assert plan.parallelism == "pipeline" and len(plan.stages) >= 2, "the fixture needs a multi-stage pipeline"
    return plan


@pytest.fixture
def pipe_app(pipe_plan):
    from streamlit.testing.v1 import AppTest

    graph, cluster, _ = _pipeline()
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT_S)
    at.session_state[Keys.GRAPH] = graph
    at.session_state[Keys.MODEL_SOURCE] = "zoo:gpt (pipeline)"
    at.session_state[Keys.CLUSTER] = cluster
    at.session_state[Keys.CLUSTER_SOURCE] = "sample_clusters/a100x2_p100x2.json"
    at.session_state[Keys.PLAN] = pipe_plan
    at.session_state[Keys.BUDGET] = 2.0
    return at.run()


def test_plan_page_lists_stages_devices_layers_and_warmup(pipe_app, pipe_plan):
    at = open_page(pipe_app, "plan")
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Predicted iteration"] == views.ms(pipe_plan.predicted_time_s)
    assert metrics["Stages"] == str(len(pipe_plan.stages))
    spmd = pipe_plan.search["parallelism_s"]["spmd"]
    assert metrics["vs best SPMD plan"] == f"{spmd / pipe_plan.predicted_time_s:.2f}x faster"
    stages = at.dataframe[0].value
    assert list(stages["warmup"]) == [s.warmup for s in pipe_plan.stages]
    assert list(stages["layers"]) == [f"{s.layers[0]}-{s.layers[1] - 1}" for s in pipe_plan.stages]
    cluster = _pipeline()[1]
    assert list(stages["devices"]) == [", ".join(cluster.devices[j].name for j in s.devices) for s in pipe_plan.stages]
    assert list(stages["program"]) == [s.program_summary() for s in pipe_plan.stages]
    assert len(at.dataframe[1].value) == len(pipe_plan.boundaries)
    listings = [e for e in at.expander if "program" in e.label]
    assert len(listings) == len(pipe_plan.stages) and all(s.plan is not None for s in pipe_plan.stages)
    assert listings[0].code[0].value == pipe_plan.stages[0].plan.listing()


def test_timeline_page_draws_one_box_per_microbatch_and_bubbles(pipe_app, pipe_plan):
    at = open_page(pipe_app, "timeline")
    no_exception(at)
    assert at.selectbox(key="timeline.schedule").value == pipe_plan.schedule
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert "per iteration" in json.dumps(spec.get("title", ""))
    at.selectbox(key="timeline.schedule").set_value("gpipe").run()
    no_exception(at)
    bubbles = at.dataframe[0].value
    assert len(bubbles) == len(pipe_plan.stages) and (bubbles["bubble_ms"] > 0).any()  # GPipe has bubbles


def test_pipeline_rows_have_every_microbatch_forward_backward_and_transfer(pipe_plan):
    S, B = len(pipe_plan.stages), pipe_plan.microbatches
    run = run_schedule(schedule_input(pipe_plan), "gpipe")
    rows = views.pipeline_rows(run.timeline.rows(), S)
    for s in range(S):
        mine = [r for r in rows if r["row"] == f"stage {s}"]
        for kind in ("forward", "backward"):
            assert sorted(int(r["microbatch"]) for r in mine if r["kind"] == kind) == list(range(B))
    transfers = [r for r in rows if r["kind"] == "transfer"]
    assert len(transfers) == 2 * B * (S - 1) or any(b.transfer_s == 0 for b in pipe_plan.boundaries)
    share = views.bubble_share(rows)
    for s, fig in enumerate(share):  # busy + bubbles cover the whole iteration on every stage
        assert fig["busy_ms"] + fig["bubble_ms"] == pytest.approx(run.iteration_s * 1e3)
    # GPipe: the last stage waits for the first microbatch to cross every earlier stage
    assert share[-1]["bubble_ms"] >= sum(s.forward_s for s in pipe_plan.stages[:-1]) * 1e3 * (1 - 1e-9)


def test_compare_page_shows_every_schedule_beside_spmd_with_peak_memory(pipe_app, pipe_plan):
    at = open_page(pipe_app, "compare")
    no_exception(at)
    table = at.dataframe[0].value
    assert list(table["strategy"]) == [f"pipeline, {n}" for n in SCHEDULES] + ["spmd (best HAP plan)"]
    for i, name in enumerate(SCHEDULES):
        r = pipe_plan.schedules[name]
        assert table["predicted_ms"][i] == pytest.approx(r.iteration_s * 1e3)
        for s, m in enumerate(r.peak_memory_bytes):
            assert table[f"stage {s} peak GiB"][i] == pytest.approx(m / views.GIB)
    assert table["predicted_ms"].iloc[-1] == pytest.approx(pipe_plan.search["parallelism_s"]["spmd"] * 1e3)


def test_export_page_offers_the_pipeline_plan_file_and_its_bundle(pipe_app, pipe_plan):
    from engine.planner import load_plan

    at = open_page(pipe_app, "export")
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels == ["Download plan.json (pipeline)", "Download cluster.json", "Download launch bundle (zip)"]
    from app import services

    back = load_plan(services.plan_json(pipe_plan))
    assert [s.layers for s in back.stages] == [s.layers for s in pipe_plan.stages]
    run = at.code[-1].value  # after the bundle digest's block
    assert "hap run plan.json" in run and "hap run hap_bundle.zip" in run
    assert at.code[0].value.startswith("sha256:")


def test_search_page_asks_the_engine_for_the_chosen_parallelism(pipe_app):
    pipe_app.session_state[Keys.PLAN] = None
    at = open_page(pipe_app, "search")
    assert at.selectbox(key="search.parallelism_kind").value == "spmd"
    at.selectbox(key="search.parallelism_kind").set_value("pipeline")
    at.button(key="search.run").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert plan.parallelism == "pipeline" and plan.search["parallelism_request"] == "pipeline"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Parallelism"] == "pipeline" and metrics["Stages"] == str(len(plan.stages))
