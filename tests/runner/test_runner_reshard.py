"""Resharding a checkpoint between plans (issue 16): a run continued on another plan, another world
size, other shardings, ends as 12 uninterrupted single-device steps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from runner_plans import RATIOS, cluster, dp_even_plan, graph
from test_runner_checkpoint import sharded_plan

from engine import cli
from engine.elastic.replan import param_layouts
from engine.options import PlanOptions
from engine.planner import load_plan
from engine.spmd.cost import CostModel
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.program import LOAD
from engine.spmd.synthesis import SearchSpace, synthesize
from engine.theory.core import FULL
from runner import checkpoint, reshard
from runner.config import FAULT_ENV, DistEnv, RunConfig
from runner.launch import run
from runner.program import shard
from runner.rank_setup import check_inputs
from runner.train import build_module, reference_run, setup_rank
from runner.verify import TOLERANCE, rel_diff

SEED, LR = 3, {"sgd": 0.05, "adam": 0.01}


def train_rank(rank: int, world: int, init_method: str, cfg: RunConfig) -> int:
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def write_cluster(tmp_path: Path, world: int) -> Path:
    path = tmp_path / f"cluster{world}.json"
    path.write_text(json.dumps(cluster(world).to_dict()))
    return path


def hap_replan(old: Path, world: int, tmp_path: Path, optimizer: str, capfd) -> Plan:
    """`hap replan OLD --cluster <world ranks> --out NEW`, its report checked for the switch's figures."""
    new = tmp_path / f"replan{world}.json"
    assert cli.main(["replan", str(old), "--cluster", str(write_cluster(tmp_path, world)), "--out", str(new),
                     "--optimizer", optimizer]) == 0
    out = capfd.readouterr().out
    assert "predicted step time" in out and "state to move" in out and f"plan written to {new}" in out
    return load_plan(new)


def config(plan: Path, tmp_path: Path, optimizer: str, steps: int, name: str, **kw) -> RunConfig:
    return RunConfig(plan=str(plan), steps=steps, optimizer=optimizer, lr=LR[optimizer], seed=SEED,
                     checkpoint_dir=str(tmp_path / "ckpt"), metrics=str(tmp_path / f"{name}.jsonl"), **kw)


