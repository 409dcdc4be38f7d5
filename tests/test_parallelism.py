"""`engine.plan(..., parallelism=)` and `hap plan --parallelism/--microbatches`: SPMD, pipeline and auto."""
from __future__ import annotations

import re

import pytest
from conftest import sample_path

import engine
from engine import PipelinePlan, Plan, PlanError, load_plan
from engine.cli import main
from engine.pipeline.partition import best_pipeline
from engine.planner import spmd_alternatives

SLOW_LINK = "a100x8_v100x8_5gbps"


@pytest.fixture(scope="module")
def gpt4():
    return engine.load_model("zoo:gpt", layers=4, hidden=128, heads=4, ffn=256, vocab=1024, seq_len=32, batch=32)


def test_spmd_is_the_default_and_returns_a_plan_without_parallelism_stats(gpt4):
    p = engine.plan(gpt4, sample_path("cpu_4_uneven"), time_budget_s=1)
    assert isinstance(p, Plan) and p.parallelism == "spmd"
    assert "parallelism_s" not in p.search


def test_pipeline_returns_the_best_pipeline(gpt4):
    cluster = engine.load_cluster(sample_path(SLOW_LINK))
    p = engine.plan(gpt4, cluster, parallelism="pipeline")
    ref = best_pipeline(gpt4, cluster)
    assert isinstance(p, PipelinePlan) and p.parallelism == "pipeline"
    assert p.predicted_time_s == p.predicted_s == pytest.approx(ref.predicted_s)
    assert [s.layers for s in p.stages] == [s.layers for s in ref.stages]
    assert p.search["parallelism_s"] == {"pipeline": p.predicted_s}


def test_pipeline_microbatches_fix_b(gpt4):
    p = engine.plan(gpt4, sample_path(SLOW_LINK), parallelism="pipeline", microbatches=4)
    assert p.microbatches == 4
    assert all(r.warmup and max(r.warmup) <= 4 for r in p.schedules.values())


def test_auto_keeps_the_faster_kind_and_records_both(gpt4):
    for name, kind in ((SLOW_LINK, "pipeline"), ("cpu_4_uneven", "spmd")):
        p = engine.plan(gpt4, sample_path(name), time_budget_s=1, parallelism="auto")
        times = p.search["parallelism_s"]
        assert set(times) == {"spmd", "pipeline"}
        assert p.parallelism == kind == min(times, key=times.get)
        assert p.predicted_time_s == pytest.approx(times[kind])


def test_auto_prices_spmd_on_the_hardware_of_a_pipeline_that_leaves_devices_idle():
    """Issue 30, item 3: a pipeline on a few A100s is measured against SPMD on the A100 machine alone and on its
    own devices, not only against SPMD across the 5 Gbps link; the plan says which devices sit idle."""
    graph = engine.load_model("zoo:gpt", layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq_len=16, batch=8)
    p = engine.plan(graph, sample_path(SLOW_LINK), time_budget_s=2, parallelism="auto")
    assert p.parallelism == "pipeline" and p.device_use.idle
    used = p.device_use.used
    assert f"uses {len(used)} of 16 devices; idle: " in p.summary() and "v100-0 to v100-7" in p.summary()
    alternatives = spmd_alternatives(p)
    labels = [a.label for a in alternatives]
    assert "SPMD on all 16 devices" in labels and "SPMD on a100-0 to a100-7 alone (8 devices)" in labels
    assert [a.predicted_time_s for a in alternatives] == sorted(a.predicted_time_s for a in alternatives)
    whole = p.search["parallelism_s"]["spmd"]
    assert alternatives[0].predicted_time_s < whole  # the honest yardstick is faster than SPMD across the link
    again = load_plan(p.to_json())
    assert spmd_alternatives(again) == alternatives and again.device_use == p.device_use


@pytest.mark.parametrize("kwargs, field", [
    ({"parallelism": "pipelines"}, "parallelism"),
    ({"parallelism": "pipeline", "microbatches": 0}, "microbatches"),
    ({"parallelism": "auto", "microbatches": 2.5}, "microbatches"),
    ({"microbatches": 4}, "parallelism='pipeline'"),
])
def test_bad_parallelism_arguments_are_refused_by_name(gpt4, kwargs, field):
    with pytest.raises(PlanError, match=re.escape(field)):
        engine.plan(gpt4, sample_path("cpu_2"), time_budget_s=1, **kwargs)


