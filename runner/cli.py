"""`hap run PLAN.json|BUNDLE [--steps N] [--verify] [--metrics FILE] [--seed S] ...`

Under an existing launch (torchrun or a Slurm script that sets RANK and WORLD_SIZE) this process
is one rank: it runs `runner.launch` in-process. Otherwise it starts

    python -m torch.distributed.run --standalone --nproc-per-node=<plan world size> -m runner.launch ...

on this machine, relays its output, and returns its exit status. When a rank crashes or is
killed, torchrun stops the others and fails; this command then names the rank that failed first.

A launch bundle (folder or zip from `hap export`) is checked against its manifest before
torchrun starts (a changed, extra or missing file is refused by name, exit status 2); a zip is
extracted once, safely, into a temporary folder that the ranks then run from.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from engine.errors import HapError
from engine.plan import Plan

from . import launch

REPO_ROOT = Path(__file__).resolve().parent.parent
_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def under_launcher(env=os.environ) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env


def torchrun_command(world_size: int, argv: Sequence[str], module: str = "runner.launch") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", module, *argv]


def child_env() -> dict[str, str]:
    """Our environment, with this checkout importable by the ranks (`-m runner.launch`)."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def failed_rank(stderr_text: str) -> tuple[int, int] | None:
    """(rank, exit code) of torchrun's 'Root Cause (first observed failure)', if it printed one."""
    _, sep, tail = stderr_text.rpartition("Root Cause")
    m = _ROOT_CAUSE.search(tail if sep else stderr_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def describe_failure(returncode: int, stderr_text: str, command: str = "hap run") -> str:
    found = failed_rank(stderr_text)
    if found is None:
        return f"{command}: torchrun exited with status {returncode}"
    rank, code = found
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"{command}: rank {rank} {how}; torchrun stopped the other ranks (exit status {returncode})"


def run_torchrun(world_size: int, argv: Sequence[str], module: str = "runner.launch", command: str = "hap run") -> int:
    """Start torchrun with `-m module argv`, relay its output, and explain a failure by naming the rank."""
    proc = subprocess.Popen(torchrun_command(world_size, argv, module), env=child_env(), stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    tail: list[str] = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            sys.stderr.write(line)
            tail = (tail + [line])[-200:]
        returncode = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    if returncode != 0:
        print(describe_failure(returncode, "".join(tail), command), file=sys.stderr, flush=True)
    return returncode


def main(argv: Sequence[str]) -> int:
    cfg = launch.parse_args(argv)
    if under_launcher():  # this process is one rank; it exits here (see launch.exit_process)
        launch.exit_process(launch.main(argv))
    scratch = None
    try:
        plan_path, _, scratch = launch.open_source(cfg.plan)
        source = str(Path(plan_path).parent) if scratch else cfg.plan  # the ranks run the extracted folder
        world_size = Plan.from_json(plan_path).world_size
        launch.check_inputs(dataclasses.replace(cfg, plan=source), world_size)
    except (HapError, ValueError, OSError) as e:
        print(f"hap run: error: {e}", file=sys.stderr)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        return 2
    sys.stdout.flush()
    try:
        return run_torchrun(world_size, with_source(argv, cfg.plan, source))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def with_source(argv: Sequence[str], old: str, new: str) -> list[str]:
    """argv with the plan/bundle argument `old` replaced by `new` (the extracted bundle folder)."""
    out = list(argv)
    out[out.index(old)] = new
    return out
