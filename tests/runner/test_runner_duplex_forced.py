"""`--overlap duplex` is a constraint, not a gamble (issue 28, item 6): forced, the planner searches
only the programs the runner's two half-batch streams can run (engine/spmd/duplex_space.py), so it
plans every zoo model at tiny sizes on every CPU sample cluster, and on the GPU ones, or is refused
in one line saying why no program exists.

Every plan here is checked with the runner's own checks (`check_duplex`, and the halves built from
the model captured at each half's batch); `hap run --verify` runs for a representative one only, the
issue's GPT on cpu_4_uneven (test_runner_overlap.py), next to that file's duplex runs of three models on
2, 3 and 4 ranks: the suite's time is tight. bench/duplex_forced.py plans every zoo model on every
sample cluster at the default options.
"""
from __future__ import annotations

import glob
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import ROOT, sample_path
from runner_plans import MODELS, graph

import engine
from engine.errors import PlanError
from engine.model.graph import Graph
from engine.spmd.halves import batch_of, capture_at, half_plan
from engine.spmd.plan import Plan
from runner.duplex import check_duplex

TINY = {**MODELS, "vgg19": dict(batch=4, image_size=32, width=0.0625, hidden=16, classes=3),
        "vit": dict(batch=6, image_size=16, patch=4, hidden=24, layers=2, heads=4, mlp=48, classes=5)}
"""Every zoo model at tiny sizes (the runner tests' configs, and the vision models')."""
CPU_CLUSTERS = sorted(Path(p).stem for p in glob.glob(str(ROOT / "sample_clusters" / "cpu_*.json")))
GPU_CLUSTERS = sorted(Path(p).stem for p in glob.glob(str(ROOT / "sample_clusters" / "*.json"))
                      if not Path(p).stem.startswith("cpu_"))
QUICK = dict(overlap="duplex", max_iterations=1, time_budget_s=0.3)
"""One Q<->B iteration under a small budget: what is checked is that the program found is duplex's."""


@lru_cache(maxsize=None)
def tiny(model: str) -> Graph:
    """The model at tiny sizes; the runner tests' own graphs where they have one (captured once a session)."""
    return graph(model) if model in MODELS else engine.load_model(f"zoo:{model}", **TINY[model])


def check_runs_in_halves(plan: Plan) -> None:
    """What the runner checks before its ranks start, and the two halves it builds."""
    assert plan.overlap == "duplex"
    check_duplex(plan)
    total = batch_of(plan.graph)
    for b in (total // 2, total - total // 2):
        half_plan(plan, capture_at(plan.graph, b))


def test_cluster_lists_hold_every_sample_cluster():
    assert len(CPU_CLUSTERS) >= 4 and len(GPU_CLUSTERS) >= 6


@pytest.mark.parametrize("model", TINY)
def test_forced_duplex_plans_a_zoo_model_on_every_cpu_cluster(model):
    for cluster in CPU_CLUSTERS:
        check_runs_in_halves(engine.plan(tiny(model), sample_path(cluster), **QUICK))


@pytest.mark.parametrize("cluster", GPU_CLUSTERS)
def test_forced_duplex_plans_on_a_gpu_cluster(cluster):
    """Planning only: the GPT and the MLP on every GPU sample cluster (several machines, where the
    hierarchical collectives duplex cannot run are left out of the search)."""
    for model in ("gpt", "mlp"):
        plan = engine.plan(tiny(model), sample_path(cluster), **QUICK)
        check_runs_in_halves(plan)
        assert not any(ins.rule.endswith(".hier") for ins in plan.program)


def test_forced_duplex_is_refused_in_one_line_where_no_program_exists():
    """A training-mode batch norm computes other statistics on half batches, whatever the program."""
    vgg = engine.load_model("zoo:vgg19", **{**TINY["vgg19"], "batch_norm": True})
    for cluster in ("cpu_2", "a100x2_p100x2"):
        with pytest.raises(PlanError, match="batch norm") as e:
            engine.plan(vgg, sample_path(cluster), **QUICK)
        assert "\n" not in str(e.value)