def test_cli_auto_chooses_a_pipeline_for_gpt24_on_the_5gbps_cluster(capsys):
    """Issue 15's acceptance: the pipeline is chosen and predicted faster than the best SPMD plan."""
    rc = main(["plan", "--model", "zoo:gpt", "--set", "layers=24", "--cluster", sample_path(SLOW_LINK),
               "--parallelism", "auto", "--time-budget", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    pipe_ms = float(re.search(r"^pipeline\s+([\d.]+) ms", out, re.M).group(1))
    spmd_ms = float(re.search(r"^SPMD on all 16 devices\s+([\d.]+) ms", out, re.M).group(1))
    assert pipe_ms < spmd_ms
    assert "schedule h-1f1b" in out
    stages = re.findall(r"^(\d+)\s+\d+ x \S+ \(.*\)\s+(\d+)-(\d+)\s+(\d+)\s", out, re.M)
    assert len(stages) >= 2 and int(stages[0][1]) == 0 and int(stages[-1][2]) == 23
    assert int(stages[-1][3]) == 1  # the last stage warms up one microbatch under every 1F1B schedule
    for name in ("gpipe", "1f1b", "eager-1f1b", "h-1f1b"):
        assert re.search(rf"^{name}\s+[\d.]+ ms", out, re.M), name


def test_cli_pipeline_out_writes_a_loadable_pipeline_plan(capsys, tmp_path):

    path = tmp_path / "p.json"
    rc = main(["plan", "--model", "zoo:gpt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4",
               "--set", "ffn=128", "--set", "vocab=256", "--set", "seq_len=16", "--set", "batch=8",
               "--cluster", sample_path(SLOW_LINK), "--parallelism", "pipeline", "--microbatches", "2",
               "--out", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and f"pipeline plan written to {path}" in out
    plan = load_plan(str(path))
    assert isinstance(plan, PipelinePlan) and plan.microbatches == 2
    assert f"{plan.predicted_time_s * 1e3:.2f} ms" in out


def test_cli_pipeline_json_prints_the_pipeline_plan(capsys):
    import json

    rc = main(["plan", "--model", "zoo:gpt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4",
               "--set", "ffn=128", "--set", "vocab=256", "--set", "seq_len=16", "--set", "batch=8",
               "--cluster", sample_path(SLOW_LINK), "--parallelism", "pipeline", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["kind"] == "hap.pipeline_plan" and load_plan(d).stages


def test_cli_microbatches_with_spmd_exits_2(capsys):
    rc = main(["plan", "--model", "zoo:mlp", "--set", "layers=1", "--cluster", sample_path("cpu_2"), "--microbatches", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "microbatches applies to pipeline plans" in err


def test_an_spmd_plan_kept_by_auto_round_trips_with_the_pipeline_time(gpt4):
    p = engine.plan(gpt4, sample_path("cpu_4_uneven"), time_budget_s=1, parallelism="auto")
    assert p.parallelism == "spmd"
    back = load_plan(p.to_json())
    assert back.to_json() == p.to_json()
    assert back.search["parallelism_s"]["pipeline"] == pytest.approx(p.search["parallelism_s"]["pipeline"])


def test_cli_report_of_an_spmd_plan_kept_by_auto_names_the_pipeline_time(capsys):
    rc = main(["plan", "--model", "zoo:gpt", "--set", "layers=4", "--set", "hidden=128", "--set", "heads=4",
               "--set", "ffn=256", "--set", "vocab=1024", "--set", "seq_len=32", "--set", "batch=32",
               "--cluster", sample_path("cpu_4_uneven"), "--parallelism", "auto", "--time-budget", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and re.search(r"parallelism: spmd kept; the best pipeline predicts [\d.]+ ms", out)


def test_cli_pipeline_report_lists_stages_and_says_spmd_was_not_planned(capsys):
    rc = main(["plan", "--model", "zoo:gpt", "--set", "layers=4", "--set", "hidden=128", "--set", "heads=4",
               "--set", "ffn=256", "--set", "vocab=1024", "--set", "seq_len=32", "--set", "batch=32",
               "--cluster", sample_path("a100x2_p100x2"), "--parallelism", "pipeline", "--microbatches", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "B = 4 microbatches" in out
    assert "spmd: parallelism='pipeline' plans a pipeline only; 'auto' compares it with SPMD" in out
    assert "SPMD on" not in out
