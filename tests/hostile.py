"""Hostile files of issue 24 (bounded readers), made for `tests/test_readers.py` and the `hostile_file` fuzz
kind (`file_case` below, registered in `tests/fuzzing.py`): deep nesting, over-long numbers, files over the
byte cap (sparse: no disk used), non-regular files (a FIFO with no writer, /dev/zero, /dev/urandom, a directory, a link to a FIFO),
bytes that are not UTF-8, a byte-order mark and cut JSON.

A base document (the valid input of a flag) may hold `MARK` where deep nesting or a long number is
spliced in, so the bad part sits inside an otherwise valid cluster, plan or graph.
"""
from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fuzzing import SAMPLES, Chooser, Fixtures, Outcome, _set, dumps, pick_path, run_cli, show_path

MARK_VALUE = "@hostile@"
"""A string value a base document holds where the hostile text goes (json.dumps writes it as MARK)."""
MARK = f'"{MARK_VALUE}"'
NON_REGULAR = ("fifo", "dev_zero", "dev_urandom", "directory", "fifo_link")
CONTENT = ("deep", "number", "huge", "not_utf8", "bom", "truncated")
"""Hostile contents of a regular file (all but "huge" also fit an upload's bytes)."""
KINDS = CONTENT + NON_REGULAR
NUMBER_FORMS = ("int", "negative", "float", "exponent", "fraction_exponent")


def deep(depth: int, bracket: str = "[", closed: bool = False) -> str:
    """`depth` nested arrays ("[") or objects ("{"), closed or left open."""
    opener = "[" if bracket == "[" else '{"k": '
    return opener * depth + ("]" * depth if bracket == "[" else "}" * depth) * closed


