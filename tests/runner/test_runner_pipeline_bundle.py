"""`hap run BUNDLE` of a pipeline plan (issue 15): checked before any rank starts, run on local gloo
ranks through `runner.pipeline`, verified against single-device microbatch accumulation; the bundle's
launch_node.sh (`torchrun -m runner.launch BUNDLE`) hands pipeline plans to the same entry."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from runner_plans import cluster
from test_runner_bundle import TWO_MACHINES, copy_bundle, free_port
from test_runner_pipeline import graph, hap_stage_plan
from warm_run import warm_hap

import engine
from engine.bundle.archive import export_bundle
from engine.errors import PlanError
from engine.pipeline.partition import fixed_pipeline
from engine.pipeline.stages import StageGraph
from runner import config
from runner.config import NODE_ENV, parse_args
from runner.pipeline import load_pipeline_plan, pipeline_inputs


@pytest.fixture(scope="module")
def pipe_bundle(tmp_path_factory) -> Path:
    """A bundle (folder + zip) of a 2-stage MLP pipeline, two uneven ranks per stage running a stage plan
    with sharded weights, on 4 CPU devices."""
    plan = hap_stage_plan("mlp")
    return export_bundle(plan, cluster(4), tmp_path_factory.mktemp("pipe") / "mlp4", zip=True)


def two_machine_plan():
    """Stage 0 on machine n0's two ranks, stage 1 on n1's (TWO_MACHINES: 2 + 2 CPU devices)."""
    g = graph("mlp")
    L = StageGraph(g).num_layers
    return fixed_pipeline(g, engine.load_cluster(TWO_MACHINES), [(0, L // 2, (0, 1)), (L // 2, L, (2, 3))], 2, "1f1b")


def test_hap_run_pipeline_bundle_zip_verify_on_4_gloo_ranks_exits_0(pipe_bundle):
    r = warm_hap("run", str(pipe_bundle.with_name("mlp4.zip")), "--steps", "5", "--verify", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step    4/5" in r.stdout and "pipeline: 2 stages, 1f1b, 2 microbatches" in r.stdout
    assert "verify: OK" in r.stdout and "largest parameter relative difference" in r.stdout


def test_hap_run_refuses_a_tampered_pipeline_bundle_before_starting_any_rank(pipe_bundle, tmp_path):
    b = copy_bundle(pipe_bundle, tmp_path / "b")
    plan = json.loads((b / "plan.json").read_text())
    plan["microbatches"] = 4
    (b / "plan.json").write_text(json.dumps(plan, indent=1))
    r = warm_hap("run", str(b), "--steps", "1", timeout=60)
    assert r.returncode == 2
    assert "changed file: plan.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "torch.distributed" not in r.stderr and "step" not in r.stdout


def test_hap_run_refuses_runner_options_a_pipeline_run_would_ignore(pipe_bundle, tmp_path):
    r = warm_hap("run", str(pipe_bundle), "--checkpoint-dir", str(tmp_path), timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--checkpoint-dir is not supported for pipeline plans yet" in r.stderr


def test_a_pipeline_rank_joins_as_the_plan_device_its_bundle_node_gives_it(tmp_path, monkeypatch):
    plan = two_machine_plan()
    out = export_bundle(plan, TWO_MACHINES, tmp_path / "b", zip=True)
    # torchrun made node 1's local rank 1 global rank 0 (c10d ordered the nodes the other way round)
    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", NODE_ENV: "1",
                 "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(k, v)
    got, env, scratch = pipeline_inputs(parse_args([str(out.with_name("b.zip"))]))
    assert env.rank == 3 and got == plan
    assert scratch and Path(scratch, "manifest.json").is_file()  # the rank's own extracted copy
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(engine.bundle.archive.BundleError, match="runs 2 ranks in the bundle but this launch started 3"):
        pipeline_inputs(parse_args([str(out)]))


def test_launch_node_script_runs_a_pipeline_bundle_on_two_nodes_and_verifies(tmp_path):
    """Both nodes' torchrun lines (`-m runner.launch BUNDLE`) started here form one 4-rank pipeline:
    stage 0 on node 0's ranks, stage 1 on node 1's, whatever order the c10d rendezvous gave the nodes."""
    plan = two_machine_plan()
    out = export_bundle(plan, TWO_MACHINES, tmp_path / "b")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", config.FAULT_ENV)}
    env.update(HAP_RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]]),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    nodes = {}
    for k in (1, 0):  # node 1 first: its agent usually gets the lower pid, so c10d numbers it first
        nodes[k] = subprocess.Popen(["bash", str(out / "launch_node.sh"), str(k), "--steps", "3", "--verify"],
                                    env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)
    try:
        logs = [nodes[k].communicate(timeout=200)[0] for k in (0, 1)]
    finally:
        for p in nodes.values():
            p.kill()
    assert [nodes[k].returncode for k in (0, 1)] == [0, 0], "\n".join(logs)[-4000:]
    # rank 0 (bundle node 0) prints the steps and the verification
    assert "verify: OK" in logs[0] and "step    2/3" in logs[0], logs[0][-3000:]


def test_a_pipeline_of_a_model_file_runs_the_bundles_copy(tmp_path):
    """The bundle ships the plan's model file; the ranks point the plan's origin at that copy (the
    original may be gone) and refuse a copy whose sha256 is not the plan's."""
    pytest.importorskip("transformers")
    model = tmp_path / "llama_tiny.py"
    shutil.copy(ROOT / "examples" / "llama_tiny.py", model)
    g = engine.load_model(str(model))
    L = StageGraph(g).num_layers
    plan = fixed_pipeline(g, cluster(4), [(0, L // 2, (0, 2)), (L // 2, L, (1, 3))], 2, "1f1b")
    out = export_bundle(plan, cluster(4), tmp_path / "b")
    model.unlink()
    opened = engine.bundle.archive.open_bundle(out)
    got = load_pipeline_plan(opened.plan_path, 4, engine.bundle.archive.model_file_of(opened))
    assert got.graph.origin["file"] == str(out / "model" / "llama_tiny.py")
    with pytest.raises(PlanError, match="the plan needs 4 ranks, torchrun started 2"):
        load_pipeline_plan(opened.plan_path, 2)
    (out / "model" / "llama_tiny.py").write_text("# edited\n")
    with pytest.raises(engine.bundle.archive.BundleError, match="changed file: model/llama_tiny.py"):
        engine.bundle.archive.open_bundle(out)
