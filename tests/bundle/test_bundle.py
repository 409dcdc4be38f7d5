"""Launch bundles (issue 6): export, manifest, `hap bundle check`, safe zips, generated launch files."""
from __future__ import annotations

import ast
import contextlib
import copy
import hashlib
import io
import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import cluster_dict, sample_dict, sample_path

import engine
from engine.bundle.archive import BundleError, LaunchNode, check_bundle, export_bundle, gpu_type_check, launch_nodes
from engine.bundle.unpack import read_zip, safe_extract, unsafe_member
from engine.cli import main
from engine.planner import load_plan

TINY_GPT = dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=8)
EXPECTED_FILES = {"plan.json", "cluster.json", "model.json", "launch_node.sh", "slurm.sbatch", "jobset.yaml",
                  "README.md", "manifest.json"}
"""The files of the a100x2_p100x2 bundle: two GPU types, so a JobSet instead of a PyTorchJob and a TrainJob."""


@pytest.fixture(scope="module")
def tiny_gpt():
    return engine.load_model("zoo:gpt", **TINY_GPT)


@pytest.fixture(scope="module")
def plan4(tiny_gpt):
    """dp-even plan of a tiny GPT on sample_clusters/cpu_4_uneven.json (1 machine, 4 CPU devices)."""
    return engine.evaluate(tiny_gpt, engine.load_cluster(sample_path("cpu_4_uneven")), "dp-even", optimizer="sgd")


@pytest.fixture(scope="module")
def plan_a100(tiny_gpt):
    """dp-even plan on sample_clusters/a100x2_p100x2.json: 2 machines of 2 GPUs, two GPU types."""
    return engine.evaluate(tiny_gpt, engine.load_cluster(sample_path("a100x2_p100x2")), "dp-even", optimizer="sgd")


@pytest.fixture(scope="module")
def bundle_uniform(tiny_gpt, tmp_path_factory) -> Path:
    """2 machines of 2 A100s each: one GPU type, so a PyTorchJob and a TrainJob."""
    spec = cluster_of(["m0", "m0", "m1", "m1"])
    return export_bundle(plan_on(tiny_gpt, spec), spec, tmp_path_factory.mktemp("u") / "bundle")


@pytest.fixture(scope="module")
def bundle_a100(plan_a100, tmp_path_factory) -> Path:
    return export_bundle(plan_a100, None, tmp_path_factory.mktemp("b") / "bundle", zip=True)


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def cluster_of(machines: list[str], gpu: str = "A100-SXM4-40GB", num_gpus: int = 1) -> dict:
    d = cluster_dict([1e13] * len(machines), name="nodes")
    for dev, m in zip(d["devices"], machines):
        dev.update(machine=m, gpu_model=gpu, num_gpus=num_gpus)
    if len(set(machines)) > 1:
        d["network"]["bandwidth_Bps"]["inter_machine"] = 1e9
    return d


def plan_on(graph, cluster_spec: dict):
    return engine.evaluate(graph, engine.load_cluster(cluster_spec), "dp-even", optimizer="sgd")


# ----------------------------------------------------------------------------- export and manifest


