"""Pipeline plans on gloo: the runner (runner/pipeline.py) against single-device microbatch accumulation."""
from __future__ import annotations

import json
from functools import lru_cache

import pytest
import torch
from dist_harness import init_gloo, run_ranks
from runner_plans import MODELS, cluster, with_sharded_stages
from warm_run import warm_hap

import engine
from engine.errors import PlanError
from engine.pipeline.partition import fixed_pipeline
from engine.pipeline.stages import StageGraph
from engine.planner import load_plan
from runner.pipeline import gathered_params, microbatch_reference, pipeline_step, setup_stage_rank
from runner.train import make_batch
from runner.verify import compare

STEPS = 3


@lru_cache(maxsize=None)
def graph(model: str):
    """The runner tests' small configs, with two layers to cut between."""
    return engine.load_model(f"zoo:{model}", **{**MODELS[model], "layers": 2})


def two_stage_plan(model: str, world: int, groups: tuple[tuple[int, ...], ...], microbatches: int, schedule: str):
    g = graph(model)
    L = StageGraph(g).num_layers
    cut = L // 2
    return fixed_pipeline(g, cluster(world), [(0, cut, groups[0]), (cut, L, groups[1])], microbatches, schedule)


def _train(rank: int, world: int, init: str, plan_json: str) -> dict:
    init_gloo(rank, world, init)
    torch.set_num_threads(1)
    plan = load_plan(json.loads(plan_json))
    sr = setup_stage_rank(plan, rank, seed=3, optimizer="sgd", lr=0.05)
    for step in range(STEPS):
        pipeline_step(plan, sr, make_batch(plan, step, 3))
    return {"losses": sr.losses, "params": gathered_params(plan, sr)}


def _compare(plan, results):
    ref_losses, ref_params = microbatch_reference(plan, STEPS, 3, "sgd", 0.05)
    return compare(results[0]["losses"], results[0]["params"], ref_losses, ref_params)


