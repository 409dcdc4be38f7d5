"""Predicted gain of hierarchical collectives (engine.cluster.hierarchy; Hetu v2 §4) on clusters of machines.

For each zoo model and cluster it prints the predicted iteration time of the best program the
search finds with every collective, and with the flat collectives only (no `.hier` key), both at
the same ratios: the flops-proportional ones (the first Q step of HAP §3.1) and the ratios of the
full planner's plan (`engine.plan`, which may pick hierarchical collectives). It also lists the
hierarchical collectives the plan uses. Figures are the cost model's predictions on the nominal
sample clusters, not measurements; a figure marked '*' comes from a search its budget stopped, so
it may be above the optimum (and a gain next to it is not a gain of the collectives alone).

Clusters: `sample_clusters/hap_paper_testbed.json` (8 machines of 8 GPUs) and
`sample_clusters/a100x2_p100x2.json` (2 machines of 2); `hap_paper_testbed_machines.json` (one
virtual device per machine) offers no hierarchical collective, so it is not listed.

Run from the repository root (a few minutes on a loaded CPU):

    PYTHONPATH=. python bench/hierarchical.py
    PYTHONPATH=. python bench/hierarchical.py --models mlp,gpt --budget 20

It reports; it never asserts.
"""
from __future__ import annotations

import argparse
import time

import engine
from engine.cluster.hierarchy import HIER_KEYS
from engine.options import DEFAULT_BEAM_WIDTH
from engine.spmd.baselines import proportional_ratios
from engine.spmd.cost import CostModel
from engine.spmd.synthesis import SearchSpace, synthesize

CLUSTERS = ("hap_paper_testbed", "a100x2_p100x2")
MODELS = {
    "mlp": {},
    "gpt": dict(layers=2),
    "bert": dict(layers=2),
    "vit": dict(layers=2),
}
"""Zoo models at their default widths (two layers for the transformers, to keep the search short)."""
FLAT_ONLY = SearchSpace(collectives=SearchSpace().collectives - set(HIER_KEYS))


def best_cost(graph, cluster, ratios, space: SearchSpace | None, budget: float) -> tuple[float, bool]:
    """(predicted seconds, proven optimal) of the best program the search finds at `ratios` in
    `space`, with the planner's beam width (a search stopped by the budget may miss the optimum)."""
    res = synthesize(graph, CostModel(graph, cluster, ratios), space=space, time_budget_s=budget,
                     beam_width=DEFAULT_BEAM_WIDTH)
    return res.cost, res.optimal


def row(model: str, cluster_name: str, budget: float) -> dict:
    graph = engine.load_model(f"zoo:{model}", **MODELS[model])
    cluster = engine.load_cluster(f"sample_clusters/{cluster_name}.json")
    prop = proportional_ratios(cluster)
    start = time.perf_counter()
    plan = engine.plan(graph, cluster, time_budget_s=budget)
    return {"model": model, "cluster": cluster_name,
            "q_hier": best_cost(graph, cluster, prop, None, budget),
            "q_flat": best_cost(graph, cluster, prop, FLAT_ONLY, budget),
            "plan": (plan.predicted_time_s, bool(plan.search.get("optimal", False))),
            "plan_flat": best_cost(graph, cluster, plan.ratio_rows, FLAT_ONLY, budget),
            "used": sorted({i.rule for i in plan.program if i.rule in HIER_KEYS}),
            "seconds": time.perf_counter() - start}


def _ms(figure: tuple[float, bool], width: int) -> str:
    """Milliseconds, with '*' when the search was stopped by its budget before proving optimality."""
    seconds, optimal = figure
    return f"{seconds * 1e3:{width}.3f}{' ' if optimal else '*'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo models (default: all)")
    ap.add_argument("--budget", type=float, default=10.0, help="search seconds per plan and per search (default 10)")
    args = ap.parse_args()
    print(f"{'model':6} {'cluster':18} {'Q flat ms':>11} {'Q hier ms':>11} {'gain':>6}   "
          f"{'plan flat ms':>13} {'plan ms':>11} {'gain':>6}   hierarchical collectives in the plan")
    for cluster_name in CLUSTERS:
        for model in args.models.split(","):
            r = row(model, cluster_name, args.budget)
            print(f"{r['model']:6} {r['cluster']:18} {_ms(r['q_flat'], 10)} {_ms(r['q_hier'], 10)} "
                  f"{r['q_flat'][0] / r['q_hier'][0]:5.2f}x   {_ms(r['plan_flat'], 12)} {_ms(r['plan'], 10)} "
                  f"{r['plan_flat'][0] / r['plan'][0]:5.2f}x   {', '.join(r['used']) or '-'}", flush=True)
    print("* the search was stopped by its budget before proving optimality: that figure may be above the optimum")


if __name__ == "__main__":
    main()
