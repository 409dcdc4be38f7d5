"""The `hap` command line's planning commands: headless planning from a shell.

    hap plan --model zoo:gpt --set layers=24 --set hidden=768 --cluster FILE --out plan.json [--time-budget S]
             [--segments N] [--overlap auto|none|ddp|duplex] [--parallelism spmd|pipeline|auto]
             [--microbatches N] [--json]
    hap plan --model path/to/model.py --cluster FILE ...         (a file defining build_model() and example_inputs())
    hap plan --model hf:LlamaForCausalLM [--config cfg.json] [--set hidden_size=256 --set batch=8 --set seq_len=128] ...
    hap capture --model zoo:gpt --set layers=2 --out graph.json
    hap export plan.json --out DIR [--zip] [--cluster FILE] [--model-file F]      (launch bundle)
    hap bundle check BUNDLE                                                       (0 valid, 1 invalid, 2 usage)
    hap ui [--port 8501] [--host 127.0.0.1]                                       (the Streamlit workbench)

`hap run` and `hap profile` execute (torch.distributed): the `hap` console entry (`runner.hap`) adds them
to this parser, so the engine never imports the runner. Bad input exits with status 2 and one line
naming the problem, never a traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from engine import limits
from engine.bundle.grammar import digest_arg
from engine.bundle.launch_files import cluster_launch_warnings
from engine.errors import HapError
from engine.options import GRAD_DTYPES, OPTIMIZERS, PARALLELISMS, PLAN_OVERLAPS, PRECISIONS, RECOMPUTE, PlanOptions
from engine.planner import BASELINES, OVERLAP_MEANING, PARALLELISM_MEANING, SPMD_ON, spmd_alternatives
from engine.spmd.utilisation import percent

GIB = 2**30


class _UsageError(HapError):
    pass


def _knobs(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _UsageError(f"--set expects KEY=VALUE, got '{pair}'")
        problem = limits.knob_problem(key.strip(), value.strip())
        if problem:  # checked here, before the model zoo (and torch) is imported
            raise _UsageError(f"--set {problem}")
        out[key.strip()] = value.strip()
    return out


def _load_graph(args: argparse.Namespace):
    from engine import load_model

    knobs = _knobs(args.set or [])
    return load_model(args.model, fallback=args.fallback, config=args.config, **knobs)


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
        cells = [f"{d.gpu_model} x{d.num_gpus}", "/".join(f"{r[j]:.4f}" for r in plan.ratios.values()),
                 f"{plan.memory_bytes[j] / GIB:.2f} GiB", f"{d.memory_bytes_per_gpu / GIB:.1f} GiB"]
        if runs and runs[-1][2] == cells:
            runs[-1] = (runs[-1][0], d.name, cells)
        else:
            runs.append((d.name, d.name, cells))
    return runs


def _report(plan, baselines: dict[str, float | None], cluster) -> str:
    from engine.spmd.baselines import unsplittable_input

    lines = [f"model {plan.graph.name}: {plan.graph.num_parameters / 1e6:.1f}M parameters, "
             f"{len(plan.graph)} nodes; cluster {cluster.name}: {cluster.num_devices} devices",
             plan.utilisation.line(), f"devices: the plan {plan.device_use.line()}", ""]
    rows = [["strategy", "predicted iteration", "speed-up of hap", "MFU"]]
    rows.append(["hap", f"{plan.predicted_time_s * 1e3:.2f} ms", "", percent(plan.mfu)])
    batch_of_one = unsplittable_input(plan.graph)
    for name, t in baselines.items():
        if t is None:
            why = f"no program: input '{batch_of_one.name}' has batch < 2" if batch_of_one else "does not fit in memory"
            rows.append([name, why, "", ""])
        else:
            rows.append([name, f"{t * 1e3:.2f} ms", f"{t / plan.predicted_time_s:.2f}x",
                         percent(plan.utilisation.mfu_at(t))])
    lines += [_table(rows), "", *_overlap_lines(plan, baselines), *_parallelism_lines(plan), *_states_lines(plan), ""]
    dev = [["device", "gpu", "ratio" if len(plan.ratios) == 1 else "ratio per segment", "memory / GPU", "capacity"]]
    for first, last, cells in _device_runs(plan, cluster):
        name = first if first == last else f"{first} .. {last}"
        dev.append([name] + cells)
    lines.append(_table(dev))
    lines += recompute_lines(plan)
    s = plan.search
    lines += ["", f"search: {s.get('iterations', 0)} Q<->B iterations, {s.get('expanded', 0)} states expanded, "
                  f"{s.get('elapsed_s', 0.0):.2f} s, {'every search exact' if s.get('optimal') else 'beam-limited'}"]
    return "\n".join(lines)


def recompute_lines(plan) -> list[str]:
    """Which layers recompute their activations (none: no line), and what `auto` tried to get there."""
    from engine.spmd.recompute import describe

    if not getattr(plan, "recompute", None):
        asked = plan.options.recompute if plan.parallelism == "spmd" else "none"
        return ["", "recompute: no layer (every activation fits)"] if asked == "auto" else []
    auto = plan.search.get("recompute_auto")
    how = (f"; auto planned {len(auto['tried'])} layer sets in {auto['elapsed_s']:.2f} s to fit memory"
           if isinstance(auto, dict) else "")
    return ["", f"recompute: {describe(plan.graph, plan.recompute)}{how}"]


def _states_lines(plan) -> list[str]:
    """Which weights' states are sharded at which ZeRO stage, and the shares (engine.spmd.zero)."""
    from engine.spmd.zero import summary_line

    record = getattr(plan, "shard_states", None)
    return [summary_line(record, len(plan.graph.parameters))] if record else []


