"""Per-instruction timing and emulated device speed (runner.timing)."""
from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import cluster_dict, sample_path
from dist_harness import run_ranks
from runner_plans import forced_plan

from runner.config import DistEnv, RunConfig
from runner.launch import run
from runner.timing import Pacer, parse_speeds, speeds_from_cluster
from runner.train import reference_run
from runner.verify import compare


def _spin(seconds: float) -> None:
    """Busy CPU work of about `seconds` of thread CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.serial  # a wall-clock measurement: alone on the machine (`make test`'s second pass)
def test_pacer_stretches_computation_by_one_over_speed_before_each_collective():
    pacer = Pacer(0.25)
    pacer.begin_step()
    _spin(0.02)
    with pacer.comm("all_reduce", "x"):
        time.sleep(0.01)  # communication is not stretched
    _spin(0.01)
    out = pacer.end_step()
    assert out["emulated_s"] == pytest.approx(3 * 0.03, rel=0.25)  # (1/0.25 - 1) x 30 ms of work
    assert out["comm_s"] == pytest.approx(0.01, abs=0.01)


@pytest.mark.serial  # a wall-clock measurement: alone on the machine (`make test`'s second pass)
def test_time_spent_waiting_for_a_core_counts_toward_the_emulated_slow_down():
    """A window of 20 ms CPU time that also waited 20 ms (here: slept, as when ranks share a core) lasts
    20 / 0.5 = 40 ms at speed 0.5, not 60: the pacer pads the window to c / f."""
    pacer = Pacer(0.5)
    pacer.begin_step()
    start = time.perf_counter()
    _spin(0.02)
    time.sleep(0.02)  # off the CPU inside the window
    out = pacer.end_step()
    assert time.perf_counter() - start == pytest.approx(0.04, abs=0.008)
    assert out["emulated_s"] < 0.008


@pytest.mark.serial  # a wall-clock measurement: alone on the machine (`make test`'s second pass)
def test_work_set_aside_is_timed_apart_pays_no_slow_down_and_its_collectives_are_not_the_step_s():
    """A gradient norm computed only for the metrics (runner.loop): the step before it is still paid
    for, the norm's own work and its all-reduce land in `aside_s` alone."""
    pacer = Pacer(0.25, record=True)
    pacer.begin_step()
    _spin(0.01)
    with pacer.aside():
        _spin(0.02)
        with pacer.comm("all_reduce", "grad_norm"):
            time.sleep(0.01)
    out = pacer.end_step()
    assert out["emulated_s"] == pytest.approx(3 * 0.01, rel=0.3)  # the 10 ms before: paid on entering
    assert out["aside_s"] == pytest.approx(0.03, abs=0.01) and out["comm_s"] == 0
    assert [x["kind"] for x in out["timeline"] if x["kind"] == "aside"] == ["aside"]


def test_full_speed_pacer_sleeps_never_and_records_nothing_by_default():
    pacer = Pacer(1.0)
    pacer.begin_step()
    _spin(0.005)
    out = pacer.end_step()
    assert out["emulated_s"] == 0 and "timeline" not in out and out["compute_s"] > 0


def test_speeds_from_a_cluster_are_flops_relative_to_the_fastest():
    assert speeds_from_cluster(sample_path("cpu_4_uneven")) == [1.0, 1.0, 0.5, 0.5]
    assert speeds_from_cluster(cluster_dict([4e12, 1e12])) == [1.0, 0.25]


def test_parse_speeds_checks_count_and_range():
    assert parse_speeds("1,0.5", 2) == [1.0, 0.5]
    assert parse_speeds("0.5", 3) == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="gives 2 factors but the plan has 3 ranks"):
        parse_speeds("1,0.5", 3)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        parse_speeds("1,2", 2)


def train_rank(rank, world, init_method, cfg):
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def test_timing_records_every_instruction_and_the_slow_rank_sleeps_without_changing_numbers(tmp_path):
    plan = forced_plan("gpt", 2, "all_gather.grouped")
    plan.save(tmp_path / "plan.json")
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), steps=3, timing=True, speeds="1,0.5",
                    metrics=str(tmp_path / "m.jsonl"), save_params=str(tmp_path / "p.pt"))
    assert run_ranks(train_rank, 2, tmp_path / "run", cfg) == [0, 0]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    by_rank = {r: [x for x in records if x["rank"] == r] for r in (0, 1)}
    assert [x["speed"] for x in by_rank[1]] == [0.5] * 3
    assert all(x["emulated_s"] == 0 for x in by_rank[0]) and all(x["emulated_s"] > 0 for x in by_rank[1])

    timeline = by_rank[1][-1]["timeline"]
    assert {s["phase"] for s in timeline} == {"fwd", "bwd", "step"}
    names = {(s["phase"], s["kind"], s["name"]) for s in timeline}
    computed = {f"{plan.graph[i.node].name}:{i.rule}" for i in plan.program if i.kind == "compute"}
    recorded = {n for _, k, n in names if k == "compute"}
    assert recorded <= computed | {"(other)", ""} and len(recorded & computed) >= len(computed) // 2
    gathered = [plan.graph[i.node].name for i in plan.program if i.rule == "all_gather.grouped"]
    assert gathered
    for tensor in gathered:
        assert ("fwd", "comm", f"all_gather.grouped({tensor})") in names
        assert ("bwd", "comm", f"reduce_scatter({tensor})") in names  # the dual in backward
    assert ("step", "comm", "all_reduce(gradients)") in names
    assert any(p == "bwd" and k == "compute" and n != "(other)" for p, k, n in names)

    ref_losses, ref_params = reference_run(plan, 3, 0)
    assert compare([x["loss"] for x in by_rank[0]], torch.load(tmp_path / "p.pt"), ref_losses, ref_params).ok()
