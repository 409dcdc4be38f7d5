"""`hap run PLAN --elastic CLUSTER.json`: a job that loses a rank continues on the others (issue 16).

What is torchrun's and what is ours. torchrun starts the ranks, runs the rendezvous, watches them,
and when one dies stops the others and exits with its 'Root Cause' summary; `hap run` names that
rank (runner.cli.first_failure). torchrun's own elastic restart (`--max-restarts`) restarts the
*same* number of workers per node, and its world size only changes by whole nodes
(`--nnodes=MIN:MAX`), so it cannot continue one machine's job without one of its GPUs. That switch
is ours: this supervisor drops the failed rank's device from the cluster spec, re-plans the model
on the rest (engine.replan, the old program as incumbent), and starts torchrun again on the new
world size with `--resume`, so the ranks reshard the newest complete checkpoint onto the new plan
(runner.reshard). It repeats for every failure until the job reaches its last step or one device
is left.

Each switch is logged: the supervisor prints which rank failed, the re-plan time and the steps
lost (steps done after the checkpoint, read from the metrics file); rank 0 of the new job prints
the whole switch (old and new world size, re-plan and reshard seconds, steps lost) and writes it
to the metrics file as a record `{"event": "elastic_switch", ...}`. Without `--metrics` the
metrics go to `<checkpoint dir>/metrics.jsonl`. New plans are saved as
`<checkpoint dir>/elastic/plan-<n>.json`.

A fault planted for tests (runner.launch FAULT_ENV) applies to the first launch only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from engine.bundle.unpack import is_bundle
from engine.cluster.spec import Cluster, load_cluster
from engine.elastic.replan import replan, without_devices
from engine.errors import HapError
from engine.planner import load_plan
from engine.spmd.plan import Plan
from runner import checkpoint
from runner.config import FAULT_ENV
from runner.rank_setup import check_inputs
from runner.torchrun import run_torchrun

SWITCH_ENV = "HAP_ELASTIC_SWITCH"
"""JSON of the switch a relaunched job continues after (set by the supervisor for the new ranks)."""
EVENT = "elastic_switch"
BAD_INPUT = 2
"""A rank's exit status for inputs it refused (runner.launch.run): not a device failure."""


@dataclass(frozen=True)
class Switch:
    """One change of plan after a failure."""

    number: int
    """1 for the first switch of the job."""
    failed_rank: int
    failed_device: str
    old_world: int
    new_world: int
    resume_step: int
    """Steps done by the checkpoint the new job continues from."""
    steps_lost: int
    """Steps the failed job had finished after that checkpoint (they are run again)."""
    replan_s: float
    plan: str
    """The new plan's file."""

    def record(self, reshard_s: float) -> dict[str, Any]:
        return {"event": EVENT, **dataclasses.asdict(self), "reshard_s": reshard_s}

    def line(self, reshard_s: float) -> str:
        return (f"hap run: elastic switch {self.number}: {self.old_world} -> {self.new_world} ranks "
                f"(rank {self.failed_rank}, device {self.failed_device}, failed); re-plan {self.replan_s:.3f} s, "
                f"reshard {reshard_s:.3f} s, {self.steps_lost} step{'s' if self.steps_lost != 1 else ''} lost, "
                f"continuing after step {self.resume_step}")


