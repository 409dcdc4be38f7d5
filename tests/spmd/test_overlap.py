"""Tests of the overlap modes of the cost model (engine.spmd.overlap, engine.spmd.cost): DDP's buckets
overlapped with backward, HiDup's duplex halves, their closed forms against the one timeline
simulator, and the predicted timeline of a priced program."""
from __future__ import annotations

import random

import pytest
from conftest import build_graph, ce_graph, cluster_dict

import engine
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.options import PlanOptions
from engine.spmd.baselines import data_parallel_space
from engine.spmd.cost import ZERO, Breakdown, BucketRecord, CostModel, Stage, evaluate
from engine.spmd.overlap import (bucket_queue, ddp_backward_time, duplex_chain_time, duplex_problem, grad_buckets,
                                 predicted_timeline, price)
from engine.spmd.synthesis import synthesize
from engine.timeline import simulate


def free_network(flops=(1e12, 1e12, 5e11)) -> Cluster:
    """Collectives cost nothing (no latency, a huge bandwidth): overlap cannot change anything."""
    return Cluster.from_dict(cluster_dict(list(flops), latency_s=0.0, bandwidth_Bps=1e30))


@pytest.fixture(scope="module")
def slow() -> Cluster:
    return Cluster.from_dict(cluster_dict([1e12, 1e12, 5e11], latency_s=1e-4, bandwidth_Bps=1e9))


def dp_program(graph, cluster):
    cm = CostModel(graph, cluster, [1 / cluster.num_devices] * cluster.num_devices)
    return synthesize(graph, cm, space=data_parallel_space(graph)).program


# ----------------------------------------------------------------------------- the modes


def test_an_unknown_overlap_mode_is_refused_naming_the_choices(slow):
    with pytest.raises(PlanError, match=r"overlap must be one of none, ddp, duplex, got 'async'"):
        CostModel(ce_graph(), slow, [0.4, 0.4, 0.2], overlap="async")


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_with_a_free_network_every_mode_costs_what_none_costs(mode):
    """No communication time and no per-parameter-byte work: buckets, halves and tails are all free,
    and the halves' computations add up to the whole batch's."""
    graph = ce_graph()
    cluster = free_network()
    ratios = [0.5, 0.3, 0.2]
    program = synthesize(graph, CostModel(graph, cluster, ratios)).program
    none = evaluate(program, CostModel(graph, cluster, ratios))
    other = evaluate(program, CostModel(graph, cluster, ratios, overlap=mode))
    assert other.total_s == pytest.approx(none.total_s, rel=1e-12)
    assert other.overlap == mode and none.overlap == "none"


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_a_devices_overlap_slowdown_stretches_its_computation_in_that_mode_only(mode):
    """`overlap_slowdown` (measured by hap profile) scales every stage's computation of that device in
    that mode, and nothing else: not its communication, not another mode's price."""
    graph = ce_graph()
    spec = cluster_dict([1e12, 1e12, 5e11], latency_s=1e-4, bandwidth_Bps=1e9)
    ratios = [0.4, 0.4, 0.2]
    program = synthesize(graph, CostModel(graph, Cluster.from_dict(spec), ratios)).program
    plain = evaluate(program, CostModel(graph, Cluster.from_dict(spec), ratios, overlap=mode))
    spec["devices"][2]["overlap_slowdown"] = {mode: 3.0}
    slowed = Cluster.from_dict(spec)
    other = "duplex" if mode == "ddp" else "ddp"
    b = evaluate(program, CostModel(graph, slowed, ratios, overlap=mode))
    assert [t[2] for t in b.stage_comp_s] == pytest.approx([3.0 * t[2] for t in plain.stage_comp_s], rel=1e-12)
    assert [t[j] for t in b.stage_comp_s for j in (0, 1)] == pytest.approx(
        [t[j] for t in plain.stage_comp_s for j in (0, 1)], rel=1e-12)
    assert b.stage_comm_s == pytest.approx(plain.stage_comm_s) and b.total_s > plain.total_s
    for m in ("none", other):
        assert (evaluate(program, CostModel(graph, slowed, ratios, overlap=m)).total_s
                == pytest.approx(evaluate(program, CostModel(graph, Cluster.from_dict(
                    cluster_dict([1e12, 1e12, 5e11], latency_s=1e-4, bandwidth_Bps=1e9)), ratios, overlap=m)).total_s))


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_buckets_are_the_plans_full_parameters_by_slot_each_paying_one_latency(slow, mode):
    graph = engine.load_model("zoo:mlp", layers=2, in_features=256, hidden=1024, classes=16, batch=64)
    program = dp_program(graph, slow)
    b = evaluate(program, CostModel(graph, slow, [0.4, 0.4, 0.2], overlap=mode))
    assert [list(x.params) for x in b.buckets] == grad_buckets(graph, program)
    assert len(b.buckets) >= 2, "the 1 MiB first bucket splits this model's 4 MiB of weights"
    fit = slow.collectives["all_reduce"]
    for x in b.buckets:
        assert x.bytes == sum(graph[p].nbytes for p in x.params)
        assert x.duration_s == pytest.approx(fit.latency_s + x.bytes / fit.bandwidth_Bps, rel=1e-12)
        assert x.start_s >= x.ready_s and x.end_s == pytest.approx(x.start_s + x.duration_s, rel=1e-12)
    assert all(a.end_s <= b_.start_s * (1 + 1e-12) for a, b_ in zip(b.buckets, b.buckets[1:])), "one at a time"
    assert b.total_s == pytest.approx(max(b.buckets[-1].end_s, b.total_s - b.tail_s) + b.tail_s, rel=1e-12)


