"""Sharded states of Full weights (engine.spmd.zero; issue 26 item 3): stages, shares, memory and time terms."""
from __future__ import annotations

import math

import pytest
from conftest import cluster_dict, with_memory

import engine
from engine.errors import PlanError
from engine.options import PlanOptions
from engine.spmd.balance import balance
from engine.spmd.baselines import data_parallel, unlimited
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.zero import StateSharding, all_params_at, flat_sizes, stage2_buckets, state_memory, to_record


@pytest.fixture(scope="module")
def deep_mlp():
    """Eight small layers: weights dominate, and the largest layer is a small part of them."""
    return engine.load_model("zoo:mlp", layers=8, in_features=64, hidden=128, classes=8, batch=4)


def param_bytes(graph) -> float:
    return float(sum(n.nbytes for n in graph.parameters))


def test_state_bytes_per_stage_follow_the_zero_formula():
    # Adam: 16 B a parameter (4 B weights, 4 gradient, 8 moments); P = 4 bytes, one parameter
    assert state_memory(0, 4, 4) == (16, 0)
    assert state_memory(1, 4, 4) == (8, 8)   # weight and gradient whole, moments split
    assert state_memory(2, 4, 4) == (4, 12)  # weight whole, gradient and moments split
    assert state_memory(3, 4, 4) == (0, 16)  # all split


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_predicted_memory_per_device_is_the_stage_formula(deep_mlp, stage):
    """Data parallelism, every weight staged, shares 0.5/0.3/0.2: each device's bytes are the stage-0 bytes
    minus the replicated 16 B a parameter plus the stage's whole part and its share of the rest, plus the
    transient (stage 2: one bucket of gradients, here all of them; stage 3: twice the largest layer's weights)."""
    c = engine.load_cluster(cluster_dict([1e12] * 3))
    ratios, shares = [0.4, 0.35, 0.25], (0.5, 0.3, 0.2)
    program = data_parallel(deep_mlp, CostModel(deep_mlp, c, ratios)).program
    base = evaluate(program, CostModel(deep_mlp, c, ratios)).memory_bytes
    states = StateSharding(all_params_at(deep_mlp, stage), shares)
    got = evaluate(program, CostModel(deep_mlp, c, ratios, states=states)).memory_bytes
    P = param_bytes(deep_mlp)
    kept = {1: 2, 2: 1, 3: 0}[stage]
    weights = [n.nbytes for n in deep_mlp.parameters]
    layers: dict[int, float] = {}
    for n in deep_mlp.parameters:
        layers[n.segment] = layers.get(n.segment, 0) + n.nbytes
    transient = {1: 0, 2: P, 3: 2 * max(layers.values())}[stage]  # stage 2: every gradient fits one bucket
    for j in range(3):
        want = base[j] - 4 * P + kept * P + (4 - kept) * P * shares[j] + transient
        assert math.isclose(got[j], want, rel_tol=1e-12), (j, got[j], want)


def test_stage_2_gradients_are_sent_in_buckets_as_they_reach_the_cap(monkeypatch):
    assert stage2_buckets([20.0, 48.0, 24.0]) == (0, 92.0)  # all left for the bucket after backward
    monkeypatch.setattr("engine.spmd.zero.STAGE2_BUCKET_BYTES", 28)
    assert stage2_buckets([20.0, 48.0, 24.0]) == (1, 24.0)  # 20 + 48 >= 28 sent during backward
    monkeypatch.setattr("engine.spmd.zero.STAGE2_BUCKET_BYTES", 1)
    assert stage2_buckets([20.0, 48.0, 24.0]) == (3, 0.0)


@pytest.mark.parametrize("stage, cap", [(1, None), (2, None), (2, 1), (3, None)])
def test_staged_gradients_leave_the_all_reduce_and_are_priced_as_the_runners_collectives(deep_mlp, stage, cap,
                                                                                         monkeypatch):
    """A latency per collective `runner.zero` issues: stage 1 one bucket each way; stage 2 its buckets sent
    during backward (each gradient alone at a 1-byte cap), the rest after it, and one bucket of weights;
    stage 3 one bucket each way and an all-gather per layer in backward, but for the first layer: a linear keeps its
    weight for its input's gradient, and the model's input needs none."""
    if cap is not None:
        monkeypatch.setattr("engine.spmd.zero.STAGE2_BUCKET_BYTES", cap)
    c = engine.load_cluster(cluster_dict([1e12] * 3))
    program = data_parallel(deep_mlp, CostModel(deep_mlp, c, [1 / 3] * 3)).program
    n, layers = len(deep_mlp.parameters), len({p.segment for p in deep_mlp.parameters})
    assert 1 < layers < n
    scatters, gathers, gathered = {(1, None): (1, 1, 1), (2, None): (1, 1, 1), (2, 1): (n, 1, 1),
                                   (3, None): (1, 1 + layers - 1, 2)}[stage, cap]
    for overlap in ("none", "ddp"):
        plain = evaluate(program, CostModel(deep_mlp, c, [1 / 3] * 3, overlap=overlap))
        cm = CostModel(deep_mlp, c, [1 / 3] * 3, overlap=overlap,
                       states=StateSharding(all_params_at(deep_mlp, stage), (0.6, 0.2, 0.2)))
        b = evaluate(program, cm)
        assert b.states_s > 0 and not b.buckets and not any(s.comm == "grad_all_reduce" for s in b.stages)
        rs, ag = c.collectives["reduce_scatter"], c.collectives["all_gather"]
        P = param_bytes(deep_mlp)
        comm = (scatters * rs.latency_s + gathers * ag.latency_s
                + 0.6 * P * (1 / rs.bandwidth_Bps + gathered / ag.bandwidth_Bps))
        assert math.isclose(b.states_s, comm, rel_tol=1e-9)  # the spec gives no memory bandwidth: no update time
        assert b.total_s < plain.total_s + b.states_s


