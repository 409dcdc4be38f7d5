"""Coverage bench (issue 13): do the models people bring capture, plan, and (with --run) train exactly?

Builds every model of `engine.model.zoo.ecosystem` (transformers decoders, encoders, encoder-decoders and
vision models from their default configs with small sizes, dropout as the config has it, plus two
plain-torch models) and prints, per model:

- captured: yes, or the error (first line);
- nodes, and the fraction of compute nodes kept opaque by capture's automatic fallback
  (`fallback`), i.e. run unsharded with every operand Full;
- for `hap_paper_testbed` and `a100x2_p100x2`: planned, the fraction of compute instructions the
  plan shards (`sharded`), and the predicted speed-up over the faster data-parallel baseline
  (`dp-even` / `dp-proportional`, both at whole units under the same cost model);
- with `--run`: `hap run --steps 3 --verify` of the model on 2 and 3 gloo ranks of a CPU cluster
  with uneven declared speeds (cpu_4_uneven's first devices), through the CLI in subprocesses, on a
  plan made from a model file (`engine.model.zoo.ecosystem.model_file`); "ok" or the failing line.

Writes the table to bench/results/coverage.json. Run from the repository root:

    python bench/coverage.py                       # capture and plan every model (a few minutes)
    python bench/coverage.py --models bert,llama   # some of them (updates their rows in the JSON)
    python bench/coverage.py --run                 # also train and verify on 2 and 3 ranks (slow)
    python bench/coverage.py --all --jobs 16       # every transformers type (bench/sweep.py; long)
    python bench/coverage.py --all --verify 10 --seed 20261127   # and train 10 of them drawn with that seed
    python bench/coverage.py --all --types swin,funnel --verify-types swin,funnel   # train those (if they plan)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.model.graph import Graph  # noqa: E402
from engine.model.zoo import ecosystem  # noqa: E402
from engine.spmd.program import COMPUTE  # noqa: E402

PLAN_CLUSTERS = ("hap_paper_testbed", "a100x2_p100x2")
RUN_RANKS = {2: ("cpu-0", "cpu-2"), 3: ("cpu-0", "cpu-1", "cpu-2")}
"""Devices of cpu_4_uneven run for each world size: both speeds (2e10 and 1e10 FLOP/s) in each."""
RUN_TIMEOUT_S = 900


@dataclass
class PlanRow:
    """One model planned on one cluster."""

    planned: bool
    error: str = ""
    sharded: float = 0.0
    """Fraction of compute instructions that run on a sharded form."""
    speedup: float = 0.0
    """Predicted time of the faster data-parallel baseline over the plan's."""
    predicted_ms: float = 0.0


@dataclass
class Row:
    """One model of the bench."""

    model: str
    captured: bool
    error: str = ""
    nodes: int = 0
    fallback: float = 0.0
    """Fraction of compute nodes kept opaque (run unsharded by the automatic fallback)."""
    plans: dict[str, PlanRow] = field(default_factory=dict)
    runs: dict[str, str] = field(default_factory=dict)
    """World size -> "ok" or the error of `hap run --steps 3 --verify`."""


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}"


def plan_row(graph: Graph, cluster_name: str, budget_s: float) -> PlanRow:
    """Plan `graph` on a sample cluster and compare it with both data-parallel baselines."""
    cluster = engine.load_cluster(ROOT / "sample_clusters" / f"{cluster_name}.json")
    try:
        plan = engine.plan(graph, cluster, time_budget_s=budget_s)
    except Exception as e:  # a bench reports every failure and goes on
        return PlanRow(False, first_line(e))
    baselines = []
    for strategy in ("dp-even", "dp-proportional"):
        try:
            baselines.append(engine.evaluate(graph, cluster, strategy).predicted_time_s)
        except engine.InfeasibleError:
            continue
    computes = [ins for ins in plan.program if ins.kind == COMPUTE]
    sharded = sum(ins.post >= 0 or any(f >= 0 for _, f in ins.pre) for ins in computes) / max(1, len(computes))
    speedup = min(baselines) / plan.predicted_time_s if baselines else float("nan")
    return PlanRow(True, "", round(sharded, 3), round(speedup, 3), round(plan.predicted_time_s * 1e3, 4))


def run_cluster(world: int, folder: Path) -> Path:
    """A cpu_4_uneven cluster of `world` of its devices (uneven speeds), written into `folder`."""
    spec = json.loads((ROOT / "sample_clusters" / "cpu_4_uneven.json").read_text())
    spec["devices"] = [d for d in spec["devices"] if d["name"] in RUN_RANKS[world]]
    spec["name"] = f"cpu_{world}_uneven"
    path = folder / f"cpu_{world}_uneven.json"
    path.write_text(json.dumps(spec))
    return path


