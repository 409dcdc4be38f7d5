"""Runs page: loss and eval-loss curves, lr, grad norm and tokens/s from runner metrics files, the summary
figures, and the measured step time beside the session plan's prediction (app.runs does the reading)."""
from __future__ import annotations

import json

import pytest
from ui_helpers import ROOT, app, no_exception, open_page, tiny_plan  # noqa: F401 (fixtures)

from app import runs

FIXTURES = ROOT / "tests" / "fixtures" / "metrics"
NEW = FIXTURES / "run_3ranks_eval.jsonl"
OLD = FIXTURES / "old_format.jsonl"


def _upload(at, *files: tuple[str, bytes]):
    at.file_uploader(key="runs.metrics").set_value([(name, data, "application/json") for name, data in files]).run()
    no_exception(at)
    return at


def _specs(at) -> list[str]:
    return [c.proto.spec for c in at.get("vega_lite_chart")]


def test_a_run_with_evaluations_reads_into_series_and_figures():
    run = runs.load_run("new", NEW.read_text())
    assert (run.world_size, len(run.steps), [e.step for e in run.evals]) == (3, 6, [0, 2, 4])
    assert run.steps[0].step_time_s == 0.215  # the slowest rank's: the step waits for it
    assert run.steps[2].grad_norm is None and run.steps[3].grad_norm == 1.22
    s = runs.summarise(run)
    assert (s.first_loss, s.last_loss, s.min_loss) == (5.62, 3.71, 3.71)
    assert s.eval_drop_pct == pytest.approx(100 * (5.55 - 3.79) / 5.55)
    assert s.mean_step_time_s == pytest.approx((0.108 + 0.106 + 0.105 + 0.107 + 0.104) / 5)  # step 0 warms up
    assert 0 < s.mean_mfu < 1 and s.mean_tokens_per_s > 0
    series = {(r["series"], r["step"]) for r in runs.loss_rows([run])}
    assert ("eval loss", 4) in series and ("loss", 5) in series and ("eval loss", 5) not in series


def test_an_old_file_has_no_lr_grad_norm_or_evaluations():
    run = runs.load_run("old", OLD.read_text())
    s = runs.summarise(run)
    assert (s.steps, s.ranks, s.eval_drop_pct, s.mean_tokens_per_s, s.mean_mfu) == (4, 3, None, None, None)
    assert not any(runs.recorded([run], f) for f, _, _ in runs.SERIES_CHARTS)


def test_bad_records_are_named():
    with pytest.raises(runs.MetricsError, match=r"^m: record of step 1, rank 0: 'loss' is 'high', not a number"):
        runs.load_run("m", json.dumps({"step": 1, "rank": 0, "loss": "high"}))
    with pytest.raises(runs.MetricsError, match=r"'step' is -1, not a step"):
        runs.load_run("m", json.dumps({"step": -1, "rank": 0, "loss": 1.0}))
    with pytest.raises(runs.MetricsError, match="no record has a 'loss'"):
        runs.load_run("m", json.dumps({"step": 0, "rank": 0, "step_time_s": 0.1}))


def test_a_diverged_step_is_a_gap_and_a_note():
    text = "\n".join(json.dumps({"step": k, "rank": 0, "loss": v}) for k, v in enumerate([2.0, float("nan"), 1.5]))
    run = runs.load_run("nan", text)
    assert run.nonfinite_steps == (1,) and [r["step"] for r in runs.loss_rows([run])] == [0, 2]
    assert "NaN or infinite at step 1" in runs.run_notes([run])[0]


def test_an_elastic_switch_sets_the_world_compared_with_the_plan():
    records = [{"step": k, "rank": r, "loss": 1.0, "step_time_s": 0.1} for k in range(3) for r in range(4)]
    records.append({"event": "elastic_switch", "old_world": 4, "new_world": 3, "resume_step": 2})
    records += [{"step": k, "rank": r, "loss": 1.0, "step_time_s": 0.3} for k in range(2, 5) for r in range(3)]
    run = runs.run_from_records("elastic", records)
    assert (run.world_size, run.since_step) == (3, 2)
    assert runs.summarise(run).mean_step_time_s == pytest.approx(0.3)  # steps 3 and 4, at 3 ranks
    assert runs.world_mismatch(run, 3) is None and "ran on 3 ranks" in runs.world_mismatch(run, 4)
    assert "4 to 3 ranks" in runs.run_notes([run])[0]