def test_ddp_buckets_of_later_layers_are_ready_earlier_in_backward(slow):
    """One backward stage (data parallelism) still overlaps: a bucket is ready once the backward of
    the layers from its parameters on has run, not at the end of the stage. (A batch large enough
    that backward computes about as long as the buckets take.)"""
    graph = engine.load_model("zoo:mlp", layers=2, in_features=256, hidden=1024, classes=16, batch=4096)
    program = dp_program(graph, slow)
    cm = CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="ddp")
    b = evaluate(program, cm)
    ready = [x.ready_s for x in b.buckets]
    assert ready == sorted(ready) and ready[0] < ready[-1]
    none = evaluate(program, CostModel(graph, slow, [0.4, 0.4, 0.2]))
    assert b.total_s < none.total_s, "overlapping all but the first-layer bucket beats one bucket after backward"


def test_ddp_moves_the_per_parameter_byte_work_to_a_tail_after_the_buckets():
    d = cluster_dict([1e12, 1e12], latency_s=1e-4, bandwidth_Bps=1e9)
    for dev in d["devices"]:
        dev["memory_bandwidth_Bps"] = 1e10
    cluster = Cluster.from_dict(d)
    graph = ce_graph()
    program = dp_program(graph, cluster)
    b = evaluate(program, CostModel(graph, cluster, [0.5, 0.5], PlanOptions(optimizer="sgd"), overlap="ddp"))
    nbytes = sum(n.nbytes for n in graph.parameters)
    assert b.tail_s == pytest.approx(nbytes * (3.0 + 4.0) / 1e10, rel=1e-12)  # SGD's update + the copies into and out of the bucket
    assert b.tail_device_s == [b.tail_s, b.tail_s]
    assert b.total_s == pytest.approx(b.buckets[-1].end_s + b.tail_s, rel=1e-12)


def test_duplex_halves_the_payload_of_batch_derived_collectives_only(slow):
    graph = ce_graph()
    cm = CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="duplex")
    fit = slow.collectives["all_reduce"]
    h = graph.loss - 2  # the logits: batch-derived
    assert cm.half_comm_seconds("all_reduce", h, 0.4) == pytest.approx(
        fit.latency_s + graph[h].nbytes / fit.bandwidth_Bps / 2, rel=1e-12)
    w = next(n.id for n in graph.parameters)
    assert cm.half_comm_seconds("all_reduce", w, 0.4) == sum(cm.comm_terms("all_reduce", w))
    ag = slow.collectives["all_gather"]
    assert cm.half_comm_seconds("all_gather.padded", h, 0.4) == pytest.approx(
        ag.latency_s + 0.4 * graph[h].nbytes / ag.bandwidth_Bps / 2, rel=1e-12)


