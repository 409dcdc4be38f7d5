"""Timeline page: the predicted Gantt per device and stage, and a measured one from runner metrics."""
from __future__ import annotations

import json

import pytest
from ui_helpers import no_exception, open_page, app, tiny_plan  # noqa: F401 (fixtures)

from app import components as ui


def _metrics(ranks: int = 2, steps: int = 2) -> str:
    """Records in the format of `hap run --timing --metrics` (runner.launch + runner.timing.Pacer)."""
    lines = []
    for step in range(steps):
        for rank in range(ranks):
            timeline = [{"phase": "fwd", "kind": "compute", "name": "linear_mm", "start_s": 0.0, "s": 0.002 * (rank + 1)},
                        {"phase": "fwd", "kind": "comm", "name": "all_gather.padded(add)", "start_s": 0.002 * (rank + 1), "s": 0.001},
                        {"phase": "bwd", "kind": "compute", "name": "linear_mm", "start_s": 0.004, "s": 0.003}]
            lines.append(json.dumps({"step": step, "rank": rank, "loss": 1.0, "step_time_s": 0.01, "speed": 1.0,
                                     "compute_s": 0.005, "comm_s": 0.001, "emulated_s": 0.0, "timeline": timeline}))
    return "\n".join(lines) + "\n"


def test_one_bar_group_per_device_and_stage(tiny_plan):
    rows = ui.timeline_rows(tiny_plan)
    groups = {(r["device"], r["stage"]) for r in rows}
    assert groups == {(d, s) for d in tiny_plan.device_names for s in range(len(tiny_plan.stages))}
    assert sum(r["kind"] == "compute" for r in rows) == len(groups)
    end = max(r["end_ms"] for r in rows)
    assert end == pytest.approx(tiny_plan.predicted_time_s * 1e3, rel=1e-9)


def test_idle_is_the_slowest_compute_minus_own(tiny_plan):
    rows = ui.timeline_rows(tiny_plan)
    order = ui.execution_stages(tiny_plan)
    for k, (idx, stage) in enumerate(order):
        slowest = max(stage.comp_s)
        for j, dev in enumerate(tiny_plan.device_names):
            idle = sum(r["end_ms"] - r["start_ms"] for r in rows if r["stage"] == k and r["device"] == dev and r["kind"] == "idle")
            assert idle == pytest.approx((slowest - stage.comp_s[j]) * 1e3, abs=1e-9)


def test_backward_stages_run_in_reverse(tiny_plan):
    order = ui.execution_stages(tiny_plan)
    directions = [s.direction for _, s in order]
    first_bwd = directions.index("backward")
    assert set(directions[:first_bwd]) == {"forward"} and set(directions[first_bwd:]) == {"backward"}
    bwd = [idx for idx, s in order if s.direction == "backward"]
    assert bwd == sorted(bwd, reverse=True)
    starts = [min(r["start_ms"] for r in ui.timeline_rows(tiny_plan) if r["stage"] == k) for k in range(len(order))]
    assert starts == sorted(starts)


def test_grouping_merges_identical_devices(tiny_plan):
    groups = ui.device_groups(tiny_plan, True)
    assert sum(len(m) for _, m in groups) == tiny_plan.world_size
    for _, members in groups:
        assert len({tuple(s.comp_s[j] for s in tiny_plan.stages) for j in members}) == 1


def test_timeline_page_draws_predicted_and_measured(app, tiny_plan):
    at = open_page(app, "timeline")
    no_exception(at)
    charts = at.get("vega_lite_chart")
    assert len(charts) == 1 and "Predicted" in charts[0].proto.spec
    assert list(at.dataframe[0].value["device"]) == tiny_plan.device_names
    at.file_uploader(key="timeline.metrics").set_value(("metrics.jsonl", _metrics().encode(), "application/json")).run()
    no_exception(at)
    charts = at.get("vega_lite_chart")
    assert len(charts) == 3 and "Measured, step 1" in charts[2].proto.spec


def test_bad_metrics_upload_shows_one_line(app):
    at = open_page(app, "timeline")
    at.file_uploader(key="timeline.metrics").set_value(("m.jsonl", b'{"step": 0}\nnot json\n', "application/json")).run()
    no_exception(at)
    assert len(at.error) == 1 and at.error[0].value.startswith("metrics file line 1: a record needs 'step' and 'rank'")


def test_measured_rows_from_the_runner_pacer():
    """The parser reads what runner.timing.Pacer really records."""
    from runner.timing import Pacer

    pacer = Pacer(record=True)
    pacer.begin_step()
    with pacer.comm("all_reduce", "x"):
        pass
    pacer.instruction_done("linear_mm")
    pacer.set_phase("bwd")
    record = {"step": 0, "rank": 0, "loss": 0.5, **pacer.end_step()}
    rows = ui.measured_rows(ui.parse_metrics(json.dumps(record)))
    assert {r["kind"] for r in rows} <= {"compute", "communication"} and any(r["kind"] == "communication" for r in rows)
    assert all(r["device"] == "rank 0" and r["end_ms"] >= r["start_ms"] for r in rows)
    with pytest.raises(ValueError, match="no 'timeline'"):
        ui.measured_rows([{"step": 0, "rank": 0}])
