"""One clear line when a rank fails: per-rank error records and the report `hap run` prints.

`hap run` gives the ranks a folder (`HAP_RUN_ERRORS`); a rank that fails writes one JSON record
there (rank, exception type, message, traceback, time) from its top-level handler, before it tears
down its process group, so the first record in time is the first failure (the other ranks fail
after it, when their collectives lose that rank). torchrun's own summary only knows exit codes.
`hap run` then prints first `hap run: rank 3 failed: ValueError: ...`, and writes every rank's
traceback and torchrun's whole output to a log file in that folder, which it names.

A rank killed by a signal or leaving through `os._exit` writes no record; the report falls back on
torchrun's 'Root Cause' summary (rank and exit code, `runner.cli.describe_failure`).
"""
from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

ERRORS_ENV = "HAP_RUN_ERRORS"
"""Folder where each failing rank writes `rank-<r>.json` (set by `hap run` for its ranks)."""
LOG_NAME = "hap-run.log"


@dataclass(frozen=True)
class FailureRecord:
    """The first exception of one rank."""

    rank: int
    kind: str
    """Exception type name, e.g. `ValueError`."""
    message: str
    traceback: str
    time: float
    """time.time() when the rank recorded it."""

    def headline(self, command: str = "hap run") -> str:
        """`hap run: rank 3 failed: ValueError: <first line of the message>`."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{command}: rank {self.rank} failed: {self.kind}" + (f": {first}" if first else "")


def record_failure(rank: int, exc: BaseException, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Write this rank's record (only its first: a later one is a consequence) when `hap run` asked for records."""
    folder = environ.get(ERRORS_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    path = Path(folder) / f"rank-{rank}.json"
    if path.exists():
        return path
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record = {"rank": rank, "kind": type(exc).__name__, "message": str(exc), "traceback": text, "time": time.time()}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # atomic: the reader never sees half a record
    return path


def read_failures(folder: str | Path) -> list[FailureRecord]:
    """Every rank's record in the folder, first failure first (unreadable files are skipped)."""
    out = []
    for p in sorted(Path(folder).glob("rank-*.json")):
        try:
            d = json.loads(p.read_text())
            out.append(FailureRecord(int(d["rank"]), str(d["kind"]), str(d["message"]), str(d["traceback"]), float(d["time"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: (r.time, r.rank))


def write_log(folder: str | Path, failures: list[FailureRecord], output: str) -> Path:
    """The log `hap run` names: every rank's traceback (first failure first), then torchrun's whole stderr."""
    parts = []
    for r in failures:
        parts.append(f"==== rank {r.rank}: {r.kind} (at {time.strftime('%H:%M:%S', time.localtime(r.time))}"
                     f".{int(r.time % 1 * 1000):03d}) ====\n{r.traceback.rstrip()}\n")
    parts.append(f"==== torchrun output (stderr of every rank) ====\n{output}")
    path = Path(folder) / LOG_NAME
    path.write_text("\n".join(parts))
    return path
