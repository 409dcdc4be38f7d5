"""`hap run BUNDLE` (issue 6): checked before the first step, safe zips, GPU-type report, verify passes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, sample_path
from test_runner_cli import TINY_GPT
from warm_run import warm_hap

import engine
from engine.bundle.archive import export_bundle
from engine.planner import load_plan
from runner import config, launch
from runner.config import NODE_ENV, DistEnv, RunConfig
from runner.launch import report_device
from runner.rank_setup import Inputs, bundle_rank, check_inputs


@pytest.fixture(scope="module")
def bundle4(tmp_path_factory) -> Path:
    """A bundle (folder + zip) of the engine's plan of a tiny GPT for sample_clusters/cpu_4_uneven.json."""
    plan = engine.plan(engine.load_model("zoo:gpt", **TINY_GPT), sample_path("cpu_4_uneven"))
    return export_bundle(plan, None, tmp_path_factory.mktemp("bundle") / "gpt4", zip=True)


def test_hap_run_bundle_zip_verify_on_4_gloo_ranks_exits_0(bundle4, tmp_path):
    """Warm (the real torchrun runs bundles in the two-node launch below and in test_plan_interface)."""
    metrics = tmp_path / "m.jsonl"
    digest = hashlib.sha256((bundle4 / "manifest.json").read_bytes()).hexdigest()  # the digest `hap export` printed
    r = warm_hap("run", str(bundle4.with_name("gpt4.zip")), "--steps", "5", "--verify", "--metrics", str(metrics),
                 "--digest", digest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hap run: device check ok: rank 0: CPU, as planned for device cpu-0" in r.stdout
    assert "verify: OK" in r.stdout and "largest parameter relative difference" in r.stdout
    assert len(metrics.read_text().splitlines()) == 5 * 4


def copy_bundle(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_hap_run_refuses_an_edited_bundle_by_name_before_starting_any_rank(bundle4, tmp_path):
    b = copy_bundle(bundle4, tmp_path / "b")
    (b / "cluster.json").write_text((b / "cluster.json").read_text().replace("20000000000.0", "30000000000.0"))
    (b / "extra.py").write_text("print('hi')")
    r = warm_hap("run", str(b), "--steps", "1", timeout=60)
    assert r.returncode == 2
    assert "changed file: cluster.json" in r.stderr and "extra file: extra.py" in r.stderr
    assert "torch.distributed" not in r.stderr and "step" not in r.stdout


def test_hap_run_refuses_a_tampered_bundle_by_its_digest_and_without_it_by_regeneration(bundle4, tmp_path):
    digest = hashlib.sha256((bundle4 / "manifest.json").read_bytes()).hexdigest()
    b = copy_bundle(bundle4, tmp_path / "b")
    script = (b / "launch_node.sh").read_text().replace("set -euo pipefail", "set -euo pipefail; touch pwned")
    (b / "launch_node.sh").write_text(script)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["files"]["launch_node.sh"]["sha256"] = hashlib.sha256(script.encode()).hexdigest()
    (b / "manifest.json").write_text(json.dumps(manifest))
    r = warm_hap("run", str(b), "--steps", "1", "--digest", digest, timeout=60)
    assert r.returncode == 2 and "digest mismatch" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = warm_hap("run", str(b), "--steps", "1", timeout=60)
    assert r.returncode == 2 and "launch_node.sh: not the file `hap export` writes" in r.stderr
    assert "step" not in r.stdout


def test_hap_run_refuses_a_zip_with_an_entry_escaping_the_folder(bundle4, tmp_path):
    z = tmp_path / "evil.zip"
    with zipfile.ZipFile(z, "w") as out:
        for p in sorted(bundle4.iterdir()):
            out.write(p, f"gpt4/{p.name}")
        out.writestr("gpt4/../../evil.sh", "echo pwned")
    r = warm_hap("run", str(z), "--steps", "1", timeout=60)
    assert r.returncode == 2 and "escapes the bundle folder" in r.stderr
    assert not (tmp_path.parent / "evil.sh").exists()


def test_a_rank_reads_a_bundle_zip_from_its_own_scratch_folder_and_knows_the_gpu_types(bundle4):
    inputs = check_inputs(RunConfig(plan=str(bundle4.with_name("gpt4.zip"))), 4, DistEnv(2, 4, 2, 4))
    try:
        assert inputs.plan.world_size == 4 and inputs.cluster is not None
        assert [d.gpu_model for d in inputs.cluster.devices] == ["cpu"] * 4
        assert Path(inputs.scratch, "manifest.json").is_file()
    finally:
        shutil.rmtree(inputs.scratch)


def inputs_with_gpu(bundle: Path, gpu_model: str) -> Inputs:
    data = json.loads((bundle / "cluster.json").read_text())
    for d in data["devices"]:
        d["gpu_model"] = gpu_model
    plan = load_plan(bundle / "plan.json")
    return Inputs(plan, DistEnv(0, 4, 0, 4), engine.load_cluster(data))


def test_a_rank_on_cpu_reports_the_gpu_check_as_skipped(bundle4, capsys):
    ok = report_device(inputs_with_gpu(bundle4, "P100-PCIE-16GB"), RunConfig(plan="x", device_check="error"),
                       DistEnv(0, 4, 0, 4), torch.device("cpu"))
    assert ok and "device check skipped: rank 0: GPU type check skipped: no CUDA here" in capsys.readouterr().out


def test_a_rank_on_the_wrong_gpu_type_is_reported_and_stops_the_run_with_device_check_error(bundle4, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    inputs = inputs_with_gpu(bundle4, "P100-PCIE-16GB")
    env = DistEnv(3, 4, 3, 4)
    assert report_device(inputs, RunConfig(plan="x"), env, torch.device("cuda", 0))
    err = capsys.readouterr().err
    assert "hap run: warning: rank 3 runs on a 'NVIDIA A100-SXM4-40GB' but the plan puts it on device cpu-3 " \
           "of type 'P100-PCIE-16GB'" in err
    assert not report_device(inputs, RunConfig(plan="x", device_check="error"), env, torch.device("cuda", 0))
    assert "hap run: error: rank 3 runs on" in capsys.readouterr().err
    assert report_device(inputs, RunConfig(plan="x", device_check="off"), env, torch.device("cuda", 0))


def test_checkpoint_files_are_loaded_with_weights_only():
    source = Path(launch.__file__).with_name("checkpoint.py").read_text()
    loads = [ln for ln in source.splitlines() if "torch.load(" in ln]
    assert loads and all("weights_only=True" in ln for ln in loads)


TWO_MACHINES = {"schema_version": 1, "name": "cpu_2x2", "description": "two pretend machines of 2 CPU ranks",
                "sources": ["tests"],
                "devices": [{"name": "a", "gpu_model": "cpu", "machine": "n0", "flops_per_gpu": 2e10,
                             "memory_bytes_per_gpu": 2**33, "count": 2},
                            {"name": "b", "gpu_model": "cpu", "machine": "n1", "flops_per_gpu": 1e10,
                             "memory_bytes_per_gpu": 2**33, "count": 2}],
                "network": {"latency_s": 5e-5, "bandwidth_Bps": {"intra_machine": 2e9, "inter_machine": 1e9}}}


@pytest.fixture(scope="module")
def bundle_2x2(tmp_path_factory) -> Path:
    """A bundle of a small MLP on sample_clusters/cpu_2x2.json: machines m0 and m1, two CPU devices each."""
    graph = engine.load_model("zoo:mlp", layers=1, in_features=8, hidden=16, classes=4, batch=12)
    cluster = engine.load_cluster(sample_path("cpu_2x2"))
    return export_bundle(engine.plan(graph, cluster, optimizer="sgd"), cluster, tmp_path_factory.mktemp("b22") / "b")


def launch_env(**extra: str) -> dict[str, str]:
    """This machine's environment for a launch script: no rank variables, this venv's torchrun first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", config.FAULT_ENV)}
    env.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]]),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    return env


def test_launch_node_script_on_two_nodes_rendezvous_over_c10d_and_verifies(bundle_2x2, tmp_path):
    """Both nodes' generated torchrun lines started on this machine form one 4-rank job, and node k
    runs the bundle's ranks of node k whichever order the c10d rendezvous gave the nodes."""
    env = launch_env(HAP_RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    args = ["--steps", "3", "--verify"]  # every node passes the same runner options
    nodes = {}
    for k in (1, 0):  # node 1 first: its agent usually gets the lower pid, so c10d numbers it first
        nodes[k] = subprocess.Popen(["bash", str(bundle_2x2 / "launch_node.sh"), str(k), *args], env=env, cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)
    nodes = [nodes[0], nodes[1]]
    try:
        logs = [p.communicate(timeout=150)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-4000:]
    assert "verify: OK" in "".join(logs) and "on 4 ranks (gloo)" in "".join(logs)
    for k, log in enumerate(logs):  # whatever order the rendezvous chose, node k runs its bundle ranks
        for local in range(2):
            assert f"rank {2 * k + local}: CPU, as planned for device cpu-m{k}-{local}" in log, log[-3000:]


def test_a_node_that_never_arrives_ends_the_launch_with_a_clear_message_within_the_timeout(bundle_2x2, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    env = launch_env(HAP_RDZV_ENDPOINT=endpoint, HAP_RDZV_TIMEOUT="3")
    r = subprocess.run(["bash", str(bundle_2x2 / "launch_node.sh"), "0", "--steps", "1"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert (f"launch_node.sh: node 0 waited 3 s at {endpoint} but not all 2 nodes joined: start `bash launch_node.sh K` "
            "on every node K in 0..1 with the same HAP_RDZV_ENDPOINT, or raise HAP_RDZV_TIMEOUT") in r.stderr, r.stderr[-2000:]
    bad = subprocess.run(["bash", str(bundle_2x2 / "launch_node.sh"), "0"], env={**env, "HAP_RDZV_TIMEOUT": "5s"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HAP_RDZV_TIMEOUT must be a whole number of seconds, got 5s" in bad.stderr


def test_a_rank_joins_as_the_plan_device_its_bundle_node_and_local_rank_give(tmp_path):
    """torchrun's c10d rendezvous may number the nodes the other way round; the bundle's rank wins."""
    graph = engine.load_model("zoo:mlp", layers=1, in_features=8, hidden=16, classes=4, batch=12)
    cluster = engine.load_cluster(TWO_MACHINES)
    opened = engine.bundle.archive.open_bundle(export_bundle(engine.evaluate(graph, cluster, "dp-even"), cluster, tmp_path / "b"))
    torchrun_env = DistEnv(0, 4, 1, 2)  # torchrun made node 1's local rank 1 global rank 0
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert bundle_rank(torchrun_env, opened, {**agent, NODE_ENV: "1"}) == DistEnv(3, 4, 1, 2)
    assert bundle_rank(torchrun_env, opened, {**agent, NODE_ENV: "0"}) == DistEnv(1, 4, 1, 2)
    assert bundle_rank(torchrun_env, opened, {NODE_ENV: "1"}) == torchrun_env  # rank 0 hosts the store: keep
    assert bundle_rank(torchrun_env, None, {**agent, NODE_ENV: "1"}) == torchrun_env
    with pytest.raises(engine.bundle.archive.BundleError, match="runs 2 ranks in the bundle but this launch started 3"):
        bundle_rank(DistEnv(0, 4, 0, 3), opened, {**agent, NODE_ENV: "1"})
    with pytest.raises(engine.bundle.archive.BundleError, match="HAP_NODE_RANK=2 but the bundle has nodes 0..1"):
        bundle_rank(torchrun_env, opened, {**agent, NODE_ENV: "2"})
