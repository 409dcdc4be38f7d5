"""Bounded readers (issue 24): every file a user hands the tools is read by engine.readers, so deep
nesting, a 5 000-digit number, /dev/zero, a FIFO with no writer, a sparse file over the byte cap, a
directory and bytes that are not UTF-8 each end in exit status 2 (or the site's typed error) and
one line naming the file, never a traceback or a hang.

Each test runs under a SIGALRM guard (`fuzzing.time_limit`): a reader that blocks fails the test
instead of stalling the suite. No wall-clock time is asserted.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

import hostile
import pytest
from fuzzing import time_limit
from hap_inprocess import run_hap

from engine import limits
from engine.errors import ClusterError, ModelError, PlanError
from engine.readers import json_depth, parse_json, read_bytes, read_json

GUARD_S = 30.0
"""A test still running after this is a hang (every case here takes milliseconds)."""
CLUSTER = str(Path(__file__).resolve().parent.parent / "sample_clusters" / "cpu_4_uneven.json")
CLI_KINDS = ("deep", "number", "dev_zero", "fifo", "huge", "directory", "not_utf8")
"""The acceptance cases of issue 24, fed to every flag that takes a file."""


@pytest.fixture(autouse=True)
def _no_hang():
    with time_limit(GUARD_S):
        yield


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    """A valid plan of a tiny MLP on cpu_4_uneven (the flags that need a plan beside the hostile file)."""
    import engine

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    engine.plan(engine.load_model("zoo:mlp", layers=1, hidden=16, in_features=16, batch=8), CLUSTER,
                time_budget_s=1).save(path)
    return str(path)


@pytest.fixture
def no_torchrun(monkeypatch):
    """`hap run` must stop before any rank starts: torchrun refuses to start here."""
    import runner.cli
    import runner.elastic

    def refuse(*_a, **_k):
        raise AssertionError("a hostile file reached torchrun")

    monkeypatch.setattr(runner.cli, "run_torchrun", refuse)
    monkeypatch.setattr(runner.elastic, "run_torchrun", refuse)


def hostile_file(kind: str, folder: Path, suffix: str = ".json") -> str:
    """The acceptance case `kind` as a file under `folder` (100 000 `[`, 5 000 digits, ...)."""
    cap = limits.MAX_MODEL_FILE_BYTES if suffix == ".py" else limits.MAX_INPUT_BYTES
    text = {"deep": hostile.deep(100_000), "number": "[" + hostile.long_number(5000) + "]"}.get(kind, "")
    return hostile.make(kind, folder, f"{kind}{suffix}", text=text, cap=cap)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {stderr[:500]!r}"
    return lines[0]


# ----------------------------------------------------------------------------- every flag that takes a file


@pytest.mark.parametrize("kind", CLI_KINDS)
@pytest.mark.parametrize("flag", hostile.FLAGS, ids=lambda f: f.name)
def test_every_file_flag_refuses_a_hostile_file_in_one_line(flag, kind, plan_file, tmp_path, no_torchrun):
    path = hostile_file(kind, tmp_path, flag.suffix)
    r = run_hap(*flag.args(path, plan_file, CLUSTER, str(tmp_path)))
    line = one_error_line(r.stderr)
    assert r.returncode == 2, line
    assert Path(path).name in line and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["huge", *hostile.NON_REGULAR])
def test_export_model_file_refuses_what_is_no_regular_python_file_of_sane_size(kind, plan_file, tmp_path):
    """`hap export --model-file F` only hashes and copies F, so only its kind and size can be wrong."""
    path = hostile_file(kind, tmp_path, ".py")
    r = run_hap("export", plan_file, "--out", str(tmp_path / "bundle"), "--model-file", path)
    assert r.returncode == 2 and Path(path).name in one_error_line(r.stderr)
    assert not (tmp_path / "bundle").exists()


def test_messages_name_what_the_file_is(tmp_path):
    cases = {"dev_zero": "a character device", "fifo": "a FIFO", "directory": "a directory", "fifo_link": "a FIFO",
             "huge": "larger than 256 MiB", "not_utf8": "not UTF-8", "deep": "nested 100000 levels deep",
             "number": "a number of 5000 characters"}
    for kind, said in cases.items():
        with pytest.raises(ClusterError, match=said) as e:
            read_json(hostile_file(kind, tmp_path) if kind != "fifo_link" else
                      hostile.make(kind, tmp_path, "link.json"), f"cluster file '{kind}'", ClusterError)
        assert "\n" not in str(e.value)


def test_a_socket_is_refused_by_name(tmp_path):
    path = tmp_path / "s.json"
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.bind(str(path))
        except OSError:
            pytest.skip("no unix socket at this path length")
        with pytest.raises(PlanError, match="not a regular file \\(a socket\\)"):
            read_bytes(path, "plan file 's.json'", PlanError)


def test_the_model_file_cap_is_its_own(tmp_path):
    with pytest.raises(ModelError, match="larger than 16 MiB"):
        read_bytes(hostile_file("huge", tmp_path, ".py"), "model file 'm.py'", ModelError,
                   max_bytes=limits.MAX_MODEL_FILE_BYTES)


# ----------------------------------------------------------------------------- the bounds themselves


def test_nesting_at_the_bound_parses_and_one_deeper_is_refused():
    ok = hostile.deep(limits.MAX_JSON_DEPTH, closed=True)
    assert json_depth(ok) == limits.MAX_JSON_DEPTH and parse_json(ok, "x", PlanError) is not None
    with pytest.raises(PlanError, match=f"nested {limits.MAX_JSON_DEPTH + 1} levels deep"):
        parse_json(hostile.deep(limits.MAX_JSON_DEPTH + 1, "{", closed=True), "x", PlanError)


def test_numbers_at_the_bound_parse_and_longer_ones_are_refused():
    n = limits.MAX_JSON_NUMBER_CHARS
    assert parse_json(f"[{'9' * n}, 1.5e-300, -0.25]", "x", PlanError)[0] == int("9" * n)
    for form in hostile.NUMBER_FORMS:
        with pytest.raises(PlanError, match="holds a number of"):
            parse_json(f'{{"a": [{hostile.long_number(n + 1, form)}]}}', "x", PlanError)


def test_brackets_and_digits_inside_strings_count_for_nothing():
    text = json.dumps({"s": "[" * 500 + "9" * 500 + '\\"{', "t": ["]]]", "\\"]})
    assert parse_json(text, "x", PlanError)["s"].startswith("[[[")


def test_nan_and_infinity_still_parse_for_the_validators_to_refuse():
    value = parse_json('{"a": NaN, "b": Infinity, "c": -Infinity, "d": 1e999}', "x", ClusterError)
    assert value["b"] == value["d"] == float("inf") and value["a"] != value["a"]


def test_a_byte_order_mark_is_skipped():
    assert parse_json(b"\xef\xbb\xbf{\"a\": 1}", "x", ClusterError) == {"a": 1}


def test_invalid_json_gives_line_and_column():
    with pytest.raises(ClusterError, match="x is not valid JSON: line 2 column 3"):
        parse_json('{\n  oops}', "x", ClusterError)


def test_the_cap_is_read_when_called(monkeypatch, tmp_path):
    monkeypatch.setattr(limits, "MAX_INPUT_BYTES", 64)
    path = tmp_path / "c.json"
    path.write_text(" " * 62 + "{}")
    assert read_json(path, "c", ClusterError) == {}
    path.write_text(" " * 63 + "{}")
    with pytest.raises(ClusterError, match="larger than 64 bytes"):
        read_json(path, "c", ClusterError)


def test_plan_text_is_bounded_like_a_plan_file(monkeypatch):
    from engine.planner import load_plan

    with pytest.raises(PlanError, match="nested 100000 levels deep"):
        load_plan(hostile.deep(100_000))
    monkeypatch.setattr(limits, "MAX_INPUT_BYTES", 100)
    with pytest.raises(PlanError, match="plan is larger than 100 bytes"):
        load_plan("{" + " " * 200 + "}")


# ----------------------------------------------------------------------------- the workbench's uploads


UPLOAD_KINDS = ("deep", "number", "huge", "not_utf8")


def upload(kind: str) -> bytes:
    text = {"deep": hostile.deep(100_000), "number": "[" + hostile.long_number(5000) + "]"}.get(kind, "")
    return hostile.content(kind, base='{"a": 1}', text=text, cap=limits.MAX_INPUT_BYTES)


@pytest.fixture
def small_caps(monkeypatch):
    """Caps of 1 KiB, so the 'huge' uploads stay small in memory."""
    monkeypatch.setattr(limits, "MAX_INPUT_BYTES", 1024)
    monkeypatch.setattr(limits, "MAX_MODEL_FILE_BYTES", 1024)


@pytest.mark.parametrize("kind", UPLOAD_KINDS)
def test_workbench_uploads_refuse_hostile_bytes_with_a_typed_line(kind, small_caps):
    from app import services
    from app.runs import parse_metrics

    data = upload(kind)
    for fn, error in ((services.graph_from_json, ModelError), (services.cluster_from_json, ClusterError),
                      (lambda d: parse_metrics(d.decode("utf-8", errors="replace")), ValueError),
                      (lambda d: services.hf_model("BertForMaskedLM", d.decode("utf-8", errors="replace"), 2, 8),
                       ModelError)):
        if kind == "not_utf8" and error is ValueError:
            continue  # the page decodes metrics with errors="replace": the replaced text is merely invalid JSON
        with pytest.raises(error) as e:
            fn(data)
        assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("kind", UPLOAD_KINDS)
def test_a_hostile_python_upload_is_refused_in_one_line(kind, small_caps):
    from app import services

    with pytest.raises(ModelError, match="model file up.py") as e:
        services.model_from_python(upload(kind), "up.py")
    assert "\n" not in str(e.value)
