"""Every training mode of issue 26 at once on `examples/llama_tiny.py` (GQA, RoPE): bf16 autocast,
every layer recomputed under `torch.utils.checkpoint`, and the Full weights' states sharded at
ZeRO stage 3 (Adam), on 3 uneven gloo ranks, verified against single-device training
under the same autocast (`hap run --verify`'s path; bf16's tolerance, runner.verify).

Adam at a language model's learning rate (3e-4): its update divides each gradient by its own
running magnitude, so at lr 1e-2 on this tiny model bf16's rounding of near-zero gradients (a flipped
sign is a full-size step the other way) alone moves parameters 5% apart from the reference, with or
without sharding and recomputation; at 3e-4 the difference is 1e-3, inside bf16's tolerance."""
from __future__ import annotations

import pytest
from conftest import ROOT
from dist_harness import run_ranks
from test_runner_precision import WORLD, mixed_cluster, train_rank

import engine
from engine.spmd.recompute import layers
from runner.config import RunConfig


def test_llama_tiny_in_bf16_recomputing_with_zero3_states_verifies(tmp_path):
    pytest.importorskip("transformers")
    g = engine.load_model(str(ROOT / "examples" / "llama_tiny.py"))
    plan = engine.plan(g, mixed_cluster(), optimizer="adam", precision="bf16", recompute="all", shard_states=3,
                       overlap="none")
    assert plan.options.precision == "bf16" and plan.recompute == layers(g) and len(plan.recompute) >= 2
    assert plan.shard_states and set(plan.shard_states["stages"].values()) == {3}
    plan.save(tmp_path / "plan.json")
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), steps=3, seed=3, optimizer="adam", lr=3e-4, verify=True,
                    metrics=str(tmp_path / "m.jsonl"))
    assert run_ranks(train_rank, WORLD, tmp_path / "run", cfg) == [0] * WORLD
