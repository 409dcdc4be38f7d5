"""Sharded checkpoints and resume (issue 6): a killed run resumed ends as an uninterrupted one."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from runner_plans import RATIOS, cluster, graph

from engine.options import PlanOptions
from engine.spmd.cost import CostModel
from engine.spmd.iteration import plan_of
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL
from runner import checkpoint
from runner.config import FAULT_ENV, DistEnv, RunConfig, parse_args
from runner.launch import MetricsFile, run
from runner.rank_setup import run_key
from runner.train import setup_rank

STEPS = 10


def sharded_plan(model: str, world: int):
    """The cheapest program that keeps no parameter whole: every rank holds uneven slices (RATIOS)."""
    g, c, ratios = graph(model), cluster(world), RATIOS[world]
    res = synthesize(g, CostModel(g, c, ratios, PlanOptions(optimizer="sgd")), space=SearchSpace(param_forms=lambda node, form: form != FULL))
    return plan_of(res.program, g, c, ratios, options=PlanOptions(optimizer="sgd"))


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    plan = sharded_plan("mlp", 2)
    shapes = [[tuple(p.shape) for p in setup_rank(plan, r, 0).params] for r in (0, 1)]
    assert shapes[0] != shapes[1], "each rank should hold its own, uneven slices"
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return plan, path


def train_rank(rank: int, world: int, init_method: str, cfg: RunConfig) -> int:
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def records(metrics: Path) -> list[tuple[int, int, float]]:
    return sorted((r["step"], r["rank"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())
                  if "event" not in r)


def config(plan_path: Path, tmp_path: Path, name: str, **kw) -> RunConfig:
    return RunConfig(plan=str(plan_path), steps=STEPS, optimizer="adam", lr=0.01, seed=5,
                     metrics=str(tmp_path / f"{name}.jsonl"), **kw)


def test_a_run_killed_after_step_6_and_resumed_ends_as_an_uninterrupted_run(plan2, tmp_path, monkeypatch):
    _, path = plan2
    full = config(path, tmp_path, "full", save_params=str(tmp_path / "full.pt"))
    assert run_ranks(train_rank, 2, tmp_path / "full", full) == [0, 0]

    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=4)
    monkeypatch.setenv(FAULT_ENV, "1:6:kill")  # rank 1 SIGKILLs itself after 6 steps (checkpoint at 4)
    with pytest.raises(AssertionError, match="rank 1 exited"):
        run_ranks(train_rank, 2, tmp_path / "killed", config(path, tmp_path, "resumed", **ckpt), timeout_s=90)
    monkeypatch.delenv(FAULT_ENV)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004"]
    assert max(s for s, _, _ in records(tmp_path / "resumed.jsonl")) == 5

    resumed = config(path, tmp_path, "resumed", resume=True, save_params=str(tmp_path / "resumed.pt"), **ckpt)
    assert run_ranks(train_rank, 2, tmp_path / "resume", resumed) == [0, 0]
    assert records(tmp_path / "resumed.jsonl") == records(tmp_path / "full.jsonl")
    assert len(records(tmp_path / "full.jsonl")) == 2 * STEPS
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004", "step-00000008", "step-00000010"]


# ----------------------------------------------------------------------------- single-process pieces


def saved(plan, root: Path, steps: int, world: int = 2, **key_kw) -> dict:
    """A checkpoint after `steps` steps with every rank's file (written here, one rank after another)."""
    key = checkpoint.run_key(plan, seed=key_kw.get("seed", 5), optimizer="adam", lr=0.01)
    for rank in range(world):
        st = setup_rank(plan, rank, 5, "adam", 0.01)
        st.losses[:] = [1.0] * steps
        checkpoint.save(root, key, st, rank, steps, barrier=lambda: None)
    return key


def test_resume_takes_the_newest_complete_checkpoint_and_skips_an_incomplete_one(plan2, tmp_path):
    plan, _ = plan2
    key = saved(plan, tmp_path, 4)
    saved(plan, tmp_path, 8)
    (tmp_path / "step-00000008" / checkpoint.COMPLETE).unlink()  # killed while saving step 8
    (tmp_path / "step-00000012").mkdir()
    (tmp_path / "step-00000012" / "rank-00000.pt.tmp123").write_bytes(b"partial")
    assert checkpoint.latest_complete(tmp_path, key, 1) == 4
    assert checkpoint.latest_complete(tmp_path / "none", key, 0) is None


def test_resume_refuses_another_runs_checkpoint_and_a_missing_rank_file(plan2, tmp_path):
    plan, _ = plan2
    saved(plan, tmp_path, 4)
    other = checkpoint.run_key(plan, seed=6, optimizer="adam", lr=0.01)
    with pytest.raises(checkpoint.CheckpointError, match="written by another run \\(seed 5 != 6\\)"):
        checkpoint.latest_complete(tmp_path, other, 0)
    key = checkpoint.run_key(plan, seed=5, optimizer="adam", lr=0.01)
    checkpoint.rank_file(tmp_path, 4, 1).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="rank-00001.pt missing .* every rank sees"):
        checkpoint.latest_complete(tmp_path, key, 1)


