"""The `hap` console entry: the engine's planning commands, plus `hap run` and `hap profile`.

It sits above both the engine and the runner (the runner may import the engine; the engine never
imports the runner), so the planning commands stay importable without torch.distributed and the two
execution commands live with the code they run.

    hap run plan.json|BUNDLE [--steps N] [--verify] [--metrics FILE] [--seed S]   (`hap run PLAN --help`)
    hap profile --out cluster.json [--parquet raw.parquet] [--nproc N] [--speeds 1,0.5]   (`hap profile --help`)
    hap data prepare TEXT... --out tokens.parquet [--tokenizer DIR] [--seq-len N]   (`hap data prepare --help`)
"""
from __future__ import annotations

import argparse
import os
import sys
import zipfile
from typing import Any, Sequence

from engine import cli as planning
from engine.bundle.unpack import check_zip
from engine.errors import HapError


def cmd_run(args: argparse.Namespace) -> int:
    try:
        check_zip_first(args.plan)
    except HapError as e:
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2
    from runner.cli import main as run_main  # imports torch: seconds and hundreds of MB

    return run_main([args.plan, *args.options])


def check_zip_first(path: str) -> None:
    """Refuse a bundle zip by its directory before torch is imported, so a zip bomb costs milliseconds (issue 24)."""
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        check_zip(path)


def cmd_profile(args: argparse.Namespace) -> int:
    from runner.profile import main as profile_main

    return profile_main(args.options)


def cmd_data(args: argparse.Namespace) -> int:
    from runner.prepare import main as prepare_main  # imports pyarrow and torch

    return prepare_main(args.options)


def add_commands(sub: Any) -> None:
    """`run`, `profile` and `data`, beside the planning commands."""
    r = sub.add_parser("run", help="train a plan over torch.distributed (starts torchrun on this machine)",
                       epilog="options after PLAN go to the runner: see `hap run PLAN --help`")
    r.add_argument("plan", help="plan JSON from `hap plan --out`, or a launch bundle (folder or zip) from `hap export`")
    r.add_argument("options", nargs=argparse.REMAINDER, help="--steps N --verify --metrics FILE --seed S ...")
    r.set_defaults(func=cmd_run)
    f = sub.add_parser("profile", add_help=False, help="measure this cluster (FLOP/s, collectives) and write a cluster spec",
                       description="options go to the profiler: see `hap profile --help`")
    f.set_defaults(func=cmd_profile)
    d = sub.add_parser("data", help="token datasets for `hap run --data` (hap data prepare TEXT... --out FILE)",
                       epilog="options after the action go to it: see `hap data prepare --help`")
    d.add_argument("action", choices=["prepare"], help="prepare: tokenize text files into a Parquet or Arrow file")
    d.add_argument("options", nargs=argparse.REMAINDER, help="TEXT... --out FILE [--tokenizer DIR] [--seq-len N] ...")
    d.set_defaults(func=cmd_data)


def main(argv: Sequence[str] | None = None) -> int:
    return planning.main(argv, more=add_commands)


if __name__ == "__main__":
    sys.exit(main())
