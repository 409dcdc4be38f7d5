"""Mixed precision on gloo ranks (runner.precision): bf16 and fp16 autocast, fp16's loss scaler agreed on
by every rank, and a bf16 gradient bucket, each verified against single-device training under the same
autocast (`hap run --verify`'s path: `runner.launch.run` with `verify=True`, rank 0 exiting 1 on a mismatch)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cluster_dict
from dist_harness import init_gloo, run_ranks
from runner_plans import RATIOS, graph

import engine
from engine.options import PlanOptions
from runner.config import DistEnv, RunConfig
from runner.launch import run
from runner.precision import RankScaler
from runner.train import reference_run
from runner.verify import MIXED_TOLERANCE, rel_diff

WORLD = 3


def mixed_cluster():
    """RATIOS[3]'s uneven CPU devices, rating every dtype alike (the ratios stay uneven in any precision)."""
    d = cluster_dict([1e10 * r / max(RATIOS[WORLD]) for r in RATIOS[WORLD]], name="cpu_3_uneven_mixed")
    for dev in d["devices"]:
        f = dev["flops_per_gpu"]
        dev["flops_per_gpu"] = {"fp32": f, "bf16": f, "fp16": f}
    return engine.load_cluster(d)


def train_rank(rank: int, world: int, init_method: str, cfg: RunConfig) -> int:
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def losses(metrics: Path) -> list[float]:
    recs = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    return [r["loss"] for r in sorted(recs, key=lambda r: r["step"]) if r["rank"] == 0]


@pytest.mark.parametrize("precision, grad_dtype, overlap", [
    pytest.param("bf16", "fp32", "none", id="bf16"),
    pytest.param("fp16", "fp32", "none", id="fp16-scaler"),
    pytest.param("bf16", "bf16", "ddp", id="bf16-grads-in-bf16-ddp-buckets"),
    pytest.param("fp16", "fp32", "duplex", id="fp16-scaler-duplex-halves"),
])
def test_mixed_precision_training_verifies_against_single_device_autocast(precision, grad_dtype, overlap, tmp_path):
    plan = engine.plan(graph("gpt"), mixed_cluster(), optimizer="sgd", precision=precision, grad_dtype=grad_dtype,
                       overlap=overlap)
    assert len(set(plan.ratios["0"])) == WORLD and plan.options.precision == precision
    plan.save(tmp_path / "plan.json")
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), steps=4, seed=3, verify=True, metrics=str(tmp_path / "m.jsonl"))
    assert run_ranks(train_rank, WORLD, tmp_path / "run", cfg) == [0] * WORLD
    ref, _ = reference_run(plan, 4, 3)
    fp32, _ = reference_run(dataclasses.replace(plan, search={**plan.search, "options": PlanOptions().to_dict()}), 4, 3)
    got = losses(tmp_path / "m.jsonl")
    assert max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref)) <= MIXED_TOLERANCE[precision]
    assert max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(ref, fp32)) > 1e-6, "autocast ran"


def _collectives_rank(rank: int, world: int, init_method: str) -> dict:
    init_gloo(rank, world, init_method)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(6, dtype=dtype) + rank
        s = x.clone()
        dist.all_reduce(s)
        g = torch.empty(6 * world, dtype=dtype)
        dist.all_gather_into_tensor(g, x)
        r = torch.empty(2, dtype=dtype)
        dist.reduce_scatter(r, list(x.split(2)))
        a = torch.empty(6, dtype=dtype)
        dist.all_to_all_single(a, x)
        out[str(dtype)] = [t.float().tolist() for t in (s, g, r, a)]
    return out


def test_gloo_runs_bf16_and_fp16_collectives(tmp_path):
    """The collectives the runner's programs and buckets use take autocast's dtypes as they are on gloo."""
    for rank, res in enumerate(run_ranks(_collectives_rank, WORLD, tmp_path)):
        for s, g, r, a in res.values():
            assert s == [3.0 * i + 3 for i in range(6)]
            assert g == [float(i + j) for j in range(WORLD) for i in range(6)]
            assert r == [3.0 * i + 3 for i in range(2 * rank, 2 * rank + 2)]
            assert a == [float(2 * rank + i + j) for j in range(WORLD) for i in range(2)]


def _scaler_rank(rank: int, world: int, init_method: str) -> tuple[bool, float, float]:
    init_gloo(rank, world, init_method)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = RankScaler("cpu")
    scaler.scale(p.sum()).backward()
    if rank == 1:
        p.grad[0] = float("inf")  # only rank 1 overflows (its shard of a sharded parameter)
    stepped = scaler.step(opt)
    return stepped, float(p.detach()[1]), scaler.scaler.get_scale()


def test_an_overflow_on_one_rank_skips_the_step_and_backs_off_on_every_rank(tmp_path):
    results = run_ranks(_scaler_rank, WORLD, tmp_path)
    assert all(r == (False, 1.0, 2.0**15) for r in results), results


def test_a_bf16_pipeline_sends_bf16_activations_and_matches_microbatch_accumulation_under_autocast(tmp_path):
    from dataclasses import replace

    from test_runner_pipeline import _compare, _train, two_stage_plan

    from runner.pipeline import microbatch_reference

    fp32 = two_stage_plan("gpt", 2, ((0,), (1,)), 2, "h-1f1b")
    plan = replace(fp32, search={**fp32.search, "options": PlanOptions(precision="bf16").to_dict()})
    results = run_ranks(_train, 2, tmp_path, json.dumps(plan.to_dict()))
    result = _compare(plan, results)
    assert not result.missing and result.ok(MIXED_TOLERANCE["bf16"]), result.render()
    ref_fp32, _ = microbatch_reference(fp32, 3, 3, "sgd", 0.05)
    assert max(rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(results[0]["losses"], ref_fp32)) > 1e-6


def test_a_checkpoint_keeps_the_fp16_loss_scale(tmp_path):
    """A resumed fp16 run continues with the scale (and growth counter) it had, not the initial 65536."""
    from runner import checkpoint
    from runner.train import setup_rank

    plan = engine.plan(graph("mlp"), mixed_cluster(), optimizer="sgd", precision="fp16", overlap="none")
    st = setup_rank(plan, 0, 3)
    st.scaler.factor()  # the scaler makes its scale on first use
    st.scaler.scaler.update(new_scale=1024.0)
    checkpoint.save(tmp_path, {"model": "m"}, st, 0, 1, lambda: None)
    fresh = setup_rank(plan, 0, 3)
    assert fresh.scaler.factor() == 65536.0
    checkpoint.load(tmp_path, 1, 0, fresh)
    assert fresh.scaler.factor() == 1024.0
