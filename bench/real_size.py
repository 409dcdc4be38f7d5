"""Real-size plans (issue 26, item 6): a Llama-7B-shaped and a Mixtral-8x7B-shaped model, planned
the way people train them, on the HAPT cluster and the HAP paper testbed.

For each model and cluster it plans one case per training mode: fp32 with recomputation and state
sharding forced off (what every plan was before issue 26), the defaults (fp32, `recompute=auto`,
`shard_states=auto`), mixed precision (bf16 where every device rates it, else fp16) without and
with recomputation, and with each ZeRO stage. Each case runs in a fresh Python process (its
capture, its planning time and its peak RSS are its own) under `--timeout` seconds.

Columns: the case, layers planned, whether it fits and the peak GiB per GPU of each GPU type (or
why not), the predicted iteration time, the compute bound and MFU (`plan.compute_bound_s`,
`plan.mfu`), what recomputes and which ZeRO stages the plan chose, and the planning time (capture
excluded). A model whose every layer does not plan within the timeout is planned with fewer
layers (`--layers` lists the depths tried, deepest first), and the table says how many.

    PYTHONPATH=. python bench/real_size.py                 # every case (tens of minutes on 2 cores)
    PYTHONPATH=. python bench/real_size.py --quick         # Llama on the HAPT cluster only
    PYTHONPATH=. python bench/real_size.py --models llama --clusters hapt --modes default,bf16

It writes `bench/results/real_size.json` (`--out`) and prints the table. It never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from synthesis import run_worker  # noqa: E402  (bench/ is the script's folder)

MODELS = {
    "llama": ("hf:LlamaForCausalLM", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                           intermediate_size=11008, vocab_size=32000, batch=16, seq_len=2048)),
    "mixtral": ("hf:MixtralForCausalLM", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                               intermediate_size=14336, vocab_size=32000, num_local_experts=8,
                                               num_experts_per_tok=2, experts_implementation="batched_mm",
                                               batch=16, seq_len=2048)),
}
"""Llama-2-7B's and Mixtral-8x7B's published shapes (their config.json) at batch 16 x 2048 tokens.
Mixtral's experts run as batched matmuls, the implementation whose shapes do not depend on the
routing (engine/model/zoo/ecosystem.py), which is how the zoo's entry captures it."""
LAYER_KEY = "num_hidden_layers"
CLUSTERS = {"hapt": "sample_clusters/a100x8_v100x8_5gbps.json",
            "paper": "sample_clusters/hap_paper_testbed_machines.json",
            "paper64": "sample_clusters/hap_paper_testbed.json"}
"""HAPT's 16 GPUs; HAP's testbed as 8 machines (each 8 GPUs in data parallel, states sharded across
machines only) and as its 64 GPUs (states sharded across all of them)."""
MODES = {
    "fp32 plain": dict(precision="fp32", recompute="none", shard_states=0),
    "default": dict(precision="fp32", recompute="auto", shard_states="auto"),
    "mixed": dict(precision="MIXED", recompute="none", shard_states=0),
    "mixed+recompute": dict(precision="MIXED", recompute="all", shard_states=0),
    "mixed+zero1": dict(precision="MIXED", recompute="auto", shard_states=1),
    "mixed+zero2": dict(precision="MIXED", recompute="auto", shard_states=2),
    "mixed+zero3": dict(precision="MIXED", recompute="auto", shard_states=3),
    "mixed+auto": dict(precision="MIXED", recompute="auto", shard_states="auto"),
}
"""Training modes. MIXED is bf16 where every device of the cluster rates bf16, else fp16 (V100 and
P100 have no bf16)."""
QUICK_MODES = ("fp32 plain", "default", "mixed", "mixed+auto")


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def mixed_precision(cluster) -> str:
    """bf16 when every device rates it, else fp16."""
    return "bf16" if all(d.flops_per_gpu_in("bf16") for d in cluster.devices) else "fp16"


