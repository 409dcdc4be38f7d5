"""The library API on pipeline plans (runner.pipeline_api): a user's loop over `runner.parallelize(pipeline_plan)`
trains as single-device microbatch accumulation does, with AdamW (decay on matrices), a LambdaLR warm-up
and cosine, clipping on the global norm and accumulation of 2.

Two plans on gloo: two stages of two uneven ranks each running a stage plan with sharded weights (the
norm sums shards and counts replicated gradients once per stage), and two one-rank stages on three ranks
where the partition left rank 0 idle (its optimiser steps nothing, its loop runs unchanged). Even steps
accumulate under `no_sync()` (one synchronisation inside each stage per step), odd ones synchronise each
microstep.
"""
from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from dist_harness import init_gloo, run_ranks
from runner_plans import cluster, with_sharded_stages
from test_runner_pipeline import two_stage_plan

import runner
from engine.planner import load_plan
from runner import optim as O
from runner.global_batch import ApiError
from runner.optim import OptimConfig
from runner.pipeline import microbatch_reference
from runner.pipeline_api import PipelineModel
from runner.train import initial_module, make_batch
from runner.verify import compare

SEED, STEPS, LR, DECAY, CLIP, ACCUM, WARMUP = 3, 3, 0.01, 0.1, 0.3, 2, 1
OPTIM = OptimConfig(name="adamw", lr=LR, weight_decay=DECAY, schedule="cosine", warmup=WARMUP, steps=STEPS,
                    clip_grad_norm=CLIP, grad_accum=ACCUM)


def factor(s: int) -> float:
    """The schedule as a user writes it for LambdaLR."""
    if s < WARMUP:
        return (s + 1) / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (s - WARMUP) / max(1, STEPS - WARMUP))))


def own_loop_rank(rank: int, world: int, init_method: str, plan_json: str) -> dict:
    """The SPMD user's loop, unchanged, on a pipeline plan; then evaluate and the whole-state round trip."""
    init_gloo(rank, world, init_method)
    torch.set_num_threads(1)
    plan = load_plan(json.loads(plan_json))
    model = runner.parallelize(plan, seed=SEED)
    assert isinstance(model, PipelineModel)
    opt = model.optimizer(torch.optim.AdamW, lr=LR, weight_decay=DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses, norms = [], []
    for step in range(STEPS):
        model.zero_grad()
        total = 0.0
        for j in range(ACCUM):
            local = j < ACCUM - 1 and step % 2 == 0  # even steps synchronise once, odd ones every microstep
            with model.no_sync() if local else contextlib.nullcontext():
                loss = model(model.local_batch(make_batch(plan, step * ACCUM + j, SEED)))
                (loss / ACCUM).backward()
            total += float(loss.detach())
        norms.append(float(model.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        losses.append(total / ACCUM)
    evaluated = model.evaluate(make_batch(plan, 100, SEED))
    state = model.full_state_dict()
    started = runner.parallelize(plan, seed=SEED + 1, init=state).full_state_dict()  # --init-from's path
    gen = torch.Generator().manual_seed(7)
    noise = {k: torch.randn(v.shape, generator=gen) for k, v in state.items()}
    model.load_full_state_dict(noise)
    back = model.full_state_dict()
    with pytest.raises(ApiError, match="not a local one"):
        model.local_batch(tuple(t[:1] for t in make_batch(plan, 0, SEED)))
    return {"losses": losses, "norms": norms, "eval": evaluated, "state": state,
            "round_trip": all(torch.equal(noise[k], back[k]) and torch.equal(state[k], started[k]) for k in noise),
            "stage": model.stage}


def reference_norms_and_eval(plan) -> tuple[list[float], float]:
    """Single-device gradient norms before clipping, microbatch by microbatch as the pipeline sums them,
    and the final model's loss on the evaluation batch."""
    module = initial_module(plan, SEED)
    params = list(module.parameters())
    opt = O.build(OPTIM, params, [tuple(p.shape) for p in params])
    B, norms = plan.microbatches, []
    for step in range(STEPS):
        O.set_lr(opt, OPTIM.lr_at(step))
        opt.zero_grad(set_to_none=True)
        for j in range(ACCUM):
            batch = make_batch(plan, step * ACCUM + j, SEED)
            for m in range(B):
                (module(*(x.chunk(B, 0)[m] for x in batch)) / B / ACCUM).backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = O.total_norm(grads)
        O.clip_(grads, norm, CLIP)
        opt.step()
        norms.append(float(norm))
    with torch.no_grad():
        batch = make_batch(plan, 100, SEED)
        evaluated = sum(float(module(*(x.chunk(B, 0)[m] for x in batch))) / B for m in range(B))
    return norms, evaluated


PLANS = {
    "sharded-stages": lambda: (with_sharded_stages(two_stage_plan("mlp", 4, ((0, 2), (1, 3)), 2, "1f1b"), cluster(4)),
                               4),
    "idle-rank": lambda: (two_stage_plan("mlp", 3, ((1,), (2,)), 2, "1f1b"), 3),
}


@pytest.mark.parametrize("kind", list(PLANS))
def test_own_loop_over_a_pipeline_plan_trains_like_one_device(kind, tmp_path):
    plan, world = PLANS[kind]()
    results = run_ranks(own_loop_rank, world, tmp_path, json.dumps(plan.to_dict()))
    first = results[0]
    assert all(r["losses"] == first["losses"] and r["norms"] == first["norms"] and r["eval"] == first["eval"]
               for r in results), "every rank reports the global loss and clips by the same global norm"
    assert all(r["round_trip"] for r in results), "init= and load_full_state_dict, then full_state_dict, give them back"
    if kind == "idle-rank":
        assert first["stage"] == -1
    ref_losses, ref_params = microbatch_reference(plan, STEPS, SEED, optim=OPTIM)
    result = compare(first["losses"], first["state"], ref_losses, ref_params)
    assert not result.missing and result.ok(1e-4), result.render()
    ref_norms, ref_eval = reference_norms_and_eval(plan)
    assert max(abs(a - b) / b for a, b in zip(first["norms"], ref_norms)) < 1e-5, (first["norms"], ref_norms)
    assert any(n > CLIP for n in ref_norms) and any(n < CLIP for n in ref_norms), ref_norms  # clipped, not always
    assert abs(first["eval"] - ref_eval) / ref_eval < 1e-5, (first["eval"], ref_eval)
