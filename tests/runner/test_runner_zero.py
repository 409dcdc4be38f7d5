"""Sharded states (ZeRO 1-3, uneven shares) train exactly as one device does (issue 26 item 3).

Three gloo ranks run a data-parallel and the engine's own plan of the small MLP with every weight at
stage 1, 2 and 3 and uneven shares, with Adam, and the test compares losses and final weights with
single-device training (runner.verify's fp32 tolerance), as tests/runner/test_runner_equivalence.py does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from dist_harness import init_gloo, run_ranks
from runner_plans import dp_even_plan, engine_plan
from test_runner_equivalence import check_equivalence

from engine.spmd.zero import StateSharding, all_params_at, to_record

SHARES = (0.5, 0.3, 0.2)


def staged(plan, stage: int, shares=SHARES):
    """`plan` with every Full weight at `stage` and the given state shares."""
    record = to_record(plan.graph, plan.program, StateSharding(all_params_at(plan.graph, stage), shares))
    assert record["stages"], "the plan keeps some weight Full"
    return dataclasses.replace(plan, shard_states=record)


BUCKET_SIZES = [[3, 0, 2], [4, 4, 4], [1, 5, 0]]
"""Three staged weights' flat elements on each of 3 ranks: uneven, one rank holding none of two of them."""


def rank_gradient(i: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s whole gradient of weight i, arange + i times rank + 1: over 3 ranks, 6 arange + 3 i."""
    return torch.arange(sum(BUCKET_SIZES[i]), dtype=torch.float32) * (rank + 1) + i


def rank_states(rank: int, stage: int):
    """The weights of BUCKET_SIZES at `stage`, rank `rank`'s slices all equal to `rank` (stages 1-2: whole
    weights of zeros beside them)."""
    from runner.zero import RankStates, StagedParam

    states = RankStates([], build_optimizer=torch.optim.SGD)
    for i, sizes in enumerate(BUCKET_SIZES):
        flat = torch.nn.Parameter(torch.full((sizes[rank],), float(rank)))
        full = None if stage == 3 else torch.nn.Parameter(torch.zeros(sum(sizes)))
        states.staged.append(StagedParam(i, stage, sizes, torch.Size([sum(sizes)]), flat, full=full, name=f"w{i}"))
    return states


@contextlib.contextmanager
def counting_collectives():
    """The names of the collectives run inside, in order."""
    from runner import collectives

    calls: list[str] = []

    class Count:
        @contextlib.contextmanager
        def comm(self, name, tag, args=()):
            calls.append(name)
            yield

    collectives.set_observer(Count())
    try:
        yield calls
    finally:
        collectives.set_observer(None)


def bucket_body(rank: int, world: int, init_method: str, stage: int = 1,
                cap: int | None = None) -> tuple[list, list, list[str]]:
    """Stages 1-2 (2: the gradients arrive through the stage-2 hook, in order, with `cap` as the bucket
    size): each rank's gradient slices after backward, whole weights after the step, collectives run."""
    from runner import zero

    init_gloo(rank, world, init_method)
    if cap is not None:
        zero.STAGE2_BUCKET_BYTES = cap
    states = rank_states(rank, stage)
    with counting_collectives() as calls:
        for i, sp in enumerate(states.staged):
            sp.full.grad = rank_gradient(i, rank)
            if stage == 2:
                states._stage2_hook(sp)(sp.full)
        states.reduce_gradients()
        states.gather_updated()
    return [sp.slice.grad for sp in states.staged], [sp.full.detach() for sp in states.staged], calls


def stage3_body(rank: int, world: int, init_method: str) -> tuple[list, list, list[str]]:
    """Stage 3: the weights gathered for forward, a loss whose gradient is `rank_gradient`, backward."""
    init_gloo(rank, world, init_method)
    states = rank_states(rank, 3)
    with counting_collectives() as calls:
        wholes = states.program_params([sp.slice for sp in states.staged])
        sum((w * rank_gradient(i, rank)).sum() for i, w in enumerate(wholes)).backward()
    return [sp.slice.grad for sp in states.staged], [w.detach() for w in wholes], calls


def assert_slices_and_wholes(results: list, calls_want: list[str]) -> None:
    """Every rank ran `calls_want`, holds its slices of the summed gradients and every weight whole
    from every rank's slices."""
    for rank, (grads, wholes, calls) in enumerate(results):
        assert calls == calls_want
        for i, sizes in enumerate(BUCKET_SIZES):
            total = (torch.arange(sum(sizes), dtype=torch.float32) * 6 + 3 * i).split(sizes)[rank]
            torch.testing.assert_close(grads[i], total, rtol=0, atol=0)
            want = torch.cat([torch.full((n,), float(r)) for r, n in enumerate(sizes)])
            torch.testing.assert_close(wholes[i], want, rtol=0, atol=0)


