"""Input fuzzing shared by `tests/test_fuzz.py` (hypothesis) and `bench/fuzz.py` (1000s of seeded cases).

A *case* is one of the project's own valid inputs (a sample cluster, a captured graph JSON, a plan
JSON, a launch bundle, a command line) with one or two random mutations of the kinds a user makes
by hand (a field deleted, a wrong type, 0, a negative number, NaN, infinity, 1e308, a string for a
number, a list duplicated or truncated, a nested object replaced), fed to the API the CLI wraps.

Every random choice goes through a `Chooser` (n -> an index in range(n)), so hypothesis
(`data.draw(st.integers(0, n - 1))`) and the bench (`random.Random(seed).randrange`) share the
mutation code. A case's outcome is one of:

    error     a typed HapError (or argparse's usage exit 2) with a one-line message: the desired refusal
    accepted  the input went through (also desired when the mutation kept it valid)
    raw       any other exception, or an error message of several lines: a bug to fix
    hang      the case ran past its time limit (SIGALRM): a bug to fix

Nothing here starts a process: the command-line cases stub out torchrun and subprocesses.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.planner import load_plan

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_clusters"
KINDS = ("cluster", "graph", "plan", "bundle", "cli", "hostile_bundle", "hostile_file")
OUTCOMES = ("error", "accepted", "raw", "hang")

Chooser = Callable[[int], int]
"""Returns an index in range(n): the one source of randomness of a mutation."""

WEIRD_NUMBERS: tuple[Any, ...] = (0, -1, -1e-300, float("nan"), float("inf"), float("-inf"), 1e308, 10**12, 2**64, 1e-300)
WEIRD_ARGS: tuple[str, ...] = ("0", "-1", "nan", "inf", "-inf", "1e308", "1000000000000", "abc", "", "1.5", "0x10",
                               "999999999999999999999999999", "'unclosed", "a:b:c", "../..", "-")
JSON_MUTATIONS = ("delete", "wrong_type", "zero", "negative", "nan", "inf", "huge", "big_int", "string_number",
                  "duplicate_list", "truncate_list", "replace_nested", "edge", "small_int", "other_name")
SMALL_INTS = (0, 1, 2, 3, 5, 7, 64)
"""Type-correct numbers that change a shape, an index or a dim (e.g. an input swapped for another node)."""
SEMANTIC_MUTATIONS = ("small_int", "other_name", "edge", "duplicate_list", "truncate_list", "delete")
"""Mutations that keep JSON types (a shape, an index, an operator changed): they pass the type checks
and reach the theory, the cost model and the LP."""
OTHER_NAMES = ("linear", "relu", "view", "add", "mul", "embedding", "softmax", "layer_norm", "cross_entropy",
               "placeholder", "parameter", "sum", "transpose", "conv2d", "float16", "int64", "cpu-0", "m0", "")
"""Type-correct strings: other operators, dtypes, device or machine names."""
EDGE_NUMBERS: tuple[Any, ...] = (1, 2, 3600, 4096, 1e18, 1e24, 1e30, 2**48, 2**53, 2**62)
"""Numbers at or near the bounds of `engine.limits`: valid inputs whose costs must stay finite."""


# ----------------------------------------------------------------------------- JSON mutations


def _children(node: Any) -> list[Any]:
    """Keys (dict) or indices (list) of a container; [] for a scalar."""
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


def pick_path(doc: Any, choose: Chooser, focus: tuple[tuple, ...] = ()) -> tuple:
    """A random path into `doc`: a walk that stops at each container with probability 1/4, so top-level
    fields are hit about as often as the leaves of a long node list. With `focus` (paths of containers
    that hold what matters, e.g. ("nodes",)), three walks in four start inside one of them."""
    path: tuple = ()
    if focus and choose(4):
        start = focus[choose(len(focus))]
        try:
            if _children(_get(doc, start)):
                path = start
        except (KeyError, IndexError, TypeError):
            pass
    floor = len(path) + 1  # a walk from a focus goes at least one level into it
    node = _get(doc, path)
    while True:
        keys = _children(node)
        if not keys or (len(path) >= floor and choose(4) == 0):
            return path
        key = keys[choose(len(keys))]
        path, node = path + (key,), node[key]


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    """doc with the value at path replaced (the root itself when path is empty)."""
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def show_path(path: tuple) -> str:
    """`devices[0].count` style."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "<root>"


