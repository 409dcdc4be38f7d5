"""Cost-model accuracy: predicted vs measured iteration time on the local CPU "cluster" (issue 6, item 5).

For each local cluster — 2 gloo ranks with emulated speeds 1.0/0.5, and 4 ranks with
0.5/0.5/0.25/0.25 (`--speeds`, runner.timing) — and each model family (zoo:gpt, zoo:mlp):

1. `hap profile` measures the cluster (matmul FLOP/s, the family's own operators at the profiler's
   small config, collective fits on the gloo group), `--profiles` times in a row; the spec the
   plans use is the profiler's own fit over the Parquet rows of all of them (as one profile with
   all their repeats: per measurement the profiler's own figure, `combine_profiles`);
2. every variant of the family (sizes x layer counts) is planned on that spec twice: the HAP
   plan (`engine.plan`, overlap mode `--overlap`, default auto: ddp or duplex) and the `dp-even`
   baseline (`engine.evaluate`, priced and run as DDP runs: buckets during backward), SGD as the runner uses;
   the first variant of each family is also planned in each training mode of `--modes` (issue 26:
   bf16 autocast, recomputation of every layer, ZeRO stages 1-3 with Adam; and the best pipeline plan,
   whose ranks `hap run --speeds` slows as it does SPMD ranks), HAP only;
3. each plan runs with `hap run --speeds ... --metrics` (plus `--timing` with `--timing`) for `--steps` steps. Iteration
   time = per step the slowest rank's `step_time_s`, median over the steps after `--warmup`;
   each plan is launched `--repeat` times, interleaved with the other plans of its cluster,
   and the fastest launch is kept (load from other processes only ever adds time).

It prints predicted vs measured per variant, with the predicted and measured split into
computation (slowest device, emulated slow-down included) and communication, then the Pearson
correlation, the mean absolute percentage error (MAPE) and the Spearman rank correlation over
all variants, and per cluster. Targets (issue 6): r >= 0.97 (HAP reports 0.970), MAPE <= 20%.
Run from the repository root:

    PYTHONPATH=. python bench/accuracy.py            # about 11 minutes on 2 cores
    PYTHONPATH=. python bench/accuracy.py --quick    # one launch per plan, fewer steps

It writes everything (profiles, plans, metrics, figures) under `bench/results/accuracy/` and the
figures to `bench/results/accuracy.json`. It never asserts. The machine may be shared: 4 ranks
on 2 cores share cores by design, and other processes' load adds noise to every figure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.pipeline.plan import PipelinePlan
from engine.planner import load_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

CLUSTERS = {"2 ranks": (1.0, 0.5), "4 ranks": (0.5, 0.5, 0.25, 0.25)}
"""Emulated speed factor per rank of each local cluster. 4 ranks share 2 cores, so none runs faster
than 0.5: a rank then waits for a core no longer than its emulated slow-down lasts
(runner.timing), and the emulated cluster is what the profile and the plans describe."""
GPT_BASE = dict(heads=4, vocab=512, seq_len=64, batch=16)
VARIANTS = {
    "gpt": [dict(GPT_BASE, layers=2, hidden=128, ffn=512), dict(GPT_BASE, layers=4, hidden=128, ffn=512),
            dict(GPT_BASE, layers=2, hidden=256, ffn=1024)],
    "mlp": [dict(layers=2, in_features=256, hidden=1024, classes=16, batch=64),
            dict(layers=4, in_features=256, hidden=1024, classes=16, batch=64),
            dict(layers=2, in_features=512, hidden=2048, classes=16, batch=64)],
}
"""Per family: sizes x layer counts. The first of each family is the profiler's own config."""
STRATEGIES = ("hap", "dp-even")
MODES = {"bf16": dict(precision="bf16"), "recompute": dict(recompute="all"),
         "zero1": dict(shard_states=1, optimizer="adam"), "zero2": dict(shard_states=2, optimizer="adam"),
         "zero3": dict(shard_states=3, optimizer="adam"), "pipeline": dict(parallelism="pipeline")}
"""Training modes of issue 26, each planned (HAP only) for the first variant of every family on top of
the fp32 plans: bf16 autocast, every layer recomputed, the ZeRO stages (with Adam, whose state is
what they shard; the launch runs Adam too), and the best pipeline plan (HAPT, engine.pipeline; its
ranks slowed by `hap run --speeds` as SPMD ranks are)."""


OVERLAP_KINDS = {"none": "SPMD (no overlap)", "ddp": "ddp", "duplex": "duplex", "pipeline": "pipeline"}
"""The plan kinds the report groups by (issue 28); dp-even runs as DDP."""