def _overlap_lines(plan, baselines: dict[str, float | None]) -> list[str]:
    """The speed-up over the best baseline, and which overlap mode the plan runs and why."""
    fitting = {k: t for k, t in baselines.items() if t is not None}
    lines = []
    if fitting:
        name = min(fitting, key=fitting.get)
        lines.append(f"speed-up over the best baseline ({name}): {fitting[name] / plan.predicted_time_s:.2f}x "
                     "(baselines priced as PyTorch DDP runs: gradient buckets overlapped with backward)")
    modes = plan.search.get("overlap_s", {})
    tried = ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in modes.items())
    line = f"overlap: {plan.overlap} ({OVERLAP_MEANING[plan.overlap]})"
    if len(modes) > 1:
        line += f"; predicted {tried}"
    lines.append(line)
    lines += [f"overlap {m} not tried: {why}" for m, why in plan.search.get("overlap_skipped", {}).items()]
    options = plan.options
    if options.precision != "fp32" or options.grad_dtype != "fp32":  # mixed precision (engine.spmd.precision)
        lines.append(f"precision: {options.precision} under autocast (matmuls at the devices' {options.precision} "
                     f"rate, 2-byte activations; weights and optimizer state fp32), gradients all-reduced in "
                     f"{options.grad_dtype}")
    return lines


def _parallelism_lines(plan) -> list[str]:
    """When `--parallelism auto` kept the SPMD plan: the pipeline's predicted time, or why there was none."""
    times, skipped = plan.search.get("parallelism_s", {}), plan.search.get("parallelism_skipped", {})
    if "pipeline" in times:
        return [f"parallelism: spmd kept; the best pipeline predicts {times['pipeline'] * 1e3:.2f} ms"]
    return [f"parallelism: spmd kept; no pipeline: {skipped['pipeline']}"] if "pipeline" in skipped else []


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The `PlanOptions` of `hap plan`'s flags (checked before the model is built)."""
    return PlanOptions(optimizer=args.optimizer, time_budget_s=args.time_budget, overlap=args.overlap,
                       parallelism=args.parallelism, microbatches=args.microbatches, segments=args.segments,
                       precision=args.precision, grad_dtype=args.grad_dtype, recompute=args.recompute,
                       shard_states=args.shard_states)


def cmd_plan(args: argparse.Namespace) -> int:
    from engine import load_cluster, plan

    options = plan_options(args)
    _knobs(args.set or [])  # bad options, knobs and a bad cluster fail in milliseconds, before the model is built
    cluster = load_cluster(args.cluster)
    for warning in cluster_launch_warnings(cluster):
        print(f"warning: {warning}", file=sys.stderr)
    graph = _load_graph(args)
    from engine.model.source import adjusted_note  # torch: only once the cheap checks above passed

    for key, default in graph.origin.get("adjusted", {}).items():
        print(adjusted_note(key, default), file=sys.stderr)
    result = plan(graph, cluster, progress=_progress_printer(), options=options)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if result.parallelism == "pipeline":
        return _pipeline_output(result, graph, cluster, args)
    if args.out:
        result.save(args.out)
    if args.json:
        print(result.to_json())
        return 0
    # the planner already evaluated the baselines (they seed its search); None = no data-parallel program fits
    baselines = {name: result.search["baselines_s"][name] for name in BASELINES}
    print(_report(result, baselines, cluster))
    if args.out:
        print(f"\nplan written to {args.out}")
    return 0


