"""`hap run PLAN.json|BUNDLE [--steps N] [--verify] [--metrics FILE] [--seed S] ...`

Under an existing launch (torchrun or a Slurm script that sets RANK and WORLD_SIZE) this process
is one rank: it runs `runner.launch` in-process. Otherwise it starts

    python -m torch.distributed.run --standalone --nproc-per-node=<plan world size> -m runner.launch ...

on this machine, relays its output, and returns its exit status. When a rank crashes or is
killed, torchrun stops the others and fails; this command then prints first one line naming the
rank that failed first with its exception (`hap run: rank 3 failed: ValueError: ...`, from the
ranks' error records, runner.failure), and names the log file holding every rank's traceback.
Tracebacks are not relayed as they come: from the first one on, the output goes to that log.

The plan is validated (engine.spmd.validate) before torchrun starts: an inconsistent plan exits with
status 2 and one line naming the problem; a bundle's plan is also re-priced on its cluster.json
(`warning: ...` when the prediction moved).
SIGTERM or SIGHUP to this command (a scheduler cancelling the job) is relayed to torchrun, which
stops every rank; the command then exits with 128 + the signal number.

A launch bundle (folder or zip from `hap export`) is checked against its manifest before
torchrun starts (a changed, extra or missing file is refused by name, exit status 2); a zip is
extracted once, safely, into a temporary folder that the ranks then run from; that folder is
removed however the command ends (SIGTERM included: runner.scratch), after torchrun has exited.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from engine.bundle.archive import OpenedBundle, check_on_cluster, model_file_of
from engine.errors import HapError
from engine.pipeline.plan import PipelinePlan
from engine.planner import load_plan
from runner import launch
from runner.config import RunConfig, parse_args
from runner.elastic import run_elastic
from runner.pipeline import check_pipeline_options, load_pipeline_plan
from runner.rank_setup import check_inputs, checked_sources, exit_process, opened_source
from runner.torchrun import run_torchrun, under_launcher


def main(argv: Sequence[str]) -> int:
    cfg = parse_args(argv)
    if under_launcher():  # this process is one rank; it exits here (see rank_setup.exit_process)
        exit_process(launch.main(argv))
    if cfg.elastic:

        return run_elastic(cfg, argv)
    try:
        with opened_source(cfg.plan, digest=cfg.digest) as (plan_path, opened, scratch):  # a zip's folder removed on every way out
            source = str(Path(plan_path).parent) if scratch else cfg.plan  # the ranks run the extracted folder
            module, world_size, warnings = check_launch(cfg, plan_path, opened, source)
            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
            sys.stdout.flush()
            return run_torchrun(world_size, with_source(argv, cfg.plan, source), module=module)
    except (HapError, ValueError, OSError) as e:
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2


def check_launch(cfg: RunConfig, plan_path: str, opened: OpenedBundle | None,
                 source: str) -> tuple[str, int, list[str]]:
    """(rank module, world size, warnings) once the plan and options are checked as every rank will check them."""
    plan = load_plan(plan_path)  # validated (engine.spmd.validate): an inconsistent plan stops here
    warnings = check_on_cluster(plan, opened.cluster) if opened else []
    if isinstance(plan, PipelinePlan):  # its own rank entry (runner.pipeline_run), one rank per device
        check_pipeline_options(cfg, plan.world_size)
        pipe = load_pipeline_plan(plan_path, plan.world_size, model_file_of(opened) if opened else None)
        checked_sources(pipe, cfg)  # data, evaluation data, weights and output folders, before torchrun
        return "runner.pipeline_run", plan.world_size, warnings
    check_inputs(dataclasses.replace(cfg, plan=source), plan.world_size)
    return "runner.launch", plan.world_size, warnings


def with_source(argv: Sequence[str], old: str, new: str) -> list[str]:
    """argv with the plan/bundle argument `old` replaced by `new` (the extracted bundle folder)."""
    out = list(argv)
    out[out.index(old)] = new
    return out
