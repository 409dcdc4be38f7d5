"""Timeline page: the predicted Gantt per device and stage, and a measured one from runner metrics."""
from __future__ import annotations

import json

import pytest
from ui_helpers import ROOT, app, cpu_cluster, no_exception, open_page, tiny_graph, tiny_plan  # noqa: F401 (fixtures)

from app.runs import parse_metrics
from engine import views


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


def _lanes(plan, cluster, group=False):
    from engine.compare import predicted_schedule

    return views.predicted_lane_rows(predicted_schedule(plan, cluster).rows(), group=group)


def test_a_compute_lane_and_communication_lanes_per_device(tiny_plan, cpu_cluster):
    rows = _lanes(tiny_plan, cpu_cluster)
    lanes = {(r["device"], r["lane"]) for r in rows}
    assert {d for d, lane in lanes if lane == "compute"} == set(tiny_plan.device_names)
    assert {lane for _, lane in lanes} - {"compute"} and {lane for _, lane in lanes} <= {"compute", "network", "buckets"}
    assert {r["row"] for r in rows} == {f"{d} · {lane}" for d, lane in lanes}
    assert max(r["end_ms"] for r in rows) == pytest.approx(tiny_plan.predicted_time_s * 1e3, rel=1e-9)
    assert {r["kind"] for r in rows if r["lane"] == "compute"} <= {"compute", "optimizer"}
    assert {r["kind"] for r in rows if r["lane"] == "buckets"} <= {"gradient bucket"}
    assert all(r["end_ms"] > r["start_ms"] for r in rows)


def test_lane_summary_shows_hidden_communication(tiny_plan, cpu_cluster):
    rows = _lanes(tiny_plan, cpu_cluster)
    summary = views.lane_summary(rows)
    assert [s["device"] for s in summary] == tiny_plan.device_names
    span = max(r["end_ms"] for r in rows) - min(r["start_ms"] for r in rows)
    for s in summary:
        busy = s["compute_ms"] + s["network_ms"] - s["overlapped_ms"]
        assert s["idle_ms"] == pytest.approx(span - busy, abs=1e-9) and 0 <= s["hidden_%"] <= 100


def test_ddp_overlap_is_visible_in_the_lanes(cpu_cluster):
    """A data-parallel plan priced as DDP runs: with more than DDP's first 1 MiB bucket of
    gradients, some bucket runs while backward still computes."""
    import engine

    graph = engine.load_model("zoo:gpt", layers=2, hidden=256, heads=4, ffn=1024, vocab=256, seq_len=16, batch=8)
    ddp = engine.evaluate(graph, cpu_cluster, "ddp")
    rows = _lanes(ddp, cpu_cluster)
    assert any(r["kind"] == "gradient bucket" for r in rows)
    assert any(s["overlapped_ms"] > 0 for s in views.lane_summary(rows))


def test_grouping_merges_devices_with_identical_lanes(tiny_plan, cpu_cluster):
    rows, grouped = _lanes(tiny_plan, cpu_cluster), _lanes(tiny_plan, cpu_cluster, group=True)
    devices = list(dict.fromkeys(r["device"] for r in grouped))
    assert len(devices) <= tiny_plan.world_size
    members = sum(int(d.rsplit("(", 1)[1][:-1]) if " .. " in d else 1 for d in devices)
    assert members == tiny_plan.world_size
    assert len(grouped) == sum(1 for r in rows if r["device"] in {d.split(" .. ")[0] for d in devices})


def test_measured_segments_go_to_their_lane():
    rows = views.measured_rows(parse_metrics(_metrics()))
    assert {(r["name"], r["lane"]) for r in rows} == {("linear_mm", "compute"), ("all_gather.padded(add)", "network")}
    rank0, rank1 = views.lane_summary(rows)
    assert (rank0["device"], rank0["overlapped_ms"]) == ("rank 0", 0)
    assert rank1["overlapped_ms"] == pytest.approx(1.0)  # its collective (4-5 ms) runs beside its backward (4-7 ms)
    overlapped = json.dumps({"step": 0, "rank": 0, "timeline": [
        {"phase": "bwd", "kind": "compute", "name": "linear_mm", "start_s": 0.0, "s": 0.004},
        {"phase": "bwd", "kind": "comm", "name": "all_reduce(bucket 0)", "start_s": 0.003, "s": 0.002}]})
    (s,) = views.lane_summary(views.measured_rows(parse_metrics(overlapped)))
    assert s["overlapped_ms"] == pytest.approx(1.0) and s["hidden_%"] == pytest.approx(50.0)


