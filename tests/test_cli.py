"""Tests of the `hap` command line (engine.cli.main): the report, --json, --set, and one-line errors."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import GIB, ROOT, sample_dict, sample_path

from engine.cli import main
from engine.planner import load_plan

TINY_GPT = ["--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "ffn=128",
            "--set", "vocab=256", "--set", "seq_len=16", "--set", "batch=8"]
SMALL_MLP = ["--set", "layers=2", "--set", "in_features=64", "--set", "hidden=128", "--set", "batch=32"]


def assert_one_line_error(rc: int, out: str, err: str) -> str:
    assert rc == 2
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hap: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def mlp_report(tmp_path_factory):
    """Output of `hap plan --model zoo:mlp --cluster cpu_4_uneven --out plan.json`, run once (capsys is
    function-scoped, so the module-scoped run captures by hand)."""
    out_path = tmp_path_factory.mktemp("cli") / "plan.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", "--model", "zoo:mlp", "--cluster", sample_path("cpu_4_uneven"), "--out", str(out_path)])
    return rc, out.getvalue(), err.getvalue(), out_path


# ----------------------------------------------------------------------------- hap plan: the report


def test_plan_returns_0_and_writes_a_loadable_plan(mlp_report):
    rc, out, err, path = mlp_report
    assert rc == 0, err
    assert "Traceback" not in err
    plan = load_plan(str(path))
    assert plan.strategy == "hap"
    assert plan.cluster_name == "cpu_4_uneven"
    assert f"plan written to {path}" in out


def test_plan_report_compares_hap_with_both_baselines_and_a_speed_up(mlp_report):
    rc, out, _, path = mlp_report
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(hap|ddp|dp-even|dp-proportional)\s+([\d.]+) ms\s*(?:([\d.]+)x)?\s*(?:[\d.]+%)?$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), m.group(3))
    assert set(rows) == {"hap", "ddp", "dp-even", "dp-proportional"}, out
    plan = load_plan(str(path))
    assert rows["hap"][0] == pytest.approx(plan.predicted_time_s * 1e3, abs=0.006)
    for name in ("ddp", "dp-even", "dp-proportional"):
        t, speed_up = rows[name]
        assert speed_up is not None
        assert float(speed_up) == pytest.approx(t / rows["hap"][0], abs=0.011)
        assert float(speed_up) >= 1.0
    best = min(rows[n][0] for n in ("ddp", "dp-even", "dp-proportional"))
    m = re.search(r"^speed-up over the best baseline \((ddp|dp-even|dp-proportional)\): ([\d.]+)x", out, re.M)
    assert m and rows[m.group(1)][0] == best, out
    assert float(m.group(2)) == pytest.approx(best / rows["hap"][0], abs=0.011)


def test_plan_report_says_which_overlap_mode_won(mlp_report):
    _, out, _, path = mlp_report
    plan = load_plan(str(path))
    times = plan.search["overlap_s"]
    assert set(times) == {"ddp", "duplex", "none"} and plan.overlap == min(times, key=times.get)
    line = next(x for x in out.splitlines() if x.startswith("overlap: "))
    assert line.startswith(f"overlap: {plan.overlap} (") and "predicted ddp" in line and "duplex" in line and "none" in line


def test_plan_overlap_duplex_writes_a_duplex_plan_of_bert_moe(capsys, tmp_path):
    """The issue's acceptance command, with a small time budget."""
    out_path = tmp_path / "p.json"
    rc = main(["plan", "--model", "zoo:bert_moe", "--cluster", str(ROOT / "sample_clusters" / "hap_paper_testbed_machines.json"),
               "--overlap", "duplex", "--out", str(out_path), "--time-budget", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out_path.read_text())["overlap"] == "duplex"
    assert load_plan(str(out_path)).overlap == "duplex"
    assert re.search(r"^overlap: duplex \(", out, re.M), out


@pytest.mark.parametrize("mode", ["none", "ddp"])
def test_plan_overlap_flag_reaches_the_plan(capsys, tmp_path, mode):
    rc = main(["plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", sample_path("cpu_2"), "--overlap", mode, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["overlap"] == mode


def test_plan_overlap_duplex_with_batch_norm_exits_2_with_one_line(capsys):
    rc = main(["plan", "--model", "zoo:vgg19", "--set", "batch=4", "--set", "image_size=32", "--set", "width=0.125",
               "--set", "hidden=32", "--set", "pool_size=1", "--set", "classes=4", "--set", "batch_norm=true",
               "--cluster", sample_path("cpu_2"), "--overlap", "duplex"])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "duplex" in line and "overlap 'ddp'" in line


def test_plan_report_lists_ratio_and_memory_of_every_device(mlp_report):
    _, out, _, path = mlp_report
    plan = load_plan(str(path))
    cluster_devices = plan.device_names
    table = out[out.index("device"):]
    for j, name in enumerate(cluster_devices):
        # devices with identical figures share a row "first .. last"
        row = next((line for line in table.splitlines() if re.search(rf"(^|\s){re.escape(name)}(\s|$)", line)
                    or _in_range(line, name, cluster_devices)), None)
        assert row is not None, f"no row for {name}:\n{out}"
        assert f"{plan.ratios['0'][j]:.4f}" in row
        assert f"{plan.memory_bytes[j] / GIB:.2f} GiB" in row
        assert "8.0 GiB" in row  # capacity


def _in_range(line: str, name: str, names: list[str]) -> bool:
    m = re.match(r"^(\S+) \.\. (\S+)\s", line)
    if not m:
        return False
    a, b = names.index(m.group(1)), names.index(m.group(2))
    return a <= names.index(name) <= b


def test_plan_json_flag_prints_only_parseable_json(capsys, tmp_path):
    rc = main(["plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", sample_path("cpu_2"), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads(out)
    assert d["kind"] == "hap.plan" and d["strategy"] == "hap"
    assert load_plan(d).to_dict() == d


def test_plan_set_knobs_reach_the_zoo_model(capsys, tmp_path):
    path = tmp_path / "gpt.json"
    rc = main(["plan", "--model", "zoo:gpt", *TINY_GPT, "--cluster", sample_path("cpu_4_uneven"), "--out", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "model gpt" in out
    config = load_plan(str(path)).graph.origin["config"]
    assert config["layers"] == 2 and config["hidden"] == 64 and config["heads"] == 4


def test_capture_then_plan_from_the_graph_file(capsys, tmp_path):
    graph = tmp_path / "graph.json"
    assert main(["capture", "--model", "zoo:mlp", *SMALL_MLP, "--out", str(graph)]) == 0
    rc = main(["plan", "--model", str(graph), "--cluster", sample_path("cpu_2"), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out[out.index("{"):])["kind"] == "hap.plan"  # after capture's one-line summary


# ----------------------------------------------------------------------------- bad input: exit 2, one line


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_unknown_model_exits_2_with_one_line(capsys):
    rc = main(["plan", "--model", "zoo:nope", "--cluster", sample_path("cpu_2")])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "unknown zoo model 'nope'" in line
    assert out == ""


@pytest.mark.parametrize("pair", ["layers2", "=2", ""])
def test_bad_set_syntax_exits_2_with_one_line(capsys, pair):
    rc = main(["plan", "--model", "zoo:gpt", "--set", pair, "--cluster", sample_path("cpu_2")])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "--set expects KEY=VALUE" in line


@pytest.mark.parametrize("pair,expected", [("layerz=2", "unknown knob 'layerz'"), ("layers=abc", "knob 'layers'"),
                                           ("layers=-1", "knob 'layers'")])
def test_bad_knob_exits_2_with_one_line(capsys, pair, expected):
    rc = main(["plan", "--model", "zoo:gpt", "--set", pair, "--cluster", sample_path("cpu_2")])
    out, err = capsys.readouterr()
    assert expected in assert_one_line_error(rc, out, err)


def test_missing_cluster_file_exits_2_with_one_line(capsys, tmp_path):
    rc = main(["plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", str(tmp_path / "nope.json")])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "nope.json" in line and "not found" in line


def test_missing_graph_file_exits_2_with_one_line(capsys, tmp_path):
    rc = main(["plan", "--model", str(tmp_path / "graph.json"), "--cluster", sample_path("cpu_2")])
    out, err = capsys.readouterr()
    assert "not found" in assert_one_line_error(rc, out, err)


def test_malformed_cluster_exits_2_with_one_line(capsys, tmp_path):
    path = _write(tmp_path, "broken.json", '{"schema_version": 1, "name": "broken", "devices": [ {"name": ')
    rc = main(["plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", path])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "broken.json" in line and "not valid JSON" in line


@pytest.mark.parametrize("flops", [-1e10, 0])
def test_non_positive_flops_exits_2_with_one_line_naming_the_field(capsys, tmp_path, flops):
    spec = sample_dict("cpu_4_uneven")
    spec["devices"][2]["flops_per_gpu"] = flops
    path = _write(tmp_path, "neg.json", json.dumps(spec))
    rc = main(["plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", path])
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "devices[2].flops_per_gpu" in line and "positive" in line


def test_model_too_big_for_the_cluster_exits_2_with_one_line(capsys, tmp_path):
    spec = sample_dict("cpu_2")
    spec["devices"][0]["memory_bytes_per_gpu"] = 64 * 2**20
    path = _write(tmp_path, "small.json", json.dumps(spec))
    rc = main(["plan", "--model", "zoo:mlp", "--cluster", path])  # default mlp: ~0.8 GiB of state
    out, err = capsys.readouterr()
    line = assert_one_line_error(rc, out, err)
    assert "out of memory" in line and "GiB" in line


def test_report_marks_a_baseline_that_does_not_fit_in_memory(capsys, tmp_path):
    spec = sample_dict("cpu_2")
    spec["devices"][0]["memory_bytes_per_gpu"] = int(1.2 * GIB)  # data parallel needs 1.38 GiB, HAP 0.88 GiB
    path = _write(tmp_path, "small.json", json.dumps(spec))
    rc = main(["plan", "--model", "zoo:mlp", "--set", "layers=2", "--set", "in_features=1024", "--set", "hidden=8192",
               "--set", "classes=16", "--set", "batch=8192", "--cluster", path])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert re.search(r"^dp-even\s+does not fit in memory", out, re.M), out
    assert re.search(r"^dp-proportional\s+does not fit in memory", out, re.M), out
    assert re.search(r"^hap\s+[\d.]+ ms", out, re.M), out


def test_report_says_why_a_batch_of_one_has_no_data_parallel_baseline(capsys):
    rc = main(["plan", "--model", "zoo:mlp", "--set", "layers=1", "--set", "batch=1", "--cluster", sample_path("cpu_2")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert re.search(r"^dp-even\s+no program: input 'x' has batch < 2", out, re.M), out
    assert re.search(r"^hap\s+[\d.]+ ms", out, re.M), out


# ----------------------------------------------------------------------------- the real process


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "runner.hap", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_console_entry_point_plans_and_reports_errors_without_traceback(tmp_path):
    ok = _run("plan", "--model", "zoo:mlp", *SMALL_MLP, "--cluster", "sample_clusters/cpu_4_uneven.json",
              "--out", str(tmp_path / "plan.json"))
    assert ok.returncode == 0, ok.stderr
    assert "Traceback" not in ok.stderr
    assert "dp-proportional" in ok.stdout
    assert "HiGHS" not in ok.stdout  # highspy writes its banner to fd 1 (not sys.stdout); the report keeps it out
    load_plan(str(tmp_path / "plan.json"))

    bad = _run("plan", "--model", "zoo:nope", "--cluster", "sample_clusters/cpu_2.json")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("hap: error: unknown zoo model 'nope'")


def test_console_entry_point_with_a_time_budget_plans_without_traceback(tmp_path):
    run = _run("plan", "--model", "zoo:gpt", *TINY_GPT, "--cluster", "sample_clusters/cpu_4_uneven.json",
               "--time-budget", "0.01")
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0
    assert "dp-even" in run.stdout
