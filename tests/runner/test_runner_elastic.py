"""`hap run --elastic` (issue 16): a 4-rank job that loses a rank at step 7 re-plans, reshards its
checkpoint and finishes on 3 ranks, training exactly as one device would."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_plans import cluster
from test_runner_checkpoint import sharded_plan
from test_runner_cli import hap
from warm_run import warm_hap

from engine.planner import load_plan
from runner.config import FAULT_ENV, RunConfig
from runner.elastic import EVENT, no_switch, relaunch_argv, steps_reached
from runner.launch import MetricsFile
from runner.train import reference_run
from runner.verify import TOLERANCE

SEED, LR = 3, 0.01


def write_job(tmp_path: Path) -> tuple[Path, Path]:
    plan_path, cluster_path = tmp_path / "plan.json", tmp_path / "cluster.json"
    sharded_plan("mlp", 4).save(plan_path)
    cluster_path.write_text(json.dumps(cluster(4).to_dict()))
    return plan_path, cluster_path


def test_a_rank_killed_at_step_7_of_20_the_job_finishes_on_3_ranks_as_single_device_training(tmp_path):
    """End to end: torchrun's summary names the killed rank, and the supervisor starts torchrun again."""
    plan_path, cluster_path = write_job(tmp_path)
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    r = hap("run", str(plan_path), "--steps", "20", "--elastic", str(cluster_path), "--checkpoint-every", "2",
            "--checkpoint-dir", str(ckpt), "--metrics", str(metrics), "--optimizer", "adam", "--lr", str(LR),
            "--seed", str(SEED), env={FAULT_ENV: "2:7:kill"}, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank 2 was killed by signal 9" in r.stderr
    assert "hap run: elastic switch 1: 4 -> 3 ranks (rank 2, device dev-2, failed)" in r.stdout
    assert "1 step lost, continuing after step 6" in r.stdout
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    [switch] = [x for x in records if x.get("event") == EVENT]
    assert (switch["old_world"], switch["new_world"], switch["resume_step"], switch["steps_lost"]) == (4, 3, 6, 1)
    assert switch["failed_device"] == "dev-2" and switch["replan_s"] > 0 and switch["reshard_s"] > 0
    new = load_plan(switch["plan"])
    assert new.world_size == 3 and "dev-2" not in new.device_names
    steps = [x for x in records if "event" not in x]
    assert {x["rank"] for x in steps if x["step"] >= 6} == {0, 1, 2}  # after the switch: 3 ranks
    losses = {x["step"]: x["loss"] for x in steps if x["rank"] == 0}
    assert sorted(losses) == list(range(20))
    ref, _ = reference_run(new, 20, SEED, "adam", LR)
    assert max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in range(20)) <= TOLERANCE


def test_a_cluster_that_is_not_the_plans_is_refused_before_any_rank_starts(tmp_path):
    plan_path, _ = write_job(tmp_path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(cluster(3).to_dict()))
    r = warm_hap("run", str(plan_path), "--elastic", str(other), "--checkpoint-dir", str(tmp_path / "c"))
    assert r.returncode == 2 and "are not the plan's" in r.stderr and "Traceback" not in r.stderr


def test_elastic_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="--elastic needs --checkpoint-dir"):
        RunConfig(plan="p.json", elastic="c.json")


def test_steps_lost_are_the_steps_rank_0_finished_after_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "rank": r, "loss": 1.0}) + "\n" for s in range(9) for r in (0, 1))
                    + json.dumps({"event": EVENT, "old_world": 4}) + "\n")
    assert steps_reached(str(path), 6) == 3 and steps_reached(str(path), 10) == 0
    assert steps_reached(str(tmp_path / "none.jsonl"), 4) == 0


def test_a_resumed_metrics_file_keeps_earlier_steps_and_every_switch(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"step": 5, "rank": 0}, {"step": 6, "rank": 0},
                                                          {"event": EVENT, "number": 1}]))
    MetricsFile(str(path), 0, keep_before=6).close()
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert kept == [{"step": 5, "rank": 0}, {"event": EVENT, "number": 1}]


def test_the_relaunch_runs_the_new_plan_resumed_with_the_survivors_speeds():
    argv = ["old.json", "--steps", "9", "--speeds", "1,1,0.5,0.5", "--elastic", "c.json"]
    out = relaunch_argv(argv, "old.json", "new.json", "m.jsonl", "1,1,0.5")
    assert out[0] == "new.json" and out[-5:] == ["--resume", "--metrics", "m.jsonl", "--speeds", "1,1,0.5"]


def test_only_a_device_failure_before_the_last_step_is_followed_by_a_switch():
    assert no_switch(1, (2, -9), 7, 20, 4) is None
    assert no_switch(1, (2, 1), 7, 20, 4) is None  # an exception or exit in training: the device is dropped
    assert "refused its inputs" in no_switch(1, (0, 2), 0, 20, 4)
    assert "after the last step" in no_switch(1, (0, 1), 20, 20, 4)  # e.g. a failed --verify
    assert "no device would be left" in no_switch(1, (0, -9), 3, 20, 1)
    assert no_switch(0, None, 20, 20, 4) == "the job succeeded"
    assert "named no failed rank" in no_switch(1, None, 3, 20, 4)
