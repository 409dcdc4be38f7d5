"""Bundles submitted to a real Slurm (issue 25): exactly as the bundle's README says, failure, scancel and resume,
and a heterogeneous job whose components are pinned by node features.

One Slurm per machine: the module starts munged, slurmctld and two slurmd (this machine's name and `localhost`,
both resolving here, so a two-node job and its c10d rendezvous run for real) once, in a pytest process
of their own that `make test` runs beside its parallel pass (tests/conftest.py SERIAL_FILES), and stops them at the end. Skipped, with the reason, only where Slurm
cannot be installed or started (tests/runner/slurm_harness.py `unavailable`).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import sample_path
from slurm_harness import SlurmCluster, start_slurm, unavailable

import engine
from engine.bundle.archive import export_bundle
from runner.checkpoint import COMPLETE, step_dir
from runner.config import FAULT_ENV

pytestmark = pytest.mark.serial  # one Slurm per machine: never two of these modules at once

MLP = dict(layers=1, in_features=8, hidden=16, classes=4, batch=8)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> SlurmCluster:
    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        cluster = start_slurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"Slurm could not be started here: {str(e).splitlines()[0]}")
    venv_bin = str(Path(sys.executable).parent)
    cluster.env.update(PATH=f"{venv_bin}:{cluster.env['PATH']}", OMP_NUM_THREADS="1")
    yield cluster
    cluster.stop()


def bundle_of(root: Path, cluster: str | dict, name: str = "bundle") -> Path:
    """The MLP's dp-even plan on `cluster` (a sample name or a spec), exported under root/name (logs/ beside it)."""
    spec = root / f"{name}-cluster.json"
    spec.write_text(json.dumps(cluster) if isinstance(cluster, dict) else Path(sample_path(cluster)).read_text())
    plan = engine.evaluate(engine.load_model("zoo:mlp", **MLP), engine.load_cluster(str(spec)), "dp-even",
                           optimizer="sgd")
    return export_bundle(plan, str(spec), root / name)


def submit(slurm: SlurmCluster, bundle: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`mkdir -p ../logs && sbatch slurm.sbatch ARGS` in the bundle folder, as its README says; the job id."""
    assert "mkdir -p ../logs && sbatch slurm.sbatch" in (bundle / "README.md").read_text()
    (bundle.parent / "logs").mkdir(exist_ok=True)
    saved = dict(slurm.env)
    slurm.env.update(env or {})
    try:
        return slurm.sbatch(bundle, *args)
    finally:
        slurm.env.clear()
        slurm.env.update(saved)


def log_of(bundle: Path, job: str) -> str:
    """The job's output, where slurm.sbatch sends it: ../logs/JOBNAME-JOBID.out beside the bundle."""
    found = list((bundle.parent / "logs").glob(f"*-{job}.out"))
    return found[0].read_text(errors="replace") if found else "(no log)"


def test_a_bundle_submitted_as_its_readme_says_verifies_and_leaves_the_bundle_clean(slurm, tmp_path):
    bundle = bundle_of(tmp_path, "cpu_2x2")
    before = sorted(p.name for p in bundle.iterdir())
    job = submit(slurm, bundle, "--steps", "3", "--verify")
    state = slurm.wait(job)
    log = log_of(bundle, job)
    assert state == "COMPLETED" and "verify: OK" in log, f"{state}\n{log}\n{slurm.logs()}"
    assert sorted(p.name for p in bundle.iterdir()) == before
    assert engine.bundle.archive.check_bundle(bundle).ok


def test_a_failing_rank_fails_the_job_with_the_runners_reason_in_the_log(slurm, tmp_path):
    bundle = bundle_of(tmp_path, lean())
    job = submit(slurm, bundle, "--steps", "3", env={FAULT_ENV: "1:1:raise"})
    state = slurm.wait(job)
    log = log_of(bundle, job)
    assert state == "FAILED", f"{state}\n{log}"
    assert f"{FAULT_ENV}=1:1:raise: injected fault in rank 1 at step 1" in log, log


def latest_checkpoint(root: Path) -> int:
    """Steps done by the newest checkpoint in `root` with its COMPLETE marker (0 when none)."""
    done = [int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / COMPLETE).exists()]
    return max(done, default=0)


def test_scancel_leaves_a_checkpoint_that_a_second_submit_resumes(slurm, tmp_path):
    bundle = bundle_of(tmp_path, lean())
    ckpt = tmp_path / "ckpt"
    job = submit(slurm, bundle, "--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    end = time.monotonic() + 120
    while not (step_dir(ckpt, 2) / COMPLETE).exists():
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log_of(bundle, job)
        assert time.monotonic() < end, f"no checkpoint after step 2\n{log_of(bundle, job)}"
        time.sleep(0.2)
    slurm.cmd("scancel", job)
    assert slurm.wait(job) == "CANCELLED"
    done = latest_checkpoint(ckpt)
    assert done >= 2
    again = submit(slurm, bundle, "--steps", str(done + 2), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                   "--resume")
    state = slurm.wait(again)
    log = log_of(bundle, again)
    resumed = re.findall(r"resuming from the checkpoint after step (\d+)", log)
    assert state == "COMPLETED" and resumed and int(resumed[0]) > 0, f"{state}\n{log}"
    assert latest_checkpoint(ckpt) == done + 2


def lean() -> dict:
    """cpu_2x2 with one device per machine: still two nodes, half the ranks (each rank's torch import is most of a
    job's time on two cores)."""
    spec = json.loads(Path(sample_path("cpu_2x2")).read_text())
    for dev in spec["devices"]:
        dev.pop("count")
    spec["network"]["bandwidth_Bps"].pop("intra_machine")
    return spec


def featured_machines() -> dict:
    """Two one-device machines, each pinned to one node feature: a two-component heterogeneous job."""
    spec = lean()
    spec["devices"][0]["slurm"] = {"feature": "a100"}
    spec["devices"][1]["slurm"] = {"feature": "p100"}
    return spec


def test_a_heterogeneous_job_runs_one_component_per_machine_and_verifies(slurm, tmp_path):
    bundle = bundle_of(tmp_path, featured_machines())
    text = (bundle / "slurm.sbatch").read_text()
    assert "#SBATCH hetjob" in text and "--constraint=a100" in text and "--constraint=p100" in text
    job = submit(slurm, bundle, "--steps", "3", "--verify")
    shown = slurm.cmd("scontrol", "show", "job", job, check=False)
    state = slurm.wait(job)
    log = log_of(bundle, job)
    assert state == "COMPLETED" and "verify: OK" in log, f"{state}\n{log}\n{shown}"
    assert "HetJobOffset=1" in shown or "HetJobId" in shown, shown
    assert "device check ok" in log
