"""One plan interface for both kinds (`engine.AnyPlan`), one loader (`engine.load_plan`), one options object
(`engine.PlanOptions`), and plans and bundles written before them still loading and running."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, sample_path

import engine
from engine import AnyPlan, PipelinePlan, Plan, PlanError, PlanOptions, load_plan
from engine.bundle.archive import check_bundle
from engine.options import OPTIMIZERS, PARALLELISMS, PLAN_OVERLAPS

SLOW_LINK = "a100x8_v100x8_5gbps"
OLD = ROOT / "tests" / "fixtures" / "written_by_66fbce9"


@pytest.fixture(scope="module")
def gpt4():
    return engine.load_model("zoo:gpt", layers=4, hidden=128, heads=4, ffn=256, vocab=1024, seq_len=32, batch=32)


@pytest.mark.parametrize("cluster, kind", [("cpu_4_uneven", "spmd"), (SLOW_LINK, "pipeline")])
def test_both_kinds_of_plan_save_load_list_and_summarise_through_the_same_code(gpt4, cluster, kind, tmp_path):
    """`parallelism="auto"` returns an SPMD plan on one cluster and a pipeline on the other; the same
    calls serve both."""
    p: AnyPlan = engine.plan(gpt4, sample_path(cluster), time_budget_s=1, parallelism="auto")
    assert p.parallelism == kind
    path = tmp_path / "x.json"
    p.save(path)
    again = engine.load_plan(str(path))
    assert type(again) is type(p) and again.to_dict() == json.loads(path.read_text()) == json.loads(p.to_json())
    assert engine.load_plan(path.read_text()).to_dict() == engine.load_plan(p.to_dict()).to_dict() == again.to_dict()
    assert again.predicted_time_s == pytest.approx(p.predicted_time_s)
    assert again.world_size == p.world_size == engine.load_cluster(sample_path(cluster)).num_devices
    listing, summary = p.listing(), p.summary()
    assert listing and summary and listing == again.listing() and summary == again.summary()
    assert f"{p.predicted_time_s * 1e3:.2f} ms" in summary
    if kind == "pipeline":
        assert isinstance(p, PipelinePlan)
        assert summary.count("\nstage ") == len(p.stages) and listing.count("# stage ") == len(p.stages)
    else:
        assert isinstance(p, Plan) and len(listing.splitlines()) == len(p.program)
        assert "speed-up over the best data-parallel baseline" in summary


def test_the_options_a_plan_was_made_with_are_recorded_and_read_back(gpt4, tmp_path):
    opts = PlanOptions(optimizer="sgd", time_budget_s=1.5, overlap="ddp", beam_width=8, max_iterations=3)
    p = engine.plan(gpt4, sample_path("cpu_4_uneven"), options=opts)
    assert p.search["options"] == dataclasses.asdict(opts)
    p.save(tmp_path / "p.json")
    assert engine.load_plan(str(tmp_path / "p.json")).options == opts
    pipe = engine.plan(gpt4, sample_path(SLOW_LINK), options=dataclasses.replace(opts, parallelism="pipeline",
                                                                                   overlap="auto"))
    assert PlanOptions.from_dict(pipe.search["options"]).parallelism == "pipeline"


def test_keyword_options_and_an_options_object_plan_alike(gpt4):
    by_keyword = engine.plan(gpt4, sample_path("cpu_2"), time_budget_s=60, optimizer="sgd", overlap="none")
    by_object = engine.plan(gpt4, sample_path("cpu_2"), options=PlanOptions(time_budget_s=60, optimizer="sgd",
                                                                            overlap="none"))
    assert by_keyword.search["options"] == by_object.search["options"]
    assert by_keyword.program == by_object.program


@pytest.mark.parametrize("option, value, allowed", [
    ("overlap", "bogus", ", ".join(PLAN_OVERLAPS)),
    ("optimizer", "adamw", ", ".join(OPTIMIZERS)),
    ("parallelism", "pipelines", ", ".join(PARALLELISMS)),
    ("segments", 0, "an integer from 1 to 1024"),
    ("segments", True, "an integer from 1 to 1024"),
    ("beam_width", -3, "or None for an exact search"),
    ("max_iterations", 2.5, "an integer from 1"),
    ("report_every", 0, "an integer from 1"),
    ("microbatches", 0, "or None to search"),
    ("time_budget_s", -1, "a number of seconds in (0, 86400]"),
    ("time_budget_s", float("nan"), "a number of seconds"),
])
def test_every_bad_option_is_one_plan_error_line_naming_it_and_its_allowed_values(gpt4, option, value, allowed):
    kwargs = {option: value, **({"parallelism": "pipeline"} if option == "microbatches" else {})}
    for make in (lambda: engine.plan(gpt4, sample_path("cpu_2"), **kwargs), lambda: PlanOptions(**kwargs)):
        with pytest.raises(PlanError) as e:
            make()
        message = str(e.value)
        assert "\n" not in message and option in message and allowed in message, message


def test_an_unknown_option_is_refused_by_name_not_with_a_type_error(gpt4):
    with pytest.raises(PlanError, match=r"option 'overlaps' is not known \(the options are: .*overlap.*\)"):
        engine.plan(gpt4, sample_path("cpu_2"), overlaps="ddp")
    with pytest.raises(PlanError, match="option 'bogus' is not known"):
        PlanOptions.from_dict({"bogus": 1})


def test_microbatches_belong_to_pipelines_only():
    with pytest.raises(PlanError, match="microbatches applies to pipeline plans"):
        PlanOptions(microbatches=4)
    assert PlanOptions(microbatches=4, parallelism="auto").microbatches == 4


def test_options_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        PlanOptions("sgd")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanOptions().optimizer = "sgd"  # type: ignore[misc]


def test_load_plan_refuses_what_is_not_a_plan_in_one_line(tmp_path):
    (tmp_path / "graph.json").write_text(json.dumps({"kind": "hap.graph"}))
    with pytest.raises(PlanError, match=r'not a plan: "kind" is "hap.graph", expected "hap.plan" or "hap.pipeline_plan"'):
        load_plan(str(tmp_path / "graph.json"))
    with pytest.raises(PlanError, match="not found"):
        load_plan(str(tmp_path / "missing.json"))


def test_a_recorded_option_the_engine_does_not_know_is_refused_by_its_path(tmp_path):
    d = json.loads((OLD / "spmd_plan.json").read_text())
    d["search"]["options"] = {"overlap": "sideways"}
    with pytest.raises(PlanError, match=r"search\.options: overlap 'sideways' is not known"):
        load_plan(d)


# ----------------------------------------------------------------------------- written before this layout


def test_plans_written_by_main_at_66fbce9_still_load():
    spmd = load_plan(str(OLD / "spmd_plan.json"))
    pipe = load_plan(str(OLD / "pipeline_plan.json"))
    assert isinstance(spmd, Plan) and isinstance(pipe, PipelinePlan) and len(pipe.stages) == 2
    assert spmd.options == PlanOptions(optimizer="sgd")  # such plans recorded their optimizer only
    assert spmd.summary() and pipe.summary() and spmd.listing() and pipe.listing()
    assert check_bundle(OLD / "spmd_bundle").ok


def hap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner.hap", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/tmp"})


@pytest.mark.parametrize("what", ["spmd_bundle", "pipeline_plan.json"])
def test_a_bundle_and_a_pipeline_plan_written_by_main_at_66fbce9_run_and_verify(what, tmp_path):
    """End to end through `hap run` (torchrun, 2 ranks): the old files train and match single-device training."""
    src = OLD / what
    dst = tmp_path / what
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    r = hap("run", str(dst), "--steps", "2", "--verify")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "verify: OK" in r.stdout + r.stderr, r.stdout[-2000:]


def test_repr_is_one_short_line_for_logs(load_sample):
    """Issue 31: repr() of a graph, a cluster and either kind of plan is one line (the dataclass repr of a
    4-layer GPT plan was 61 411 characters); only the rich displays draw."""
    graph = engine.load_model("zoo:gpt", layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=8)
    cluster = load_sample("cpu_4_uneven")
    spmd = engine.plan(graph, cluster, max_iterations=1, overlap="none")
    pipe = engine.plan(graph, cluster, parallelism="pipeline")
    for obj, name in ((graph, "Graph"), (cluster, "Cluster"), (spmd, "Plan"), (pipe, "PipelinePlan")):
        text = repr(obj)
        assert text.startswith(f"<{name} ") and "\n" not in text and len(text) < 160, text
    assert "4 devices" in repr(spmd) and "ms per iteration" in repr(pipe)