def test_fixed_stages_are_recorded_and_round_trip_through_json(deep_mlp):
    c = engine.load_cluster(cluster_dict([1e12] * 3))
    for stage in (1, 2, 3):
        plan = engine.plan(deep_mlp, c, shard_states=stage)
        record = plan.shard_states
        assert record and set(record["stages"].values()) == {stage}
        assert math.isclose(sum(record["shares"]), 1)
        for name, sizes in record["sizes"].items():
            n = next(p for p in deep_mlp.parameters if p.name == name)
            assert sizes == flat_sizes(n.numel, record["shares"]) and sum(sizes) == n.numel
        assert f"ZeRO-{stage} on {len(record['stages'])} of {len(deep_mlp.parameters)} weights" in plan.summary()
        again = engine.load_plan(plan.to_json())
        assert again.to_json() == plan.to_json() and again.shard_states == record
        assert not engine.validate_plan(again, c)  # re-priced with its states: the same time


def test_stage_0_plans_carry_no_shard_states_field(deep_mlp):
    plan = engine.plan(deep_mlp, engine.load_cluster(cluster_dict([1e12] * 3)))
    assert plan.shard_states == {} and "shard_states" not in plan.to_dict() and "states:" not in plan.summary()


def test_auto_keeps_stage_0_where_the_plan_fits_and_shards_where_it_does_not(deep_mlp):
    P = param_bytes(deep_mlp)
    fits = with_memory(cluster_dict([1e12] * 3), [int(4.8 * P)] * 2 + [int(2.4 * P)])
    auto, zero = engine.plan(deep_mlp, fits), engine.plan(deep_mlp, fits, shard_states=0)
    assert auto.program == zero.program and auto.ratios == zero.ratios and auto.memory_bytes == zero.memory_bytes
    assert auto.predicted_time_s == zero.predicted_time_s and not auto.shard_states
    tight = with_memory(cluster_dict([1e12] * 3), [int(2.4 * P)] * 2 + [int(1.2 * P)])
    with pytest.raises(engine.InfeasibleError):
        engine.plan(deep_mlp, tight, shard_states=0)
    plan = engine.plan(deep_mlp, tight)
    assert plan.shard_states["stages"]
    assert all(m <= d.memory_bytes_per_gpu for m, d in zip(plan.memory_bytes, tight.devices))


def test_the_lp_gives_more_state_to_the_device_with_more_memory(deep_mlp):
    """Equal speeds, one device with half the memory: the shares follow memory, not the compute ratios."""
    P = param_bytes(deep_mlp)
    c = with_memory(cluster_dict([1e12] * 3), [int(2.4 * P)] * 2 + [int(1.2 * P)])
    program = data_parallel(deep_mlp, CostModel(deep_mlp, unlimited(c), [1 / 3] * 3)).program
    states = StateSharding(all_params_at(deep_mlp, 3), (1 / 3,) * 3)
    res = balance(program, deep_mlp, c, states=states)
    assert math.isclose(sum(res.shares), 1) and res.shares[2] < res.shares[0] - 0.05
    assert math.isclose(res.shares[0], res.shares[1], rel_tol=1e-6)


def test_shard_states_are_refused_on_pipelines_and_duplex_with_stage_3(deep_mlp):
    c = engine.load_cluster(cluster_dict([1e12] * 4))
    with pytest.raises(PlanError, match="shard_states 2 applies to SPMD plans"):
        engine.plan(deep_mlp, c, parallelism="pipeline", shard_states=2)
    with pytest.raises(PlanError, match="duplex"):
        engine.plan(deep_mlp, c, overlap="duplex", shard_states=3)


def test_a_malformed_or_inconsistent_shard_states_field_is_refused(deep_mlp):
    c = engine.load_cluster(cluster_dict([1e12] * 3))
    d = engine.plan(deep_mlp, c, shard_states=1).to_dict()
    name = next(iter(d["shard_states"]["stages"]))
    for edit, match in ((lambda r: r["stages"].update({name: 4}), "not a ZeRO stage"),
                        (lambda r: r["shares"].append(0.0), "3 devices"),
                        (lambda r: r["sizes"][name].reverse(), "are not"),
                        (lambda r: r["stages"].update({"nope": 1}), "exactly the weights")):
        bad = {**d, "shard_states": {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in d["shard_states"].items()}}
        bad["shard_states"]["sizes"] = {k: list(v) for k, v in bad["shard_states"]["sizes"].items()}
        edit(bad["shard_states"])
        with pytest.raises(PlanError, match=match):
            engine.load_plan(bad)


def test_recorded_stages_name_only_weights_the_program_keeps_full(deep_mlp):
    c = engine.load_cluster(cluster_dict([1e12] * 3))
    plan = engine.plan(deep_mlp, c, shard_states=0)
    record = to_record(deep_mlp, plan.program, StateSharding(all_params_at(deep_mlp, 2), (0.5, 0.3, 0.2)))
    full = {deep_mlp[i.node].name for i in plan.program if i.kind == "load" and i.post == -1
            and deep_mlp[i.node].op == "parameter"}
    assert set(record.get("stages", {})) == full
    assert PlanOptions(shard_states="2").shard_states == 2