def cmd_replan(args: argparse.Namespace) -> int:
    """`hap replan OLD.json --cluster NEW.json [--out NEW_PLAN.json]`: the same model on a changed cluster (engine.replan)."""
    from engine import load_plan
    from engine.elastic.replan import replan

    old = load_plan(args.plan)
    if old.parallelism != "spmd":
        raise _UsageError(f"{args.plan} is a {old.parallelism} plan; hap replan re-plans SPMD plans")
    result = replan(old, args.cluster, time_budget_s=args.time_budget, optimizer=args.optimizer)
    if args.out:
        result.plan.save(args.out)
    print(result.report.render())
    if args.out:
        print(f"\nplan written to {args.out}")
    return 0


def _pipeline_output(pipe, graph, cluster, args: argparse.Namespace) -> int:
    """Write (`--out`) and print (`--json`, else the report) a pipeline plan ("hap.pipeline_plan", `engine.pipeline.plan`)."""
    if args.out:
        pipe.save(args.out)
    if args.json:
        print(pipe.to_json())
        return 0
    print(_pipeline_report(pipe, graph, cluster))
    if args.out:
        print(f"\npipeline plan written to {args.out} (run it with `hap run {args.out}`)")
    return 0


def _pipeline_report(pipe, graph, cluster) -> str:
    """Stages (devices, layers, warm-up, program), boundaries, every schedule's time and peak memory, and the SPMD time."""

    lines = [f"model {graph.name}: {graph.num_parameters / 1e6:.1f}M parameters, {len(graph)} nodes; "
             f"cluster {cluster.name}: {cluster.num_devices} devices", pipe.utilisation.line(),
             f"devices: the pipeline {pipe.device_use.line()}", ""]
    rows = [["parallelism", "predicted iteration", "speed-up of the pipeline", "MFU"],
            ["pipeline", f"{pipe.predicted_s * 1e3:.2f} ms", "", percent(pipe.mfu)]]
    rows += [[alt.label, f"{alt.predicted_time_s * 1e3:.2f} ms", f"{alt.predicted_time_s / pipe.predicted_s:.2f}x",
              percent(pipe.utilisation.mfu_at(alt.predicted_time_s))] for alt in spmd_alternatives(pipe)]
    lines += [_table(rows), ""]
    lines += [f"SPMD on {', '.join(r['devices'])} alone: {r['skipped']}" for r in pipe.search.get(SPMD_ON, [])
              if "skipped" in r]
    lines += [f"spmd: {why}" for k, why in pipe.search.get("parallelism_skipped", {}).items() if k == "spmd"]
    lines.append(f"parallelism: pipeline ({PARALLELISM_MEANING['pipeline']}); schedule {pipe.schedule}, "
                 f"B = {pipe.microbatches} microbatches, t_max {pipe.t_max_s * 1e3:.3f} ms per microbatch")
    stage_rows = [["stage", "devices", "layers", "warm-up", "forward", "backward", "sync", "peak memory / GPU",
                   "program"]]
    for i, s in enumerate(pipe.stages):
        stage_rows.append([str(i), _device_names(cluster, s.devices), f"{s.layers[0]}-{s.layers[1] - 1}", str(s.warmup),
                           f"{s.forward_s * 1e3:.3f} ms", f"{s.backward_s * 1e3:.3f} ms", f"{s.sync_s * 1e3:.2f} ms",
                           f"{s.peak_memory_bytes / GIB:.2f} GiB", s.program_summary()])
    lines += ["", _table(stage_rows)]
    if "hap_stages_skipped" in pipe.search:
        lines.append(f"stages run data parallelism, not HAP plans: {pipe.search['hap_stages_skipped']}")
    if pipe.boundaries:
        lines.append("")
        lines += [f"boundary {i}|{i + 1} at layer {b.cut}: {b.forward_bytes / 2**20:.1f} MiB per iteration over "
                  f"{b.link}, {b.transfer_s * 1e3:.3f} ms per microbatch each way" for i, b in enumerate(pipe.boundaries)]
    sched = [["schedule", "predicted iteration", "warm-up per stage", "peak memory / GPU per stage", "fits"]]
    for name, r in pipe.schedules.items():
        sched.append([name, f"{r.iteration_s * 1e3:.2f} ms", " ".join(map(str, r.warmup)),
                      " ".join(f"{m / GIB:.2f}" for m in r.peak_memory_bytes) + " GiB", "yes" if r.fits else "no"])
    lines += ["", _table(sched), "", f"planning: {pipe.planning_s:.2f} s for the pipeline DP and the stages' plans"]
    return "\n".join(lines)


