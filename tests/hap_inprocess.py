"""`hap ARGS` run in the test's own process: what `python -m runner.hap ARGS` would return and print.

A subprocess costs a fresh interpreter importing torch and the engine (5 s and more on 2 cores)
before the command does anything. A test about what a command does (the plan it writes, the error
line it prints, the refusal before any rank starts) calls `runner.hap.main` here instead, with the
environment and working folder the subprocess would have had and its streams captured, and gets the
same `subprocess.CompletedProcess` back. A test about the fresh process itself (what it imports, that
the console script prints no traceback) keeps its subprocess. `hap run` started here still starts a
real torchrun, unless the test wraps it in tests/runner/warm_run.py's warm torchrun.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path
from typing import Iterator, Mapping, TextIO

import runner.hap
from runner.config import FAULT_ENV

ROOT = Path(__file__).resolve().parent.parent

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", FAULT_ENV)
"""Dropped from the command's environment (as the subprocess helpers drop them): a launcher's variables
would make `hap run` one rank, which leaves through os._exit, and a planted fault is the test's to set."""


@contextlib.contextmanager
def environment(env: Mapping[str, str] | None, cwd: str | Path) -> Iterator[None]:
    """os.environ without LAUNCH_ENV, with `env` on top, and `cwd` as working folder, for the block."""
    if env and {"RANK", "WORLD_SIZE"} & set(env):
        raise ValueError("a command under a launcher (RANK, WORLD_SIZE) is one rank and ends its process with "
                         "os._exit: run it in a subprocess")
    saved, here = dict(os.environ), os.getcwd()
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    os.environ.update(env or {})
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)


def exit_status(code: object) -> int:
    """The process exit status `sys.exit(code)` gives (None: 0, an int: itself, anything else: 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def exit_status_of(e: SystemExit, err: TextIO) -> int:
    """The exit status of `sys.exit(code)`; a message code is printed to `err`, as Python does at exit."""
    if e.code is not None and not isinstance(e.code, int):
        print(e.code, file=err)
    return exit_status(e.code)


def run_hap(*args: str, env: Mapping[str, str] | None = None, cwd: str | Path = ROOT) -> subprocess.CompletedProcess:
    """`hap ARGS` in this process: its exit status (argparse's SystemExit included), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with environment(env, cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = exit_status(runner.hap.main(list(args)))
        except SystemExit as e:  # argparse: a usage error (2) or --help (0)
            code = exit_status_of(e, err)
    return subprocess.CompletedProcess(["hap", *args], code, out.getvalue(), err.getvalue())
