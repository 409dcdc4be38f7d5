"""Auto's overlap modes searched side by side (issue 28): one process per mode where the machine allows it.

Each overlap mode's Q<->B loop (`engine.spmd.iteration._plan_in`) depends only on the graph, the
cluster, the options and the seeds, never on another mode's result, so `auto` may run them at once: the
first in this process, the others in forked children that send back their best plan and what their
loop recorded (history, search counts). The merged result is the one the modes give one after another,
record for record, renumbered as if they had run in turn; only the wall time differs (on 2 cores the
three searches of a 24-layer GPT take the time of about two).

A child is forked, so it shares the parent's graph and tables without copying them; it is used only
where that is safe and pays: several modes, more than one CPU, the `fork` start method, a graph of at
least `MIN_NODES` nodes, and no other thread in the process (a fork copies no other thread, and a lock
one of them holds would stay held in the child: a Streamlit server plans serially). `HAP_PLAN_PARALLEL=0`
turns it off, `=1` forces it (tests).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import traceback
from typing import Any, Callable, TypeVar

from engine.errors import PlanError

T = TypeVar("T")

MIN_NODES = 200
"""Smaller graphs plan in well under a second: forking would cost more than it saves."""
ENV = "HAP_PLAN_PARALLEL"


def can_fork(nodes: int, jobs: int) -> bool:
    """Whether `jobs` mode searches of a graph of `nodes` nodes should run in forked children."""
    setting = os.environ.get(ENV, "")
    if setting == "0" or jobs < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return False
    if multiprocessing.current_process().daemon:
        return False  # a daemonic process may not have children
    if setting == "1":
        return True
    return nodes >= MIN_NODES and (os.cpu_count() or 1) > 1 and threading.active_count() == 1


def run_side_by_side(jobs: list[Callable[[], T]], parallel: bool) -> list[T]:
    """Each job's result, in order: all in this process one after another, or (`parallel`) the first
    here while the others run in forked children. A child's exception is raised here (its type kept
    where it pickles, else as a PlanError carrying its traceback)."""
    if not parallel or len(jobs) < 2:
        return [job() for job in jobs]
    ctx = multiprocessing.get_context("fork")
    children = []
    gc.freeze()  # the children's collector then never walks (and so never copies) the parent's objects
    for job in jobs[1:]:
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(job, send), daemon=True)
        child.start()
        send.close()
        children.append((child, receive))
    try:
        results = [jobs[0]()]
        for child, receive in children:
            results.append(_result(child, receive))
        return results
    finally:
        gc.unfreeze()
        for child, receive in children:
            receive.close()
            if child.is_alive():
                child.kill()
            child.join()


def _child(job: Callable[[], Any], send) -> None:
    try:
        out: tuple[str, Any] = ("ok", job())
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        out = ("error", (e, traceback.format_exc()))
    try:
        send.send(out)
    except Exception as e:  # noqa: BLE001 - an unpicklable exception: send its text
        send.send(("error", (None, f"{type(e).__name__}: {e}\n{out[1][1] if out[0] == 'error' else ''}")))
    send.close()


def _result(child, receive) -> Any:
    try:
        kind, value = receive.recv()
    except EOFError:
        child.join()
        raise PlanError(f"a mode search's process ended without a result (exit code {child.exitcode}); "
                        f"set {ENV}=0 to plan the overlap modes one after another") from None
    if kind == "ok":
        return value
    error, text = value
    if isinstance(error, BaseException):
        raise error
    raise PlanError(f"a mode search failed in its process:\n{text}")
