"""Run a function on m fresh local processes joined by a gloo group (tests only; `hap run` uses torchrun).

Every call gets its own processes (torch.multiprocessing, spawn) and its own `file://`
rendezvous; results come back through files, never through a queue (a large result in a queue
deadlocks `join`); an outer deadline kills the processes and fails the test instead of hanging.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0


def init_gloo(rank: int, world_size: int, init_method: str, timeout_s: float = 60.0) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _entry(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple) -> None:
    out = Path(workdir)
    status = 0
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
    os._exit(status)  # no interpreter finalisation: see runner.launch.exit_process


def run_ranks(fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """`fn(rank, world_size, init_method, *args)` on `world_size` processes; each rank's return value.

    `fn` must be importable (a module-level function) and initialise the process group itself,
    e.g. with `init_gloo(rank, world_size, init_method)`.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(fn, world_size, str(workdir), args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks still running after {timeout_s:.0f} s{_errors(workdir)}")
    except mp.ProcessExitedException as e:
        raise AssertionError(f"rank {e.error_index} exited with status {e.exit_code}{_errors(workdir)}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [pickle.loads((workdir / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _errors(workdir: Path) -> str:
    texts = [f"\n--- {p.stem} ---\n{p.read_text()}" for p in sorted(workdir.glob("rank*.err"))]
    return "".join(texts)