def _wrong_type(value: Any, choose: Chooser) -> Any:
    """A value of another JSON type than `value`."""
    options = [o for o in ("text", 7, 2.5, True, None, [], {}, [1, 2]) if type(o) is not type(value)]
    return options[choose(len(options))]


def _as_number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0


def apply_json_mutation(doc: Any, path: tuple, kind: str, choose: Chooser) -> tuple[Any, str]:
    """(doc with one mutation of `kind` at `path`, a description); `doc` is changed in place."""
    value = _get(doc, path)
    where = show_path(path)
    if kind == "delete" and path:
        parent = _get(doc, path[:-1])
        del parent[path[-1]]
        return doc, f"{where}: deleted"
    if kind in ("duplicate_list", "truncate_list") and isinstance(value, list) and value:
        if kind == "duplicate_list":
            k = choose(len(value))
            value.insert(k, copy.deepcopy(value[k]))
            return doc, f"{where}: item {k} duplicated"
        cut = choose(len(value))
        del value[cut:]
        return doc, f"{where}: truncated to {cut} items"
    if kind == "replace_nested" and isinstance(value, (dict, list)):
        new = [{}, [], "x", 0, None][choose(5)]
        return _set(doc, path, new), f"{where}: replaced by {new!r}"
    number = _as_number(value)
    if kind in ("edge", "small_int", "other_name"):
        pool = {"edge": EDGE_NUMBERS, "small_int": SMALL_INTS, "other_name": OTHER_NAMES}[kind]
        new = pool[choose(len(pool))]
        return _set(doc, path, new), f"{where}: {kind} -> {new!r}"
    new = {"zero": 0, "negative": -abs(number) - 1, "nan": float("nan"), "inf": float("inf"), "huge": 1e308,
           "big_int": 10**12, "string_number": str(value if isinstance(value, (int, float)) else 12)}.get(kind)
    if new is None:  # the mutation does not fit this value: change its type instead
        new = _wrong_type(value, choose)
        kind = "wrong_type"
    return _set(doc, path, new), f"{where}: {kind} -> {new!r}"


def mutate_json(doc: Any, choose: Chooser, *, max_mutations: int = 2, focus: tuple[tuple, ...] = (),
                semantic_share: bool = False) -> tuple[Any, str]:
    """A deep copy of `doc` with 1..max_mutations random mutations (mostly inside `focus`), and their
    description; with `semantic_share`, half the cases use only SEMANTIC_MUTATIONS."""
    out = copy.deepcopy(doc)
    said = []
    kinds = SEMANTIC_MUTATIONS if semantic_share and choose(2) else JSON_MUTATIONS
    for _ in range(1 + (choose(max_mutations) if max_mutations > 1 else 0)):
        path = pick_path(out, choose, focus)
        out, text = apply_json_mutation(out, path, kinds[choose(len(kinds))], choose)
        said.append(text)
    return out, "; ".join(said)


def dumps(doc: Any) -> str:
    """JSON text of a mutated document (NaN and Infinity written as Python's json does, as users' tools do)."""
    return json.dumps(doc, allow_nan=True)


# ----------------------------------------------------------------------------- argument-list mutations


def mutate_args(args: list[str], choose: Chooser) -> tuple[list[str], str]:
    """A copy of a command line with one random mutation (an option's value or a knob made weird, an
    argument deleted, duplicated or swapped for an unknown one, the list truncated), and its description."""
    out = list(args)
    kind = ("value", "value", "value", "knob", "knob", "delete", "duplicate", "truncate", "unknown")[choose(9)]
    weird = WEIRD_ARGS[choose(len(WEIRD_ARGS))]
    knobs = [i for i, a in enumerate(out) if "=" in a and not a.startswith("-")]
    values = [i for i, a in enumerate(out) if i > 0 and not re.fullmatch(r"--?[A-Za-z][\w-]*", a) and i not in knobs]
    if kind == "knob" and knobs:
        i = knobs[choose(len(knobs))]
        out[i] = f"{out[i].split('=', 1)[0]}={weird}"
        return out, f"knob {out[i]!r}"
    if kind in ("value", "knob") and values:
        i = values[choose(len(values))]
        old, out[i] = out[i], weird
        return out, f"argument {i} ({old!r}) -> {weird!r}"
    k = choose(len(out))
    if kind == "delete":
        return out[:k] + out[k + 1:], f"argument {k} ({out[k]!r}) deleted"
    if kind == "duplicate":
        return out[:k + 1] + out[k:], f"argument {k} ({out[k]!r}) duplicated"
    if kind == "truncate":
        return out[:k], f"truncated to {k} arguments"
    return out[:k] + ["--bogus"] + out[k:], f"unknown option inserted at {k}"


# ----------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """How one case ended: `kind` in OUTCOMES, and what happened (exception type and message)."""

    kind: str
    detail: str = ""
    scripts: int = 0
    """Generated launch scripts this case ran under stubs (hostile bundles)."""
    created: int = 0
    """Files those scripts created: must stay 0."""


class CaseTimeout(BaseException):
    """Raised by the SIGALRM guard; a BaseException so no `except Exception` in the engine swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after `seconds` (POSIX SIGALRM)."""
    def expire(_signum: int, _frame: Any) -> None:
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line(message: str) -> bool:
    """A message a user reads on one line: non-empty, no newline."""
    return bool(message.strip()) and "\n" not in message.strip()


def classify(fn: Callable[[], Any], timeout_s: float) -> Outcome:
    """Run one case under a time limit and classify how it ended."""
    from engine.errors import HapError

    try:
        with time_limit(timeout_s):
            result = fn()
    except CaseTimeout:
        return Outcome("hang", f"still running after {timeout_s:g} s")
    except HapError as e:
        if one_line(str(e)):
            return Outcome("error", f"{type(e).__name__}: {e}")
        return Outcome("raw", f"{type(e).__name__} with a message of several lines: {str(e)[:300]!r}")
    except SystemExit as e:  # argparse: exit 2 after a usage line, exit 0 after --help
        return Outcome("error" if e.code == 2 else "accepted" if e.code in (0, None) else "raw", f"SystemExit({e.code})")
    except Exception as e:  # noqa: BLE001 - the point is to catch what should not escape
        first = str(e).splitlines()[0] if str(e) else ""
        return Outcome("raw", f"{type(e).__name__}: {first[:300]}")
    if isinstance(result, Outcome):
        return result
    return Outcome("accepted")


# ----------------------------------------------------------------------------- the inputs and what is done with them


SMALL_MLP = {"layers": 2, "in_features": 32, "hidden": 64, "classes": 4, "batch": 8}
"""A zoo:mlp small enough that planning it takes tens of milliseconds."""
GRAPH_MODELS: dict[str, dict[str, Any]] = {
    "mlp": SMALL_MLP,
    "gpt": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq_len": 8, "batch": 4},
    "vit": {"layers": 1, "hidden": 32, "heads": 2, "mlp": 64, "image_size": 16, "patch": 8, "batch": 4},
    "bert_moe": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq_len": 8, "predictions": 2,
                 "batch": 4, "experts": 2},
    "vgg19": {"batch": 4, "image_size": 32, "width": 0.125, "hidden": 32, "pool_size": 1, "classes": 4, "batch_norm": True},
}
"""Tiny zoo models whose graph JSON is mutated: together they hold every operator family's attrs."""
PLAN_BUDGET_S = 0.3
"""Time budget of every plan call in a case (the guard allows far more)."""


@dataclass
class Fixtures:
    """The valid inputs every case starts from, made once."""

    clusters: dict[str, dict[str, Any]]
    graph: Any
    graph_jsons: dict[str, dict[str, Any]]
    plan_json: dict[str, Any]
    bundle_files: dict[str, bytes]
    workdir: Path
    plan_path: Path
    bundle_dir: Path


def make_fixtures(workdir: str | Path) -> Fixtures:
    """Sample clusters, a captured zoo:mlp graph, its plan on cpu_4_uneven and that plan's bundle."""
    import engine
    from engine.bundle.archive import export_bundle, read_folder

    work = Path(workdir)
    clusters = {p.stem: json.loads(p.read_text()) for p in sorted(SAMPLES.glob("*.json"))}
    graph = engine.load_model("zoo:mlp", **SMALL_MLP)
    graph_jsons = {name: json.loads(engine.load_model(f"zoo:{name}", **knobs).to_json())
                   for name, knobs in GRAPH_MODELS.items()}
    plan = engine.plan(graph, SAMPLES / "cpu_4_uneven.json", time_budget_s=5)
    plan_path = work / "plan.json"
    plan.save(plan_path)
    bundle_dir = export_bundle(plan, SAMPLES / "cpu_4_uneven.json", work / "bundle")
    return Fixtures(clusters, graph, graph_jsons, json.loads(plan.to_json()), read_folder(bundle_dir),
                    work, plan_path, Path(bundle_dir))


def cluster_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A mutated sample cluster, loaded and planned for the small MLP."""
    import engine

    names = sorted(fx.clusters)
    name = names[choose(len(names))]
    doc, said = mutate_json(fx.clusters[name], choose, focus=(("devices",), ("network",)), semantic_share=True)
    text = dumps(doc)

    def run() -> None:
        cluster = engine.load_cluster(json.loads(text))
        engine.plan(fx.graph, cluster, time_budget_s=PLAN_BUDGET_S)

    return run, f"{name}: {said}"


def graph_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A mutated graph JSON of a tiny zoo model, loaded and planned on cpu_4_uneven."""
    import engine
    from engine.model.graph import Graph

    names = sorted(fx.graph_jsons)
    name = names[choose(len(names))]
    doc, said = mutate_json(fx.graph_jsons[name], choose, focus=(("nodes",),), semantic_share=True)
    text = dumps(doc)
    cluster = engine.load_cluster(fx.clusters["cpu_4_uneven"])

    def run() -> None:
        graph = Graph.from_dict(json.loads(text))
        engine.plan(graph, cluster, time_budget_s=PLAN_BUDGET_S)

    return run, f"{name}: {said}"


PLAN_FOCUS = (("program",), ("ratios",), ("shard_sizes",), ("cluster",), ("graph", "nodes"), ("stages",))
"""Where a plan's meaning lives: most plan mutations land there."""


def plan_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A mutated plan JSON, parsed and listed."""
    doc, said = mutate_json(fx.plan_json, choose, focus=PLAN_FOCUS, semantic_share=True)
    text = dumps(doc)

    def run() -> None:
        load_plan(text).listing()

    return run, said


BUNDLE_JSON = ("manifest.json", "plan.json", "cluster.json")


def bundle_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A bundle with one file mutated (a JSON file mutated as JSON, else cut, emptied or deleted, or a
    file added), half the time with the manifest re-signed so the checks past the sha256s are reached;
    one case in five is the bundle's zip with bytes flipped or cut instead."""
    from engine.bundle.archive import MANIFEST, check_files, open_bundle, sha256

    if choose(5) == 0:
        return zip_case(fx, choose)
    files = dict(fx.bundle_files)
    names = sorted(files)
    name = names[choose(len(names))]
    if name in BUNDLE_JSON and choose(4):
        doc, said = mutate_json(json.loads(files[name]), choose,
                                focus=PLAN_FOCUS if name == "plan.json" else (("nodes",), ("devices",)))
        files[name] = dumps(doc).encode()
    else:
        how = choose(4)
        if how == 0:
            del files[name]
        elif how == 1:
            files[name] = files[name][: choose(max(len(files[name]), 1))]
        elif how == 2:
            files[name] = b"\xff\xfe not utf-8 \x00"
        else:
            files["extra.txt"] = b"hello"
        said = ("deleted", "truncated", "replaced by bytes that are not UTF-8", "extra.txt added")[how]
    resign = name != MANIFEST and MANIFEST in files and choose(2)
    if resign:
        manifest = json.loads(files[MANIFEST])
        manifest["files"] = {n: {"sha256": sha256(b), "bytes": len(b)} for n, b in files.items() if n != MANIFEST}
        files[MANIFEST] = json.dumps(manifest).encode()

    def run() -> Outcome:
        report = check_files(files, "bundle")
        bad = [p for p in report.problems if not one_line(p)]
        if bad:
            return Outcome("raw", f"bundle problem of several lines: {bad[0][:300]!r}")
        if not report.ok:
            return Outcome("error", report.problems[0])
        with tempfile.TemporaryDirectory(dir=fx.workdir) as folder:  # what `hap run BUNDLE` opens
            for rel, data in files.items():
                (Path(folder) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / rel).write_bytes(data)
            open_bundle(folder)
        return Outcome("accepted")

    return run, f"{name}: {said}{' (manifest re-signed)' if resign else ''}"


def zip_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """The bundle's zip with a few bytes overwritten or the end cut off, checked as `hap bundle check` does."""
    from engine.bundle.archive import check_bundle, zip_bytes

    data = bytearray(zip_bytes(fx.bundle_files, "bundle"))
    if choose(3) == 0:
        cut = choose(len(data))
        data, said = data[:cut], f"zip cut to {cut} bytes"
    else:
        spots = [choose(len(data)) for _ in range(1 + choose(8))]
        for k in spots:
            data[k] = choose(256)
        said = f"zip bytes at {spots} overwritten"

    def run() -> Outcome:
        with tempfile.TemporaryDirectory(dir=fx.workdir) as folder:
            path = Path(folder) / "bundle.zip"
            path.write_bytes(bytes(data))
            report = check_bundle(path)
        bad = [p for p in report.problems if not one_line(p)]
        if bad:
            return Outcome("raw", f"bundle problem of several lines: {bad[0][:300]!r}")
        return Outcome("accepted") if report.ok else Outcome("error", report.problems[0])

    return run, said


def cli_commands(fx: Fixtures) -> list[tuple[str, list[str]]]:
    """Valid command lines to mutate: `hap plan/capture/export/bundle check` and the runner's options."""
    cluster = str(SAMPLES / "cpu_4_uneven.json")
    knobs = [a for k, v in SMALL_MLP.items() for a in ("--set", f"{k}={v}")]
    return [
        ("hap", ["plan", "--model", "zoo:mlp", *knobs, "--cluster", cluster, "--time-budget", str(PLAN_BUDGET_S),
                 "--segments", "1", "--json"]),
        ("hap", ["capture", "--model", "zoo:mlp", "--set", "layers=1", "--set", "hidden=16", "--out", "graph.json"]),
        ("hap", ["capture", "--model", "zoo:vit", "--set", "layers=1", "--set", "hidden=32", "--set", "heads=2",
                 "--set", "mlp=64", "--set", "image_size=32", "--set", "patch=8", "--set", "batch=4",
                 "--set", "dropout=0.0", "--out", "vit.json"]),
        ("hap", ["export", str(fx.plan_path), "--out", "bundle-out", "--cluster", cluster, "--run-args", "--steps 10",
                 "--rdzv-endpoint", "localhost:29500", "--zip"]),
        ("hap", ["bundle", "check", str(fx.bundle_dir)]),
        ("run", [str(fx.plan_path), "--steps", "2", "--seed", "0", "--lr", "0.01"]),
        ("run", [str(fx.bundle_dir), "--steps", "3", "--verify"]),
        ("profile", ["--out", "c.json", "--nproc", "2", "--sizes", "4K,64K,1M", "--matmul", "256,512",
                     "--repeats", "3", "--warmup", "1", "--timeout", "60", "--speeds", "1,0.5"]),
    ]


def cli_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A mutated command line of `hap` (engine.cli.main), `hap run` (runner.cli.main, torchrun stubbed)
    or `hap profile` (its argument parsing only: profiling starts ranks)."""
    commands = cli_commands(fx)
    program, base = commands[choose(len(commands))]
    args, said = mutate_args(base, choose)
    return (lambda: run_cli(program, args, fx.workdir)), f"{program} {' '.join(base[:2])}: {said}"


def run_cli(program: str, args: list[str], workdir: Path) -> Outcome:
    """Run a command line in a fresh folder under `workdir`, with no process started; classify its exit."""
    import engine.cli
    import runner.cli
    import runner.profile

    err = io.StringIO()
    with tempfile.TemporaryDirectory(dir=workdir) as cwd, _no_processes(), _cwd(cwd), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if program == "profile":
            runner.profile.parse_args(args)
            return Outcome("accepted")
        rc = engine.cli.main(args) if program == "hap" else runner.cli.main(args)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    if rc == 0:
        return Outcome("accepted")
    if rc == 1 and program == "hap" and args[:2] == ["bundle", "check"]:
        return Outcome("error", lines[0] if lines else "bundle invalid")
    if rc == 2 and len(lines) == 1:
        return Outcome("error", lines[0])
    return Outcome("raw", f"exit status {rc} with {len(lines)} lines on stderr: {' | '.join(lines)[:300]}")


@contextlib.contextmanager
def _cwd(path: str) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _no_processes() -> Iterator[None]:
    """torchrun and every subprocess replaced: a fuzz case never starts a process (or a rank)."""
    import runner.cli

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a fuzz case tried to start a process")

    import runner.elastic

    saved = (runner.cli.run_torchrun, subprocess.Popen, os.environ.pop("RANK", None), os.environ.pop("WORLD_SIZE", None),
             runner.elastic.run_torchrun)
    runner.cli.run_torchrun = lambda *a, **k: 0  # the run is accepted once every pre-flight check passed
    runner.elastic.run_torchrun = lambda *a, **k: 0  # `hap run --elastic` launches through its own import
    subprocess.Popen = refuse  # type: ignore[misc]
    try:
        yield
    finally:
        runner.cli.run_torchrun, subprocess.Popen = saved[0], saved[1]  # type: ignore[misc]
        runner.elastic.run_torchrun = saved[4]
        for key, value in (("RANK", saved[2]), ("WORLD_SIZE", saved[3])):
            if value is not None:
                os.environ[key] = value


# ----------------------------------------------------------------------------- hostile inputs (issue 24)


def hostile_file_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A hostile file handed to a flag that takes one, or hostile bytes to an upload (tests/hostile.py)."""
    from hostile import file_case

    return file_case(fx, choose)


def hostile_bundle_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """What a bundle's author could do to whoever runs it (tests/hostile_bundle.py)."""
    from hostile_bundle import hostile_case

    return hostile_case(fx, choose)


CASES: dict[str, Callable[[Fixtures, Chooser], tuple[Callable[[], Any], str]]] = {
    "cluster": cluster_case, "graph": graph_case, "plan": plan_case, "bundle": bundle_case, "cli": cli_case,
    "hostile_bundle": hostile_bundle_case, "hostile_file": hostile_file_case}
"""For each input kind: build one mutated case (what to run, what was mutated)."""