def long_number(digits: int, form: str = "int") -> str:
    """A JSON number with `digits` digits in one of NUMBER_FORMS (past Python's 4300-digit int() limit at 5000)."""
    body = ("123456789" * (digits // 9 + 1))[:digits]
    return {"int": body, "negative": "-" + body, "float": f"{body[:1]}.{body[1:]}", "exponent": f"1e{body}",
            "fraction_exponent": f"0.{body}e5"}[form]


def splice(base: str, text: str) -> str:
    """`base` with its MARK replaced by `text` (the bare text when `base` holds no MARK)."""
    return base.replace(MARK, text, 1) if MARK in base else text


def make(kind: str, folder: Path, name: str, *, base: str = "{}", text: str = "", cap: int = 0) -> str:
    """The path of a hostile file of `kind` under `folder` (named `name`, so a flag sees the suffix it
    expects): `text` spliced into `base` for "deep" and "number", a sparse file of `cap` + 1 bytes
    for "huge", else the kind's own content or special file."""
    path = folder / name
    if kind in ("deep", "number"):
        path.write_text(splice(base, text))
    elif kind == "huge":
        path.write_text(base)
        with open(path, "r+b") as f:
            f.truncate(cap + 1)  # a hole: no disk used
    elif kind == "not_utf8":
        raw = base.encode()
        path.write_bytes(raw[: len(raw) // 2] + b"\xff\xfe\xc3\x28" + raw[len(raw) // 2:])
    elif kind == "bom":
        path.write_bytes(b"\xef\xbb\xbf" + base.encode())
    elif kind == "truncated":
        path.write_text(base[: len(base) // 2])
    elif kind in ("dev_zero", "dev_urandom"):
        device = "/dev/zero" if kind == "dev_zero" else "/dev/urandom"
        if name.endswith(".json"):
            return device
        path.symlink_to(device)  # a model file must end in .py
    elif kind == "directory":
        path.mkdir()
    elif kind in ("fifo", "fifo_link"):
        pipe = path if kind == "fifo" else folder / f"pipe-{name}"
        os.mkfifo(pipe)  # no writer: a blocking open or read would wait forever
        if kind == "fifo_link":
            path.symlink_to(pipe)
    else:
        raise ValueError(f"unknown hostile kind {kind!r}; one of {', '.join(KINDS)}")
    return str(path)


def content(kind: str, *, base: str = "{}", text: str = "", cap: int = 0) -> bytes:
    """The bytes of a hostile upload of a CONTENT kind ("huge": `cap` + 1 bytes)."""
    if kind in ("deep", "number"):
        return splice(base, text).encode()
    if kind == "huge":
        return base.encode().ljust(cap + 1, b" ")
    if kind == "not_utf8":
        raw = base.encode()
        return raw[: len(raw) // 2] + b"\xff\xfe\xc3\x28" + raw[len(raw) // 2:]
    if kind == "bom":
        return b"\xef\xbb\xbf" + base.encode()
    if kind == "truncated":
        return base.encode()[: len(base) // 2]
    raise ValueError(f"{kind!r} is no upload content; one of {', '.join(CONTENT)}")


# ----------------------------------------------------------------------------- the flags that take a file


@dataclass(frozen=True)
class FileFlag:
    """A command-line argument that takes a file: `argv` of `hap` with "{F}" where the file goes,
    "{PLAN}" a valid plan, "{CLUSTER}" its cluster and "{OUT}" a scratch folder."""

    name: str
    argv: tuple[str, ...]
    base: str
    """Which valid document the file's content starts from: cluster, plan, graph, config or python."""
    suffix: str = ".json"

    def args(self, path: str, plan: str, cluster: str, out: str) -> list[str]:
        marks = {"{F}": path, "{PLAN}": plan, "{CLUSTER}": cluster, "{OUT}": out}
        return [_filled(a, marks) for a in self.argv]


def _filled(arg: str, marks: dict[str, str]) -> str:
    """`arg` with every mark in it replaced, inside a longer argument too (`{OUT}/bundle`)."""
    for mark, value in marks.items():
        arg = arg.replace(mark, value)
    return arg


BUDGET = ("--time-budget", "0.3")
FLAGS = (
    FileFlag("plan --cluster", ("plan", "--model", "zoo:mlp", "--set", "layers=1", "--set", "hidden=16", "--cluster",
                                "{F}", *BUDGET), "cluster"),
    FileFlag("plan --model GRAPH.json", ("plan", "--model", "{F}", "--cluster", "{CLUSTER}", *BUDGET), "graph"),
    FileFlag("plan --model MODEL.py", ("plan", "--model", "{F}", "--cluster", "{CLUSTER}", *BUDGET), "python", ".py"),
    FileFlag("plan --config", ("plan", "--model", "hf:BertForMaskedLM", "--config", "{F}", "--cluster", "{CLUSTER}"),
             "config"),
    FileFlag("export PLAN", ("export", "{F}", "--out", "{OUT}/bundle"), "plan"),
    FileFlag("export --cluster", ("export", "{PLAN}", "--out", "{OUT}/bundle", "--cluster", "{F}"), "cluster"),
    FileFlag("replan PLAN", ("replan", "{F}", "--cluster", "{CLUSTER}", *BUDGET), "plan"),
    FileFlag("replan --cluster", ("replan", "{PLAN}", "--cluster", "{F}", *BUDGET), "cluster"),
    FileFlag("run PLAN", ("run", "{F}"), "plan"),
    FileFlag("run --emulate-link", ("run", "{PLAN}", "--emulate-link", "{F}"), "cluster"),
    FileFlag("run --elastic", ("run", "{PLAN}", "--elastic", "{F}", "--checkpoint-dir", "{OUT}/ckpt"), "cluster"),
)
"""Every flag of `hap` that reads a user's file (`hap run` is the runner's; a bundle is engine.bundle's)."""


# ----------------------------------------------------------------------------- the hostile_file fuzz kind


FILE_CLUSTER = "cpu_4_uneven"
"""The cluster of the fixture plan: a cluster file's content starts from it (so --elastic may accept it)."""


def file_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """A hostile file (tests/py: deep nesting, a long number, over the byte cap, a FIFO, a
    device, a directory, not UTF-8, a BOM, cut) handed to one flag that takes a file, run in-process
    as the `cli` kind does; one case in five is hostile bytes given to a workbench upload instead."""
    from engine import limits

    if choose(5) == 0:
        return upload_case(fx, choose)
    flag = FLAGS[choose(len(FLAGS))]
    kind = KINDS[choose(len(KINDS))]
    base, where = hostile_base(fx, flag.base, choose)
    text, said = hostile_text(kind, choose)
    cap = limits.MAX_MODEL_FILE_BYTES if flag.suffix == ".py" else limits.MAX_INPUT_BYTES
    cap += choose(cap) if kind == "huge" else 0

    def run() -> Outcome:
        with tempfile.TemporaryDirectory(dir=fx.workdir) as folder:
            path = make(kind, Path(folder), f"input{flag.suffix}", base=base, text=text, cap=cap)
            args = flag.args(path, str(fx.plan_path), str(SAMPLES / f"{FILE_CLUSTER}.json"), folder)
            return run_cli("run", args[1:], fx.workdir) if args[0] == "run" else run_cli("hap", args, fx.workdir)

    return run, f"{flag.name} <- {kind}{said}{placed(kind, base, where)}"


def placed(kind: str, base: str, where: str) -> str:
    """Where the hostile text sits in its document (empty when it is the whole file)."""
    return where if kind in ("deep", "number") and MARK in base else ""


def hostile_base(fx: Fixtures, name: str, choose: Chooser) -> tuple[str, str]:
    """The text of a valid document of kind `name` (cluster, plan, graph, config, python), half the time
    with MARK at a random leaf (where deep nesting or a long number goes), and where it is."""
    if name == "python":
        return f"VALUE = {MARK}\n", " in a Python file"
    if name == "config":
        return f"[1, {MARK}]", " in a config list"
    docs = {"cluster": fx.clusters[FILE_CLUSTER], "plan": fx.plan_json}
    doc = copy.deepcopy(docs.get(name) or fx.graph_jsons[sorted(fx.graph_jsons)[choose(len(fx.graph_jsons))]])
    if choose(2):
        return dumps(doc), ""
    path = pick_path(doc, choose)
    return dumps(_set(doc, path, MARK_VALUE)), f" at {show_path(path)}"


def hostile_text(kind: str, choose: Chooser) -> tuple[str, str]:
    """Deep nesting (500..200 000 levels) or a long number (300..20 000 digits) for `kind`, else ""."""
    if kind == "deep":
        depth, bracket, closed = 500 + choose(199_501), "[{"[choose(2)], bool(choose(2))
        return deep(depth, bracket, closed), f" ({depth} x {bracket}{', closed' if closed else ''})"
    if kind == "number":
        digits, form = 300 + choose(19_701), NUMBER_FORMS[choose(len(NUMBER_FORMS))]
        return long_number(digits, form), f" ({digits} digits, {form})"
    return "", ""


UPLOADS = ("graph JSON", "cluster JSON", "metrics", "hf config", "Python model")
"""The workbench's upload parsers (app.services, app.components), fed bytes rather than a path."""


def upload_case(fx: Fixtures, choose: Chooser) -> tuple[Callable[[], Any], str]:
    """Hostile bytes (every CONTENT kind but 'huge', which tests/test_readers.py covers with a
    lowered cap) given to one of the workbench's upload parsers."""
    target = UPLOADS[choose(len(UPLOADS))]
    kind = [k for k in CONTENT if k != "huge"][choose(len(CONTENT) - 1)]
    name = {"graph JSON": "graph", "cluster JSON": "cluster", "metrics": "plan", "hf config": "config"}.get(target, "python")
    base, where = hostile_base(fx, name, choose)
    text, said = hostile_text(kind, choose)
    data = content(kind, base=base, text=text)

    def run() -> None:
        import streamlit.logger

        streamlit.logger.set_log_level("error")  # no "no runtime found" warning per call outside `streamlit run`
        from app import runs, services

        if target == "graph JSON":
            services.graph_from_json(data)
        elif target == "cluster JSON":
            services.cluster_from_json(data)
        elif target == "metrics":
            runs.load_run("upload", data.decode("utf-8", errors="replace"))  # parse_metrics, then the Runs page's reading
        elif target == "hf config":
            services.hf_model("BertForMaskedLM", data.decode("utf-8", errors="replace"), 2, 8)
        else:
            services.model_from_python(data, "upload.py")

    return run, f"upload {target} <- {kind}{said}{placed(kind, base, where)}"
