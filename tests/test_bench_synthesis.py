"""bench/synthesis.py's case selection: `--gpt-only` keeps exactly the 8-device GPT depths asked for."""
from __future__ import annotations

from conftest import load_bench


def _bench():
    return load_bench("synthesis")


def test_gpt_only_keeps_the_8_device_gpt_depths_and_nothing_else():
    bench = _bench()
    cases = bench.selected_cases([24, 48], gpt_only=True)
    assert [(c.get("layers"), c.get("model"), c["cluster"]) for c in cases] == [(24, None, bench.MACHINES),
                                                                                (48, None, bench.MACHINES)]


def test_default_selection_also_runs_the_64_device_vision_and_language_cases():
    bench = _bench()
    cases = bench.selected_cases([24])
    assert (12, bench.TESTBED_64) in [(c.get("layers"), c["cluster"]) for c in cases]
    models = {c.get("model") for c in cases}
    assert set(bench.VISION) <= models and set(bench.LANGUAGE) <= models
    vision = bench.selected_cases([24], vision_only=True)
    assert vision and {c["model"] for c in vision} == set(bench.VISION)


def test_the_environment_records_the_reference_loop_time_beside_the_figures(monkeypatch):
    """Planning times are comparable across machines only with the reference loop's time beside them:
    the best of its runs (a fake clock here: runs of 3, 1 and 2 s)."""
    bench = _bench()
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    monkeypatch.setattr(bench, "REFERENCE_LOOP", 10)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks, 100.0))  # any later reader: a later time
    assert bench.environment()["reference_loop_s"] == 1.0


def test_the_exact_report_compares_finished_cases_and_states_depth_only_when_it_was_run():
    bench = _bench()
    beam = [{"model": "vgg19", "cluster": bench.MACHINES, "predicted_time_s": 0.1010},
            {"model": "vit", "cluster": bench.MACHINES, "predicted_time_s": 0.5}]
    exact = [{"predicted_time_s": 0.1, "planning_time_s": 2.0, "optimal": True},
             {"predicted_time_s": 0.5, "planning_time_s": 600.0, "optimal": False}]
    text = bench.exact_report(beam, exact, [], 600, 0)
    assert "1.0100" in text and "did not finish in 600 s" in text
    assert "deepest" not in text, "no depth run, no depth claim"
    depth = [{"layers": 1, "optimal": True}, {"layers": 2, "optimal": False}]
    assert bench.exact_report([], [], depth, 0, 60).endswith("finishes within 60 s: 1 layer")
