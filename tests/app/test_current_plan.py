"""One current plan, checked on every page (issue 30, item 1), and exports as a matching set (item 2).

After the cluster or the model changes without a new search, Plan, Timeline, Compare and Export say
what changed, offer "Plan again" and draw nothing of the old plan: no chart, no table, no download.
"""
from __future__ import annotations

import functools

import pytest
from conftest import TWO_VIRTUAL_MACHINES
from ui_helpers import (ROOT, TINY_GPT, app, cpu_cluster, no_exception, open_page, tiny_graph,  # noqa: F401 (fixtures)
                        tiny_plan)

import engine
from app import services
from app.services import Keys
from engine import views

PLAN_PAGES = ["plan", "timeline", "compare", "export"]
OLD_PLAN = ("vega_lite_chart", "arrow_data_frame", "download_button", "graphviz_chart", "metric")
"""Element types that would show the old plan's numbers."""


@functools.cache
def _other_model():
    return engine.load_model("zoo:gpt", **{**TINY_GPT, "vocab": 128})


def _cpu_2():
    return engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json")


def _shows_nothing_of_the_old_plan(at) -> None:
    no_exception(at)
    for kind in OLD_PLAN:
        assert not at.get(kind), f"{kind} of the old plan drawn"
    assert not at.code, "commands or a listing of the old plan shown"
    assert [b.label for b in at.button] == ["Plan again"]


@pytest.mark.parametrize("page", PLAN_PAGES)
def test_after_switching_the_cluster_the_page_says_so_and_draws_nothing_of_the_old_plan(app, page):
    app.session_state[Keys.CLUSTER] = _cpu_2()
    at = open_page(app, page)
    assert [w.value.split(" Its numbers")[0] for w in at.warning] == [
        "The cluster changed from a100x2_p100x2 to cpu_2 since this plan was made."]
    _shows_nothing_of_the_old_plan(at)
    assert "made for another cluster" in at.sidebar.caption[-1].value


@pytest.mark.parametrize("page", PLAN_PAGES)
def test_after_switching_the_model_the_page_says_so_and_draws_nothing_of_the_old_plan(app, page):
    app.session_state[Keys.GRAPH] = _other_model()
    app.session_state[Keys.MODEL_SOURCE] = "zoo:gpt vocab=128"
    at = open_page(app, page)
    assert [w.value.split(" Its numbers")[0] for w in at.warning] == [
        "The model changed from gpt to zoo:gpt vocab=128 since this plan was made."]
    _shows_nothing_of_the_old_plan(at)


def test_plan_again_plans_the_current_inputs_with_the_old_options_and_the_pages_draw_again(app, tiny_plan):
    app.session_state[Keys.CLUSTER] = _cpu_2()
    at = open_page(app, "plan")
    at.button(key="plan.plan_again").click().run()
    no_exception(at)
    plan = at.session_state[Keys.PLAN]
    assert plan.cluster_name == "cpu_2" and plan.options == tiny_plan.options
    assert not at.warning and len(at.get("vega_lite_chart")) == 2
    assert at.session_state[Keys.PLAN_FOR][2:] == ("zoo:gpt (tiny)", "cpu_2")
    # the names recorded with the plan name it in the next message
    at.session_state[Keys.CLUSTER] = engine.load_cluster(ROOT / "sample_clusters" / "a100x2_p100x2.json")
    at = open_page(at, "timeline")
    assert at.warning[0].value.startswith("The cluster changed from cpu_2 to a100x2_p100x2 since this plan was made.")


def test_search_page_shows_no_numbers_of_a_stale_plan(app):
    app.session_state[Keys.CLUSTER] = _cpu_2()
    at = open_page(app, "search")
    no_exception(at)
    assert any(i.value.startswith("The cluster changed from a100x2_p100x2 to cpu_2") for i in at.info)
    assert not at.metric and not at.get("vega_lite_chart")


def test_an_edited_cluster_of_the_same_name_is_named_as_edited(tiny_plan, tiny_graph, cpu_cluster):
    d = cpu_cluster.to_dict()
    d["network"]["latency_s"] *= 2
    status = services.plan_status(tiny_plan, tiny_graph, engine.load_cluster(d))
    assert status.changed == ("cluster",) and not status.current
    assert status.message == "The cluster a100x2_p100x2 was edited since this plan was made."
    assert services.plan_status(tiny_plan, tiny_graph, cpu_cluster).current


