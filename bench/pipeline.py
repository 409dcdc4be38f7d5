"""Pipelines (HAPT) beside SPMD HAP on clusters joined by slow links.

For `zoo:gpt` (hidden 768, seq_len 128, batch 64) at 12, 24 and 48 layers on
`sample_clusters/a100x8_v100x8_5gbps.json` and `sample_clusters/hap_paper_testbed.json` it prints
the SPMD HAP prediction (`engine.plan` with a small time budget), the best pipeline
(`engine.plan(..., parallelism="pipeline")`: HAPT's DP, repartitioned with stages priced by their
layers' HAP plans, then HAP's plan inside every stage) with each stage's program, under each
schedule (GPipe, 1F1B, Eager-1F1B, H-1F1B: simulated iteration time, the fullest GPU's peak memory,
and whether it fits), and both planning times. With `--epsilon` the pipeline is HAPT's DP with that
epsilon (`best_pipeline`) and HAP inside its stages (`with_hap_stages`), without the repartitioning. Then the shape of HAPT Fig. 10: the pipeline
chosen for the deepest model at 5 Gbps, its cross-machine link scaled from 10 to 3 Gbps, under
each schedule (H-1F1B stays flat until a transfer exceeds t_max).

Run from the repository root (captures take a while; the 64-GPU SPMD plans dominate):

    PYTHONPATH=. python bench/pipeline.py                   # 12, 24, 48 layers, both clusters
    PYTHONPATH=. python bench/pipeline.py --layers 12 --budget 5
    PYTHONPATH=. python bench/pipeline.py --layers 24 --clusters a100x8_v100x8_5gbps --epsilon 0.05

With `--run`, instead: a 2-stage pipeline plan of a small GPT (4 layers, hidden 256, batch 16; 2 ranks per stage running their HAP
stage plans) is planned for this machine's 4 CPU ranks as `hap profile --nproc 4 --model zoo:gpt
--set ...` measures them (the same model's operators; `--no-profile` plans on
`sample_clusters/cpu_4_uneven.json`'s datasheet-like figures instead), with each stage's two ranks
declared one machine and the link between them slowed to `--link-gbps` so transfers matter, and run by `hap run --emulate-links` on 4
local CPU ranks; the measured iteration time (median of the steps after the first) is printed
beside the predicted one.

    PYTHONPATH=. python bench/pipeline.py --run --link-gbps 0.1

It reports; it never asserts. Stage times are per microbatch; "sync" is a stage's gradient
all-reduce in its group plus its optimizer step, after the pipeline drains.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import engine
from engine.options import PlanOptions
from engine.pipeline.partition import best_pipeline, schedule_input
from engine.pipeline.plan import PipelinePlan
from engine.pipeline.schedule import SCHEDULES, run_schedule
from engine.pipeline.stage_cost import transfer_s
from engine.pipeline.stage_plan import with_hap_stages
from engine.spmd.utilisation import percent

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ("a100x8_v100x8_5gbps", "hap_paper_testbed")
GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of SPMD HAP search per case")
    ap.add_argument("--epsilon", type=float, default=0.0,
                    help="HAPT Eq. 2: a transfer under epsilon x t_max adds one warm-up forward, not two")
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=CLUSTERS)
    ap.add_argument("--run", action="store_true", help="run a 2-stage plan on 4 CPU ranks: measured vs predicted")
    ap.add_argument("--link-gbps", type=float, default=0.1, help="--run: the emulated link between stages, Gbit/s")
    ap.add_argument("--no-profile", action="store_true", help="--run: plan on cpu_4_uneven.json, not a profile of this box")
    args = ap.parse_args()
    if args.run:
        _measured_vs_predicted(args.link_gbps, profile=not args.no_profile)
        return
    graphs = {n: _capture(n) for n in args.layers}
    deepest = None
    for name in args.clusters:
        cluster = engine.load_cluster(ROOT / "sample_clusters" / f"{name}.json")
        print(f"\n== {name}: {cluster.num_devices} GPUs")
        for n, graph in graphs.items():
            pipe = _case(graph, cluster, n, args.budget, args.epsilon)
            if name == CLUSTERS[0]:
                deepest = (n, pipe, cluster)
    if deepest is not None:
        _fig10(*deepest)


def _capture(layers: int):
    start = time.perf_counter()
    graph = engine.load_model("zoo:gpt", layers=layers)
    print(f"captured gpt-{layers} in {time.perf_counter() - start:.1f} s")
    return graph


def _case(graph, cluster, layers: int, budget: float, epsilon: float) -> PipelinePlan:
    start = time.perf_counter()
    spmd = engine.plan(graph, cluster, time_budget_s=budget)
    spmd_s = time.perf_counter() - start
    start = time.perf_counter()
    if epsilon:
        pipe = with_hap_stages(best_pipeline(graph, cluster, epsilon=epsilon), cluster, PlanOptions(time_budget_s=budget))
    else:
        pipe = engine.plan(graph, cluster, time_budget_s=budget, parallelism="pipeline")
    pipe_s = time.perf_counter() - start
    print(f"gpt-{layers}: SPMD HAP {spmd.predicted_time_s * 1e3:9.1f} ms, MFU {percent(spmd.mfu)} (planned in "
          f"{spmd_s:.1f} s); pipeline of {len(pipe.stages)} stages, B = {pipe.microbatches}, "
          f"{pipe.predicted_s * 1e3:.1f} ms, MFU {percent(pipe.mfu)} (planned in {pipe_s:.1f} s)")
    if "hap_stages_skipped" in pipe.search:
        print(f"    stages data-parallel: {pipe.search['hap_stages_skipped']}")
    for s in pipe.stages:
        print(f"    layers {s.layers[0]:>2}-{s.layers[1] - 1:<2} on {len(s.devices):>2} x {s.sub_cluster:<16} "
              f"f {s.forward_s * 1e3:7.3f} b {s.backward_s * 1e3:7.3f} sync {s.sync_s * 1e3:7.2f} ms, N = {s.warmup}, "
              f"{s.program_summary()}")
    for b in pipe.boundaries:
        print(f"    cut {b.cut}: {b.forward_bytes / 2**20:.1f} MiB per iteration over {b.link}, "
              f"{b.transfer_s * 1e3:.3f} ms per microbatch each way")
    for name in SCHEDULES:
        r = pipe.schedules[name]
        print(f"    {name:<11} {r.iteration_s * 1e3:9.1f} ms  MFU {percent(pipe.utilisation.mfu_at(r.iteration_s)):>6}"
              f"  peak {max(r.peak_memory_bytes) / GIB:6.2f} GiB"
              f"{'' if r.fits else '  (does not fit)'}  warm-up {r.warmup}")
    closed = "n/a (a transfer exceeds t_max)" if pipe.closed_form_s is None else f"{pipe.closed_form_s * 1e3:.1f} ms"
    print(f"    HAPT Eq. 13 (syncs excluded): {closed}; t_max {pipe.t_max_s * 1e3:.3f} ms")
    return pipe


def _fig10(layers: int, pipe: PipelinePlan, cluster) -> None:
    print(f"\n== HAPT Fig. 10 shape: gpt-{layers} on {cluster.name}, the chosen partition, inter_machine link scaled")
    print("   Gbps " + "".join(f"{s:>12}" for s in SCHEDULES) + "   c/t_max")
    for gbps in (10, 9, 8, 7, 6, 5, 4, 3):
        c = tuple(transfer_s(cluster, b.link, max(b.forward_bytes, b.backward_bytes) / pipe.microbatches)
                  if b.link != "inter_machine" else
                  cluster.network.latency_s + max(b.forward_bytes, b.backward_bytes) / pipe.microbatches / (gbps * 1.25e8)
                  for b in pipe.boundaries)
        p = schedule_input(pipe, c)
        times = [run_schedule(p, s).iteration_s for s in SCHEDULES]
        ratio = max(c, default=0.0) / p.t_max
        print(f"   {gbps:>4} " + "".join(f"{t * 1e3:9.1f} ms" for t in times) + f"   {ratio:6.2f}")


RUN_GPT = dict(layers=4, hidden=256, heads=4, ffn=1024, vocab=512, seq_len=64, batch=16)
"""The model `--run` plans, profiles and runs."""


def _measured_vs_predicted(link_gbps: float, profile: bool = True, steps: int = 6) -> None:
    """Run a 2 x 2 pipeline plan through `hap run --emulate-links`; print measured and predicted step times."""
    import json
    import os
    import re
    import statistics
    import subprocess
    import sys
    import tempfile

    from engine.cluster.spec import Cluster
    from engine.pipeline.partition import fixed_pipeline
    from engine.pipeline.stages import StageGraph

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        spec = ROOT / "sample_clusters" / "cpu_4_uneven.json"
        if profile:
            spec = Path(tmp) / "cluster.json"
            knobs = [a for k, v in RUN_GPT.items() for a in ("--set", f"{k}={v}")]
            r = subprocess.run([sys.executable, "-m", "runner.hap", "profile", "--out", str(spec), "--nproc", "4",
                                "--model", "zoo:gpt", *knobs], env=env, cwd=ROOT, capture_output=True, text=True,
                               timeout=600)
            if r.returncode != 0:
                print(r.stdout + r.stderr)
                return
        d = json.loads(spec.read_text())
        for key in ("flops_per_gpu", "activation_bandwidth_Bps", "memory_bandwidth_Bps"):
            figures = sorted((dev[key] for dev in d["devices"] if key in dev),  # a flops map sorts by its fp32 rate
                             key=lambda v: v["fp32"] if isinstance(v, dict) else v)
            for dev in d["devices"]:  # four processes of one box: one figure each, the median (4 on 2 cores is noisy)
                if key in dev:
                    dev[key] = figures[len(figures) // 2]
        for j, dev in enumerate(d["devices"]):  # two "machines": the stages' link is the emulated one
            dev["machine"] = f"box-{j // 2}"
        d["network"]["bandwidth_Bps"]["inter_machine"] = link_gbps * 1.25e8
        cluster = Cluster.from_dict(d)
        graph = engine.load_model("zoo:gpt", **RUN_GPT)
        L = StageGraph(graph).num_layers
        plan = with_hap_stages(fixed_pipeline(graph, cluster, [(0, L // 2, (0, 1)), (L // 2, L, (2, 3))], 4,
                                              "h-1f1b"), cluster, PlanOptions(time_budget_s=10))
        path = Path(tmp) / "pipeline.json"
        path.write_text(json.dumps(plan.to_dict()))
        r = subprocess.run([sys.executable, "-m", "runner.hap", "run", str(path), "--steps", str(steps),
                            "--emulate-links"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        return
    times = [float(t) for t in re.findall(r"time ([0-9.]+) ms", r.stdout)]
    measured = statistics.median(times[1:]) if len(times) > 1 else times[0]
    where = "a profile of this machine" if profile else "cpu_4_uneven.json's figures"
    print(f"gpt (4 layers, hidden 64) on 4 CPU ranks, 2 stages x 2 ranks, B = {plan.microbatches}, "
          f"link {link_gbps} Gbit/s emulated, planned on {where}")
    for b in plan.boundaries:
        print(f"    cut {b.cut}: {b.transfer_s * 1e3:.2f} ms per microbatch each way")
    for i, s in enumerate(plan.stages):
        print(f"    stage {i}: {s.program_summary()}, shares {', '.join(f'{r:.2f}' for r in s.ratios)}")
    print(f"    predicted {plan.predicted_s * 1e3:8.2f} ms per step   measured {measured:8.2f} ms "
          f"(median of steps 1..{len(times) - 1})   measured / predicted {measured / (plan.predicted_s * 1e3):.2f}")
    print(f"    MFU predicted {percent(plan.mfu)}   measured {percent(plan.utilisation.mfu_at(measured / 1e3))}")


if __name__ == "__main__":
    main()
