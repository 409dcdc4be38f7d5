"""Overlap in the runner (issue 14): gradient buckets all-reduced during backward (`ddp`) and two
half-batch streams per rank (`duplex`) train exactly as one device does.

Each case trains a plan of the engine (uneven ratios) with its `overlap` set, in fresh gloo
processes, and compares the losses and final parameters with single-device training (relative
1e-4, the verify tolerance) and with the same plan without overlap (relative 1e-6: only the
order of float sums may differ), for every model on 2, 3 and 4 ranks under both modes.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import sample_path
from dist_harness import run_ranks
from runner_plans import MODELS, cluster
from warm_run import warm_hap

import engine
from engine.errors import PlanError
from runner.config import DistEnv, RunConfig
from runner.launch import run
from runner.rank_setup import load_spmd_plan
from runner.timing import EmulatedLink
from runner.train import reference_run, setup_rank
from runner.verify import TOLERANCE, compare

STEPS = 3
CASES = [pytest.param(mode, m, w, {"tie_weights": True} if (mode, m, w) == ("ddp", "gpt", 3) else {},
                      id=f"{mode}-{m}-{w}ranks{'-tied' if (mode, m, w) == ('ddp', 'gpt', 3) else ''}")
         for mode in ("ddp", "duplex") for m in ("mlp", "gpt", "bert_moe") for w in (2, 3, 4)]
"""(mode, model, world size, knobs): every model on 2, 3 and 4 uneven ranks under both modes; GPT on
3 ranks under ddp with its output layer tied to the embedding (one parameter, two uses, one hook)."""


def train_rank(rank: int, world: int, init_method: str, cfg: RunConfig) -> int:
    return run(cfg, DistEnv(rank, world, rank, world), init_method=init_method)


def train(plan, tmp_path: Path, name: str, timing: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """Train `plan` for STEPS steps on its world size; rank 0's losses, the gathered parameters and
    the metrics records."""
    out = tmp_path / name
    out.mkdir()
    plan.save(out / "plan.json")
    cfg = RunConfig(plan=str(out / "plan.json"), steps=STEPS, seed=3, metrics=str(out / "metrics.jsonl"),
                    save_params=str(out / "params.pt"), timing=timing)
    assert run_ranks(train_rank, plan.world_size, out / "run", cfg) == [0] * plan.world_size
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_rank = {r: [x["loss"] for x in sorted(records, key=lambda x: x["step"]) if x["rank"] == r] for r in range(plan.world_size)}
    assert all(v == by_rank[0] and len(v) == STEPS for v in by_rank.values()), "every rank reports the same loss"
    return by_rank[0], torch.load(out / "params.pt"), records


def check_overlap_trains_the_same(plan, mode: str, tmp_path: Path) -> None:
    plain = dataclasses.replace(plan, overlap="none")
    overlapped = dataclasses.replace(plan, overlap=mode)
    losses, params, records = train(overlapped, tmp_path, mode, timing=True)
    base_losses, base_params, _ = train(plain, tmp_path, "none")
    ref_losses, ref_params = reference_run(plan, STEPS, 3)
    single = compare(losses, params, ref_losses, ref_params)
    assert not single.missing and single.ok(TOLERANCE), f"{mode} vs one device:\n{single.render()}\n{plan.listing()}"
    same = compare(losses, params, base_losses, base_params)
    assert not same.missing and same.ok(1e-6), f"{mode} vs no overlap:\n{same.render(1e-6)}"
    check_timeline(mode, records)


def check_timeline(mode: str, records: list[dict]) -> None:
    """The measured timeline shows the overlap: ddp launches buckets in backward and waits for them
    (comm) before the step; duplex records both halves, each computing forward and backward."""
    for r in records:
        segments = [(s["phase"], s["kind"], s["name"].split("(")[0]) for s in r["timeline"]]
        if mode == "ddp":
            assert ("bwd", "comm", "all_reduce.launch") in segments, segments
            assert ("step", "comm", "all_reduce.wait") in segments, segments
        else:
            assert len(r["halves"]) == 2 and ("step", "comm", "all_reduce.wait") in segments, segments
            for half in r["halves"]:
                phases = {(s["phase"], s["kind"]) for s in half["timeline"]}
                assert {("fwd", "compute"), ("bwd", "compute")} <= phases, phases


@pytest.mark.parametrize("mode, model, world, knobs", CASES)
def test_overlapped_plan_trains_like_one_device_and_like_no_overlap(mode, model, world, knobs, tmp_path):
    g = engine.load_model(f"zoo:{model}", **{**MODELS[model], **knobs})
    plan = engine.plan(g, cluster(world), optimizer="sgd")
    assert len(set(plan.ratios["0"])) == world, "the ratios should be uneven"
    check_overlap_trains_the_same(plan, mode, tmp_path)


def test_duplex_draws_the_whole_batch_dropout_masks(tmp_path):
    """Dropout on in BERT (embeddings, attention probabilities, residuals): each half draws its rows
    of the whole batch's masks, so duplex still equals one device."""
    g = engine.load_model("zoo:bert", **{**MODELS["bert"], "dropout": 0.2})
    check_overlap_trains_the_same(engine.plan(g, cluster(3), optimizer="sgd"), "duplex", tmp_path)


