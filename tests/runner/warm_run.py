"""`hap run` (and `hap profile`) in the test's process, with torchrun replaced by warm ranks (tests only).

`runner.torchrun.run_torchrun` starts `python -m torch.distributed.run --standalone --nproc-per-node=N
-m MODULE ARGV`, relays its stderr and waits for it; torchrun then starts N fresh interpreters that
each import torch (seconds each on 2 cores). Inside `warm_torchrun()` run_torchrun starts a
`WarmTorchrun` instead: N ranks forked from dist_harness's forkserver (torch, the engine and the
runner imported once per test session), each given the environment torchrun's agent gives its
workers on one node (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, OMP_NUM_THREADS=1, ...) on top of the one run_torchrun passes (its extra_env and drop_env
applied, the folder for the ranks' error records), each running `MODULE.main(ARGV)` and leaving
through `runner.rank_setup.exit_process` as `python -m MODULE` does.

Towards run_torchrun it behaves as torchrun does: when a rank fails it stops the others (SIGTERM,
then SIGKILL), its stderr carries the ranks' stderr and then the exception torchrun raises
(torch's own `ChildFailedError` summary, whose 'Root Cause' names the first failed rank and its exit
code), and its exit status is 1; 0 when every rank exits 0. So everything of `hap run` but the
torchrun process is the real code: the checks before the launch, the ranks (training, verify,
bundles, pipelines, error records), and run_torchrun's relay, failure report, `failed` list and
signal forwarding.

What is not torchrun's: the ranks' output comes when they have all ended (stdout to sys.stdout,
stderr through run_torchrun's relay), not as they write it; there is no rendezvous agent (rank 0
hosts the process group's store, as under a Slurm script, so TORCHELASTIC_USE_AGENT_STORE is not
set) and no torchrun log lines. Tests of those keep a real `hap run` (see the runner tests' `hap`).
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing.connection as mp_connection
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import dist_harness
import torch
from conftest import free_port
from hap_inprocess import ROOT, exit_status, exit_status_of, run_hap

import runner.torchrun
from runner.rank_setup import exit_process
from runner.torchrun import torchrun_command

DEFAULT_TIMEOUT_S = 300.0
"""After this long the ranks still running are killed and the launch fails (instead of hanging the test)."""
STOP_GRACE_S = 10.0
"""Between the SIGTERM to the ranks still running after a failure and their SIGKILL (torchrun waits 30 s)."""


def parse_command(command: Sequence[str]) -> tuple[int, str, list[str]]:
    """(world size, module, argv) of the command `runner.torchrun.torchrun_command` makes; any other is refused."""
    command = list(command)
    try:  # [python, -m, torch.distributed.run, --standalone, --nproc-per-node=N, -m, MODULE, *ARGV]
        world_size, module, argv = int(command[4].removeprefix("--nproc-per-node=")), command[6], command[7:]
    except (IndexError, ValueError):
        world_size, module, argv = 0, "", []
    if command != torchrun_command(world_size, argv, module):
        raise ValueError(f"not a torchrun command of runner.torchrun: {command}")
    return world_size, module, argv


def rank_environ(env: Mapping[str, str], rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun puts in the environment of worker `rank` on one node (its default OMP_NUM_THREADS,
    then torch.distributed.elastic's LocalElasticAgent._start_workers), on top of torchrun's own `env`."""
    out = dict(env)
    if "OMP_NUM_THREADS" not in out and world_size > 1:
        out["OMP_NUM_THREADS"] = "1"
    out.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # no agent: rank 0 hosts the store at MASTER_PORT
    out.update(RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default", LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), WORLD_SIZE=str(world_size), GROUP_WORLD_SIZE="1",
               ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id,
               TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    return out


def rank_main(module: str, argv: list[str], environ: dict[str, str], cwd: str, workdir: str, rank: int) -> None:
    """One rank as `python -m MODULE ARGV` would be under torchrun: its environment, working folder and
    thread count, its output in files of `workdir`, its exit status what MODULE's main returns or raises."""
    dist_harness.enter_rank(workdir, rank, environ, cwd)
    if environ.get("OMP_NUM_THREADS", "").isdigit():  # what a fresh interpreter's torch reads at import
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    sys.argv = [module, *argv]
    exit_process(run_main(lambda: importlib.import_module(module).main(list(argv))))


def run_main(main: Callable[[], Any]) -> int:
    """The exit status of a process whose `__main__` calls `main` (an uncaught exception: its traceback, 1)."""
    try:
        return exit_status(main())
    except SystemExit as e:
        return exit_status_of(e, sys.stderr)
    except BaseException:
        traceback.print_exc()
        return 1


def failure_summary(module: str, failures: dict[int, int], pids: list[int]) -> str:
    """The end of torchrun's stderr when ranks failed: the ChildFailedError it raises, formatted by torch."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error = ChildFailedError(module, {r: ProcessFailure(local_rank=r, pid=pids[r], exitcode=code, error_file="<N/A>")
                                      for r, code in sorted(failures.items())})
    return ("Traceback (most recent call last):\n  (raised by torchrun's launcher: warm torchrun, no frames)\n"
            f"{ChildFailedError.__module__}.{ChildFailedError.__name__}: \n{error.format_msg()}\n")


class WarmTorchrun:
    """The `subprocess.Popen` of torchrun that run_torchrun gets inside warm_torchrun(): the ranks, forked warm.

    `stderr` yields the ranks' stderr lines (then torchrun's failure summary) once every rank has
    ended; `wait` returns torchrun's exit status; `send_signal` goes to every rank still running.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str] | None = None, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **_popen: Any) -> None:
        self.world_size, self.module, argv = parse_command(command)
        self.timeout_s = timeout_s
        self.returncode: int | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="warm-torchrun-"))
        base, port, run_id = dict(os.environ if env is None else env), free_port(), f"warm-{uuid.uuid4().hex[:8]}"
        ctx = dist_harness.context()
        self.procs = [ctx.Process(target=rank_main, daemon=True,
                                  args=(self.module, argv, rank_environ(base, r, self.world_size, port, run_id),
                                        os.getcwd(), str(self.workdir), r))
                      for r in range(self.world_size)]
        dist_harness.start(self.procs)
        self.stderr: Iterator[str] = self._supervise()

    def _supervise(self) -> Iterator[str]:
        """Watch the ranks, stop them after a failure, relay their stdout; then their stderr and the summary."""
        try:
            failures = self._watch()
        finally:
            self._stop()
        self.returncode = 0 if failures == {} else 1
        lines = self._collect()
        if failures is None:
            lines.append(f"warm torchrun: ranks still running after {self.timeout_s:.0f} s were killed\n")
        elif failures:
            lines += failure_summary(self.module, failures, [p.pid for p in self.procs]).splitlines(keepends=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        yield from lines

    def _watch(self) -> dict[int, int] | None:
        """{} when every rank exited 0; else the ranks found failed (exit code != 0) when the first failure was
        seen, with their exit codes, as torchrun's monitor sees them; None at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            codes = [p.exitcode for p in self.procs]
            failed = {r: code for r, code in enumerate(codes) if code not in (None, 0)}
            if failed or all(code == 0 for code in codes):
                return failed
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            mp_connection.wait([p.sentinel for p, code in zip(self.procs, codes) if code is None], timeout=min(left, 1.0))

    def _stop(self) -> None:
        """Stop the ranks still running as torchrun does: SIGTERM, then SIGKILL after STOP_GRACE_S."""
        running = [p for p in self.procs if p.exitcode is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in running:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)

    def _collect(self) -> list[str]:
        """Every rank's stdout written to sys.stdout (the ranks share it under torchrun); their stderr lines."""
        def text(rank: int, stream: str) -> str:
            path = self.workdir / f"rank{rank}.{stream}"
            return path.read_text(errors="replace") if path.exists() else ""

        sys.stdout.write("".join(text(r, "stdout") for r in range(self.world_size)))
        sys.stdout.flush()
        return [line for r in range(self.world_size) for line in text(r, "stderr").splitlines(keepends=True)]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        for _ in self.stderr:  # not read yet: supervise the ranks all the same
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.returncode is None:  # interrupted while watching (KeyboardInterrupt): the ranks are stopped
            self.returncode = 1
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """torchrun relays SIGTERM, SIGHUP and SIGINT to its workers."""
        for p in self.procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)


class WarmSubprocess:
    """The `subprocess` module as runner.torchrun sees it inside warm_torchrun(): Popen starts a WarmTorchrun."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def Popen(self, command: Sequence[str], **kwargs: Any) -> WarmTorchrun:  # noqa: N802 (subprocess's name)
        return WarmTorchrun(command, timeout_s=self.timeout_s, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


@contextlib.contextmanager
def warm_torchrun(timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Inside the block, `runner.torchrun.run_torchrun` (hence `hap run`, its elastic supervisor and
    `hap profile`) starts a WarmTorchrun where it would start torchrun."""
    saved = runner.torchrun.subprocess
    runner.torchrun.subprocess = WarmSubprocess(timeout_s)  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.torchrun.subprocess = saved


def warm_hap(*args: str, env: Mapping[str, str] | None = None, timeout: float = DEFAULT_TIMEOUT_S,
             cwd: str | Path = ROOT) -> subprocess.CompletedProcess:
    """`hap ARGS` in this process (hap_inprocess.run_hap) with torchrun warm: the exit status, stdout and
    stderr the runner tests' subprocess `hap` would give, `env` added to the environment the same way."""
    with warm_torchrun(timeout):
        return run_hap(*args, env=env, cwd=cwd)