@pytest.mark.parametrize("stage, cap, scatters", [(1, None, 1), (2, None, 1), (2, 7 * 4, 2), (2, 1, 3)])
def test_sharded_gradients_and_updated_weights_move_in_buckets(stage, cap, scatters, tmp_path):
    """Stage 1 sends all gradients in one bucket; stage 2 sends a bucket during backward whenever the
    finished gradients reach the cap (28 bytes: after weights 0 and 1, 5 + 12 floats; 1 byte: after
    each), the rest after backward; one all-gather after the step (the counts
    engine.spmd.zero.comm_terms prices)."""
    results = run_ranks(bucket_body, 3, tmp_path, stage, cap)
    assert_slices_and_wholes(results, ["reduce_scatter"] * scatters + ["all_gather"])


def test_stage_3_weights_are_gathered_and_their_gradients_reduce_scattered_in_one_bucket_each(tmp_path):
    assert_slices_and_wholes(run_ranks(stage3_body, 3, tmp_path), ["all_gather", "reduce_scatter"])


def regather_body(rank: int, world: int, init_method: str) -> tuple[list, list, list[str], list]:
    """Stage 3 with weights 0 and 1 in layer 0 and weight 2 in layer 1, each multiplied by an input that needs a
    gradient, so autograd saves every gathered weight and backward reads it again (the input's gradient is the
    weight): the slices' gradients, the wholes, the collectives, the inputs' gradients."""
    init_gloo(rank, world, init_method)
    states = rank_states(rank, 3)
    states.staged[2].layer = 1
    inputs = [rank_gradient(i, rank).requires_grad_() for i in range(len(BUCKET_SIZES))]
    with counting_collectives() as calls:
        with states.saving():
            wholes = states.program_params([sp.slice for sp in states.staged])
            loss = sum((w * x).sum() for w, x in zip(wholes, inputs))
        loss.backward()
    return [sp.slice.grad for sp in states.staged], [w.detach() for w in wholes], calls, [x.grad for x in inputs]


def test_backward_gathers_each_stage_3_layer_again_in_one_bucket(tmp_path):
    """Backward reads the three saved weights of two layers: two all-gathers, one per layer (the count
    engine.spmd.zero.comm_terms prices), not one per weight; what they gather is each weight whole."""
    results = run_ranks(regather_body, 3, tmp_path)
    assert_slices_and_wholes([r[:3] for r in results], ["all_gather"] * 3 + ["reduce_scatter"])
    for _, wholes, _, input_grads in results:
        for whole, grad in zip(wholes, input_grads):
            torch.testing.assert_close(grad, whole, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_data_parallel_with_sharded_states_trains_like_one_device(stage, tmp_path):
    plan = staged(dp_even_plan("mlp", 3), stage)
    assert len(set(sum(plan.shard_states["sizes"].values(), []))) > 1, "uneven sizes"
    check_equivalence(plan, tmp_path, "adam")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engines_plan_with_sharded_states_trains_like_one_device(stage, tmp_path):
    check_equivalence(staged(engine_plan("mlp", 3), stage), tmp_path, "adam")


def test_a_checkpoint_of_sharded_states_resumes_after_replan_to_2_ranks_with_other_stages(tmp_path, capfd):
    """3 ranks at stage 3 save (Adam moments gathered whole), `hap replan` to 2 ranks, the new plan at
    stage 2 loads its slices; steps 6-11 end as single-device training."""
    from test_runner_reshard import hap_replan, switch_and_continue, train_old

    old = staged(dp_even_plan("mlp", 3), 3)
    old_path = train_old(old, tmp_path, "adam")
    capfd.readouterr()
    new = hap_replan(old_path, 2, tmp_path, "adam", capfd)
    assert new.world_size == 2
    switch_and_continue(old_path, staged(new, 2, (0.7, 0.3)), tmp_path, "adam", capfd)


def test_a_run_with_sharded_states_killed_after_a_checkpoint_resumes_exactly(tmp_path, monkeypatch, capfd):
    from test_runner_reshard import assert_single_device, config, train_rank

    from runner.config import FAULT_ENV

    plan = staged(dp_even_plan("mlp", 3), 1)
    path = tmp_path / "plan.json"
    plan.save(path)
    monkeypatch.setenv(FAULT_ENV, "1:7:kill")
    with pytest.raises(AssertionError, match="rank 1 exited"):
        run_ranks(train_rank, 3, tmp_path / "old", config(path, tmp_path, "adam", 12, "old", checkpoint_every=3),
                  timeout_s=240)
    monkeypatch.delenv(FAULT_ENV)
    first = [json.loads(x) for x in (tmp_path / "old.jsonl").read_text().splitlines()]
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first if r["step"] < 6))
    cfg = config(path, tmp_path, "adam", 12, "new", resume=True, save_params=str(tmp_path / "params.pt"))
    assert run_ranks(train_rank, 3, tmp_path / "new", cfg, timeout_s=240) == [0] * 3
    assert_single_device(plan, tmp_path, "adam")