def test_duplex_total_is_both_passes_chains_then_the_buckets_then_the_tail(slow):
    graph = ce_graph()
    ratios = [0.4, 0.4, 0.2]
    program = synthesize(graph, CostModel(graph, slow, ratios)).program
    b = evaluate(program, CostModel(graph, slow, ratios, overlap="duplex"))
    psi = 0.0
    for direction in ("forward", "backward"):
        xs = []
        for s, m, comp in zip(b.stages, b.stage_half_comm_s, b.stage_comp_s):
            if s.direction == direction:
                xs += [m, max(comp) / 2]
        psi += duplex_chain_time(xs)
    assert b.total_s == pytest.approx(psi + sum(x.duration_s for x in b.buckets) + b.tail_s, rel=1e-12)
    assert all(x.ready_s == pytest.approx(psi, rel=1e-12) for x in b.buckets)


def test_duplex_is_refused_for_training_mode_batch_norm(slow):
    graph = build_graph([
        ("x", "placeholder", (), (8, 4, 6, 6)),
        ("w", "parameter", (), (4,)),
        ("b", "parameter", (), (4,)),
        ("bn", "batch_norm", (0, 1, 2), (8, 4, 6, 6), 8 * 4 * 36 * 5, {"eps": 1e-5}),
        ("loss", "sum", (3,), (), 8 * 4 * 36),
    ])
    why = duplex_problem(graph)
    assert why is not None and "'bn'" in why and "batch norm" in why and "\n" not in why
    with pytest.raises(PlanError, match="duplex is refused: node 'bn' is a training-mode batch norm"):
        CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="duplex")
    CostModel(graph, slow, [0.4, 0.4, 0.2], overlap="ddp")
    assert duplex_problem(ce_graph()) is None


# ----------------------------------------------------------------------------- closed forms == the simulator


def random_breakdown(rng: random.Random, mode: str) -> Breakdown:
    """Made-up stage lists: 1-4 devices with their own computation times, collectives (some stages
    without one), ddp buckets ready part-way through a random backward stage, a tail per device."""
    devices = [f"d{j}" for j in range(rng.randint(1, 4))]
    stages, comm, comp, half = [], [], [], []
    for direction in ("forward", "backward"):
        for i in range(rng.randint(1, 6)):
            key = "" if i == 0 or rng.random() < 0.2 else rng.choice(["all_reduce", "all_gather.padded", "all_to_all"])
            stages.append(Stage(direction, key, -1, 0.0, 0.0, ZERO))
            c = rng.choice([0.0, rng.uniform(0, 2), rng.uniform(0, 0.1)]) if key else 0.0
            comm.append(c)
            half.append(rng.uniform(c / 2, c) if mode == "duplex" else 0.0)
            comp.append([rng.choice([0.0, rng.uniform(0, 1), rng.uniform(0, 3)]) for _ in devices])
    bwd = [i for i, s in enumerate(stages) if s.direction == "backward"]
    buckets = []
    for k in range(rng.randint(0, 5) if mode != "none" else 0):  # mode none lists its bucket as a stage
        at = rng.choice(bwd)
        f = rng.random()
        left = tuple(f * t for t in comp[at]) if mode == "ddp" else ()
        nbytes = float(rng.randint(1, 10**6))
        buckets.append(BucketRecord((k,), nbytes, rng.uniform(0, 1.5), 0.0, 0.0, 0.0, at if mode == "ddp" else -1, left))
    tail = [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in devices]
    b = Breakdown(0.0, stages, comm, comp, [0.0] * len(devices), [[1 / len(devices)] * len(devices)], mode, buckets,
                  0.0, tail if mode != "none" else [], half if mode == "duplex" else [], devices)
    return price(b)


@pytest.mark.parametrize("mode", ["none", "ddp", "duplex"])
def test_closed_forms_equal_the_simulated_makespan_on_random_stage_lists(mode):
    for case in range(300):
        b = random_breakdown(random.Random(f"{mode}/{case}"), mode)
        schedule = simulate(predicted_timeline(b))
        assert schedule.makespan_s == pytest.approx(b.total_s, rel=1e-9, abs=1e-12), f"case {case}"
        for k, x in enumerate(b.buckets):
            spans = [s for s in schedule.spans if s.task.info.get("bucket") == k]
            assert len(spans) == len(b.devices)
            assert all(s.start_s == pytest.approx(x.start_s, rel=1e-9, abs=1e-12) for s in spans), f"case {case}"
            assert all(s.end_s == pytest.approx(x.end_s, rel=1e-9, abs=1e-12) for s in spans), f"case {case}"


