"""Starting torchrun on this machine and reading what its ranks left behind (`hap run`, `hap profile`).

Used by the commands that supervise a run (`runner.cli`, `runner.elastic`, `runner.profile`), never by
a rank itself.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from runner.failure import ERRORS_ENV, read_failures, write_log

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


def failed_ranks(stderr_text: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every failure torchrun's summary lists (its 'Failures' and its 'Root Cause'), once each."""
    return list(dict.fromkeys((int(r), int(c)) for r, c in _ROOT_CAUSE.findall(stderr_text)))


def describe_failure(returncode: int, stderr_text: str, command: str = "hap run",
                     found: tuple[int, int] | None = None) -> str:
    """The line naming a rank that died without an exception (`found`, default torchrun's root cause)."""
    found = found or failed_rank(stderr_text)
    if found is None:
        return f"{command}: torchrun exited with status {returncode}"
    rank, code = found
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"{command}: rank {rank} {how}; torchrun stopped the other ranks (exit status {returncode})"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals a scheduler or a closed terminal sends to stop a job; relayed to torchrun, which stops the ranks."""


def forward_stop_signals(proc: subprocess.Popen, stopped: list[int]) -> dict[int, Any]:
    """Relay SIGTERM/SIGHUP to torchrun (recording them in `stopped`) instead of dying and orphaning
    the ranks; returns the previous handlers. Only the main thread may set handlers: elsewhere none."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def relay(signum: int, _frame: Any) -> None:
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    return {signum: signal.signal(signum, relay) for signum in STOP_SIGNALS}


class StderrRelay:
    """Relays torchrun's stderr as it comes until a traceback starts; keeps every line for the log."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.held: list[str] = []

    def feed(self, line: str) -> None:
        self.lines.append(line)
        if not self.held and not line.startswith(TRACEBACK_START):
            sys.stderr.write(line)
        else:
            self.held.append(line)

    def release(self) -> None:
        """Write the held lines after all (the run did not fail: nothing to report them in)."""
        sys.stderr.write("".join(self.held))
        self.held = []


TRACEBACK_START = "Traceback (most recent call last)"


def failure_report(returncode: int, errors: str, output: str, command: str = "hap run") -> list[str]:
    """First the one line naming the first failed rank and its exception, then where the tracebacks are.

    The first failure is the earliest record, unless a rank torchrun lists as failed left none: it
    died without an exception (SIGKILL, an exit), and the others' records are only its echo
    (connection closed by peer), so that rank and its exit code are the news. Ranks torchrun itself
    stopped (SIGTERM) are not such news. torchrun's root cause is not enough alone: under load it
    may observe an echoing rank exit before the killed one."""
    _, head = first_failure(returncode, errors, output, command)
    log = write_log(errors, read_failures(errors), output)
    return [head, f"{command}: every rank's traceback and torchrun's output are in {log}"]


def first_failure(returncode: int, errors: str, output: str, command: str = "hap run") -> tuple[int | None, str]:
    """(the rank that failed first or None when none is known, the line naming it); see failure_report."""
    found = read_failures(errors)
    recorded = {r.rank for r in found}
    silent = [(rank, code) for rank, code in failed_ranks(output)
              if rank not in recorded and code != -signal.SIGTERM]
    root = failed_rank(output)
    if silent:
        first = root if root in silent else silent[0]
        return first[0], describe_failure(returncode, output, command, first)
    if found:
        return found[0].rank, found[0].headline(command)
    return None, describe_failure(returncode, output, command)


def run_torchrun(world_size: int, argv: Sequence[str], module: str = "runner.launch", command: str = "hap run",
                 *, extra_env: dict[str, str] | None = None, drop_env: Sequence[str] = (),
                 failed: list[tuple[int, int | None]] | None = None) -> int:
    """Start torchrun with `-m module argv`, relay its output, and explain a failure by naming the rank.

    `extra_env`/`drop_env` adjust the ranks' environment; (the rank that failed first, its exit code
    or None), when the rank is known, is appended to `failed` (runner.elastic re-plans without it)."""
    errors = tempfile.mkdtemp(prefix=command.replace(" ", "-") + "-")
    env = {k: v for k, v in {**child_env(), **(extra_env or {}), ERRORS_ENV: errors}.items() if k not in drop_env}
    proc = subprocess.Popen(torchrun_command(world_size, argv, module), env=env, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    relay = StderrRelay()
    stopped: list[int] = []
    previous = forward_stop_signals(proc, stopped)
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            relay.feed(line)
        returncode = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        relay.release()
        shutil.rmtree(errors, ignore_errors=True)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if returncode == 0 or stopped:
        relay.release()
        shutil.rmtree(errors, ignore_errors=True)
    if stopped:
        name = signal.Signals(stopped[0]).name
        print(f"{command}: stopped by {name}; torchrun stopped every rank (exit status {returncode})",
              file=sys.stderr, flush=True)
        return 128 + stopped[0]
    if returncode != 0:
        output = "".join(relay.lines)
        print("\n".join(failure_report(returncode, errors, output, command)), file=sys.stderr, flush=True)
        rank, _ = first_failure(returncode, errors, output, command)
        if failed is not None and rank is not None:
            failed.append((rank, dict(failed_ranks(output)).get(rank)))
    return returncode
