"""Activation recomputation per layer (issue 26, item 2): the choice, its cost and memory terms, the plan field.

A 3-layer GPT on two devices of 0.6 MiB: without recomputation nothing fits; `auto` recomputes the
fewest layers that make it fit (one layer fewer does not fit the same program at any ratios); `none`
refuses with the out-of-memory message of before; `all` recomputes every layer. The cost model adds a
recomputed layer's forward work and collectives to backward and keeps only its outputs.
"""
from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

import pytest
from conftest import cluster_dict

import engine
from engine import InfeasibleError, PlanError
from engine.cli import recompute_lines
from engine.cluster.spec import Cluster
from engine.spmd.cost import CostModel, evaluate, replay
from engine.spmd.iteration import _program_fits, plan_of
from engine.spmd.recompute import describe, layer_outputs, layers, ranked_layers
from engine.spmd.synthesis import SearchSpace, synthesize

MIB = 2**20
OPTS = dict(optimizer="sgd", overlap="none", beam_width=4)
TIGHT = 0.6
"""MiB per device: the model needs about 0.7 MiB on the faster device without recomputation."""


@lru_cache(maxsize=None)
def gpt() -> engine.Graph:
    return engine.load_model("zoo:gpt", layers=3, hidden=16, heads=2, ffn=32, vocab=32, seq_len=16, batch=32)


def small(memory_mib: float) -> Cluster:
    return Cluster.from_dict(cluster_dict([1e12, 5e11], int(memory_mib * MIB)))


@lru_cache(maxsize=None)
def auto_plan():
    return engine.plan(gpt(), small(TIGHT), recompute="auto", **OPTS)


def test_auto_recomputes_the_fewest_layers_that_make_a_model_fit():
    p = auto_plan()
    assert 0 < len(p.recompute) < len(layers(gpt())), p.recompute
    assert all(m <= TIGHT * MIB for m in p.memory_bytes)
    fewer = ranked_layers(CostModel(gpt(), small(TIGHT), [0.5, 0.5], p.options, recompute=frozenset(layers(gpt()))))
    assert sorted(fewer[:len(p.recompute)]) == p.recompute, "the best-ranked layers are the ones chosen"
    one_less = frozenset(fewer[:len(p.recompute) - 1])
    assert not _program_fits(p, small(TIGHT), p.options, one_less), "one layer fewer would not fit the plan's program"
    assert f"recompute: {describe(p.graph, p.recompute)}" in p.summary()
    assert p.search["recompute_auto"]["tried"][:2] == [[], layers(gpt())], "without, then every layer, then the fewest"
    assert recompute_lines(p)[1].startswith(f"recompute: {describe(p.graph, p.recompute)}; auto planned")
    assert describe(gpt(), [1, 2]) == "layers 1-2 (2 of 3): blocks.1 .. blocks.2"
    assert describe(gpt(), [0, 2]) == "layers 0, 2 (2 of 3): blocks.0 .. blocks.2"


def test_none_refuses_with_the_out_of_memory_message_of_before():
    with pytest.raises(InfeasibleError, match=r"^out of memory: device 'dev-\d' needs .* even data-parallel"):
        engine.plan(gpt(), small(TIGHT), recompute="none", **OPTS)
    with pytest.raises(InfeasibleError, match=r"or recompute='auto' and shard_states='auto' \(recompute activations"):
        engine.plan(gpt(), small(TIGHT), recompute="none", shard_states=0, **OPTS)


def test_all_recomputes_every_layer_and_auto_leaves_a_plan_that_fits_unchanged():
    big = small(1000)
    every = engine.plan(gpt(), big, recompute="all", **OPTS)
    assert every.recompute == layers(gpt()) == [0, 1, 2]
    plain, auto = (engine.plan(gpt(), big, recompute=m, **OPTS) for m in ("none", "auto"))
    assert auto.recompute == [] and "recompute" not in auto.to_dict()
    assert auto.program == plain.program and auto.ratios == plain.ratios and auto.memory_bytes == plain.memory_bytes
    assert every.predicted_time_s > plain.predicted_time_s and max(every.memory_bytes) < max(plain.memory_bytes)


