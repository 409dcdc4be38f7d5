"""Hierarchical collectives (engine.cluster.hierarchy) forward and backward on 4 gloo ranks grouped as 2
machines of 2, with uneven shards (one empty), against the same one-process reference as the flat
collectives: they must compute exactly what all_reduce / all_gather / reduce_scatter compute."""
from __future__ import annotations

import pytest
import torch
from dist_harness import init_gloo, run_ranks
from hap_inprocess import run_hap
from runner_plans import collectives_of, forced_plan
from test_runner_collectives import SIZES, inputs, out_grads, reference
from test_runner_equivalence import check_equivalence
from warm_run import warm_hap

import engine
import runner.collectives as C
from engine.cluster.hierarchy import HIER_KEYS
from engine.planner import load_plan

WORLD = 4
LAYOUTS = {"contiguous": ((0, 1), (2, 3)), "interleaved": ((0, 2), (1, 3))}
"""Ranks of each machine: machines of neighbouring ranks, and machines whose ranks alternate."""
FLAT_OF = {"all_reduce.hier": "all_reduce", "all_gather.hier": "all_gather.padded",
           "reduce_scatter.hier": "reduce_scatter"}


def apply_hier(op: str, x: torch.Tensor, machines) -> torch.Tensor:
    sizes = SIZES[WORLD]
    if op == "all_reduce.hier":
        return C.all_reduce_hierarchical(x, machines)
    if op == "all_gather.hier":
        return C.all_gather_hierarchical(x, 1, sizes, machines)
    return C.reduce_scatter_hierarchical(x, 1, sizes, machines)


def rank_body(rank: int, world: int, init_method: str, machines) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    init_gloo(rank, world, init_method)
    out = {}
    for op, flat in FLAT_OF.items():
        x = inputs(flat, world)[rank].clone().requires_grad_(True)
        y = apply_hier(op, x, machines)
        (y * out_grads(flat, world)[rank]).sum().backward()
        out[op] = (y.detach(), x.grad.detach())
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_collectives_match_single_process_forward_and_backward(layout, tmp_path):
    assert 0 in SIZES[WORLD], "the uneven sizes include an empty shard"
    results = run_ranks(rank_body, WORLD, tmp_path, LAYOUTS[layout])
    for op, flat in FLAT_OF.items():
        ys, grads = reference(flat, WORLD)
        for rank in range(WORLD):
            got_y, got_g = results[rank][op]
            torch.testing.assert_close(got_y, ys[rank], rtol=1e-6, atol=1e-6, msg=f"{op} forward, rank {rank}")
            torch.testing.assert_close(got_g, grads[rank], rtol=1e-6, atol=1e-6, msg=f"{op} backward, rank {rank}")


# --- plans that use them, trained end to end ---------------------------------------------------


def two_by_two():
    """4 CPU ranks declared as 2 machines of 2 (sample_clusters/cpu_2x2.json)."""
    from conftest import sample_path
    return engine.load_cluster(sample_path("cpu_2x2"))


@pytest.mark.parametrize("key", HIER_KEYS)
def test_plans_forced_to_one_hierarchical_collective_train_like_one_device(key, tmp_path):
    plan = forced_plan("mlp", WORLD, key, on=two_by_two())
    assert key in collectives_of(plan) and plan.machines == ["m0", "m0", "m1", "m1"]
    assert len(set(plan.ratios["0"])) == WORLD, "uneven shards"
    check_equivalence(plan, tmp_path, "sgd")


def test_hap_plan_then_hap_run_verify_on_two_machines_of_two(tmp_path):
    """The engine picks a hierarchical collective on cpu_2x2 (its machines are 8x faster inside than
    between) and `hap run --verify` trains that plan on 4 ranks like one device."""
    plan_path = tmp_path / "plan.json"
    made = run_hap("plan", "--model", "zoo:mlp", "--set", "layers=2", "--set", "in_features=64", "--set", "hidden=128",
               "--set", "batch=32", "--cluster", "sample_clusters/cpu_2x2.json", "--out", str(plan_path))
    assert made.returncode == 0, made.stdout + made.stderr
    assert collectives_of(load_plan(plan_path)) & set(HIER_KEYS)
    r = warm_hap("run", str(plan_path), "--steps", "3", "--verify", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout
