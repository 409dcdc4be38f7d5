"""Fuzz every input kind with seeded random mutations and print the outcome table of issue 17.

Each case takes one of the project's own valid inputs (a sample cluster, the graph JSON of a tiny
zoo model, a plan of `zoo:mlp` on `cpu_4_uneven`, that plan's launch bundle or its zip, a `hap`,
`hap run` or `hap profile` command line), mutates it once or twice (a field deleted, a wrong type,
0, negative, NaN, infinity, 1e308, 10**12, a string for a number, a list duplicated or truncated, a
nested object replaced, a number at a bound, a shape, index or name changed) and feeds it to the
API the CLI wraps (cluster: `load_cluster` + `plan`; graph: `Graph.from_dict` + `plan`; plan:
`engine.load_plan` + `listing`; bundle: `check_files` and, when valid, `open_bundle`, or
`check_bundle` of the zip; CLI: `engine.cli.main` and `runner.cli.main` with torchrun stubbed out,
`runner.profile.parse_args`; hostile_file: a hostile file of issue 24 (deep nesting, a long number, a sparse
file over the byte cap, a FIFO, /dev/zero, a directory, bytes that are not UTF-8, a BOM, cut JSON)
given to every flag that takes a file, or hostile bytes to a workbench upload). No process is ever started,
except by the hostile_bundle kind (tests/hostile_bundle.py): hostile strings in every value that reaches a
generated file, exported and, when export accepts them, the bundle's `launch_node.sh` and `slurm.sbatch` run
by bash with a PATH of stubs only (a case is raw when anything but the expected torchrun line runs or a file
appears); generated files edited with their hashes re-signed; zip bombs; corrupt zips.
Every case runs under a SIGALRM time limit; plans get a 0.3 s search budget. The mutations and the
outcome rules are `tests/fuzzing.py`, shared with `tests/test_fuzz.py`.

Outcomes: a clean one-line error (a typed HapError, or argparse's usage exit), accepted, a raw
exception (any other exception, or a message of several lines: a traceback at the CLI), a hang.
The same seed gives the same cases. It reports; it never asserts (exit status 0 either way).

Run from the repository root:

    PYTHONPATH=. python bench/fuzz.py                         # 1000 cases of each kind (a few minutes)
    PYTHONPATH=. python bench/fuzz.py --cases 200 --kind cluster --kind graph
    PYTHONPATH=. python bench/fuzz.py --seed 7 --timeout 20   # other cases, a longer hang limit
    PYTHONPATH=. python bench/fuzz.py --zip-bomb              # issue 24: a 3 GiB-entry zip, time and peak memory

It prints the table and every distinct raw exception or hang with the mutations that produce it
(replay case i of a kind with `random.Random(f"{seed}/{kind}/{i}")`), and writes the same to
`bench/results/fuzz.json` (`--json FILE` to change).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the engine, and the mutation code shared with tests/test_fuzz.py

import fuzzing  # noqa: E402  (tests/fuzzing.py, imported as pytest imports it)

LABELS = {"cluster": "cluster spec → `load_cluster` + `plan`", "graph": "graph JSON → `Graph.from_dict` + `plan`",
          "plan": "plan JSON → `engine.load_plan` + `listing`", "bundle": "bundle → `check_files` + `open_bundle`",
          "cli": "CLI arguments → `hap` / `hap run` / `hap profile` (no process started)",
          "hostile_bundle": "hostile bundle → `hap export` + generated scripts run under stubs, tampered and bomb "
                            "zips → `hap bundle check`",
          "hostile_file": "hostile file → every flag that takes a file, and the workbench uploads"}


@dataclass
class KindReport:
    """Outcome counts of one input kind and the distinct raw exceptions and hangs it found."""

    kind: str
    counts: Counter = field(default_factory=Counter)
    bugs: dict[str, list[str]] = field(default_factory=dict)
    """Raw exception or hang detail -> the mutations that produced it (first few)."""
    seconds: float = 0.0
    scripts: int = 0
    """Generated launch scripts run under stubs (hostile bundles)."""
    created: int = 0
    """Files those scripts created (must be 0)."""


def run_kind(fx: fuzzing.Fixtures, kind: str, cases: int, seed: int, timeout_s: float) -> KindReport:
    """`cases` seeded cases of one kind; case i uses random.Random(f'{seed}/{kind}/{i}') so any case can be replayed."""
    report = KindReport(kind)
    start = time.perf_counter()
    for i in range(cases):
        rng = random.Random(f"{seed}/{kind}/{i}")
        run, said = fuzzing.CASES[kind](fx, rng.randrange)
        outcome = fuzzing.classify(run, timeout_s)
        report.counts[outcome.kind] += 1
        report.scripts += outcome.scripts
        report.created += outcome.created
        if outcome.kind in ("raw", "hang"):
            report.bugs.setdefault(f"{outcome.kind}: {outcome.detail}", []).append(f"case {i}: {said}")
    report.seconds = time.perf_counter() - start
    return report


def table(reports: list[KindReport]) -> str:
    """The issue's markdown table."""
    rows = ["| input | cases | clean one-line error | accepted | raw exception | hang |", "|---|---|---|---|---|---|"]
    for r in reports:
        c = r.counts
        rows.append(f"| {LABELS[r.kind]} | {sum(c.values())} | {c['error']} | {c['accepted']} | {c['raw']} | {c['hang']} |")
    scripts = [r for r in reports if r.scripts]
    notes = [f"\n{r.kind}: {r.scripts} generated scripts run under stubs, {r.created} files created" for r in scripts]
    return "\n".join(rows) + "".join(notes)