def hap(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "runner.hap", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"hap {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def speeds_arg(speeds: tuple[float, ...]) -> str:
    return ",".join(f"{s:g}" for s in speeds)


def profile(cluster: str, family: str, out: Path, count: int) -> Path:
    """`count` runs of `hap profile` on a local cluster with the family's own operators, combined; the spec's path."""
    speeds = CLUSTERS[cluster]
    specs = []
    for k in range(count):
        spec = out / f"cluster_{len(speeds)}_{family}_{k}.json"
        hap("profile", "--out", str(spec), "--parquet", str(spec.with_suffix(".parquet")), "--nproc", str(len(speeds)),
            "--speeds", speeds_arg(speeds), "--model", f"zoo:{family}", "--name", f"local_{len(speeds)}_{family}")
        specs.append(spec)
    combined = out / f"cluster_{len(speeds)}_{family}.json"
    combined.write_text(json.dumps(combine_profiles(specs), indent=1))
    return combined


def combine_profiles(specs: list[Path]) -> dict:
    """One spec from several profiles: the profiler's own fits (`runner.profile`) over the rows of all
    of them, as one profile with all their repeats would give. Taking each figure's best across
    profiles instead (each rank's FLOP/s, each collective's payloads) composes a machine faster than
    any one profile saw: it under-predicted every launch (mean signed error -21% over 24 variants)."""
    import pyarrow.parquet as pq

    from engine.cluster.spec import fit_collective
    from runner.profile import (COLLECTIVES, collective_points, device_compute, emulated_devices, memory_bandwidth,
                                overlap_slowdowns, rank_speeds)

    out = json.loads(specs[0].read_text())
    rows = [r for s in specs for r in pq.read_table(s.with_suffix(".parquet")).to_pylist()]
    ranks = list(range(len(out["devices"])))
    for j, (dev, fields) in enumerate(zip(out["devices"], device_compute(rows, ranks))):
        for key in ("activation_bandwidth_Bps", "overlap_slowdown"):
            dev.pop(key, None)
        dev.update(fields, memory_bandwidth_Bps=memory_bandwidth(rows, j))
        if slow := overlap_slowdowns(rows, j):
            dev["overlap_slowdown"] = slow
    out["devices"] = emulated_devices(out["devices"], rank_speeds(rows, ranks))
    for name in COLLECTIVES:
        out["network"]["collectives"][name] = fit_collective(*collective_points(rows, name)).to_dict()
    bcast = out["network"]["collectives"]["broadcast"]
    out["network"]["latency_s"] = bcast["latency_s"]
    out["network"]["bandwidth_Bps"] = {k: bcast["bandwidth_Bps"] for k in out["network"]["bandwidth_Bps"]}
    out["description"] += f" Fitted over the repeats of {len(specs)} profiles (bench/accuracy.py)."
    return out


def make_plans(family: str, knobs: dict, spec: Path, out: Path, tag: str, overlap: str = "auto",
               modes: tuple[str, ...] = ()) -> dict[str, Path]:
    """The HAP plan and the baseline, SGD as the runner uses, then one HAP plan per mode of `modes`
    (named `hap+MODE`)."""
    import engine

    graph = engine.load_model(f"zoo:{family}", **knobs)
    paths = {}
    for strategy in STRATEGIES:
        plan = (engine.plan(graph, spec, time_budget_s=30, optimizer="sgd", overlap=overlap) if strategy == "hap"
                else engine.evaluate(graph, spec, strategy, optimizer="sgd"))
        paths[strategy] = out / f"plan_{tag}_{strategy}.json"
        plan.save(paths[strategy])
    for mode in modes:
        options = {"optimizer": "sgd", **MODES[mode]}
        plan = engine.plan(graph, spec, time_budget_s=30, overlap=overlap, **options)
        paths[f"hap+{mode}"] = out / f"plan_{tag}_hap_{mode}.json"
        plan.save(paths[f"hap+{mode}"])
    return paths


def run_plan(plan: Path, speeds: tuple[float, ...], steps: int, metrics: Path, timing: bool,
             optimizer: str = "sgd") -> list[dict]:
    """One launch; `timing` adds the per-instruction probes and timelines (`hap run --timing`), which cost
    a little time per operator, so the measured figures are taken without them by default."""
    hap("run", str(plan), "--steps", str(steps), "--speeds", speeds_arg(speeds), *(["--timing"] if timing else []),
        "--optimizer", optimizer, "--metrics", str(metrics))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def measured(records: list[dict], warmup: int) -> dict[str, float]:
    """Medians over the steps after warm-up: the slowest rank's step, its compute (+ emulated), and comm."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        if r["step"] >= warmup:
            by_step.setdefault(r["step"], []).append(r)
    worst = [max(rs, key=lambda r: r["step_time_s"]) for rs in by_step.values()]
    return {"iteration_s": statistics.median(r["step_time_s"] for r in worst),
            "compute_s": statistics.median(max(r["compute_s"] + r["emulated_s"] for r in rs) for rs in by_step.values()),
            "comm_s": statistics.median(min(r["comm_s"] for r in rs) for rs in by_step.values())}


def predicted(plan_path: Path, spec: Path) -> dict[str, float]:
    """The plan's prediction: iteration, computation (slowest device per stage, plus the optimizer
    tail of the overlap modes) and communication (every collective and gradient bucket, hidden or not,
    and the sharded states' reduce-scatters and all-gathers with their work)."""
    import engine
    from engine.spmd.iteration import breakdown_of
    from engine.spmd.plan import Plan

    plan = load_plan(plan_path)
    if isinstance(plan, PipelinePlan):
        return pipeline_predicted(plan)
    b = breakdown_of(plan, engine.load_cluster(spec))
    return {"iteration_s": plan.predicted_time_s, "compute_s": sum(max(c) for c in b.stage_comp_s) + b.tail_s,
            "comm_s": sum(b.stage_comm_s) + sum(x.duration_s for x in b.buckets) + b.states_s, "ratios": plan.ratios,
            "overlap": plan.overlap, "collectives": sorted({i.rule for i in plan.program if i.kind == "comm"})}


def pipeline_predicted(plan: PipelinePlan) -> dict:
    """A pipeline plan's prediction: its schedule's step (`predicted_s`); computation, the busiest stage's
    forwards and backwards of every microbatch; communication, every boundary's transfers both ways."""
    B = plan.microbatches
    return {"iteration_s": plan.predicted_s, "compute_s": max(B * (s.forward_s + s.backward_s) for s in plan.stages),
            "comm_s": sum(2 * B * b.transfer_s for b in plan.boundaries), "ratios": [s.ratios for s in plan.stages],
            "overlap": "pipeline", "collectives": [f"{len(plan.stages)} stages, {B} microbatches, {plan.schedule}"]}


# ----------------------------------------------------------------------------- statistics


def pearson(x: list[float], y: list[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def ranks(x: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    return pearson(ranks(x), ranks(y))


def mape(pred: list[float], meas: list[float]) -> float:
    return statistics.fmean(abs(p - m) / m for p, m in zip(pred, meas))


def figures(rows: list[dict]) -> dict[str, float]:
    p, m = [r["predicted"]["iteration_s"] for r in rows], [r["measured"]["iteration_s"] for r in rows]
    signed = statistics.fmean((a - b) / b for a, b in zip(p, m))
    return {"n": len(rows), "pearson_r": pearson(p, m), "mape": mape(p, m), "spearman_rho": spearman(p, m),
            "mean_signed_error": signed}


# ----------------------------------------------------------------------------- report


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe(family: str, knobs: dict) -> str:
    if family == "gpt":
        return f"gpt L{knobs['layers']} h{knobs['hidden']}"
    return f"mlp L{knobs['layers']} h{knobs['hidden']} in{knobs['in_features']}"


def report(rows: list[dict]) -> str:
    head = [["cluster", "model", "plan", "predicted", "measured", "error", "pred comp", "meas comp", "pred comm",
             "meas comm", "launch spread", "load", "collectives"]]
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    for r in rows:
        p, m = r["predicted"], r["measured"]
        head.append([r["cluster"], r["model"], f"{r['strategy']} ({p.get('overlap', 'none')})", ms(p["iteration_s"]),
                     ms(m["iteration_s"]),
                     f"{(p['iteration_s'] - m['iteration_s']) / m['iteration_s']:+.0%}", ms(p["compute_s"]),
                     ms(m["compute_s"]), ms(p["comm_s"]), ms(m["comm_s"]), f"{r['launch_spread']:.0%}",
                     f"{m['load_before']:.1f}",
                     ",".join(p["collectives"]) or "-"])
    lines = [table(head), ""]
    groups = {"all variants": rows, **{c: [r for r in rows if r["cluster"] == c] for c in CLUSTERS},
              "fp32 plans": [r for r in rows if "+" not in r["strategy"]],
              **{f"hap+{m}": [r for r in rows if r["strategy"] == f"hap+{m}"] for m in MODES},
              **{f"{OVERLAP_KINDS[k]} plans": [r for r in rows if r["predicted"].get("overlap", "none") == k]
                 for k in OVERLAP_KINDS}}
    stats = [["variants", "n", "Pearson r", "MAPE", "Spearman rho", "mean signed error"]]
    for name, members in groups.items():
        if len(members) >= 2:
            f = figures(members)
            stats.append([name, str(f["n"]), f"{f['pearson_r']:.3f}", f"{f['mape']:.1%}", f"{f['spearman_rho']:.3f}",
                          f"{f['mean_signed_error']:+.1%}"])
    lines.append(table(stats))
    f = figures(rows)
    lines += ["", f"targets: Pearson r >= 0.97: {'PASS' if f['pearson_r'] >= 0.97 else 'MISS'} ({f['pearson_r']:.3f}); "
                  f"MAPE <= 20%: {'PASS' if f['mape'] <= 0.20 else 'MISS'} ({f['mape']:.1%})",
              "pred/meas comp: slowest device's computation (measured: compute + emulated slow-down of the slowest rank); "
              "meas comm: the least-waiting rank's collective time; launch spread: slowest / fastest launch - 1 "
              "(the noise of this machine); load: 1-minute load average before the kept launch; collectives: those of the program ('-': data parallel, only the "
              "gradient bucket)"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> list[dict]:
    out = RESULTS / "accuracy"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cluster, speeds in CLUSTERS.items():
        if args.clusters and cluster.split()[0] not in args.clusters.split(","):
            continue
        cases = []
        for family in args.families.split(","):
            spec = profile(cluster, family, out, args.profiles)
            print(f"[{time.strftime('%H:%M:%S')}] profiled {cluster} for zoo:{family}: {spec.name}", file=sys.stderr)
            for i, knobs in enumerate(VARIANTS[family]):
                tag = f"{len(speeds)}_{family}{i}"
                modes = tuple(m for m in args.modes.split(",") if m) if i == 0 else ()
                for strategy, path in make_plans(family, knobs, spec, out, tag, args.overlap, modes).items():
                    cases.append({"cluster": cluster, "model": describe(family, knobs), "family": family,
                                  "knobs": knobs, "strategy": strategy, "plan": path, "predicted": predicted(path, spec),
                                  "launches": []})
        for launch in range(args.repeat):  # interleaved, so a burst of load from elsewhere hits all plans alike
            for case in cases:
                metrics = out / f"metrics_{case['plan'].stem}_{launch}.jsonl"
                load = os.getloadavg()[0]
                optimizer = MODES.get(case["strategy"].partition("+")[2], {}).get("optimizer", "sgd")
                case["launches"].append(measured(run_plan(case["plan"], speeds, args.steps, metrics, args.timing, optimizer),
                                                 args.warmup))
                case["launches"][-1]["load_before"] = load
                print(f"[{time.strftime('%H:%M:%S')}] {cluster} {case['model']} {case['strategy']} launch {launch}: "
                      f"{case['launches'][-1]['iteration_s'] * 1e3:.1f} ms (predicted "
                      f"{case['predicted']['iteration_s'] * 1e3:.1f} ms)", file=sys.stderr)
        for case in cases:
            case["measured"] = min(case["launches"], key=lambda m: m["iteration_s"])
            its = [m["iteration_s"] for m in case["launches"]]
            case["launch_spread"] = max(its) / min(its) - 1
            case["plan"] = str(case["plan"].relative_to(ROOT))
            rows.append(case)
        save(args, rows, partial=True)  # a later failure keeps what was measured
    return rows


def save(args: argparse.Namespace, rows: list[dict], partial: bool = False) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "accuracy.json").write_text(json.dumps({
        "partial": partial, "steps": args.steps, "warmup": args.warmup, "repeat": args.repeat,
        "profiles": args.profiles, "clusters": CLUSTERS, "figures": figures(rows) if len(rows) >= 2 else {},
        "rows": rows, "load_average": os.getloadavg(), "cpu_count": os.cpu_count()}, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=14, help="steps per launch (default 14)")
    p.add_argument("--warmup", type=int, default=4, help="steps discarded at the start of each launch (default 4)")
    p.add_argument("--repeat", type=int, default=2, help="launches per plan, the fastest kept (default 2)")
    p.add_argument("--profiles", type=int, default=2, help="hap profile runs per cluster and family, fitted together (default 2)")
    p.add_argument("--timing", action="store_true",
                   help="launch with hap run --timing: per-instruction timelines in the metrics (slightly slower steps)")
    p.add_argument("--quick", action="store_true", help="10 steps, one launch per plan, one profile")
    p.add_argument("--families", default="gpt,mlp", help="model families (default gpt,mlp)")
    p.add_argument("--clusters", default="", help="only these rank counts, e.g. 2 or 2,4 (default all)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"training modes planned for each family's first variant (default {','.join(MODES)}; '' for none)")
    p.add_argument("--overlap", default="auto", choices=["auto", "none", "ddp", "duplex"],
                   help="overlap mode of the HAP plans (default auto; dp-even always runs as DDP does)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeat, args.profiles = 10, 1, 1
    start = time.perf_counter()
    rows = run(args)
    print(report(rows))
    save(args, rows)
    print(f"\nwritten to bench/results/accuracy.json ({time.perf_counter() - start:.0f} s; "
          f"1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