def test_load_restores_slices_optimizer_state_losses_and_rng(plan2, tmp_path):
    plan, _ = plan2
    st = setup_rank(plan, 1, 5, "adam", 0.01)
    for p in st.params:
        p.grad = torch.ones_like(p)
    st.optimizer.step()
    st.losses[:] = [3.0, 2.0]
    torch.manual_seed(123)
    checkpoint.save(tmp_path, {}, st, 1, 2, barrier=lambda: None)
    expected_rng = torch.rand(3)
    fresh = setup_rank(plan, 1, 5, "adam", 0.01)
    checkpoint.load(tmp_path, 2, 1, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, st.params))
    assert fresh.losses == [3.0, 2.0]
    assert torch.equal(torch.rand(3), expected_rng)
    state = fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg"], st.optimizer.state_dict()["state"][i]["exp_avg"]) for i in state)


def test_load_refuses_slices_of_another_shape(plan2, tmp_path):
    plan, _ = plan2
    st = setup_rank(plan, 0, 5, "adam", 0.01)
    checkpoint.save(tmp_path, {}, st, 0, 1, barrier=lambda: None)
    other = setup_rank(plan, 1, 5, "adam", 0.01)  # rank 1's slices are smaller (uneven ratios)
    with pytest.raises(checkpoint.CheckpointError, match=r"parameter slices \[\(14, 8\).* do not match this rank's \[\(10, 8\)"):
        checkpoint.load(tmp_path, 1, 0, other)


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_checkpoint_holding_an_arbitrary_object_is_not_unpickled(plan2, tmp_path, capsys):
    plan, _ = plan2
    st = setup_rank(plan, 0, 5, "adam", 0.01)
    checkpoint.rank_file(tmp_path, 1, 0).parent.mkdir(parents=True)
    torch.save({"params": [], "evil": Evil()}, checkpoint.rank_file(tmp_path, 1, 0))
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(tmp_path, 1, 0, st)
    assert "unpickled!" not in capsys.readouterr().out


def test_metrics_of_a_resumed_run_keep_the_steps_before_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "rank": r, "loss": 1.0}) + "\n" for s in range(7) for r in range(2)))
    m = MetricsFile(str(path), 0, keep_before=4)
    m.write({"step": 4, "rank": 0, "loss": 2.0})
    m.close()
    assert [(r["step"], r["rank"]) for r in map(json.loads, path.read_text().splitlines())] == \
        [(s, r) for s in range(4) for r in range(2)] + [(4, 0)]


def test_checkpoint_options_are_validated():
    with pytest.raises(ValueError, match="--resume needs --checkpoint-dir"):
        RunConfig(plan="p.json", resume=True)
    with pytest.raises(ValueError, match="--checkpoint-every needs --checkpoint-dir"):
        RunConfig(plan="p.json", checkpoint_every=3)
    with pytest.raises(ValueError, match="--checkpoint-every must be in 0..1000000000, got -1"):
        RunConfig(plan="p.json", checkpoint_dir="d", checkpoint_every=-1)
    assert parse_args(["p.json", "--checkpoint-dir", "d", "--checkpoint-every", "2", "--resume"]) == \
        RunConfig(plan="p.json", checkpoint_dir="d", checkpoint_every=2, resume=True)


def test_run_key_changes_with_what_would_change_the_losses(plan2):
    plan, _ = plan2
    cfg = RunConfig(plan="p.json", seed=1)
    assert run_key(plan, cfg) == run_key(plan, RunConfig(plan="q.json", seed=1, steps=99))
    assert run_key(plan, cfg) != run_key(plan, RunConfig(plan="p.json", seed=2))
    assert run_key(plan, cfg) != run_key(plan, RunConfig(plan="p.json", seed=1, lr=0.1))


def test_run_key_tells_mixed_precision_apart(plan2):
    """The same program planned in bf16 trains to other losses: its checkpoints are not an fp32 run's
    (seen on the GPU: the fp32 and bf16 plans of one model share their program). fp32 adds no field."""
    import dataclasses

    plan, _ = plan2
    cfg = RunConfig(plan="p.json", seed=1)
    options = {**plan.search["options"], "precision": "bf16"}
    mixed = dataclasses.replace(plan, search={**plan.search, "options": options})
    assert "precision" not in run_key(plan, cfg)
    assert run_key(mixed, cfg) != run_key(plan, cfg)
    assert run_key(mixed, cfg)["precision"] == "bf16"
