"""`hap run`: torchrun start, verify output, world-size refusal, a crashing rank (issue 3 acceptance).

`hap` runs the real console command (a fresh interpreter, torchrun, fresh ranks): the tests of what only
that shows (the whole path once, torchrun's own failure summary, SIGTERM reaching every rank, a process
started as a rank). `warm_hap` (warm_run.py) runs the same command in this process with its ranks forked
warm: the other tests, about what `hap run` checks and reports.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, sample_path
from warm_run import warm_hap

import engine
from runner.config import FAULT_ENV, DistEnv, RunConfig, parse_args
from runner.rank_setup import load_spmd_plan
from runner.torchrun import describe_failure, failed_rank

TINY_GPT = dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=8)


@pytest.fixture(scope="module")
def plan4(tmp_path_factory) -> Path:
    """The engine's plan of a tiny GPT for sample_clusters/cpu_4_uneven.json (4 ranks)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    engine.plan(engine.load_model("zoo:gpt", **TINY_GPT), sample_path("cpu_4_uneven")).save(path)
    return path


def hap_env() -> dict[str, str]:
    """This environment without a launcher's variables or a planted fault, with the repository importable."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", FAULT_ENV)}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    return base


def hap(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner.hap", *args], env={**hap_env(), **(env or {})}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_hap_run_verify_on_cpu_4_uneven_exits_0_and_prints_largest_differences(plan4, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = hap("run", str(plan4), "--steps", "5", "--verify", "--metrics", str(metrics))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "largest loss relative difference" in r.stdout
    assert "largest parameter relative difference" in r.stdout
    assert "verify: OK" in r.stdout
    assert len([ln for ln in metrics.read_text().splitlines() if '"event"' not in ln]) == 5 * 4  # one per step and rank


@pytest.mark.parametrize("fault, message, launch", [("2:2", "hap run: rank 2 exited with status 1", warm_hap),
                                                    ("1:3:kill", "hap run: rank 1 was killed by signal 9", hap)],
                         ids=["exit-warm", "kill-torchrun"])
def test_hap_run_names_the_rank_that_crashed_or_was_killed_and_exits_nonzero_within_60s(plan4, fault, message, launch):
    """Once through torchrun itself (its 'Root Cause' summary is what names a rank that left no record)."""
    start = time.monotonic()
    r = launch("run", str(plan4), "--steps", "5", env={FAULT_ENV: fault}, timeout=90)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert message in r.stderr, r.stderr[-3000:]


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc to find the ranks")
def test_sigterm_to_hap_run_stops_torchrun_and_every_rank(plan4, tmp_path):
    """A scheduler cancelling the job (SIGTERM) must not leave torchrun and its ranks running."""
    metrics = tmp_path / "sigterm.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "runner.hap", "run", str(plan4), "--steps", "100000",
                             "--metrics", str(metrics)], env=hap_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step was recorded within 90 s"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert processes_mentioning(str(metrics)), "the ranks should be running"
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + 15, err[-3000:]
    assert "hap run: stopped by SIGTERM; torchrun stopped every rank" in err
    deadline = time.monotonic() + 10
    while processes_mentioning(str(metrics)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(metrics)), "torchrun or a rank outlived hap run"


def test_hap_run_under_a_launch_of_another_world_size_refuses_the_plan(plan4):
    r = hap("run", str(plan4), "--steps", "1", env={"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}, timeout=60)
    assert r.returncode == 2
    assert "is for 4 devices" in r.stderr and "WORLD_SIZE=3" in r.stderr and "--nproc-per-node=4" in r.stderr


def test_load_plan_rejects_a_world_size_mismatch_with_the_numbers(plan4):
    with pytest.raises(ValueError, match=r"is for 4 devices \(cpu-0, cpu-1, cpu-2, cpu-3\) but this launch has WORLD_SIZE=2"):
        load_spmd_plan(str(plan4), 2)
    assert load_spmd_plan(str(plan4), 4).world_size == 4


def test_hap_run_reports_a_missing_plan_in_one_line():
    r = warm_hap("run", "no/such/plan.json", timeout=60)
    assert r.returncode == 2
    assert "plan file 'no/such/plan.json' not found" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--speeds", "1,0.5"], "--speeds gives 2 factors but the plan has 4 ranks"),
    (["--metrics", "no/such/dir/m.jsonl"], "--metrics no/such/dir/m.jsonl: directory"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_hap_run_refuses_bad_options_before_starting_any_rank(plan4, args, message):
    r = warm_hap("run", str(plan4), *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "torch.distributed" not in r.stderr, r.stderr


def test_engine_does_not_import_the_runner():
    code = "import sys, engine, engine.cli; engine.cli.build_parser(); print('runner' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stderr


def test_run_config_rejects_bad_values_with_the_value():
    with pytest.raises(ValueError, match="--steps must be at least 1, got 0"):
        RunConfig(plan="p.json", steps=0)
    with pytest.raises(ValueError, match="--optimizer must be one of sgd, adam, adamw, got 'lamb'"):
        RunConfig(plan="p.json", optimizer="lamb")
    assert parse_args(["p.json", "--steps", "7", "--verify", "--speeds", "1,0.5"]) == \
        RunConfig(plan="p.json", steps=7, verify=True, speeds="1,0.5")


def test_dist_env_without_a_launcher_says_how_to_launch():
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE not set: runner.launch runs under torchrun"):
        DistEnv.from_environ({})
    assert DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == DistEnv(3, 4, 1, 4)


TORCHRUN_TAIL = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_00:14:05
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 21371)
  error_file: <N/A>
"""


def test_failure_summary_names_the_root_cause_rank_and_signal():
    assert failed_rank(TORCHRUN_TAIL) == (2, -9)
    assert describe_failure(1, TORCHRUN_TAIL).startswith("hap run: rank 2 was killed by signal 9")
    assert describe_failure(1, "no summary") == "hap run: torchrun exited with status 1"