def assert_single_device(new: Plan, tmp_path: Path, optimizer: str, steps: int = 12) -> None:
    """Losses of every step (from the metrics) and the final parameters equal single-device training's."""
    ref_losses, ref_params = reference_run(new, steps, SEED, optimizer, LR[optimizer])
    records = [json.loads(x) for x in (tmp_path / "new.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records}
    assert sorted(losses) == list(range(steps))
    assert max(abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in range(steps)) <= TOLERANCE
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    assert max(rel_diff(params[k], v, 1e-6) for k, v in ref_params.items()) <= TOLERANCE


def switch_and_continue(old_path: Path, new: Plan, tmp_path: Path, optimizer: str, capfd) -> None:
    """Resume the old plan's checkpoint after step 6 on `new` for steps 6-11, verified."""
    new_path = tmp_path / "new_plan.json"
    new.save(new_path)
    first = [json.loads(x) for x in (tmp_path / "old.jsonl").read_text().splitlines()]
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first if r["step"] < 6))
    cfg = config(new_path, tmp_path, optimizer, 12, "new", resume=True, verify=True,
                 save_params=str(tmp_path / "params.pt"))
    assert run_ranks(train_rank, new.world_size, tmp_path / "new", cfg, timeout_s=240) == [0] * new.world_size
    out = capfd.readouterr().out
    assert f"resharded the checkpoint after step 6 in {tmp_path / 'ckpt'}" in out and "verify: OK" in out
    assert_single_device(new, tmp_path, optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_4_ranks_killed_after_a_checkpoint_at_step_6_continue_on_3_ranks_as_single_device_training(
        optimizer, tmp_path, monkeypatch, capfd):
    old = sharded_plan("mlp", 4)
    old_path = tmp_path / "old.json"
    old.save(old_path)
    monkeypatch.setenv(FAULT_ENV, "2:7:kill")  # rank 2 dies during step 7; the checkpoint after step 6 is complete
    with pytest.raises(AssertionError, match="rank 2 exited"):
        run_ranks(train_rank, 4, tmp_path / "old", config(old_path, tmp_path, optimizer, 12, "old", checkpoint_every=3),
                  timeout_s=240)
    monkeypatch.delenv(FAULT_ENV)
    assert checkpoint.latest_complete(tmp_path / "ckpt", checkpoint.read_marker(tmp_path / "ckpt", 6)["key"], 0) == 6
    capfd.readouterr()
    new = hap_replan(old_path, 3, tmp_path, optimizer, capfd)
    assert new.world_size == 3 and new.device_names == old.device_names[:3]
    switch_and_continue(old_path, new, tmp_path, optimizer, capfd)


def train_old(old: Plan, tmp_path: Path, optimizer: str) -> Path:
    old_path = tmp_path / "old.json"
    old.save(old_path)
    cfg = config(old_path, tmp_path, optimizer, 6, "old")
    assert run_ranks(train_rank, old.world_size, tmp_path / "old", cfg, timeout_s=240) == [0] * old.world_size
    return old_path


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_2_ranks_grow_to_4_ranks_as_single_device_training(optimizer, tmp_path, capfd):
    old_path = train_old(sharded_plan("mlp", 2), tmp_path, optimizer)
    capfd.readouterr()
    new = hap_replan(old_path, 4, tmp_path, optimizer, capfd)
    assert new.world_size == 4
    switch_and_continue(old_path, new, tmp_path, optimizer, capfd)


def plan_sharding_weights_on(dim_of: dict[str, int], world: int) -> Plan:
    """The cheapest program with the given parameters sharded on the given dims, at RATIOS[world]."""
    g, c, ratios = graph("mlp"), cluster(world), RATIOS[world]
    want = {n.id: dim_of[n.attrs["target"]] for n in g.parameters if n.attrs["target"] in dim_of}
    space = SearchSpace(param_forms=lambda node, form: node not in want or form == want[node])
    res = synthesize(g, CostModel(g, c, ratios, PlanOptions(optimizer="sgd")), space=space)
    return plan_of(res.program, g, c, ratios, options=PlanOptions(optimizer="sgd"))


def forms(plan: Plan) -> dict[str, int]:
    return {plan.graph[n].attrs["target"]: f for n, f in
            ((i.node, i.post) for i in plan.program if i.kind == LOAD and plan.graph[i.node].op == "parameter")}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_weight_sharded_on_rows_continues_sharded_on_columns(optimizer, tmp_path, capfd):
    old = plan_sharding_weights_on({"layers.0.weight": 0, "layers.1.weight": 1}, 2)
    new = plan_sharding_weights_on({"layers.0.weight": 1, "layers.1.weight": 0}, 3)
    assert forms(old)["layers.0.weight"] == 0 and forms(new)["layers.0.weight"] == 1
    old_path = train_old(old, tmp_path, optimizer)
    capfd.readouterr()
    switch_and_continue(old_path, new, tmp_path, optimizer, capfd)


# ----------------------------------------------------------------------------- single-process pieces


def adam_checkpoint(plan: Plan, root: Path, grads: dict[str, torch.Tensor], steps: int = 2) -> None:
    """Every rank of `plan` takes `steps` Adam steps with its slices of `grads` and saves (rank 0 last)."""
    for rank in reversed(range(plan.world_size)):
        st = setup_rank(plan, rank, SEED, "adam", 0.01)
        for _ in range(steps):
            for (node, form), p in zip(st.program.params, st.params):
                p.grad = shard(plan, node, form, rank, grads[plan.graph[node].attrs["target"]]).clone()
            st.optimizer.step()
        st.losses[:] = [float(s) for s in range(steps)]
        key = checkpoint.run_key(plan, seed=SEED, optimizer="adam", lr=0.01)
        checkpoint.save(root, key, st, rank, steps, barrier=lambda: None, layout=reshard.layout_of(plan, st))


@pytest.fixture(scope="module")
def four_to_three(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    old, new = sharded_plan("mlp", 4), plan_sharding_weights_on({"layers.0.weight": 1}, 3)
    module = build_module(old, SEED)
    gen = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in module.named_parameters()}
    adam_checkpoint(old, root, grads)
    ref = torch.optim.Adam(list(module.parameters()), lr=0.01)
    for _ in range(2):
        for k, p in module.named_parameters():
            p.grad = grads[k].clone()
        ref.step()
    return old, new, root, module, ref


def test_each_new_rank_holds_its_slice_of_every_parameter_and_adam_moment(four_to_three):
    old, new, root, module, ref = four_to_three
    marker = checkpoint.read_marker(root, 2)
    assert marker["layout"]["world_size"] == 4 and set(marker["files"]) == {"0", "1", "2", "3"}
    named = dict(module.named_parameters())
    for rank in range(3):
        st = setup_rank(new, rank, SEED, "adam", 0.01)
        table = reshard.load_resharded(root, 2, marker, new, rank, st)
        assert table.old_world == 4 and table.new_world == 3
        state = st.optimizer.state_dict()["state"]
        for i, ((node, form), p) in enumerate(zip(st.program.params, st.params)):
            name = new.graph[node].attrs["target"]
            assert torch.equal(p.detach(), shard(new, node, form, rank, named[name].detach()))
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][k], shard(new, node, form, rank, ref.state[named[name]][k]))
            assert float(state[i]["step"]) == 2.0
        assert st.losses == [0.0, 1.0]