def test_recomputation_adds_forward_work_to_backward_and_keeps_only_layer_outputs():
    g, c = gpt(), small(1000)
    plain = CostModel(g, c, [0.6, 0.4], engine.PlanOptions(optimizer="sgd"))
    some = CostModel(g, c, [0.6, 0.4], engine.PlanOptions(optimizer="sgd"), recompute=frozenset({1, 2}))
    inside = [n.id for n in g.nodes if not n.is_leaf and n.segment in (1, 2)]
    for i in inside:
        assert some.bwd_flops[i] == pytest.approx(plain.bwd_flops[i] + plain.fwd_flops[i])
    program = synthesize(g, plain, space=SearchSpace(), beam_width=4).program
    a, b = evaluate(program, plain), evaluate(program, some)
    backward = lambda br: sum(max(t) for s, t in zip(br.stages, br.stage_comp_s) if s.direction == "backward")
    forward = lambda br: sum(max(t) for s, t in zip(br.stages, br.stage_comp_s) if s.direction == "forward")
    assert forward(b) == pytest.approx(forward(a))
    assert backward(b) > backward(a) and b.total_s > a.total_s
    # memory: the layers' activations go, their outputs stay, and the larger layer's come back at the peak
    outputs = layer_outputs(g)
    forms = {ins.node: (tuple(f for _, f in ins.pre), ins.post) for ins in program if ins.kind == "compute"}
    dropped = sum(sum(plain.activation_memory(i, *forms[i])) - sum(some.checkpoint_memory(i, forms[i][1]))
                  for i in inside if i in forms)
    largest = max(sum(some.full_activation[i] for i in inside if not outputs[i] and g[i].segment == k) for k in (1, 2))
    mem_a, mem_b = replay(program, plain)[1][0], replay(program, some)[1][0]
    assert sum(mem_a[2:]) - sum(mem_b[2:]) == pytest.approx(dropped)
    on_both = (mem_a[2] - mem_b[2]) + 2 * (mem_a[3] - mem_b[3])  # over both devices: a shard once, a replica twice
    assert sum(a.memory_bytes) - sum(b.memory_bytes) == pytest.approx(on_both - largest, rel=1e-9)


def test_a_recomputed_layers_collectives_run_again_in_backward():
    g, c = gpt(), small(1000)
    opts = engine.PlanOptions(optimizer="sgd")
    weight = next(n.id for n in g.parameters if n.rank == 2 and n.segment == 1)
    space = SearchSpace(collectives=frozenset({"all_gather.padded", "slice"}),
                        param_forms=lambda n, f: n != weight or f != -1)
    program = synthesize(g, CostModel(g, c, [0.6, 0.4], opts), space=space, beam_width=4).program
    layer_of = {ins.node: g[ins.node].segment for ins in program}
    comms = [ins for ins in program if ins.kind == "comm" and ins.rule != "slice"]
    assert comms
    plain = evaluate(program, CostModel(g, c, [0.6, 0.4], opts))
    again = evaluate(program, CostModel(g, c, [0.6, 0.4], opts, recompute=frozenset(layers(g))))
    keys = lambda br: sorted(s.comm for s in br.stages if s.direction == "backward" and s.comm)
    assert len(keys(again)) == len(keys(plain)) + len(comms), (keys(plain), keys(again), layer_of)
    assert all(ins.rule in keys(again) for ins in comms)
    # the search prices the same program as the replay does
    res = synthesize(g, CostModel(g, c, [0.6, 0.4], opts, recompute=frozenset(layers(g))), space=space,
                     incumbent=program,
                     beam_width=4)
    assert res.cost <= again.total_s * (1 + 1e-9)


def test_the_plan_json_round_trips_with_the_field_and_old_plans_load_without_it():
    p = auto_plan()
    d = json.loads(p.to_json())
    assert d["recompute"] == p.recompute
    back = engine.load_plan(p.to_json())
    assert back.recompute == p.recompute and back.to_json() == p.to_json()
    old = {k: v for k, v in d.items() if k != "recompute"}
    assert engine.load_plan(old).recompute == []
    for bad, match in (([9], r"recompute\[0\]: layer 9 is not a layer of the graph"), (["x"], r"recompute\[0\]"),
                       ([1, 1], "listed twice")):
        with pytest.raises(PlanError, match=match):
            engine.load_plan({**d, "recompute": bad})


def test_plan_of_and_the_validator_price_a_recomputing_plan_as_made():
    g, c = gpt(), small(1000)
    program = auto_plan().program
    p = plan_of(program, g, c, [0.6, 0.4], options=engine.PlanOptions(optimizer="sgd"), recompute=frozenset(layers(g)))
    assert p.recompute == [0, 1, 2]
    assert engine.validate_plan(p, c) == []
    assert engine.validate_plan(dataclasses.replace(p, recompute=[]), c), "priced without recomputation it differs"
