"""The library API (runner.parallelize, issue 27): a loop of one's own trains exactly as one device does.

Three gloo ranks run a user-style loop (AdamW with decay on matrices, a LambdaLR warm-up and cosine,
clipping, accumulation of 2) over `runner.parallelize` on uneven plans: the engine's own, and
data parallelism with every weight's states sharded (ZeRO 1 and 3, uneven shares). Losses and final
weights must match single-device training with the same settings (runner.train.reference_run), and the
global gradient norm the ranks clip with must be the single-device one.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from dist_harness import init_gloo, run_ranks
from runner_plans import dp_even_plan, engine_plan
from test_runner_zero import staged

import runner
from engine.errors import HapError
from runner.api import ApiError
from runner.optim import OptimConfig, total_norm
from runner.train import make_batch, reference_run
from runner.verify import TOLERANCE, compare

SEED, STEPS, LR, DECAY, CLIP, ACCUM, WARMUP = 3, 4, 0.01, 0.1, 0.3, 2, 1
OPTIM = OptimConfig(name="adamw", lr=LR, weight_decay=DECAY, schedule="cosine", warmup=WARMUP, steps=STEPS,
                    clip_grad_norm=CLIP, grad_accum=ACCUM)


def factor(s: int) -> float:
    """The schedule as a user writes it for LambdaLR."""
    if s < WARMUP:
        return (s + 1) / WARMUP
    done = min(1.0, (s - WARMUP) / max(1, STEPS - WARMUP))
    return 0.5 * (1.0 + math.cos(math.pi * done))


def own_loop_rank(rank: int, world: int, init_method: str, plan, no_sync: bool = False) -> dict:
    """A user's loop: everything but `parallelize`, `local_batch`, `optimizer` and `clip_grad_norm_` is torch."""
    init_gloo(rank, world, init_method)
    model = runner.parallelize(plan, seed=SEED)
    opt = model.optimizer(torch.optim.AdamW, lr=LR, weight_decay=DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses, norms = [], []
    for step in range(STEPS):
        model.zero_grad()
        total = 0.0
        for j in range(ACCUM):
            index = step * ACCUM + j
            with model.no_sync() if (no_sync and j < ACCUM - 1) else contextlib.nullcontext():
                loss = model(model.local_batch(make_batch(plan, index, SEED)), step=index)
                (loss / ACCUM).backward()
            total += float(loss.detach())
        norms.append(float(model.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        losses.append(total / ACCUM)
    state = model.full_state_dict()
    return {"losses": losses, "norms": norms, "state": state if rank == 0 else None}


def reference_norms(plan) -> list[float]:
    """The single-device gradient norms before clipping, step by step (the reference's own loop)."""
    from runner.train import initial_module
    from runner import optim as O

    module = initial_module(plan, SEED)
    params = list(module.parameters())
    opt = O.build(OPTIM, params, [tuple(p.shape) for p in params])
    out = []
    for step in range(STEPS):
        O.set_lr(opt, OPTIM.lr_at(step))
        opt.zero_grad(set_to_none=True)
        for j in range(ACCUM):
            (module(*make_batch(plan, step * ACCUM + j, SEED)) / ACCUM).backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = total_norm(grads)
        O.clip_(grads, norm, CLIP)
        opt.step()
        out.append(float(norm))
    return out


@pytest.mark.parametrize("kind, no_sync", [("engine", False), ("engine", True), ("zero1", True), ("zero3", False)])
def test_own_loop_over_parallelize_trains_like_one_device(kind, no_sync, tmp_path):
    """With and without no_sync() around the first microstep (one synchronisation per step, or one per microstep)."""
    plan = {"engine": lambda: engine_plan("mlp", 3), "zero1": lambda: staged(dp_even_plan("mlp", 3), 1),
            "zero3": lambda: staged(engine_plan("mlp", 3), 3)}[kind]()
    results = run_ranks(own_loop_rank, 3, tmp_path, plan, no_sync)
    assert all(r["losses"] == results[0]["losses"] for r in results), "every rank reports the global loss"
    assert all(r["norms"] == results[0]["norms"] for r in results), "every rank clips by the same global norm"
    ref_losses, ref_params = reference_run(plan, STEPS, SEED, optim=OPTIM)
    result = compare(results[0]["losses"], results[0]["state"], ref_losses, ref_params)
    assert not result.missing and result.ok(TOLERANCE), result.render()
    ref_norms = reference_norms(plan)
    assert max(abs(a - b) / b for a, b in zip(results[0]["norms"], ref_norms)) < 1e-5, (results[0]["norms"], ref_norms)
    assert any(n > CLIP for n in ref_norms) and any(n < CLIP for n in ref_norms), ref_norms


def state_rank(rank: int, world: int, init_method: str, plan) -> bool:
    """load_full_state_dict then full_state_dict gives back the same whole tensors."""
    init_gloo(rank, world, init_method)
    model = runner.parallelize(plan, seed=SEED)
    gen = torch.Generator().manual_seed(7)
    whole = {k: torch.randn(v.shape, generator=gen) for k, v in model.full_state_dict().items()}
    model.load_full_state_dict(whole)
    back = model.full_state_dict()
    with pytest.raises(ApiError, match="has shape"):
        model.load_full_state_dict({k: v[..., :1] if v.dim() else v for k, v in whole.items()})
    with pytest.raises(ApiError, match="the plan's model takes"):
        model.local_batch(make_batch(plan, 0, SEED)[:1])
    if any(model.state.full_params):  # replicated weights: their gradients are all-reduced
        local = model.local_batch(make_batch(plan, 0, SEED))
        model(local).backward()
        with pytest.raises(ApiError, match="no_sync"), model.no_sync():  # would count the synchronised gradients twice
            model(local).backward()
    return all(torch.equal(whole[k], back[k]) for k in whole)


@pytest.mark.parametrize("kind", ["engine", "dp-even", "zero2"])
def test_full_state_round_trips_through_the_shards(kind, tmp_path):
    plan = {"engine": lambda: engine_plan("mlp", 3), "dp-even": lambda: dp_even_plan("mlp", 3),
            "zero2": lambda: staged(engine_plan("mlp", 3), 2)}[kind]()
    assert run_ranks(state_rank, 3, tmp_path, plan) == [True] * 3


def test_parallelize_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ApiError, match="init_process_group"):
        runner.parallelize(engine_plan("mlp", 3))
    assert issubclass(ApiError, HapError)