def switching(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this rank belongs to a job started by a switch."""
    return bool(environ.get(SWITCH_ENV))


def report_switch(write: Callable[[dict], None], reshard_s: float, environ: Mapping[str, str] = os.environ) -> None:
    """Rank 0 of a relaunched job: print the switch it continues after and write it to the metrics."""
    switch = Switch(**json.loads(environ[SWITCH_ENV]))
    print(switch.line(reshard_s), flush=True)
    write(switch.record(reshard_s))


def check_cluster(plan: Plan, path: str) -> Cluster:
    """The --elastic cluster, refused unless its devices are exactly the plan's."""
    cluster = load_cluster(path)
    names = [d.name for d in cluster.devices]
    if sorted(names) != sorted(plan.device_names):
        raise ValueError(f"--elastic {path}: its devices ({', '.join(names)}) are not the plan's "
                         f"({', '.join(plan.device_names)}); plan on that cluster (hap plan --cluster {path})")
    return cluster


def steps_reached(metrics: str, steps_done_from: int) -> int:
    """Steps after `steps_done_from` that rank 0 finished according to the metrics file."""
    path = Path(metrics)
    if not path.is_file():
        return 0
    steps = [r["step"] for r in map(json.loads, filter(str.strip, path.read_text().splitlines()))
             if "event" not in r and r.get("rank") == 0 and isinstance(r.get("step"), int)]
    return max([s + 1 for s in steps if s >= steps_done_from], default=steps_done_from) - steps_done_from


def newest_checkpoint(root: str) -> int:
    """Steps done by the newest complete checkpoint under `root` (0: none)."""
    done = [int(p.parent.name.split("-", 1)[1]) for p in Path(root).glob(f"step-*/{checkpoint.COMPLETE}")]
    return max(done, default=0)


def relaunch_argv(argv: Sequence[str], plan: str, new_plan: str, metrics: str, speeds: str | None) -> list[str]:
    """The user's options for the new plan: --resume, the metrics file, the survivors' speeds (later options win)."""
    out = list(argv)
    out[out.index(plan)] = new_plan
    out += ["--resume", "--metrics", metrics]
    return out + (["--speeds", speeds] if speeds else [])


def no_switch(code: int, failed: tuple[int, int | None] | None, reached: int, steps: int, world: int) -> str | None:
    """Why a finished launch is not followed by a switch (None: re-plan without the failed rank)."""
    if code == 0:
        return "the job succeeded"
    if failed is None:
        return "torchrun named no failed rank"
    if failed[1] == BAD_INPUT:
        return f"rank {failed[0]} refused its inputs (exit status {BAD_INPUT}), which is no device failure"
    if reached >= steps:
        return f"the failure came after the last step ({steps})"
    if world == 1:
        return "no device would be left"
    return None


def run_elastic(cfg: Any, argv: Sequence[str]) -> int:
    """Run the job; after each rank failure re-plan without its device and continue (see the module doc)."""

    try:
        if is_bundle(cfg.plan):  # asked without extracting a zip (which left its scratch folder behind)
            raise ValueError("--elastic runs a plan file, not a bundle (a switch writes new plans)")
        plan = load_plan(cfg.plan)
        cluster = check_cluster(plan, cfg.elastic)
        check_inputs(cfg, plan.world_size)
    except (HapError, ValueError, OSError) as e:
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2
    metrics = cfg.metrics or str(Path(cfg.checkpoint_dir) / "metrics.jsonl")
    Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    args, extra, drop = [*argv, "--metrics", metrics], {}, ()
    speeds = cfg.speeds.split(",") if cfg.speeds else None
    for number in range(1, plan.world_size + 1):
        failed: list[tuple[int, int | None]] = []
        sys.stdout.flush()
        code = run_torchrun(plan.world_size, args, extra_env=extra, drop_env=drop, failed=failed)
        done = newest_checkpoint(cfg.checkpoint_dir)
        reached = done + steps_reached(metrics, done)
        why = no_switch(code, failed[0] if failed else None, reached, cfg.steps, plan.world_size)
        if why:
            if code != 0:
                print(f"hap run: elastic: not re-planned: {why}", file=sys.stderr, flush=True)
            return code
        rank = failed[0][0]
        began = time.perf_counter()
        try:
            new = replan(plan, without_devices(cluster, [plan.device_names[rank]]), optimizer=plan.options.optimizer).plan
        except HapError as e:
            print(f"hap run: elastic: cannot re-plan without device {plan.device_names[rank]}: {e}", file=sys.stderr)
            return code
        replan_s = time.perf_counter() - began
        path = Path(cfg.checkpoint_dir) / "elastic" / f"plan-{number}.json"
        path.parent.mkdir(exist_ok=True)
        new.save(path)
        switch = Switch(number, rank, plan.device_names[rank], plan.world_size, new.world_size, done,
                        reached - done, replan_s, str(path))
        print(f"hap run: elastic: rank {rank} (device {switch.failed_device}) failed; re-planned for "
              f"{new.world_size} devices in {replan_s:.3f} s ({path}); continuing after step {done}, "
              f"{switch.steps_lost} step(s) lost", flush=True)
        if speeds:  # in the new plan's rank order
            speeds = [dict(zip(plan.device_names, speeds))[name] for name in new.device_names]
        args = relaunch_argv(argv, cfg.plan, str(path), metrics, ",".join(speeds) if speeds else None)
        extra, drop = {SWITCH_ENV: json.dumps(dataclasses.asdict(switch))}, (FAULT_ENV,)
        cluster = without_devices(cluster, [switch.failed_device])
        plan = new
    return 1
