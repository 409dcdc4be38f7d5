"""Pipeline plans carry activation recomputation through their stages' SPMD plans (issue 26, item 2):
every stage plan recomputes the layers `recompute` chooses, the pipeline plan's JSON round-trips, and
its summary names them per stage."""
from __future__ import annotations

from conftest import cluster_dict

import engine
from engine.cluster.spec import Cluster
from engine.spmd.recompute import layers


def test_stage_plans_recompute_every_layer_under_all_and_the_plan_round_trips():
    g = engine.load_model("zoo:gpt", layers=3, hidden=16, heads=2, ffn=32, vocab=32, seq_len=16, batch=32)
    c = Cluster.from_dict(cluster_dict([1e12, 1e12, 5e11, 5e11], 1000 * 2**20))
    p = engine.plan(g, c, parallelism="pipeline", recompute="all", optimizer="sgd", microbatches=2)
    planned = [s.plan for s in p.stages if s.plan is not None]
    assert planned and all(sp.recompute == layers(sp.graph) for sp in planned)
    assert "; recompute layers" in p.summary()
    assert engine.load_plan(p.to_json()).to_json() == p.to_json()