def test_measured_duplex_halves_replace_their_phase():
    """A duplex rank records its two half-batch streams under `halves` (runner.timing.Pacer.absorb):
    their segments are drawn, placed from the rank's duplex segment, and the device waits are gaps."""
    def half(comm_at: float) -> dict:
        return {"timeline": [{"phase": "fwd", "kind": "compute", "name": "linear_mm", "start_s": 0.0, "s": 0.002},
                             {"phase": "fwd", "kind": "comm", "name": "(device busy)", "start_s": 0.002, "s": 0.001},
                             {"phase": "fwd", "kind": "comm", "name": "all_to_all(x)", "start_s": comm_at, "s": 0.002}]}

    record = {"step": 0, "rank": 0, "timeline": [
        {"phase": "fwd", "kind": "compute", "name": "(other)", "start_s": 0.0, "s": 0.001},
        {"phase": "duplex", "kind": "compute", "name": "(duplex halves)", "start_s": 0.001, "s": 0.006},
        {"phase": "step", "kind": "comm", "name": "all_reduce(bucket0)", "start_s": 0.007, "s": 0.001}],
        "halves": [half(0.002), half(0.004)]}
    rows = views.measured_rows(parse_metrics(json.dumps(record)))
    assert [(r["name"], r["half"], r["lane"]) for r in rows] == [
        ("(other)", "", "compute"), ("linear_mm", "A", "compute"), ("all_to_all(x)", "A", "network"),
        ("linear_mm", "B", "compute"), ("all_to_all(x)", "B", "network"), ("all_reduce(bucket0)", "", "network")]
    a_comm = rows[2]
    assert (a_comm["start_ms"], a_comm["end_ms"]) == pytest.approx((3.0, 5.0))


def test_timeline_page_draws_predicted_and_measured(app, tiny_plan):
    at = open_page(app, "timeline")
    no_exception(at)
    charts = at.get("vega_lite_chart")
    assert len(charts) == 1 and "Predicted" in charts[0].proto.spec
    assert '"y": {"field": "row"' in charts[0].proto.spec  # one chart row per device lane
    assert list(at.dataframe[0].value["device"]) == tiny_plan.device_names
    assert {"compute_ms", "network_ms", "overlapped_ms", "idle_ms"} <= set(at.dataframe[0].value.columns)
    assert any(f"Overlap mode **{tiny_plan.overlap}**" in m.value for m in at.markdown)
    at.file_uploader(key="timeline.metrics").set_value(("metrics.jsonl", _metrics().encode(), "application/json")).run()
    no_exception(at)
    charts = at.get("vega_lite_chart")
    assert len(charts) == 3 and "Measured, step 1" in charts[2].proto.spec
    assert '"y": {"field": "row"' in charts[2].proto.spec
    assert list(at.dataframe[1].value["device"]) == ["rank 0", "rank 1"]


def test_timeline_page_asks_for_a_new_search_on_another_cluster(app):
    import engine
    from app.services import Keys

    app.session_state[Keys.CLUSTER] = engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json")
    at = open_page(app, "timeline")
    no_exception(at)
    assert any("The cluster changed from a100x2_p100x2 to cpu_2" in w.value for w in at.warning)
    assert not at.get("vega_lite_chart")


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
    rows = views.measured_rows(parse_metrics(json.dumps(record)))
    assert {r["kind"] for r in rows} <= {"compute", "communication"} and any(r["kind"] == "communication" for r in rows)
    assert all(r["device"] == "rank 0" and r["end_ms"] >= r["start_ms"] for r in rows)
    with pytest.raises(ValueError, match="no 'timeline'"):
        views.measured_rows([{"step": 0, "rank": 0}])
