"""Launch bundles of pipeline plans (issue 15): `hap export`, `hap bundle check` and `open_bundle` on a
"hap.pipeline_plan", through the same functions as SPMD plans (engine.bundle.archive.AnyPlan)."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import cluster_dict, sample_path

import engine
from engine.bundle.archive import (BundleError, check_bundle, export_bundle, open_bundle, plan_parallelism,
                                   plan_warnings)
from engine.bundle.unpack import read_zip
from engine.cli import main
from engine.errors import PlanError
from engine.pipeline.partition import fixed_pipeline
from engine.pipeline.stages import StageGraph
from engine.planner import load_plan

MLP = dict(layers=2, in_features=8, hidden=24, classes=6, batch=20)
FILES = {"plan.json", "cluster.json", "model.json", "launch_node.sh", "slurm.sbatch", "pytorchjob.yaml",
         "trainjob.yaml", "README.md", "manifest.json"}


def two_stages(cluster, groups=((0, 2), (1, 3)), microbatches: int = 2):
    """A 2-stage pipeline plan of a small MLP: first half of the layers on groups[0], the rest on groups[1]."""
    graph = engine.load_model("zoo:mlp", **MLP)
    L = StageGraph(graph).num_layers
    return fixed_pipeline(graph, cluster, [(0, L // 2, groups[0]), (L // 2, L, groups[1])], microbatches, "1f1b")


@pytest.fixture(scope="module")
def cpu4():
    return engine.load_cluster(sample_path("cpu_4_uneven"))


@pytest.fixture(scope="module")
def pipe(cpu4):
    return two_stages(cpu4)


@pytest.fixture(scope="module")
def bundle(pipe, tmp_path_factory) -> Path:
    return export_bundle(pipe, None, tmp_path_factory.mktemp("pb") / "pipe", zip=True)


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def copied(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(folder: Path, name: str, text: str) -> None:
    """Replace a bundle file and re-hash it in the manifest (a consistent edit: only the contents can tell)."""
    (folder / name).write_text(text)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text.encode())}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ----------------------------------------------------------------------------- export


def test_export_writes_the_pipeline_plan_as_save_pipeline_plan_does_and_hashes_every_file(bundle, pipe, tmp_path):
    assert {p.name for p in bundle.iterdir()} == FILES
    pipe.save(tmp_path / "p.json")
    assert (bundle / "plan.json").read_text() == (tmp_path / "p.json").read_text()
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["files"]) == FILES - {"manifest.json"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashlib.sha256((bundle / name).read_bytes()).hexdigest()
    assert manifest["parallelism"] == "pipeline" and manifest["world_size"] == 4
    assert [(r["rank"], r["device"]) for r in manifest["ranks"]] == list(enumerate(pipe.device_names))
    assert json.loads((bundle / "model.json").read_text())["zoo"] == "mlp"
    assert read_zip(bundle.with_name("pipe.zip")) == {n: (bundle / n).read_bytes() for n in FILES}


def test_bundle_readme_describes_the_pipeline_and_the_options_it_takes(bundle):
    readme = (bundle / "README.md").read_text()
    assert "Pipeline plan (2 stages, schedule `1f1b`, 2 microbatches) for 4 ranks" in readme
    assert "--emulate-links" in readme and "--checkpoint-dir" not in readme
    assert "get_device_name" not in readme  # pipeline ranks run on the CPU and check no GPU type


def test_hap_export_of_a_pipeline_plan_file(pipe, tmp_path):
    pipe.save(tmp_path / "p.json")
    rc, out, err = cli("export", str(tmp_path / "p.json"), "--out", str(tmp_path / "b"), "--zip")
    assert rc == 0, err
    assert "pipeline plan, 4 ranks on 1 node(s)" in out and err == ""
    assert check_bundle(tmp_path / "b.zip").ok


def test_pipeline_stages_on_two_machines_launch_as_two_nodes(tmp_path):
    spec = cluster_dict([1e10] * 4, name="two_machines")
    for dev, machine in zip(spec["devices"], ("n0", "n0", "n1", "n1")):
        dev["machine"] = machine
    spec["network"]["bandwidth_Bps"]["inter_machine"] = 1e9
    plan = two_stages(engine.load_cluster(spec), ((0, 1), (2, 3)))
    out = export_bundle(plan, spec, tmp_path / "b")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["nodes"] == [{"node_rank": 0, "machine": "n0", "nproc": 2, "ranks": [0, 1]},
                                 {"node_rank": 1, "machine": "n1", "nproc": 2, "ranks": [2, 3]}]
    assert (out / "launch_node.sh").read_text().count("-m runner.launch") == 2
    opened = open_bundle(out)
    assert [n.ranks for n in opened.nodes] == [(0, 1), (2, 3)] and load_plan(opened.plan_path) == plan


# ----------------------------------------------------------------------------- what a pipeline bundle cannot carry


def test_export_refuses_a_cluster_that_is_not_the_plans_in_one_line(pipe, tmp_path):
    with pytest.raises(BundleError, match=r"has devices \[a100-0, .*but the plan was made for \[cpu-0"):
        export_bundle(pipe, sample_path("a100x2_p100x2"), tmp_path / "b")
    pipe.save(tmp_path / "p.json")
    rc, _, err = cli("export", str(tmp_path / "p.json"), "--cluster", str(sample_path("a100x2_p100x2")),
                     "--out", str(tmp_path / "b2"))
    assert rc == 2 and len(err.splitlines()) == 1 and "give --cluster the spec the plan was made for" in err
    assert not (tmp_path / "b2").exists()


def test_export_refuses_hspmd_annotations_for_a_pipeline_plan(pipe, tmp_path):
    pipe.save(tmp_path / "p.json")
    rc, _, err = cli("export", str(tmp_path / "p.json"), "--out", str(tmp_path / "b"), "--annotations")
    assert rc == 2 and len(err.splitlines()) == 1 and "without --annotations" in err


def test_export_refuses_a_pipeline_plan_without_its_graph(pipe, tmp_path):
    from dataclasses import replace

    with pytest.raises(PlanError, match="no graph to embed"):
        export_bundle(replace(pipe, graph=None), None, tmp_path / "b")


def test_a_cluster_spec_changed_since_planning_is_a_warning(pipe, cpu4, tmp_path):
    spec = json.loads(Path(sample_path("cpu_4_uneven")).read_text())
    spec["devices"][0]["flops_per_gpu"]["fp32"] *= 2  # re-profiled: same devices, other figures
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    assert plan_warnings(pipe, cpu4) == []
    [warning] = plan_warnings(pipe, path)
    assert "the cluster spec changed since the plan was made" in warning
    report = check_bundle(export_bundle(pipe, path, tmp_path / "b"))
    assert report.ok and report.warnings == [warning]


# ----------------------------------------------------------------------------- check


def test_check_passes_the_folder_and_the_zip_and_names_the_kind(bundle):
    for path in (bundle, bundle.with_name("pipe.zip")):
        report = check_bundle(path)
        assert report.ok, report.render()
        assert report.parallelism == "pipeline" and report.world_size == 4
        assert report.render().endswith("OK (8 files checked, world size 4, pipeline plan)")
    rc, out, _ = cli("bundle", "check", str(bundle))
    assert rc == 0 and "pipeline plan" in out


def test_a_tampered_pipeline_bundle_is_refused_in_one_line(bundle, tmp_path):
    b = copied(bundle, tmp_path / "b")
    plan = json.loads((b / "plan.json").read_text())
    plan["stages"][0]["devices"] = [0, 1]
    (b / "plan.json").write_text(json.dumps(plan, indent=1))
    report = check_bundle(b)
    assert not report.ok and "changed file: plan.json" in report.render()
    with pytest.raises(BundleError, match="changed file: plan.json") as e:
        open_bundle(b)
    assert "\n" not in str(e.value)
    rc, _, err = cli("bundle", "check", str(b))
    assert rc == 1 and "changed file: plan.json" in err


@pytest.mark.parametrize("edit,problem", [
    (lambda p: p["stages"][0].update(warmup=5), "plan.json: plan: stages[0].warmup: 5 exceeds the 2 microbatches"),
    (lambda p: p["boundaries"][0].update(tensors=[]), "plan.json: plan: boundaries[0].tensors"),
    (lambda p: p["cluster"].update(devices=["x0", "x1", "x2", "x3"]), "cluster.json: devices [cpu-0"),
])
def test_a_re_hashed_plan_is_still_validated(bundle, tmp_path, edit, problem):
    b = copied(bundle, tmp_path / "b")
    plan = json.loads((b / "plan.json").read_text())
    edit(plan)
    rewrite(b, "plan.json", json.dumps(plan, indent=1))
    report = check_bundle(b)
    assert not report.ok and any(problem in p for p in report.problems), report.render()


def test_a_re_hashed_cluster_of_other_devices_is_refused(bundle, tmp_path):
    b = copied(bundle, tmp_path / "b")
    rewrite(b, "cluster.json", json.dumps(json.loads(Path(sample_path("a100x2_p100x2")).read_text())))
    report = check_bundle(b)
    assert not report.ok and "cluster.json: devices [a100-0" in report.render()


def test_a_manifest_that_calls_a_pipeline_plan_spmd_is_refused(bundle, tmp_path):
    b = copied(bundle, tmp_path / "b")
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["parallelism"] = "spmd"
    (b / "manifest.json").write_text(json.dumps(manifest))
    report = check_bundle(b)
    assert not report.ok and 'parallelism "spmd" but plan.json is a pipeline plan' in report.render()


def test_plan_parallelism_reads_the_kind_of_a_file_a_folder_and_a_zip(bundle, tmp_path):
    assert plan_parallelism(bundle) == plan_parallelism(bundle.with_name("pipe.zip")) == "pipeline"
    assert plan_parallelism(bundle / "plan.json") == "pipeline"
    spmd = engine.evaluate(engine.load_model("zoo:mlp", **MLP), engine.load_cluster(sample_path("cpu_4_uneven")),
                           "dp-even", optimizer="sgd")
    spmd.save(tmp_path / "s.json")
    assert plan_parallelism(tmp_path / "s.json") == "spmd"
    (tmp_path / "bad.json").write_text("{")
    bad_zip = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad_zip, "w") as z:
        z.writestr("b/manifest.json", "{}")
    assert plan_parallelism(tmp_path / "bad.json") is None and plan_parallelism(bad_zip) is None
    assert plan_parallelism(tmp_path / "missing.json") is None
