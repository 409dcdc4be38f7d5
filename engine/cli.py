"""The `hap` command line: headless planning from a shell.

    hap plan --model zoo:gpt --set layers=24 --set hidden=768 --cluster FILE --out plan.json [--time-budget S] [--json]
    hap capture --model zoo:gpt --set layers=2 --out graph.json
    hap run plan.json [--steps N] [--verify] [--metrics FILE] [--seed S]   (runner; `hap run PLAN --help`)
    hap profile --out cluster.json [--parquet raw.parquet] [--nproc N] [--speeds 1,0.5]   (runner; `hap profile --help`)

Bad input exits with status 2 and one line naming the problem, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from .errors import HapError

GIB = 2**30


class _UsageError(HapError):
    pass


def _knobs(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _UsageError(f"--set expects KEY=VALUE, got '{pair}'")
        out[key.strip()] = value.strip()
    return out


def _load_graph(args: argparse.Namespace):
    from . import load_model

    knobs = _knobs(args.set or [])
    return load_model(args.model, **knobs)


def _progress_printer():
    if not sys.stderr.isatty():
        return None

    def show(p) -> None:
        best = "-" if p.best_cost == float("inf") else f"{p.best_cost * 1e3:.2f} ms"
        sys.stderr.write(f"\r  search iter {p.iteration}: {p.expanded} expanded, queue {p.queue_size}, best {best}   ")
        sys.stderr.flush()

    return show


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _device_runs(plan, cluster) -> list[tuple[str, str, list[str]]]:
    """Rows per run of consecutive devices with identical figures (64 identical rows say nothing more than one)."""
    runs: list[tuple[str, str, list[str]]] = []
    for j, d in enumerate(cluster.devices):
        cells = [f"{d.gpu_model} x{d.num_gpus}", f"{plan.ratios['0'][j]:.4f}",
                 f"{plan.memory_bytes[j] / GIB:.2f} GiB", f"{d.memory_bytes_per_gpu / GIB:.1f} GiB"]
        if runs and runs[-1][2] == cells:
            runs[-1] = (runs[-1][0], d.name, cells)
        else:
            runs.append((d.name, d.name, cells))
    return runs


def _report(plan, baselines: dict[str, float | None], cluster) -> str:
    lines = [f"model {plan.graph.name}: {plan.graph.num_parameters / 1e6:.1f}M parameters, "
             f"{len(plan.graph)} nodes; cluster {cluster.name}: {cluster.num_devices} devices", ""]
    rows = [["strategy", "predicted iteration", "speed-up of hap"]]
    rows.append(["hap", f"{plan.predicted_time_s * 1e3:.2f} ms", ""])
    for name, t in baselines.items():
        if t is None:
            rows.append([name, "does not fit in memory", ""])
        else:
            rows.append([name, f"{t * 1e3:.2f} ms", f"{t / plan.predicted_time_s:.2f}x"])
    lines += [_table(rows), ""]
    dev = [["device", "gpu", "ratio", "memory / GPU", "capacity"]]
    for first, last, cells in _device_runs(plan, cluster):
        name = first if first == last else f"{first} .. {last}"
        dev.append([name] + cells)
    lines.append(_table(dev))
    s = plan.search
    lines += ["", f"search: {s.get('iterations', 0)} Q<->B iterations, {s.get('expanded', 0)} states expanded, "
                  f"{s.get('elapsed_s', 0.0):.2f} s, {'proven optimal' if s.get('optimal') else 'beam-limited'}"]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from . import load_cluster, plan

    graph = _load_graph(args)
    cluster = load_cluster(args.cluster)
    result = plan(graph, cluster, time_budget_s=args.time_budget, progress=_progress_printer(), optimizer=args.optimizer)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if args.out:
        result.save(args.out)
    if args.json:
        print(result.to_json())
        return 0
    # the planner already evaluated both baselines (they seed its search); None = out of memory
    baselines = {name: result.search["baselines_s"][name] for name in ("dp-even", "dp-proportional")}
    print(_report(result, baselines, cluster))
    if args.out:
        print(f"\nplan written to {args.out}")
    return 0


def cmd_capture(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    graph.save(args.out)
    print(f"{graph.name}: {len(graph)} nodes, {graph.num_parameters / 1e6:.1f}M parameters -> {args.out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from runner.cli import main as run_main  # lazily: the engine never imports the runner

    return run_main([args.plan, *args.options])


def cmd_profile(args: argparse.Namespace) -> int:
    from runner.profile import main as profile_main  # lazily: the engine never imports the runner

    return profile_main(args.options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hap", description="Plan SPMD training of one model on a heterogeneous GPU cluster (HAP).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="synthesize a plan and compare it with data parallelism")
    p.add_argument("--model", required=True, help="zoo:NAME (e.g. zoo:gpt) or a graph JSON file")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a zoo model knob, e.g. --set layers=24")
    p.add_argument("--cluster", required=True, help="cluster spec JSON (see sample_clusters/)")
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="stop searching after S seconds")
    p.add_argument("--optimizer", choices=["adam", "sgd", "none"], default="adam", help="optimizer state counted in memory")
    p.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")
    p.set_defaults(func=cmd_plan)
    c = sub.add_parser("capture", help="capture a model into a graph JSON file")
    c.add_argument("--model", required=True)
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--out", required=True)
    c.set_defaults(func=cmd_capture)
    r = sub.add_parser("run", help="train a plan over torch.distributed (starts torchrun on this machine)",
                       epilog="options after PLAN go to the runner: see `hap run PLAN --help`")
    r.add_argument("plan", help="plan JSON from `hap plan --out`")
    r.add_argument("options", nargs=argparse.REMAINDER, help="--steps N --verify --metrics FILE --seed S ...")
    r.set_defaults(func=cmd_run)
    f = sub.add_parser("profile", add_help=False, help="measure this cluster (FLOP/s, collectives) and write a cluster spec",
                       description="options go to the profiler: see `hap profile --help`")
    f.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "profile":  # every option belongs to the profiler (runner.profile), --help included
        args.options = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except HapError as e:
        print(f"hap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hap: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