def test_export_writes_every_file_and_the_manifest_hashes_each_one(bundle_a100, plan_a100):
    assert {p.name for p in bundle_a100.iterdir()} == EXPECTED_FILES
    manifest = json.loads((bundle_a100 / "manifest.json").read_text())
    assert set(manifest["files"]) == EXPECTED_FILES - {"manifest.json"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((bundle_a100 / name).read_bytes()).hexdigest()
    assert set(manifest["packages"]) == {"python", "torch", "hap-workbench"}
    assert manifest["world_size"] == 4 and manifest["created"]
    assert load_plan(bundle_a100 / "plan.json").to_dict() == plan_a100.to_dict()
    assert json.loads((bundle_a100 / "model.json").read_text())["config"] == plan_a100.graph.origin["config"]
    assert os.access(bundle_a100 / "launch_node.sh", os.X_OK)


def test_manifest_maps_rank_r_to_plan_device_r_node_by_node(bundle_a100, plan_a100):
    manifest = json.loads((bundle_a100 / "manifest.json").read_text())
    ranks = manifest["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["device"] for r in ranks] == plan_a100.device_names
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["gpu_model"].split("-")[0] for r in ranks] == ["A100", "A100", "P100", "P100"]
    assert manifest["nodes"] == [{"node_rank": 0, "machine": "m0", "nproc": 2, "ranks": [0, 1]},
                                 {"node_rank": 1, "machine": "m1", "nproc": 2, "ranks": [2, 3]}]
    readme = (bundle_a100 / "README.md").read_text()
    assert "| 2 | 1 | 0 | m1 | p100-0 |" in readme and "bash launch_node.sh 1" in readme


def test_zip_holds_the_same_files_under_one_folder(bundle_a100):
    with zipfile.ZipFile(bundle_a100.with_name("bundle.zip")) as z:
        names = set(z.namelist())
    assert names == {f"bundle/{n}" for n in EXPECTED_FILES}
    assert read_zip(bundle_a100.with_name("bundle.zip")) == {n: (bundle_a100 / n).read_bytes() for n in EXPECTED_FILES}


def test_export_refuses_virtual_devices_of_several_gpus_and_suggests_the_per_gpu_spec(tiny_gpt, tmp_path):
    plan = engine.evaluate(tiny_gpt, engine.load_cluster(sample_path("hap_paper_testbed_machines")), "dp-even")
    with pytest.raises(BundleError, match=r"virtual device of 8 GPUs .* per-GPU cluster spec .*hap_paper_testbed.json"):
        export_bundle(plan, None, tmp_path / "b")
    plan.save(tmp_path / "plan.json")
    rc, _, err = cli("export", str(tmp_path / "plan.json"), "--out", str(tmp_path / "b2"))
    assert rc == 2 and len(err.splitlines()) == 1 and "per-GPU cluster spec" in err
    assert not (tmp_path / "b2").exists()


def test_export_refuses_a_machine_whose_devices_are_not_consecutive(tiny_gpt, tmp_path):
    spec = cluster_of(["m0", "m1", "m0"])
    with pytest.raises(BundleError, match=r"device 2 \(dev-2\) is on machine 'm0' but device 1 is not"):
        export_bundle(plan_on(tiny_gpt, spec), spec, tmp_path / "b")


def test_export_needs_the_cluster_of_a_plan_made_for_a_non_sample_cluster(tiny_gpt, tmp_path):
    spec = cluster_of(["m0", "m0"])
    plan = plan_on(tiny_gpt, spec)
    with pytest.raises(BundleError, match="not a sample cluster: pass --cluster"):
        export_bundle(plan, None, tmp_path / "b")
    other = cluster_of(["m0", "m0", "m0"])
    with pytest.raises(BundleError, match=r"has devices \[dev-0, dev-1, dev-2\] \(3\) but the plan was made for"):
        export_bundle(plan, other, tmp_path / "b")
    assert (export_bundle(plan, spec, tmp_path / "b") / "plan.json").is_file()


def test_a_non_zoo_plan_needs_its_model_file_which_the_bundle_then_carries(plan4, tmp_path):
    plan = load_plan(copy.deepcopy(plan4.to_dict()))
    plan.graph.origin.clear()
    plan.graph.origin["module"] = "MyNet"
    with pytest.raises(BundleError, match="not a zoo model .* pass --model-file"):
        export_bundle(plan, None, tmp_path / "b")
    model = tmp_path / "mynet.py"
    model.write_text("import torch\nclass MyNet(torch.nn.Module):\n    pass\n")
    out = export_bundle(plan, None, tmp_path / "b", model_source=model)
    assert (out / "model" / "mynet.py").read_text() == model.read_text()
    assert json.loads((out / "model.json").read_text())["file"] == "model/mynet.py"
    assert check_bundle(out).ok


def test_export_refuses_a_non_empty_output_folder(plan4, tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    with pytest.raises(BundleError, match="exists and is not an empty folder"):
        export_bundle(plan4, None, tmp_path / "b")


# ----------------------------------------------------------------------------- hap bundle check


def test_check_passes_then_names_an_edited_file(plan4, tmp_path):
    out = export_bundle(plan4, None, tmp_path / "b")
    assert check_bundle(out).ok and check_bundle(out).world_size == 4
    for name in ("launch_node.sh", "cluster.json", "plan.json", "README.md"):
        original = (out / name).read_bytes()
        (out / name).write_bytes(original.replace(b"4", b"5", 1))
        report = check_bundle(out)
        assert not report.ok and f"changed file: {name}" in report.render()
        (out / name).write_bytes(original)
    assert check_bundle(out).ok


def test_check_names_an_extra_and_a_missing_file_and_a_broken_manifest(plan4, tmp_path):
    out = export_bundle(plan4, None, tmp_path / "b")
    (out / "notes.txt").write_text("hi")
    assert "extra file: notes.txt" in check_bundle(out).render()
    (out / "notes.txt").unlink()
    (out / "slurm.sbatch").unlink()
    assert "missing file: slurm.sbatch" in check_bundle(out).render()
    (out / "manifest.json").write_text("{")
    assert "manifest.json does not parse" in check_bundle(out).render()
    (out / "manifest.json").unlink()
    assert "manifest.json missing" in check_bundle(out).render()


def test_check_finds_a_world_size_inconsistent_with_the_launch_scripts(plan4, tmp_path):
    """A manifest rewritten to match an edited launch script still fails: the world sizes disagree."""
    out = export_bundle(plan4, None, tmp_path / "b")
    script = out / "launch_node.sh"
    script.write_text(script.read_text().replace("--nproc-per-node=4", "--nproc-per-node=3"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["launch_node.sh"]["sha256"] = hashlib.sha256(script.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = check_bundle(out).problems
    assert problems == ["launch_node.sh: 1 torchrun lines with --nnodes [1] and --nproc-per-node [3] (sum 3) "
                        "do not launch 4 ranks"]


def test_hap_bundle_check_exit_codes_0_valid_1_invalid_2_usage(plan4, tmp_path):
    plan4.save(tmp_path / "plan.json")
    rc, out, err = cli("export", str(tmp_path / "plan.json"), "--out", str(tmp_path / "b"), "--zip")
    assert rc == 0, err
    assert "4 ranks on 1 node(s)" in out and (tmp_path / "b.zip").is_file()
    assert cli("bundle", "check", str(tmp_path / "b"))[0] == 0
    assert cli("bundle", "check", str(tmp_path / "b.zip"))[0] == 0
    (tmp_path / "b" / "model.json").write_text("{}")
    rc, _, err = cli("bundle", "check", str(tmp_path / "b"))
    assert rc == 1 and "changed file: model.json" in err
    with pytest.raises(SystemExit) as e:
        cli("bundle", "check")
    assert e.value.code == 2
    help_text = subprocess.run([os.sys.executable, "-m", "runner.hap", "bundle", "check", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "0 the bundle is valid, 1 the bundle is invalid" in help_text and "2 usage error" in help_text


# ----------------------------------------------------------------------------- zips


def evil_zip(path: Path, bundle: Path, name: str, *, symlink: bool = False) -> Path:
    """The bundle's files plus one entry `name` (optionally a symbolic link)."""
    with zipfile.ZipFile(path, "w") as z:
        for p in sorted(bundle.iterdir()):
            z.write(p, f"bundle/{p.name}")
        info = zipfile.ZipInfo(name)
        if symlink:
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "/etc/passwd" if symlink else "pwned")
    return path


@pytest.mark.parametrize("name, symlink, why", [
    ("bundle/../evil", False, "escapes the bundle folder"),
    ("../evil", False, "escapes the bundle folder"),
    ("/tmp/evil", False, "absolute"),
    ("bundle/link", True, "symbolic link"),
])
def test_zip_entries_that_escape_the_folder_are_refused_and_nothing_is_written(bundle_a100, tmp_path, name, symlink, why):
    z = evil_zip(tmp_path / "evil.zip", bundle_a100, name, symlink=symlink)
    report = check_bundle(z)
    assert not report.ok and why in report.render()
    dest = tmp_path / "x" / "dest"
    dest.mkdir(parents=True)
    with pytest.raises(BundleError, match=why):
        safe_extract(z, dest)
    assert list(dest.iterdir()) == [] and not (tmp_path / "x" / "evil").exists()


def test_unsafe_member_accepts_plain_nested_names():
    assert unsafe_member(zipfile.ZipInfo("bundle/model/net.py")) is None
    assert unsafe_member(zipfile.ZipInfo("bundle/a..b")) is None


def test_safe_extract_of_the_export_zip_gives_a_valid_bundle(bundle_a100, tmp_path):
    root = safe_extract(bundle_a100.with_name("bundle.zip"), tmp_path / "x")
    assert check_bundle(root).ok and os.access(root / "launch_node.sh", os.X_OK)


# ----------------------------------------------------------------------------- launch files


def test_launch_node_script_has_one_torchrun_line_per_node(bundle_a100):
    text = (bundle_a100 / "launch_node.sh").read_text()
    lines = [ln.strip() for ln in text.splitlines() if "exec torchrun" in ln]
    assert len(lines) == 2
    for k, line in enumerate(lines):
        assert f"--nnodes=2 --node-rank={k} --nproc-per-node=2 --rdzv-backend=c10d" in line
        assert '--rdzv-endpoint="$RDZV_ENDPOINT"' in line and '-m runner.launch "$BUNDLE_DIR" "$@"' in line
    assert "DEFAULT_RDZV_ENDPOINT=m0:29500" in text and 'RDZV_ENDPOINT="${HAP_RDZV_ENDPOINT:-$DEFAULT_RDZV_ENDPOINT}"' in text
    assert subprocess.run(["bash", "-n", str(bundle_a100 / "launch_node.sh")], timeout=30).returncode == 0


def fake_torchrun(tmp_path: Path) -> dict[str, str]:
    """PATH with a `torchrun` that prints HAP_NODE_RANK and its arguments, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "HAP_NODE_RANK=$HAP_NODE_RANK" "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_launch_node_script_runs_torchrun_with_this_nodes_arguments(bundle_a100, tmp_path):
    env = fake_torchrun(tmp_path)
    r = subprocess.run(["bash", str(bundle_a100 / "launch_node.sh"), "1", "--steps", "7"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["HAP_NODE_RANK=1", "--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=m0:29500", f"--rdzv-id={bundle_a100_job()}",
                                     "--rdzv-conf=join_timeout=600", "-m",
                                     "runner.launch", str(bundle_a100), "--steps", "7"]
    bad = subprocess.run(["bash", str(bundle_a100 / "launch_node.sh"), "2"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "NODE_RANK must be 0..1, got 2" in bad.stderr


def bundle_a100_job() -> str:
    return "hap-gpt-a100x2-p100x2"


def test_slurm_script_passes_bash_n_and_runs_one_component_per_machine(bundle_a100, tmp_path):
    """a100x2_p100x2 carries slurm hints: a heterogeneous job, component k = node k, each pinned to its GPU type."""
    path = bundle_a100 / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], timeout=30).returncode == 0
    text = path.read_text()
    assert text.count("#SBATCH --nodes=1") == 2 and text.count("#SBATCH hetjob") == 1
    assert "#SBATCH --output=../logs/%x-%j.out" in text and "mkdir -p ../logs" in text
    srun = text.split("\nsrun ", 1)[1]
    for k in (0, 1):
        assert f"--het-group={k} --ntasks=1" in srun and f"export HAP_NODE_RANK={k}; " in srun
        assert f"--node-rank={k} --nproc-per-node=2" in srun
    assert srun.count('"$BUNDLE_DIR" --device-check error "$@"') == 2
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0"' in text
    head = text.split("\nset -euo pipefail", 1)[0]
    m0, m1 = head.split("#SBATCH hetjob\n")
    assert "machine m0" in m0 and "#SBATCH --constraint=a100\n" in m0 and "#SBATCH --gres=gpu:a100:2\n" in m0
    assert "machine m1" in m1 and "#SBATCH --constraint=p100\n" in m1 and "#SBATCH --gres=gpu:p100:2\n" in m1
    assert "p100" not in m0.lower().replace("a100x2-p100x2", "") and "a100" not in m1.lower()


def test_slurm_script_gives_each_node_its_own_process_count(tiny_gpt, tmp_path):
    spec = cluster_of(["m0", "m0", "m0", "m1", "m2"])
    out = export_bundle(plan_on(tiny_gpt, spec), spec, tmp_path / "b")
    text = (out / "slurm.sbatch").read_text()
    assert text.count("#SBATCH hetjob") == 2
    for k, nproc in enumerate((3, 1, 1)):
        assert f"--node-rank={k} --nproc-per-node={nproc}" in text
    assert subprocess.run(["bash", "-n", str(out / "slurm.sbatch")], timeout=30).returncode == 0
    job = yaml.safe_load((out / "pytorchjob.yaml").read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    assert "--nproc-per-node=3" in specs["Master"]["template"]["spec"]["containers"][0]["args"]
    assert "--nproc-per-node=1" in specs["Worker"]["template"]["spec"]["containers"][0]["args"]
    assert not (out / "trainjob.yaml").exists()
    assert "`trainjob.yaml` was not generated" in (out / "README.md").read_text()
    assert check_bundle(out).ok


def test_pytorchjob_yaml_parses_with_replicas_nnodes_nproc_rendezvous_and_command(bundle_uniform):
    job = yaml.safe_load((bundle_uniform / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    for role in ("Master", "Worker"):
        (c,) = specs[role]["template"]["spec"]["containers"]
        assert c["name"] == "pytorch" and c["command"] == ["torchrun"]
        assert c["args"][:6] == ["--nnodes=2", "--node-rank=$(RANK)", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                 "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", "--rdzv-id=hap-gpt-nodes"]
        assert c["args"][6:] == ["-m", "runner.launch", "/workspace/bundle"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert specs[role]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "A100-SXM4-40GB"}


def test_runner_options_go_into_the_kubernetes_files(tiny_gpt, tmp_path):
    spec = cluster_of(["m0", "m0", "m1", "m1"])
    out = export_bundle(plan_on(tiny_gpt, spec), spec, tmp_path / "b",
                        run_args=["--steps", "100", "--resume", "--checkpoint-dir", "/ckpt"])
    specs = yaml.safe_load((out / "pytorchjob.yaml").read_text())["spec"]["pytorchReplicaSpecs"]
    assert specs["Worker"]["template"]["spec"]["containers"][0]["args"][-7:] == \
        ["runner.launch", "/workspace/bundle", "--steps", "100", "--resume", "--checkpoint-dir", "/ckpt"]
    assert yaml.safe_load((out / "trainjob.yaml").read_text())["spec"]["trainer"]["command"][-2:] == ["--checkpoint-dir", "/ckpt"]


def test_trainjob_yaml_parses_with_nodes_and_processes(bundle_uniform):
    job = yaml.safe_load((bundle_uniform / "trainjob.yaml").read_text())
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)
    assert trainer["command"] == ["torchrun", "-m", "runner.launch", "/workspace/bundle"]


def test_cpu_clusters_ask_for_no_gpus(plan4, tmp_path):
    out = export_bundle(plan4, None, tmp_path / "b")
    assert "gpus-per-node" not in (out / "slurm.sbatch").read_text()
    c = yaml.safe_load((out / "pytorchjob.yaml").read_text())["spec"]["pytorchReplicaSpecs"]["Master"]
    assert "resources" not in c["template"]["spec"]["containers"][0]
    assert "Worker" not in yaml.safe_load((out / "pytorchjob.yaml").read_text())["spec"]["pytorchReplicaSpecs"]


def test_nodes_group_the_plan_devices_by_machine(plan_a100):
    nodes = launch_nodes(plan_a100, engine.load_cluster(sample_dict("a100x2_p100x2")))
    assert nodes == [LaunchNode(0, "m0", (0, 1)), LaunchNode(1, "m1", (2, 3))]


# ----------------------------------------------------------------------------- GPU type check


@pytest.mark.parametrize("planned, actual, status", [
    ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "ok"),
    ("A100-40GB", "NVIDIA A100 80GB PCIe", "ok"),
    ("V100-SXM2-16GB", "Tesla V100-SXM2-16GB", "ok"),
    ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", "ok"),
    ("cpu", None, "ok"),
    ("P100-PCIE-16GB", None, "skipped"),
    ("P100-PCIE-16GB", "NVIDIA A100-SXM4-40GB", "mismatch"),
    ("A100-SXM4-40GB", "NVIDIA A10", "mismatch"),
])
def test_gpu_type_check(planned, actual, status):
    assert gpu_type_check(3, "dev-3", planned, actual)[0] == status


def test_gpu_type_mismatch_names_the_rank_and_both_types():
    status, message = gpu_type_check(2, "p100-0", "P100-PCIE-16GB", "NVIDIA A100-SXM4-40GB")
    assert status == "mismatch"
    assert message.startswith("rank 2 runs on a 'NVIDIA A100-SXM4-40GB' but the plan puts it on device p100-0 "
                              "of type 'P100-PCIE-16GB'")
    assert "skipped" in gpu_type_check(0, "p100-0", "P100-PCIE-16GB", None)[1]


def test_bundle_module_never_unpickles():
    """engine.bundle reads JSON and text only: none of its modules imports pickle or torch."""
    modules = sorted((Path(engine.__file__).parent / "bundle").glob("*.py"))
    assert len(modules) >= 3  # __init__, archive, launch_files
    for path in modules:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"pickle", "torch", "dill", "marshal", "shelve"}, (path.name, imported)


def test_nodes_can_be_given_by_hand_when_they_hold_the_ranks_in_order(plan4, tmp_path):
    two = [LaunchNode(0, "host-a", (0, 1)), LaunchNode(1, "host-b", (2, 3))]
    out = export_bundle(plan4, None, tmp_path / "b", nodes=two, rdzv_endpoint="host-a:1234")
    lines = [ln for ln in (out / "launch_node.sh").read_text().splitlines() if "exec torchrun" in ln]
    assert len(lines) == 2 and all("--nnodes=2" in ln and "--nproc-per-node=2" in ln for ln in lines)
    assert "DEFAULT_RDZV_ENDPOINT=host-a:1234" in (out / "launch_node.sh").read_text()
    assert check_bundle(out).ok
    with pytest.raises(BundleError, match="must be numbered 0.. and hold ranks 0..3 in order"):
        export_bundle(plan4, None, tmp_path / "c", nodes=[LaunchNode(0, "a", (0, 2)), LaunchNode(1, "b", (1, 3))])