def test_duplex_refuses_training_mode_batch_norm_in_one_line_before_any_rank_starts(tmp_path):
    g = engine.load_model("zoo:vgg19", batch=4, image_size=32, width=0.0625, hidden=16, classes=3,
                          batch_norm=True)
    plan = dataclasses.replace(engine.evaluate(g, cluster(2), "dp-even", optimizer="sgd"), overlap="duplex")
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="batch norm") as e:
        load_spmd_plan(str(tmp_path / "plan.json"), 2)
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="batch norm"):  # and the rank itself, should it be started anyway
        setup_rank(plan, 0, seed=0)


def test_hap_run_verifies_a_duplex_plan_on_cpu_4_uneven(tmp_path):
    """Issue 28's GPT, planned with duplex forced: its MLP weights are split in the LP's whole units,
    which the plan's realised ratios round differently; each half keeps the plan's weight shards."""
    gpt = engine.load_model("zoo:gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=16, batch=16)
    plan = engine.plan(gpt, sample_path("cpu_4_uneven"), overlap="duplex", max_iterations=2)
    assert plan.overlap == "duplex" and set(plan.search["overlap_s"]) == {"duplex"}
    assert len(set(plan.shard_sizes["p_blocks_0_fc_weight:0"])) > 1, "the case: a weight split unevenly"
    plan.save(tmp_path / "plan.json")
    r = warm_hap("run", str(tmp_path / "plan.json"), "--steps", "3", "--verify", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout


def test_emulated_link_prices_each_collective_as_the_cluster_fits_do():
    """`--emulate-link`: the payload of each collective is the engine's (engine.cluster): the whole
    tensor for all-reduce, the largest shard for all-gather / reduce-scatter / all-to-all (a
    resplit is one), one broadcast per shard for the grouped all-gather."""
    fits = {k: {"latency_s": 1e-3 * (i + 1), "bandwidth_Bps": 1e6 * (i + 1)}
            for i, k in enumerate(("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"))}
    spec = json.loads(Path(sample_path("cpu_2")).read_text())
    spec["network"]["collectives"] = fits
    link = EmulatedLink(spec)

    def t(name: str, nbytes: float) -> float:
        return fits[name]["latency_s"] + nbytes / fits[name]["bandwidth_Bps"]
    x = torch.zeros(3, 5)  # a local shard of 3 rows of 5 floats (20 bytes a row); sizes 3 and 7
    assert link.seconds("all_reduce", (x,)) == pytest.approx(t("all_reduce", 60))
    assert link.seconds("all_gather.padded", (x, 0, [3, 7])) == pytest.approx(t("all_gather", 140))
    assert link.seconds("all_gather.grouped", (x, 0, [3, 7])) == pytest.approx(t("broadcast", 60) + t("broadcast", 140))
    assert link.seconds("reduce_scatter", (torch.zeros(10, 5), 0, [3, 7])) == pytest.approx(t("reduce_scatter", 140))
    assert link.seconds("all_to_all", (x, 0, 1, [3, 7], [2, 3])) == pytest.approx(t("all_to_all", 140))
    assert link.seconds("resplit", (x, 0, [3, 7], [5, 5])) == pytest.approx(t("all_to_all", 140))