def hap(*args: str, cwd: Path) -> tuple[int, str]:
    """Run the `hap` CLI in a subprocess; (exit code, its last meaningful output line)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "runner.hap", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {RUN_TIMEOUT_S} s"
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and "Warning" not in ln
             and not ln.startswith(" ")]
    causes = [ln for ln in lines if "verify: FAILED" in ln or ("Error" in ln and "Traceback" not in ln and "errors/__init__" not in ln)]
    failing = [ln for ln in lines if "error" in ln.lower() or "FAIL" in ln]
    return proc.returncode, ((causes[:1] or failing[-1:] or lines[-1:] or [""])[0])[:300]


def run_row(name: str, world: int) -> str:
    """`hap plan` of the model's file on the uneven CPU cluster, then `hap run --steps 3 --verify`."""
    with tempfile.TemporaryDirectory(prefix=f"hap-coverage-{name}-") as tmp:
        folder = Path(tmp)
        model = folder / f"{name}.py"
        model.write_text(ecosystem.model_file(name))
        plan = folder / "plan.json"
        rc, line = hap("plan", "--model", str(model), "--cluster", str(run_cluster(world, folder)), "--out", str(plan),
                       cwd=folder)
        if rc != 0:
            return f"plan failed: {line}"
        rc, line = hap("run", str(plan), "--steps", "3", "--verify", cwd=folder)
        return "ok" if rc == 0 else f"rc {rc}: {line}"


def bench_model(name: str, budget_s: float, run: bool) -> Row:
    """Capture, plan on both GPU clusters and, with `run`, train and verify one model."""
    try:
        module, inputs = ecosystem.build(name, "meta")
        graph = engine.load_model(module, inputs)
    except Exception as e:
        return Row(name, False, first_line(e))
    compute = [n for n in graph.nodes if not n.is_leaf]
    row = Row(name, True, nodes=len(graph.nodes),
              fallback=round(sum(n.op == "opaque" for n in compute) / max(1, len(compute)), 3))
    row.plans = {c: plan_row(graph, c, budget_s) for c in PLAN_CLUSTERS}
    if run:
        for world in RUN_RANKS:
            try:
                row.runs[str(world)] = run_row(name, world)
            except Exception as e:
                row.runs[str(world)] = first_line(e)
    return row


def table(rows: list[Row], run: bool) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'model':24} {'captured':8} {'nodes':>5} {'fallback':>8}"
    for c in PLAN_CLUSTERS:
        head += f" | {c[:17]:17} {'shard':>5} {'x dp':>6}"
    if run:
        head += " | run 2 ranks | run 3 ranks"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r.model:24} {'yes' if r.captured else 'NO':8} {r.nodes:5} {r.fallback:8.1%}"
        for c in PLAN_CLUSTERS:
            p = r.plans.get(c)
            if p is None or not p.planned:
                line += f" | {'no plan':17} {'':>5} {'':>6}"
            else:
                line += f" | {'planned':17} {p.sharded:5.0%} {p.speedup:6.2f}"
        if run:
            line += " | " + " | ".join(f"{r.runs.get(str(w), '')[:11]:11}" for w in RUN_RANKS)
        lines.append(line)
    errors = [f"  {r.model}: {r.error}" for r in rows if r.error]
    errors += [f"  {r.model} on {c}: {p.error}" for r in rows for c, p in r.plans.items() if p.error]
    errors += [f"  {r.model} on {w} ranks: {msg}" for r in rows for w, msg in r.runs.items() if msg != "ok"]
    return "\n".join(lines + (["", "errors:"] + errors if errors else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all of engine.model.zoo.ecosystem.MODELS)")
    parser.add_argument("--run", action="store_true", help="also hap run --steps 3 --verify on 2 and 3 gloo ranks")
    parser.add_argument("--time-budget", type=float, default=20.0, metavar="S", help="search budget per plan")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "coverage.json"))
    sweep_args = parser.add_argument_group("the sweep of every transformers type (bench/sweep.py)")
    sweep_args.add_argument("--all", action="store_true", help="capture and plan every type of bench/coverage_types.json")
    sweep_args.add_argument("--write-types", action="store_true", help="with --all: rewrite the list from this transformers")
    sweep_args.add_argument("--types", help="with --all: only these comma-separated model types (nothing written)")
    sweep_args.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)), help="types at once")
    sweep_args.add_argument("--cap", type=float, default=180.0, metavar="S", help="seconds per type")
    sweep_args.add_argument("--verify", type=int, default=0, metavar="K", help="then train K planned types, 2 steps")
    sweep_args.add_argument("--seed", type=int, default=20261127, help="the draw of --verify's types")
    sweep_args.add_argument("--verify-types", metavar="A,B", help="then train these planned types (not a draw)")
    args = parser.parse_args(argv)
    if args.all:
        import sweep

        return sweep.main(args)
    names = args.models.split(",") if args.models else list(ecosystem.MODELS)
    unknown = [n for n in names if n not in ecosystem.MODELS]
    if unknown:
        parser.error(f"unknown models {unknown} (known: {', '.join(ecosystem.MODELS)})")
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            rows.append(bench_model(name, args.time_budget, args.run))
        except Exception:  # a bug in the bench itself: keep the other models
            rows.append(Row(name, False, "bench error: " + traceback.format_exc().strip().splitlines()[-1]))
        print(f"# {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print(table(rows, args.run))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = {r.model: {**asdict(r), "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())} for r in rows}
    kept = json.loads(out.read_text())["rows"] if args.models and out.exists() else []
    merged = [fresh.pop(r["model"], r) for r in kept] + list(fresh.values())  # --models updates those rows only
    out.write_text(json.dumps({"clusters": list(PLAN_CLUSTERS), "rows": merged}, indent=1) + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
