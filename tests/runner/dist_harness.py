"""Run a function on m local rank processes joined by a gloo group (tests only; `hap run` uses torchrun,
which warm_run.py replaces by ranks started here for the tests of what `hap run` does).

Ranks start from a warm parent: a forkserver that imported torch, the engine and the runner once for
the whole test session (`multiprocessing.set_forkserver_preload`), so a rank costs a fork, not a fresh
interpreter importing torch (seconds each on 2 cores). Every call still gets its own processes, its
own `file://` rendezvous and the caller's environment and working folder as they are at the call;
what the ranks print is relayed to the caller's stdout and stderr when they end (so `capfd` sees it);
results come back through files, never through a queue (a large result in a queue deadlocks `join`);
an outer deadline kills the processes and fails the test instead of hanging.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
PRELOAD = ["torch", "torch.distributed", "torch.fx", "torch._dynamo", "torch.optim", "engine", "engine.model.source",
           "engine.theory", "runner.launch", "runner.pipeline", "runner.pipeline_run", "runner.train", "runner.reshard",
           "runner.data",
           "pyarrow.parquet", "transformers.models.llama.modeling_llama", "dist_harness", "warm_run"]
"""Imported once, in the forkserver, before any rank forks from it. torch._dynamo among them: the first
optimizer a process builds imports it (torch.optim's `_disable_dynamo`), 10 s per rank on 2 cores. The
transformers Llama: examples/llama_tiny.py and hf:LlamaForCausalLM plans import it in every rank (5 s each)."""
START_METHOD = os.environ.get("HAP_TEST_START_METHOD", "forkserver")
"""`forkserver` (warm ranks); `spawn` gives every rank a fresh interpreter, to rule the harness out."""

_context: Any = None


def context() -> Any:
    """The multiprocessing context ranks start from (the forkserver is started on first use)."""
    global _context
    if _context is None:
        _context = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            _context.set_forkserver_preload(PRELOAD)
    return _context


def start(procs: list) -> None:
    """Start the rank processes (and the forkserver, on first use) with a bare `__main__`.

    multiprocessing re-runs the parent's main file in every child it starts. Under pytest that is
    pytest's own, but Streamlit's AppTest leaves the page it ran (app/main.py) as `__main__`, and
    every rank of a later test in the same process then ran the whole page first: 10 s a rank on 2 cores.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        for p in procs:
            p.start()
    finally:
        sys.modules["__main__"] = main


def enter_rank(workdir: str | Path, rank: int, environ: Mapping[str, str], cwd: str) -> None:
    """Make this forked process rank `rank` of the caller: its stdout and stderr in files of `workdir`
    (the forkserver's streams are not the caller's), the caller's environment and working folder."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(Path(workdir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def init_gloo(rank: int, world_size: int, init_method: str, timeout_s: float = 60.0) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _entry(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple, environ: dict[str, str],
           cwd: str) -> None:
    out = Path(workdir)
    status = 0
    enter_rank(out, rank, environ, cwd)
    try:
        torch.set_num_threads(1)
        result = fn(rank, world_size, f"file://{out / 'rendezvous'}", *args)
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter finalisation: see runner.rank_setup.exit_process


def run_ranks(fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """`fn(rank, world_size, init_method, *args)` on `world_size` processes; each rank's return value.

    `fn` must be importable (a module-level function) and initialise the process group itself,
    e.g. with `init_gloo(rank, world_size, init_method)`.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = context()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, str(workdir), args, environ, cwd), daemon=True)
             for r in range(world_size)]
    start(procs)
    deadline = time.monotonic() + timeout_s
    try:
        _wait(procs, deadline, workdir, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        _relay(workdir, world_size)
    return [pickle.loads((workdir / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _wait(procs: list, deadline: float, workdir: Path, world_size: int, timeout_s: float) -> None:
    """Until every rank has exited with status 0; the first failure seen (or the deadline) raises, naming the rank."""
    running = list(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{world_size} ranks still running after {timeout_s:.0f} s{_errors(workdir)}")
        ready = mp_connection.wait([p.sentinel for p in running], timeout=min(left, 1.0))
        for p in [p for p in running if p.sentinel in ready]:
            p.join()
            if p.exitcode != 0:
                raise AssertionError(f"rank {procs.index(p)} exited with status {p.exitcode}{_errors(workdir)}")
            running.remove(p)


def _relay(workdir: Path, world_size: int) -> None:
    """Every rank's output onto this process's stdout and stderr (as a spawned rank's would be, for capfd)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for r in range(world_size):
        for fd, name in ((1, "stdout"), (2, "stderr")):
            path = workdir / f"rank{r}.{name}"
            if path.exists():
                os.write(fd, path.read_bytes())


def _errors(workdir: Path) -> str:
    texts = [f"\n--- {p.stem} ---\n{p.read_text()}" for p in sorted(workdir.glob("rank*.err"))]
    return "".join(texts)