def test_ddp_closed_form_is_the_two_resource_makespan_by_hand():
    """W = 3 of backward compute; bucket 0 ready after 1 (2 long), bucket 1 ready at W (1 long)."""
    assert ddp_backward_time(3.0, [1.0, 3.0], [2.0, 1.0]) == 4.0
    assert ddp_backward_time(3.0, [1.0, 1.5], [0.5, 0.5]) == 3.0
    assert bucket_queue([0.0, 0.0, 5.0], [1.0, 1.0, 1.0]) == [(0.0, 1.0), (1.0, 2.0), (5.0, 6.0)]
    # HiDup's lockstep: (m0, c0, m1, c1) = (0, 2, 3, 1): 0 + 2 + 3 + 3 + 1
    assert duplex_chain_time([0.0, 2.0, 3.0, 1.0]) == 9.0


ZOO = {"mlp": dict(layers=2, in_features=128, hidden=512, classes=16, batch=256),
       "gpt": dict(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq_len=16, batch=8)}


@pytest.mark.parametrize("mode", ["none", "ddp", "duplex"])
@pytest.mark.parametrize("cluster_name", ["cpu_4_uneven", "hap_paper_testbed_machines", "a100_v100_mixed"])
@pytest.mark.parametrize("model", sorted(ZOO))
def test_the_predicted_timeline_of_a_priced_plan_has_its_predicted_makespan(load_sample, model, cluster_name, mode):
    graph = engine.load_model(f"zoo:{model}", **ZOO[model])
    cluster = load_sample(cluster_name)
    ratios = [f / sum(cluster.flops) for f in cluster.flops]
    for space in (None, data_parallel_space(graph)):
        program = synthesize(graph, CostModel(graph, cluster, ratios), space=space, beam_width=8).program
        b = evaluate(program, CostModel(graph, cluster, ratios, overlap=mode))
        tasks = predicted_timeline(b, graph)
        assert simulate(tasks).makespan_s == pytest.approx(b.total_s, rel=1e-9)
        lanes = {t.resource.split(":")[0] for t in tasks}
        assert lanes <= {"compute", "network", "buckets"} and "compute" in lanes
        assert {t.info["device"] for t in tasks} == {d.name for d in cluster.devices}


def test_duplex_run_problem_names_what_the_runner_cannot_split(tmp_path):
    """The planner skips duplex for every model `hap run` would refuse it for, with the reason."""
    from engine.spmd.overlap import duplex_run_problem

    gpt = engine.load_model("zoo:gpt", layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=4)
    assert duplex_run_problem(gpt) is None
    one = engine.load_model("zoo:gpt", layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=1)
    assert "fewer than two samples" in duplex_run_problem(one)
    fixed = engine.load_model("examples/llama_tiny.py")
    assert "not rebuilt at another batch size" in duplex_run_problem(fixed)
    p = engine.plan(fixed, "sample_clusters/cpu_2.json", time_budget_s=3)
    assert p.overlap != "duplex" and "not rebuilt" in p.search["overlap_skipped"]["duplex"]


def test_the_runner_refuses_duplex_with_hierarchical_collectives():
    import dataclasses

    from runner.duplex import check_duplex

    gpt = engine.load_model("zoo:gpt", layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=4)
    plan = engine.plan(gpt, "sample_clusters/cpu_2.json", time_budget_s=3, overlap="duplex")
    check_duplex(plan)  # runnable as planned
    from engine.spmd.program import COMM, Instruction
    from engine.theory.core import FULL, PARTIAL
    from runner.duplex import check_duplex

    loss = plan.graph.loss  # as if the loss's addends were summed hierarchically
    bad = dataclasses.replace(plan, program=plan.program + (Instruction(COMM, loss, "all_reduce.hier", ((loss, PARTIAL),), FULL),))
    with pytest.raises(PlanError, match="hierarchical collective 'all_reduce.hier'"):
        check_duplex(bad)