def test_memory_rows_join_by_device_name_not_position(tiny_plan, cpu_cluster):
    d = cpu_cluster.to_dict()
    d["devices"] = d["devices"][::-1][:3]  # another order, one device fewer
    other = engine.load_cluster(d)
    rows = views.memory_rows(tiny_plan, other)
    assert [r["device"] for r in rows] == tiny_plan.device_names
    capacity = {dev.name: dev.memory_bytes_per_gpu / views.GIB for dev in other.devices}
    for row, m in zip(rows, tiny_plan.memory_bytes):
        assert row["predicted_gib"] == m / views.GIB and row["capacity_gib"] == capacity.get(row["device"])
    assert rows[0]["capacity_gib"] is None and not rows[0]["fits"]  # the device the other cluster lacks


def test_export_set_of_a_plan_on_single_gpu_devices_is_the_plan_and_its_cluster(tiny_plan, cpu_cluster):
    out = services.export_set(services.plan_key(tiny_plan), cpu_cluster.fingerprint(), tiny_plan, cpu_cluster)
    assert out.plan is tiny_plan and out.cluster is cpu_cluster and out.note == ""


def test_export_page_says_plan_and_cluster_are_one_set(app, tiny_plan):
    at = open_page(app, "export")
    no_exception(at)
    assert any("made for cluster **a100x2_p100x2** (4 ranks" in m.value for m in at.markdown)
    assert [b.proto.label for b in at.get("download_button")] == [
        "Download plan.json", "Download cluster.json", "Download launch bundle (zip)"]


def test_browser_messages_lose_cli_prefixes_and_flags():
    line = ("hap export: hap: error: cluster 'x' has devices [a] but the plan was made for [b] (cluster 'y'); "
            "give --cluster the spec the plan was made for")
    assert services.browser_message(line) == "Cluster 'x' has devices [a] but the plan was made for [b] (cluster 'y')."
    assert services.browser_message("PlanError: no such device") == "No such device."


MACHINES = TWO_VIRTUAL_MACHINES


@functools.cache
def _on_machines(parallelism: str) -> tuple:
    graph = engine.load_model("zoo:gpt", **{**TINY_GPT, "layers": 2})
    cluster = engine.load_cluster(MACHINES)
    return graph, cluster, engine.plan(graph, cluster, time_budget_s=2, parallelism=parallelism)


def _machines_app(parallelism: str):
    from streamlit.testing.v1 import AppTest
    from ui_helpers import MAIN, TIMEOUT_S

    graph, cluster, plan = _on_machines(parallelism)
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT_S)
    for key, value in ((Keys.GRAPH, graph), (Keys.MODEL_SOURCE, "zoo:gpt (tiny)"), (Keys.CLUSTER, cluster),
                       (Keys.CLUSTER_SOURCE, "two machines"), (Keys.PLAN, plan), (Keys.BUDGET, 2.0)):
        at.session_state[key] = value
    return open_page(at.run(), "export"), plan


def test_export_expands_a_plan_on_virtual_devices_to_one_rank_per_gpu_and_offers_that_set():
    at, plan = _machines_app("spmd")
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    [note] = at.info
    assert note.value.startswith("The runner starts one process per GPU, so this plan's 2 virtual devices (machines "
                                 "of 2 GPUs) are exported expanded to 4 ranks on the per-GPU cluster two_machines_per_gpu")
    assert any("made for cluster **two_machines_per_gpu** (4 ranks" in m.value for m in at.markdown)
    assert [b.proto.label for b in at.get("download_button")] == [
        "Download plan.json", "Download cluster.json", "Download launch bundle (zip)"]
    assert any("--nproc-per-node=4 " in c.value for c in at.code)
    assert any(c.value.startswith("bash launch_node.sh NODE_RANK --digest ") for c in at.code)  # 2 machines
    out = services.export_set(services.plan_key(plan), engine.load_cluster(MACHINES).fingerprint(), plan,
                              engine.load_cluster(MACHINES))
    assert out.plan.cluster_fingerprint == out.cluster.fingerprint() and out.plan.world_size == 4


def test_export_of_a_pipeline_on_virtual_devices_explains_why_not_and_offers_the_per_gpu_cluster():
    at, plan = _machines_app("pipeline")
    assert plan.parallelism == "pipeline"
    no_exception(at)
    assert [i.value for i in at.info] == ["A pipeline plan's stages were searched for whole machines, so they cannot "
                                          "be split into one rank per GPU; plan again on the per-GPU cluster to run it."]
    assert [b.proto.label for b in at.get("download_button")] == ["Download the per-GPU cluster.json"]
    assert not at.code
    at.button(key="export.use_per_gpu").click().run()
    no_exception(at)
    assert [d.name for d in at.session_state[Keys.CLUSTER].devices] == ["fast-0", "fast-1", "slow-0", "slow-1"]
    assert at.warning[0].value.startswith("The cluster changed from two_machines to two_machines_per_gpu")
