"""HiDup Table 4's shape under our cost model: how much communication overlap hides as links slow down.

For BERT-MoE (`zoo:bert_moe`, 6 layers: 3 MoE layers of 8 experts, batch 256) and ViT-MoE
(`bench/models/vit_moe.py`, 6 blocks, the same experts) on the paper's testbed as 8
machines (`sample_clusters/hap_paper_testbed_machines.json`) with the inter-machine bandwidth set
to 100, 30 and 10 Gbps (`engine.compare.scale_link`), it plans

- `hap duplex`: `engine.plan(..., overlap="duplex")` (HiDup's two half-batches),
- `hap ddp`:    `engine.plan(..., overlap="ddp")` (the same search without duplex),
- `ddp`:        `engine.evaluate(..., "ddp")` (PyTorch DDP: even shares, buckets overlapped with backward),

and prints, from each plan's predicted timeline (`engine.compare.predicted_schedule`), the
iteration time (wall), the busiest device's computation and communication (busy time of its
compute and network lanes), their sum without overlap (total), the share of communication hidden
behind computation, and HiDup's overlapping ratio (overlapped time / the smaller of computation
and communication, Table 4). These are predictions of one cost model, not measurements.

    PYTHONPATH=. python bench/overlap.py                 # both models, about 7 minutes on 2 cores
    PYTHONPATH=. python bench/overlap.py --quick         # BERT-MoE only

A search that runs out of budget before its first Q<->B iteration ends keeps the data-parallel
seed: on a loaded machine give it more (`--budget`).

Writes the figures to `bench/results/overlap.json`. It never asserts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.compare import lane_figures, predicted_schedule, scale_link, schedule_spans  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CLUSTER = ROOT / "sample_clusters" / "hap_paper_testbed_machines.json"
MODELS = {"BERT-MoE": ("zoo:bert_moe", {"layers": 6}), "ViT-MoE": (str(ROOT / "bench" / "models" / "vit_moe.py"), {})}
"""Name -> (model, knobs)."""
GBPS = (100, 30, 10)
LINK = "inter_machine"


def at_gbps(cluster: engine.Cluster, gbps: float) -> engine.Cluster:
    """The cluster with its inter-machine links at `gbps` gigabits per second."""
    return scale_link(cluster, LINK, gbps * 1e9 / 8 / cluster.network.bandwidth_Bps[LINK])


def strategies(graph: engine.Graph, cluster: engine.Cluster, budget_s: float) -> dict[str, engine.Plan | str]:
    """The three plans of a row group; a plan that cannot be made is its one-line reason."""
    out: dict[str, engine.Plan | str] = {}
    for name, make in (("hap duplex", lambda: engine.plan(graph, cluster, time_budget_s=budget_s, overlap="duplex")),
                       ("hap ddp", lambda: engine.plan(graph, cluster, time_budget_s=budget_s, overlap="ddp")),
                       ("ddp", lambda: engine.evaluate(graph, cluster, "ddp"))):
        try:
            out[name] = make()
        except engine.HapError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def figures(plan: engine.Plan, cluster: engine.Cluster) -> dict[str, float]:
    """Table 4's rows for one plan, from the busiest device's lanes of its predicted timeline."""
    lanes = lane_figures(schedule_spans(predicted_schedule(plan, cluster)))
    busiest = max(lanes, key=lambda f: f.compute_s + f.network_s)
    return {"wall_s": plan.predicted_time_s, "total_s": busiest.compute_s + busiest.network_s,
            "computation_s": busiest.compute_s, "communication_s": busiest.network_s,
            "hidden_share": busiest.hidden_share, "overlap_ratio": busiest.overlap_ratio, "device": busiest.device}


def table(results: list[dict]) -> str:
    """The figures as a text table, one row per (model, bandwidth, strategy)."""
    head = ["model", "Gbps", "strategy", "wall ms", "total ms", "compute ms", "comm ms", "hidden", "overlap ratio",
            "vs ddp"]
    rows = [head]
    for r in results:
        if "error" in r:
            rows.append([r["model"], str(r["gbps"]), r["strategy"], r["error"], "", "", "", "", "", ""])
            continue
        rows.append([r["model"], str(r["gbps"]), r["strategy"], f"{r['wall_s'] * 1e3:.1f}", f"{r['total_s'] * 1e3:.1f}",
                     f"{r['computation_s'] * 1e3:.1f}", f"{r['communication_s'] * 1e3:.1f}",
                     f"{r['hidden_share'] * 100:.1f}%", f"{r['overlap_ratio'] * 100:.1f}%",
                     "" if r.get("speedup") is None else f"{r['speedup']:.2f}x"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def run(models: dict[str, tuple[str, dict]], budget_s: float) -> list[dict]:
    base = engine.load_cluster(CLUSTER)
    results = []
    for model, (source, knobs) in models.items():
        graph = engine.load_model(source, **knobs)
        for gbps in GBPS:
            cluster = at_gbps(base, gbps)
            start = time.perf_counter()
            plans = strategies(graph, cluster, budget_s)
            ddp = plans["ddp"]
            for name, p in plans.items():
                row = {"model": model, "gbps": gbps, "strategy": name}
                if isinstance(p, str):
                    row["error"] = p
                else:
                    row.update(figures(p, cluster))
                    row["speedup"] = None if isinstance(ddp, str) else ddp.predicted_time_s / p.predicted_time_s
                results.append(row)
            print(f"  {model} at {gbps} Gbps planned in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="BERT-MoE only")
    parser.add_argument("--budget", type=float, default=30.0, metavar="S", help="time budget of each search (default 30 s)")
    args = parser.parse_args()
    models = {"BERT-MoE": MODELS["BERT-MoE"]} if args.quick else MODELS
    budget = args.budget
    results = run(models, budget)
    print(table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "overlap.json").write_text(json.dumps({"cluster": CLUSTER.name, "link": LINK, "budget_s": budget,
                                                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                      "rows": results}, indent=1))
    print(f"\nwritten to {RESULTS / 'overlap.json'}")


if __name__ == "__main__":
    main()