def test_microsteps_scale_the_prediction():
    run = runs.load_run("new", NEW.read_text())
    assert runs.compare_to_plan(run, 0.05, grad_accum=2).predicted_s == pytest.approx(0.1)
    with_accum = runs.run_from_records("acc", [{"step": 0, "rank": 0, "loss": 1.0, "grad_accum": 4}])
    assert runs.compare_to_plan(with_accum, 0.05, grad_accum=2).predicted_s == pytest.approx(0.2)  # the file wins


def test_two_uploads_of_the_same_name_stay_apart():
    assert runs.unique_names(["m.jsonl", "m.jsonl", "x", "m.jsonl"]) == ["m.jsonl", "m.jsonl (2)", "x", "m.jsonl (3)"]


def test_runs_page_asks_for_a_file(app):
    at = open_page(app, "runs")
    no_exception(at)
    assert any("No metrics yet" in i.value for i in at.info) and not at.get("vega_lite_chart")


def test_runs_page_draws_a_run_with_evaluations(app):
    at = _upload(open_page(app, "runs"), ("new.jsonl", NEW.read_bytes()))
    specs = _specs(at)
    assert len(specs) == 5 and '"title": "Loss"' in specs[0] and "eval loss" in specs[0]
    assert all(title in "".join(specs) for _, title, _ in runs.SERIES_CHARTS)
    summary = at.dataframe[0].value
    assert summary["eval_drop_%"][0] == pytest.approx(31.7, abs=0.05) and summary["ranks"][0] == 3
    assert summary["first_loss"][0] == 5.62 and summary["mfu_%"][0] > 0
    # the tiny plan runs on 4 devices, the metrics on 3 ranks: no prediction is drawn beside them
    assert any("ran on 3 ranks, the plan in this session has 4 devices" in w.value for w in at.warning)
    assert "predicted_ms" not in specs[4] and len(at.dataframe) == 1 and not at.number_input


def test_runs_page_draws_an_old_file_and_compares_two_runs(app):
    at = _upload(open_page(app, "runs"), ("old.jsonl", OLD.read_bytes()), ("new.jsonl", NEW.read_bytes()))
    specs = _specs(at)
    assert len(specs) == 5
    assert list(at.dataframe[0].value["run"]) == ["old.jsonl", "new.jsonl"]
    alone = _upload(open_page(app, "runs"), ("old.jsonl", OLD.read_bytes()))
    assert len(_specs(alone)) == 2  # loss and step time; lr, grad norm and tokens/s are not recorded
    assert sum("not recorded in these metrics" in c.value for c in alone.caption) == 3


def test_runs_page_compares_with_the_plan_of_the_same_world(app, tiny_plan):
    text = "\n".join(json.dumps({"step": k, "rank": r, "loss": 2.0 - k / 10, "step_time_s": 0.02})
                     for k in range(3) for r in range(tiny_plan.world_size))
    at = _upload(open_page(app, "runs"), ("same.jsonl", text.encode()))
    assert not at.warning and "predicted_ms" in _specs(at)[-1]
    table = at.dataframe[1].value
    assert table["predicted_ms"][0] == pytest.approx(tiny_plan.predicted_time_s * 1e3)
    assert table["measured_ms"][0] == pytest.approx(20.0)
    at.number_input(key="runs.grad_accum").set_value(2).run()
    assert at.dataframe[1].value["predicted_ms"][0] == pytest.approx(2 * tiny_plan.predicted_time_s * 1e3)


def test_runs_page_without_a_plan_says_so(app):
    from app.services import Keys

    app.session_state[Keys.PLAN] = None
    at = _upload(open_page(app, "runs"), ("new.jsonl", NEW.read_bytes()))
    assert any("No plan in this session" in i.value for i in at.info) and len(_specs(at)) == 5


def test_a_garbage_file_shows_an_error_and_the_good_one_still_draws(app):
    at = _upload(open_page(app, "runs"), ("junk.txt", b"\x89PNG\r\n\x1a\n\x00\x00garbage"))
    assert len(at.error) == 1 and at.error[0].value.startswith("junk.txt: metrics file line 1")
    assert not at.get("vega_lite_chart")
    at = _upload(open_page(app, "runs"), ("junk.jsonl", b'{"step": 0, "rank": 0, "loss": []}\n'),
                 ("new.jsonl", NEW.read_bytes()))
    assert [e.value for e in at.error] == ["junk.jsonl: record of step 0, rank 0: 'loss' is [], not a number or null"]
    assert len(_specs(at)) == 5


def test_the_timeline_page_points_to_the_runs_page(app):
    at = open_page(app, "timeline")
    no_exception(at)
    (link,) = at.get("page_link")
    assert link.proto.page == "runs" and "Runs page" in link.proto.label