def test_a_rank_reads_only_the_old_files_its_slices_come_from(four_to_three, monkeypatch):
    _, new, root, _, _ = four_to_three
    marker = checkpoint.read_marker(root, 2)
    opened = []
    real = reshard.OldFiles.state
    monkeypatch.setattr(reshard.OldFiles, "state", lambda self, rank: opened.append(rank) or real(self, rank))
    for rank in range(3):
        opened.clear()
        table = reshard.load_resharded(root, 2, marker, new, rank, setup_rank(new, rank, SEED, "adam", 0.01))
        assert set(opened) == {t.sender for t in table.for_receiver(rank)}


def test_another_models_checkpoint_is_refused_with_one_line(four_to_three, tmp_path):
    _, new, root, _, _ = four_to_three
    other = dp_even_plan("gpt", 3)  # another model's plan resuming from the mlp's checkpoints
    key = checkpoint.run_key(other, seed=SEED, optimizer="adam", lr=0.01)
    assert checkpoint.run_key(new, seed=SEED, optimizer="adam", lr=0.01)["model"] != key["model"]
    with pytest.raises(checkpoint.CheckpointError, match=r"written for another model \(fingerprint") as e:
        checkpoint.latest_complete(root, key, 0, other_plans=True)
    assert "\n" not in str(e.value)