def measure(case: dict) -> dict:
    """Capture and plan one case in this process; every figure of the table."""
    import engine
    from engine.options import PlanOptions

    cls, knobs = MODELS[case["model"]]
    cluster = engine.load_cluster(ROOT / CLUSTERS[case["cluster"]])
    mode = dict(MODES[case["mode"]])
    if mode["precision"] == "MIXED":
        mode["precision"] = mixed_precision(cluster)
    graph = engine.load_model(cls, **{**knobs, LAYER_KEY: case["layers"]})
    params = sum(n.numel for n in graph.nodes if n.op == "parameter")
    start = time.perf_counter()
    try:
        plan = engine.plan(graph, cluster, options=PlanOptions(**mode, time_budget_s=case.get("budget")))
    except engine.HapError as e:
        return {**case, **mode, "params": params, "refused": str(e).splitlines()[0],
                "planning_time_s": time.perf_counter() - start}
    elapsed = time.perf_counter() - start
    peak: dict[str, float] = {}
    for d, b in zip(cluster.devices, plan.to_dict().get("memory_bytes", [])):
        peak[d.gpu_model] = max(peak.get(d.gpu_model, 0.0), b / 2**30)
    return {**case, **mode, "params": params, "planning_time_s": elapsed, "predicted_time_s": plan.predicted_time_s,
            "compute_bound_s": getattr(plan, "compute_bound_s", None), "mfu": getattr(plan, "mfu", None),
            "peak_gib": peak, "capacity_gib": {d.gpu_model: d.memory_bytes_per_gpu / 2**30 for d in cluster.devices},
            "chosen": _chosen(plan), "rss_gib": _rss_gib()}


def _chosen(plan) -> str:
    """What the plan recomputes and how it shards states, from its summary lines."""
    lines = [ln.strip() for ln in plan.summary().splitlines() if ln.strip().startswith(("recompute", "states"))]
    return "; ".join(lines) or "-"


def run_case(case: dict, timeout_s: float) -> dict:
    """`measure(case)` in a fresh interpreter (`synthesis.run_worker`)."""
    return run_worker(Path(__file__), case, timeout_s)


def deepest(model: str, cluster: str, mode: str, depths: list[int], timeout_s: float) -> dict:
    """The case at the deepest of `depths` that plans (or is refused) within the timeout."""
    result: dict = {}
    for layers in depths:
        result = run_case({"model": model, "cluster": cluster, "mode": mode, "layers": layers}, timeout_s)
        if "error" not in result:
            return result
        print(f"  {model} {layers} layers on {cluster} ({mode}): {result['error']}; trying fewer", file=sys.stderr)
    return result


HEADER = ["model", "cluster", "mode", "layers", "params", "fits: peak GiB per GPU (capacity)", "predicted",
          "compute bound", "MFU", "chosen", "planning"]


def row(r: dict) -> list[str]:
    head = [r["model"], r["cluster"], f"{r['mode']} ({r.get('precision', '?')})", str(r["layers"]),
            f"{r['params'] / 1e9:.2f}B" if "params" in r else ""]
    if "error" in r:
        return head + [r["error"]] + [""] * 5
    if "refused" in r:
        return head + [f"no: {r['refused'][:110]}", "", "", "", "", f"{r['planning_time_s']:.0f} s"]
    fits = ", ".join(f"{k} {v:.1f} ({r['capacity_gib'][k]:.0f})" for k, v in r["peak_gib"].items())
    bound, mfu = r.get("compute_bound_s"), r.get("mfu")
    return head + [f"yes: {fits}", f"{r['predicted_time_s']:.2f} s", "n/a" if bound is None else f"{bound:.2f} s",
                   "n/a" if mfu is None else f"{mfu * 100:.1f}%", r["chosen"][:90], f"{r['planning_time_s']:.0f} s"]


def markdown(results: list[dict]) -> str:
    rows = [HEADER, ["---"] * len(HEADER)] + [row(r) for r in results]
    return "\n".join("| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="llama,mixtral")
    ap.add_argument("--clusters", default="hapt,paper,paper64")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {'; '.join(MODES)}")
    ap.add_argument("--layers", default="32,16,8", help="depths tried, deepest first (default 32,16,8)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per case before fewer layers are tried")
    ap.add_argument("--quick", action="store_true", help="Llama on the HAPT cluster, four modes")
    ap.add_argument("--out", default=str(RESULTS / "real_size.json"), help="where the figures go (JSON)")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    models, clusters = args.models.split(","), args.clusters.split(",")
    modes = [m.strip() for m in args.modes.split(",")]
    if args.quick:
        models, clusters, modes = ["llama"], ["hapt"], list(QUICK_MODES)
    depths = [int(x) for x in args.layers.split(",")]
    results = []
    for model in models:
        for cluster in clusters:
            for mode in modes:
                r = deepest(model, cluster, mode, depths, args.timeout)
                results.append(r)
                print("  " + " | ".join(row(r)), file=sys.stderr, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                                        "results": results}, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