def _device_names(cluster, devices: tuple[int, ...]) -> str:
    """'4 x A100-40GB (a100-4 .. a100-7)' for a group of one GPU model, else the names joined."""
    names = [cluster.devices[j].name for j in devices]
    models = {cluster.devices[j].gpu_model for j in devices}
    if len(models) > 1:
        return ", ".join(names)
    return f"{len(names)} x {models.pop()} ({names[0]}" + (f" .. {names[-1]})" if len(names) > 1 else ")")


def cmd_capture(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    graph.save(args.out)
    print(f"{graph.name}: {len(graph)} nodes, {graph.num_parameters / 1e6:.1f}M parameters -> {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from engine import load_plan
    from engine.bundle.archive import bundle_digest, export_bundle, plan_warnings

    try:
        run_args = shlex.split(args.run_args or "")
    except ValueError as e:  # e.g. an unclosed quotation mark
        raise _UsageError(f"--run-args {args.run_args!r}: {e}; quote it as one shell string") from None
    plan = load_plan(args.plan)  # either kind, validated: an inconsistent plan is refused here
    out = export_bundle(plan, args.cluster, args.out, zip=args.zip, model_source=args.model_file,
                        rdzv_endpoint=args.rdzv_endpoint, image=args.image, run_args=run_args,
                        annotations=args.annotations, setup=args.setup,
                        slurm={"partition": args.partition, "account": args.account, "time": args.time,
                               "qos": args.qos})
    for warning in plan_warnings(plan, args.cluster):
        print(f"warning: {warning}", file=sys.stderr)
    manifest_bytes = (out / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    digest = bundle_digest({"manifest.json": manifest_bytes})
    kind = "" if plan.parallelism == "spmd" else f"{plan.parallelism} plan, "
    print(f"bundle {out}: {kind}{plan.world_size} ranks on {len(manifest['nodes'])} node(s), "
          f"{len(manifest['files'])} files" + (f"; zip {out.with_name(out.name + '.zip')}" if args.zip else ""))
    print(f"check it with `hap bundle check {out} --digest {digest}`; run it with `hap run {out} --digest {digest}` "
          f"or see {out / 'README.md'}")
    print(f"digest sha256:{digest}  (send it apart from the bundle; it names this bundle and no other)")
    return 0


def cmd_bundle_check(args: argparse.Namespace) -> int:
    from engine.bundle.archive import check_bundle

    report = check_bundle(args.bundle, args.digest)
    print(report.render(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


BUNDLE_EXIT_CODES = "exit status: 0 the bundle is valid, 1 the bundle is invalid (each problem printed, naming " \
                    "the file), 2 usage error"


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (a listening socket makes the bind fail)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise _UsageError(f"--host {host}: cannot bind ({e.strerror}); use 127.0.0.1 or an address of this machine") from None
    return True


def ui_command(host: str, port: int) -> list[str]:
    """The `streamlit run` line of the workbench (the engine itself never imports Streamlit)."""
    app = Path(__file__).resolve().parent.parent / "app" / "main.py"
    return [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false"]


def cmd_ui(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise _UsageError(f"--port {args.port}: must be between 1 and 65535")
    if not (Path(__file__).resolve().parent.parent / "app" / "main.py").exists():
        raise _UsageError("the workbench (app/main.py) is not in this installation; install from a source checkout")
    if importlib.util.find_spec("streamlit") is None:
        raise _UsageError("streamlit is not installed; install the app extra: pip install -e '.[app]'")
    if not port_is_free(args.host, args.port):
        raise _UsageError(f"port {args.port} on {args.host} is busy (another server listens there); choose another with --port N")
    print(f"hap ui: the workbench is at http://{args.host}:{args.port}  (Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(ui_command(args.host, args.port))
    stopped: list[int] = []

    def stop(signum: int, _frame) -> None:
        """Stopping `hap ui` stops the server too."""
        stopped.append(signum)
        proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    try:
        code = proc.wait()
        return 0 if stopped and code in (0, -signal.SIGTERM) else code
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise


MODEL_HELP = ("zoo:NAME (e.g. zoo:gpt), a Python file defining build_model() and example_inputs() (naming it here "
              "consents to running it), hf:CLASS (a transformers class built from its config, e.g. hf:LlamaForCausalLM) "
              "or a graph JSON file")
SET_HELP = ("a zoo knob (--set layers=24), or for hf: a config key (--set hidden_size=256) or an input knob "
            "(batch, seq_len, image_size)")
CONFIG_HELP = "hf: models: a JSON file of config keys (applied before --set)"


Commands = Callable[[Any], None]
"""Adds subcommands to the parser's subparsers (the runner's `run` and `profile`, `runner.hap`)."""


def _add_fallback(p: argparse.ArgumentParser) -> None:
    """The --fallback option of every command that captures a model."""
    p.add_argument("--fallback", choices=["auto", "replicate", "strict"], default=None,
                   help="operators with no sharding rule: 'auto' (default) runs mask/position arithmetic unsharded, "
                        "'replicate' every such op, 'strict' none")


def build_parser(more: Commands | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hap", description="Plan SPMD training of one model on a heterogeneous GPU cluster (HAP).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="synthesize a plan and compare it with data parallelism")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--cluster", required=True, help="cluster spec JSON (see sample_clusters/)")
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument("--time-budget", type=limits.bounded_float(0, limits.MAX_TIME_BUDGET_S, "seconds", low_open=True),
                   default=None, metavar="S", help="stop searching after S seconds")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer state counted in memory")
    p.add_argument("--segments", type=limits.bounded_int(1, limits.MAX_SEGMENTS, "a segment count"), default=1, metavar="N",
                   help="give N runs of layers their own sharding ratios (HAP §5.2; default 1)")
    p.add_argument("--overlap", choices=PLAN_OVERLAPS, default="auto",
                   help="overlap of communication with computation: 'ddp' gradient buckets during backward, 'duplex' "
                        "two half-batches (HiDup), 'none' nothing; 'auto' (default) plans in ddp and duplex and keeps "
                        "the faster")
    p.add_argument("--parallelism", choices=PARALLELISMS, default="spmd",
                   help="'spmd' (default) every device runs every layer (HAP); 'pipeline' layers in stages on device "
                        "groups (HAPT); 'auto' plans both and keeps the faster (helps across slow links)")
    p.add_argument("--microbatches", type=limits.bounded_int(1, 4096, "a microbatch count"), default=None, metavar="N",
                   help="pipeline plans: fix the number of microbatches B (default: searched)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="'fp32' (default), or mixed precision under torch.autocast: 'bf16', or 'fp16' with a dynamic "
                        "loss scaler (parameters, gradients and Adam state stay fp32)")
    p.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="dtype gradients are all-reduced in: 'fp32' (default) or 'bf16' (as DDP's bf16 compression hook)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="auto",
                   help="activation recomputation per layer: 'auto' (default) only where memory binds, 'none', 'all'")
    p.add_argument("--shard-states", choices=["auto", "0", "1", "2", "3"], default="auto",
                   help="ZeRO stage of replicated weights: 1 optimizer state, 2 and gradients, 3 and the weights "
                        "(gathered on use), sharded unevenly by the LP; 0 none; 'auto' (default) per weight where needed to fit")
    p.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")
    _add_fallback(p)
    p.set_defaults(func=cmd_plan)
    rp = sub.add_parser("replan", help="plan an existing plan's model on a changed cluster and show what the switch moves")
    rp.add_argument("plan", help="the old plan JSON (its model is embedded)")
    rp.add_argument("--cluster", required=True, help="the new cluster spec JSON (devices removed, added or changed)")
    rp.add_argument("--out", help="write the new plan JSON here")
    rp.add_argument("--time-budget", type=limits.bounded_float(0, limits.MAX_TIME_BUDGET_S, "seconds", low_open=True),
                    default=None, metavar="S", help="stop each search after S seconds")
    rp.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                    help="optimizer state counted in memory and moved (default: the old plan's)")
    rp.set_defaults(func=cmd_replan)
    c = sub.add_parser("capture", help="capture a model into a graph JSON file")
    c.add_argument("--model", required=True, help=MODEL_HELP)
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    c.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    c.add_argument("--out", required=True)
    _add_fallback(c)
    c.set_defaults(func=cmd_capture)
    e = sub.add_parser("export", help="write a launch bundle (plan, cluster, model, torchrun/Slurm/Kubernetes files)")
    e.add_argument("plan", help="plan JSON from `hap plan --out` (SPMD or pipeline)")
    e.add_argument("--out", required=True, metavar="DIR", help="bundle folder to create (new or empty)")
    e.add_argument("--zip", action="store_true", help="also write DIR.zip")
    e.add_argument("--cluster", metavar="FILE", help="cluster spec the plan was made for (default: the sample cluster of its name)")
    e.add_argument("--model-file", metavar="F", help="the Python file defining the model (default: the file the plan "
                   "names; its sha256 must be the plan's)")
    e.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous (default: node 0's machine, port 29500)")
    e.add_argument("--image", default="hap-workbench:latest", help="container image for the Kubernetes files")
    e.add_argument("--run-args", metavar="'OPTIONS'", help="runner options written into the Kubernetes files, "
                   "e.g. '--steps 1000 --checkpoint-dir /ckpt --checkpoint-every 100 --resume'")
    e.add_argument("--annotations", action="store_true",
                   help="also write hspmd_annotations.json: every tensor in Hetu's HSPMD terms (DG/DS union, HSize, HDim)")
    e.add_argument("--partition", metavar="P", help="Slurm partition, written into slurm.sbatch (#SBATCH --partition)")
    e.add_argument("--account", metavar="A", help="Slurm account (#SBATCH --account)")
    e.add_argument("--time", metavar="T", help="Slurm time limit, e.g. 30, 2:00:00 or 1-12 (#SBATCH --time)")
    e.add_argument("--qos", metavar="Q", help="Slurm quality of service (#SBATCH --qos)")
    e.add_argument("--setup", metavar="FILE", help="a shell prelude (module loads, environment activation) shipped "
                   "as setup.sh and sourced on every node before torchrun by slurm.sbatch and launch_node.sh")
    e.set_defaults(func=cmd_export)
    b = sub.add_parser("bundle", help="launch bundle tools")
    bsub = b.add_subparsers(dest="bundle_command", required=True)
    bc = bsub.add_parser("check", help="validate a bundle without running it", epilog=BUNDLE_EXIT_CODES,
                         description="Check a bundle folder or zip: manifest, sha256 of every file, no extra or "
                                     "missing file, plan and cluster parse, the plan validated against the theory and "
                                     "re-priced on the cluster (engine.spmd.validate), and every launch file and the "
                                     "README written again from plan, cluster and the recorded export settings and "
                                     "compared (a hand-edited script is refused even with its hash edited too).")
    bc.add_argument("bundle", help="bundle folder or zip from `hap export`")
    bc.add_argument("--digest", metavar="SHA256", type=digest_arg,
                    help="also require this digest (the sha256 of manifest.json that `hap export` printed)")
    bc.set_defaults(func=cmd_bundle_check)
    u = sub.add_parser("ui", help="serve the Streamlit workbench (binds 127.0.0.1 by default)")
    u.add_argument("--port", type=int, default=8501, help="TCP port (default 8501)")
    u.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    u.set_defaults(func=cmd_ui)
    if more is not None:
        more(sub)
    return parser


PASS_THROUGH = ("profile",)
"""Commands whose every option, --help included, belongs to the command itself (`hap profile`)."""


def main(argv: Sequence[str] | None = None, more: Commands | None = None) -> int:
    """Parse `argv` with the planning commands (and `more`), run the command, and map a HapError or an
    unusable path to one line on stderr and exit status 2."""
    parser = build_parser(more)
    args, extra = parser.parse_known_args(argv)
    if args.command in PASS_THROUGH:
        args.options = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except HapError as e:
        print(f"hap: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave cannot be read or written (a folder, no permission, no space)
        where = f"{e.filename}: " if e.filename is not None else ""
        print(f"hap: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hap: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