def tampered(root: Path, tmp_path: Path, edit) -> tuple[Path, dict]:
    """A copy of the checkpoint with `edit(folder, marker)` applied."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    marker = checkpoint.read_marker(copy, 2)
    edit(checkpoint.step_dir(copy, 2), marker)
    (checkpoint.step_dir(copy, 2) / checkpoint.COMPLETE).write_text(json.dumps(marker))
    return copy, marker


def test_a_tampered_layout_is_refused(four_to_three, tmp_path):
    _, new, root, _, _ = four_to_three

    def shrink(_folder, marker):
        marker["layout"]["params"][0]["sizes"][0] -= 1

    _, marker = tampered(root, tmp_path, shrink)
    with pytest.raises(checkpoint.CheckpointError, match=r"layers.0.weight: shard sizes \[9, 7, 5, 2\] do not split "
                                                         r"dim 0 .*tampered marker"):
        reshard.table_of(marker, new)


def test_a_changed_rank_file_is_refused_by_its_hash(four_to_three, tmp_path):
    _, new, root, _, _ = four_to_three

    def swap(folder, _marker):  # rank 1's file replaced by rank 3's (valid tensors, wrong slices)
        (folder / "rank-00001.pt").write_bytes((folder / "rank-00003.pt").read_bytes())

    copy, marker = tampered(root, tmp_path, swap)
    st = setup_rank(new, 1, SEED, "adam", 0.01)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank-00001.pt: its SHA-256 differs from the marker's"):
        reshard.load_resharded(copy, 2, marker, new, 1, st)

    def rehash(folder, marker):  # the same swap with the hash forged too: the slice shapes give it away
        marker["files"]["1"] = checkpoint.hash_file(folder / "rank-00001.pt")

    copy2, marker2 = tampered(copy, tmp_path / "again", rehash)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank-00001.pt: not the rank file|its layout says"):
        reshard.load_resharded(copy2, 2, marker2, new, 1, setup_rank(new, 1, SEED, "adam", 0.01))


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_a_rank_file_holding_an_object_is_not_unpickled(four_to_three, tmp_path, capsys):
    _, new, root, _, _ = four_to_three

    def evil(folder, marker):
        torch.save({"params": [], "evil": Evil()}, folder / "rank-00000.pt")
        marker["files"]["0"] = checkpoint.hash_file(folder / "rank-00000.pt")

    copy, marker = tampered(root, tmp_path, evil)
    with pytest.raises(checkpoint.CheckpointError, match="not a tensors-only rank file, refused without unpickling"):
        reshard.load_resharded(copy, 2, marker, new, 0, setup_rank(new, 0, SEED, "adam", 0.01))
    assert "unpickled!" not in capsys.readouterr().out


def test_replan_reports_devices_ratios_shardings_times_and_bytes():
    import engine

    old = sharded_plan("mlp", 4)
    result = engine.replan(old, cluster(3), optimizer="adam")
    rep = result.report
    assert rep.removed == ["dev-3"] and rep.added == []
    assert set(rep.ratios_before) == {f"dev-{i}" for i in range(4)} and set(rep.ratios_after) == {"dev-0", "dev-1", "dev-2"}
    assert rep.time_before_s == old.predicted_time_s and rep.time_after_s == result.plan.predicted_time_s
    assert rep.old_program_s is not None and rep.time_after_s <= rep.old_program_s * (1 + 1e-9)
    before, after = param_layouts(old), param_layouts(result.plan)
    # dev-3 is the only owner of its slices and leaves: it sends each to every new rank that needs it,
    # the parameter and both Adam moments (fp32)
    held3 = sum(3 * 4 * overlap(lay.region(3, shape), after[k][1].region(r, shape))
                for k, (shape, lay, _) in before.items() for r in range(3))
    assert rep.sent_bytes["dev-3"] == held3 > 0
    assert sum(rep.sent_bytes.values()) == sum(rep.received_bytes.values()) == rep.moved_bytes > 0
    assert {c.name for c in rep.shardings} <= set(before)


def overlap(a, b) -> int:
    return math.prod(max(0, min(x1, y1) - max(x0, y0)) for (x0, x1), (y0, y1) in zip(a, b))


def test_hap_run_refuses_a_tampered_checkpoint_before_any_process_group(four_to_three, tmp_path):
    _, new, root, _, _ = four_to_three

    def wrong_shape(_folder, marker):  # consistent with itself, not with the model
        bias = marker["layout"]["params"][1]
        bias["shape"], bias["sizes"] = [48], [2 * s for s in bias["sizes"]]

    copy, _ = tampered(root, tmp_path, wrong_shape)
    new_path = tmp_path / "new.json"
    new.save(new_path)
    cfg = RunConfig(plan=str(new_path), steps=4, optimizer="adam", lr=0.01, seed=SEED, resume=True,
                    checkpoint_dir=str(copy))
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint layout: layers.0.bias has shape \[48\], this "
                                                         r"plan's model \[24\] \(tampered marker\?\)"):
        check_inputs(cfg, 3, DistEnv(0, 3, 0, 3))


def test_hap_replan_refuses_a_missing_plan_with_one_line(tmp_path, capfd):
    assert cli.main(["replan", str(tmp_path / "none.json"), "--cluster", str(write_cluster(tmp_path, 3))]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "none.json' not found" in err


def test_resharding_loads_rank_files_with_weights_only():
    source = Path(reshard.__file__).read_text()
    loads = [ln for ln in source.splitlines() if "torch.load(" in ln]
    assert loads and all("weights_only=True" in ln for ln in loads)