@pytest.mark.parametrize("model,schedule", [("mlp", "1f1b"), ("gpt", "h-1f1b")])
def test_one_rank_per_stage_matches_microbatch_accumulation(model, schedule, tmp_path):
    plan = two_stage_plan(model, 2, ((0,), (1,)), 2 if model == "gpt" else 4, schedule)
    results = run_ranks(_train, 2, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert not result.missing
    assert result.loss_rel <= 1e-6 and result.param_rel <= 1e-6, result.render()


def test_two_stages_of_two_ranks_with_uneven_ratios(tmp_path):
    """Data parallelism inside each stage (what a model file's pipeline runs), shares ~ FLOP/s."""
    plan = two_stage_plan("mlp", 4, ((0, 2), (1, 3)), 2, "gpipe")
    assert len(set(plan.stages[0].ratios)) == 2  # the stage's devices take uneven shares
    results = run_ranks(_train, 4, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert result.ok(1e-4), result.render()


def hap_stage_plan(model: str, schedule: str = "1f1b"):
    """Two stages of two uneven ranks, each running a stage plan with its weights sharded."""
    plan = with_sharded_stages(two_stage_plan(model, 4, ((0, 2), (1, 3)), 2, schedule), cluster(4))
    for s in plan.stages:
        assert any(ins.kind == "comm" and ins.rule != "slice" for ins in s.plan.program)
        assert any(ins.kind == "load" and ins.post >= 0 and s.plan.graph[ins.node].op == "parameter"
                   for ins in s.plan.program)
    return plan


@pytest.mark.parametrize("model,schedule", [("mlp", "gpipe"), ("gpt", "1f1b")])
def test_two_stages_of_two_ranks_with_hap_sharding_inside(model, schedule, tmp_path):
    """Each stage is a 2-rank SPMD program of its own (column/row-parallel weights, all-gathers and
    reduce-scatters on the stage's process group) at uneven shares; the boundary rows are re-sliced
    between the two stages' shares."""
    plan = hap_stage_plan(model, schedule)
    assert plan.stages[0].ratios != plan.stages[1].ratios
    results = run_ranks(_train, 4, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert result.ok(1e-4), result.render()


def test_hap_run_pipeline_plan_verify(tmp_path):
    """`hap run` of a pipeline plan, warm (torchrun itself runs one in test_plan_interface and in the
    two-node pipeline bundle launch)."""
    plan = hap_stage_plan("mlp")
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(plan.to_dict()))
    r = warm_hap("run", str(path), "--steps", "5", "--verify", "--emulate-links", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout and "step    4/5" in r.stdout


def test_hap_run_emulates_the_speeds_of_a_pipelines_ranks(tmp_path):
    """`--speeds` slows a pipeline rank's computation between its sends, receives and collectives (each
    stage's second rank at half speed here), and training still matches the reference."""
    path, metrics = tmp_path / "pipeline.json", tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(hap_stage_plan("mlp").to_dict()))
    r = warm_hap("run", str(path), "--steps", "3", "--verify", "--speeds", "1,1,0.5,0.5", "--metrics", str(metrics),
                 timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {(x["rank"], x["speed"]) for x in records} == {(0, 1.0), (1, 1.0), (2, 0.5), (3, 0.5)}
    assert all(x["emulated_s"] > 0 for x in records if x["speed"] < 1)
    assert all(x["emulated_s"] == 0 and x["compute_s"] > 0 and x["comm_s"] > 0 for x in records if x["speed"] == 1)
    bad = warm_hap("run", str(path), "--speeds", "1,0.5", timeout=60)
    assert bad.returncode == 2 and "--speeds gives 2 factors but the plan has 4 ranks" in bad.stderr


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    return two_stage_plan("mlp", 4, ((0, 2), (1, 3)), 2, "h-1f1b").to_dict()


def _edited(d: dict, path: tuple, value) -> dict:
    d = json.loads(json.dumps(d))
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path, value, message", [
    (("kind",), "hap.graph", "not a plan: \"kind\" is \"hap.graph\""),
    (("schema_version",), 7, "schema_version"),
    (("schedule",), "zigzag", "schedule"),
    (("microbatches",), 0, "microbatches"),
    (("microbatches",), 3, "microbatches: 3 does not divide"),
    (("stages", 0, "devices"), [0, 1], "stages[1].devices: rank 1 is also in stages[0]"),
    (("stages", 1, "devices"), [1, 9], "stages[1].devices: rank 9 is outside"),
    (("stages", 0, "warmup"), 5, "stages[0].warmup: 5 exceeds"),
    (("stages", 0, "ratios"), [0.9, 0.3], "stages[0].ratios"),
    (("stages", 1, "nodes"), [0, 1], "stages[1].nodes"),
    (("stages", 0, "forward_s"), -1, "stages[0].forward_s"),
    (("stages", 0, "sub_cluster"), KeyError, "stages[0].sub_cluster: is missing"),
    (("boundaries", 0, "tensors"), [], "boundaries[0].tensors"),
    (("boundaries",), [], "boundaries: has 0 entries for 2 stages"),
    (("timeline", 0, "end_s"), -3.0, "timeline[0].end_s"),
    (("model", "fingerprint"), "0" * 64, "graph: was edited"),
])
def test_a_malformed_pipeline_plan_is_refused_naming_the_field(plan_dict, path, value, message):
    with pytest.raises(PlanError) as e:
        load_plan(_edited(plan_dict, path, value))
    assert message in str(e.value)


def test_pipeline_plan_round_trips_through_json(plan_dict):
    plan = load_plan(json.loads(json.dumps(plan_dict)))
    assert plan.to_dict() == plan_dict


def test_groups_of_different_sizes_re_slice_the_rows(tmp_path):
    plan = two_stage_plan("mlp", 3, ((0,), (1, 2)), 2, "eager-1f1b")
    results = run_ranks(_train, 3, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert result.ok(1e-5), result.render()


def test_a_rank_the_partition_left_idle_still_takes_part_and_reports(tmp_path):
    """The partition may leave a device out (it is faster without it): that rank, rank 0 here, joins
    the process groups, the loss sum and the final gather, so `hap run` can run the plan as made."""
    plan = two_stage_plan("mlp", 3, ((1,), (2,)), 2, "1f1b")
    results = run_ranks(_train, 3, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert not result.missing
    assert result.loss_rel <= 1e-6 and result.param_rel <= 1e-6, result.render()


def test_row_pieces_send_each_receiver_exactly_its_rows():
    from runner.pipeline import row_pieces

    send, recv = [3, 2, 4, 1], [1, 4, 2, 3]  # two microbatches of 5 rows, two ranks per stage
    assert row_pieces(send, recv, 0, 2, 2) == [(0, 0, 0, 1), (0, 1, 1, 3), (1, 1, 3, 5)]
    assert row_pieces(send, recv, 1, 2, 2) == [(0, 0, 5, 7), (0, 1, 7, 9), (1, 1, 9, 10)]
    assert row_pieces([5, 5], [2, 3, 2, 3], 1, 1, 2) == [(0, 0, 5, 7), (0, 1, 7, 10)]
