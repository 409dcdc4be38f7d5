"""The compute bound and MFU in the workbench (Plan and Compare pages, both kinds of plan), and the Search
page's precision, gradient dtype, recompute and shard-states controls reaching the planner's options."""
from __future__ import annotations

import pytest
from ui_helpers import TINY_GPT, app, cpu_cluster, no_exception, open_page, tiny_plan  # noqa: F401 (fixtures)

from app import services
from app.services import Keys
from engine import views
from engine.pipeline.partition import fixed_pipeline
from engine.spmd.utilisation import percent


def test_plan_page_shows_the_compute_bound_and_mfu(app, tiny_plan):
    at = open_page(app, "plan")
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Compute bound"] == views.ms(tiny_plan.compute_bound_s)
    assert metrics["MFU"] == percent(tiny_plan.mfu)


def test_compare_page_gives_every_row_its_mfu(app, tiny_plan):
    at = open_page(app, "compare")
    no_exception(at)
    table = at.dataframe[0].value
    mine = table[table["plan"]]
    assert mine["mfu"].iloc[0] == pytest.approx(tiny_plan.mfu * 100, rel=1e-9)
    fits = table[table["predicted_ms"].notna()]
    bound_ms = tiny_plan.compute_bound_s * 1e3
    assert list(fits["mfu"]) == pytest.approx(list(bound_ms / fits["predicted_ms"] * 100), rel=1e-9)
    assert any("MFU: the compute bound" in c.value for c in at.caption)


def test_a_pipeline_plan_shows_them_on_the_plan_and_compare_pages(app, cpu_cluster):
    import engine

    graph = engine.load_model("zoo:gpt", **{**TINY_GPT, "layers": 2})
    pipe = fixed_pipeline(graph, cpu_cluster, [(0, 1, (0, 1)), (1, 2, (2, 3))], 2)
    app.session_state[Keys.GRAPH] = graph
    app.session_state[Keys.PLAN] = pipe
    at = open_page(app, "plan")
    no_exception(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Compute bound"] == views.ms(pipe.compute_bound_s) and metrics["MFU"] == percent(pipe.mfu)
    at = open_page(at, "compare")
    no_exception(at)
    table = at.dataframe[0].value
    chosen = table[table["plan"]]
    assert chosen["mfu"].iloc[0] == pytest.approx(pipe.mfu * 100, rel=1e-9)


def test_the_search_page_passes_precision_grad_dtype_recompute_and_shard_states(app):
    app.session_state[Keys.PLAN] = None
    at = open_page(app, "search")
    assert at.selectbox(key=f"{Keys.PRECISION}_choice").value == "fp32"
    assert at.selectbox(key=f"{Keys.SHARD_STATES}_choice").value == "auto"
    at.selectbox(key=f"{Keys.PRECISION}_choice").set_value("fp16")  # the P100s have no bf16
    at.selectbox(key=f"{Keys.GRAD_DTYPE}_choice").set_value("bf16")
    at.selectbox(key=f"{Keys.RECOMPUTE}_choice").set_value("none")
    at.selectbox(key=f"{Keys.SHARD_STATES}_choice").set_value(1)
    at.button(key="search.run").click().run()
    no_exception(at)
    options = at.session_state[Keys.PLAN].options
    assert (options.precision, options.grad_dtype, options.recompute, options.shard_states) == ("fp16", "bf16", "none", 1)
    assert at.session_state[Keys.PRECISION] == "fp16" and at.session_state[Keys.SHARD_STATES] == 1


def test_plan_options_carry_the_four_choices():
    options = services.plan_options(2.0, precision="fp16", grad_dtype="bf16", recompute="all", shard_states=3)
    assert (options.precision, options.grad_dtype, options.recompute, options.shard_states) == ("fp16", "bf16", "all", 3)
    assert services.plan_options(2.0).precision == "fp32" and services.plan_options(2.0).shard_states == "auto"