def bug_list(reports: list[KindReport]) -> str:
    """Every distinct raw exception and hang, with up to three mutations that produce it."""
    lines = []
    for r in reports:
        for detail, cases in sorted(r.bugs.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"[{r.kind}] {detail}  ({len(cases)} cases)")
            lines += [f"    {c[:240]}" for c in cases[:3]]
    return "\n".join(lines) if lines else "no raw exception and no hang"


ZIP_BOMB_GIB = 3
"""Size of the zero-filled entry issue 24 reported (3 GiB in a 3 MB zip)."""


def bomb_zip(work: Path, gib: int = ZIP_BOMB_GIB) -> tuple[Path, Path]:
    """(a real bundle zip of zoo:mlp on cpu_4_uneven, a copy with one extra entry of `gib` GiB of zeros), the
    extra entry deflated as it streams in 1 MiB chunks, so the bomb never sits in memory."""
    import shutil
    import zipfile

    import engine
    from engine.bundle.archive import export_bundle

    cluster = fuzzing.SAMPLES / "cpu_4_uneven.json"
    plan = engine.plan(engine.load_model("zoo:mlp", **fuzzing.SMALL_MLP), cluster, time_budget_s=5)
    folder = export_bundle(plan, cluster, work / "bundle", zip=True)
    real, bomb = folder.with_name("bundle.zip"), work / "bomb.zip"
    shutil.copyfile(real, bomb)
    zeros = bytes(1 << 20)
    with zipfile.ZipFile(bomb, "a", zipfile.ZIP_DEFLATED, compresslevel=9) as z, z.open("bundle/zeros.bin", "w", force_zip64=True) as f:
        for _ in range(gib << 10):
            f.write(zeros)
    return real, bomb


_PEAK = """import os, sys
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""
"""Runs a command from a bare `python -S` (Linux counts a child's peak RSS from its parent's at fork, so the bench
process, which imported torch, must not fork it) and prints its exit status and peak RSS in KiB."""


def measured(cmd: list[str]) -> tuple[float, int, str, float]:
    """(wall seconds, exit status, first two stderr lines, peak RSS in MB) of one command."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-S", "-c", _PEAK, *cmd], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    code, kib = (int(x) for x in r.stdout.split())
    said = " / ".join(line.strip() for line in r.stderr.strip().splitlines()[:2])
    return seconds, code, said, kib / 1024


def zip_bomb_report(gib: int = ZIP_BOMB_GIB) -> str:
    """Issue 24's acceptance figures: `hap bundle check` and `hap run` on the bomb zip, beside the real zip and
    the peak RSS of a bare `import torch` (the baseline of anything that imports torch)."""
    hap = str(Path(sys.executable).with_name("hap"))
    rows = ["| command | wall s | exit | peak RSS MB | stderr (first two lines) |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="hap-zip-bomb-") as work:
        start = time.perf_counter()
        real, bomb = bomb_zip(Path(work), gib)
        made = time.perf_counter() - start
        cases = [("python -c 'import torch' (baseline)", [sys.executable, "-c", "import torch"]),
                 ("hap bundle check REAL.zip", [hap, "bundle", "check", str(real)]),
                 ("hap bundle check BOMB.zip", [hap, "bundle", "check", str(bomb)]),
                 ("hap run BOMB.zip --steps 1", [hap, "run", str(bomb), "--steps", "1"])]
        for label, cmd in cases:
            seconds, code, first, rss = measured(cmd)
            rows.append(f"| `{label}` | {seconds:.2f} | {code} | {rss:.0f} | {first[:220]} |")
        sizes = f"real zip {real.stat().st_size} bytes; bomb zip {bomb.stat().st_size} bytes " \
                f"(+{gib} GiB of zeros deflated, built in {made:.0f} s)"
    return "\n".join([sizes, "", *rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1000, help="cases per input kind (default 1000)")
    p.add_argument("--kind", action="append", choices=fuzzing.KINDS, help="input kind to fuzz (repeatable; default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mutations (default 0)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds after which a case counts as a hang (default 10)")
    p.add_argument("--json", metavar="FILE", default=str(ROOT / "bench" / "results" / "fuzz.json"),
                   help="where to write the counts and the bugs found as JSON (default bench/results/fuzz.json)")
    p.add_argument("--zip-bomb", action="store_true",
                   help=f"instead of fuzzing, time `hap bundle check` and `hap run` on a bundle zip with one extra "
                        f"{ZIP_BOMB_GIB} GiB entry of zeros (issue 24) and print their peak memory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.zip_bomb:
        print(zip_bomb_report())
        return 0
    kinds = args.kind or list(fuzzing.KINDS)
    with tempfile.TemporaryDirectory(prefix="hap-fuzz-") as work:
        fx = fuzzing.make_fixtures(work)
        reports = []
        for kind in kinds:
            reports.append(run_kind(fx, kind, args.cases, args.seed, args.timeout))
            c = reports[-1].counts
            print(f"{kind}: {sum(c.values())} cases in {reports[-1].seconds:.1f} s "
                  f"({c['raw']} raw, {c['hang']} hang)", file=sys.stderr, flush=True)
    print(table(reports))
    print()
    print(bug_list(reports))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is git-ignored
        Path(args.json).write_text(json.dumps({"seed": args.seed, "cases": args.cases, "kinds": {
            r.kind: {"counts": dict(r.counts), "seconds": r.seconds, "bugs": r.bugs, "scripts": r.scripts,
                     "created": r.created} for r in reports}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
