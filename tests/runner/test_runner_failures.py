"""Issue 17 at the runner: `hap run` refuses an inconsistent plan before any rank starts, and a
failing rank is reported in one first line with its exception, tracebacks in a named log."""
from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import sample_path
from test_runner_cli import TINY_GPT, hap
from warm_run import warm_hap

import engine
from engine.bundle.archive import export_bundle
from engine.planner import load_plan
from runner.config import FAULT_ENV
from runner.failure import ERRORS_ENV, read_failures, record_failure
from runner.launch import maybe_inject_fault
from runner.torchrun import StderrRelay, failure_report

ROOT_CAUSE = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_22:20:44
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
"""


@pytest.fixture(scope="module")
def plan4(tmp_path_factory) -> Path:
    """The engine's plan of a tiny GPT for sample_clusters/cpu_4_uneven.json (4 ranks)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    engine.plan(engine.load_model("zoo:gpt", **TINY_GPT), sample_path("cpu_4_uneven")).save(path)
    return path


def truncated(plan4: Path, dest: Path) -> Path:
    d = json.loads(plan4.read_text())
    d["program"] = d["program"][:-3]
    dest.write_text(json.dumps(d))
    return dest


def test_hap_run_refuses_a_truncated_plan_in_one_line_before_torchrun(plan4, tmp_path):
    """Through the real command: no torchrun line (such as its OMP_NUM_THREADS warning) may reach stderr."""
    r = hap("run", str(truncated(plan4, tmp_path / "p.json")), "--steps", "1", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("hap run: error: plan: program: the program looks truncated")
    assert len(r.stderr.strip().splitlines()) == 1 and "OMP_NUM_THREADS" not in r.stderr  # torchrun never started
    assert r.stdout == ""


def test_hap_run_refuses_a_bundle_whose_plan_is_inconsistent(plan4, tmp_path):
    plan = load_plan(plan4)
    folder = export_bundle(plan, sample_path("cpu_4_uneven"), tmp_path / "b")
    d = copy.deepcopy(plan.to_dict())
    key = next(iter(d["shard_sizes"]))
    d["shard_sizes"][key] = [d["shard_sizes"][key][0] + 1] + d["shard_sizes"][key][1:]
    data = json.dumps(d).encode()
    (folder / "plan.json").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["plan.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    r = warm_hap("run", str(folder), "--steps", "1", timeout=60)
    assert r.returncode == 2, r.stderr
    assert re.search(rf'plan.json: plan: shard_sizes\["{re.escape(key)}"\]: .* sums to', r.stderr), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_rank_that_raises_is_named_first_with_its_exception_and_the_log_holds_every_traceback(plan4):
    r = warm_hap("run", str(plan4), "--steps", "3", env={FAULT_ENV: "3:1:raise"}, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    head = "hap run: rank 3 failed: RuntimeError: HAP_RUNNER_FAULT=3:1:raise: injected fault in rank 3 at step 1"
    assert head in lines, r.stderr[-3000:]
    assert "Traceback" not in "\n".join(lines[:lines.index(head)]), "a traceback was relayed before the headline"
    log = re.search(r"every rank's traceback and torchrun's output are in (\S+)", r.stderr)
    assert log, r.stderr[-2000:]
    text = Path(log.group(1)).read_text()
    assert text.startswith("==== rank 3: RuntimeError") and "in maybe_inject_fault" in text
    shutil.rmtree(Path(log.group(1)).parent, ignore_errors=True)


# ----------------------------------------------------------------------------- the report, without processes


def write_record(folder: Path, rank: int, kind: str, message: str, at: float) -> None:
    (folder / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "kind": kind, "message": message,
                                                          "traceback": f"Traceback ...\n{kind}: {message}\n", "time": at}))


def test_the_report_names_the_earliest_record_first_even_when_torchrun_saw_another_rank_first(tmp_path):
    write_record(tmp_path, 0, "RuntimeError", "Connection closed by peer", 2.0)
    write_record(tmp_path, 3, "ValueError", "Expected input batch_size (1) to match target batch_size (11)\nmore", 1.0)
    lines = failure_report(1, str(tmp_path), ROOT_CAUSE.format(rank=0, code=1))
    assert lines[0] == "hap run: rank 3 failed: ValueError: Expected input batch_size (1) to match target batch_size (11)"
    log = Path(lines[1].rsplit(" ", 1)[1])
    assert log.read_text().index("==== rank 3: ValueError") < log.read_text().index("==== rank 0: RuntimeError")
    assert "Root Cause" in log.read_text()


def test_a_rank_that_died_without_an_exception_is_named_by_its_exit(tmp_path):
    write_record(tmp_path, 0, "RuntimeError", "Connection closed by peer", 2.0)  # an echo of rank 2's death
    lines = failure_report(1, str(tmp_path), ROOT_CAUSE.format(rank=2, code=-9))
    assert lines[0].startswith("hap run: rank 2 was killed by signal 9")


def failures_block(*failures: tuple[int, int]) -> str:
    """torchrun's 'Failures:' section listing (rank, exit code) pairs."""
    rows = [ROOT_CAUSE.format(rank=r, code=c).split("\n", 1)[1] for r, c in failures]
    return "Failures:\n" + "".join(rows)


def test_a_killed_rank_is_named_even_when_torchrun_observed_its_echo_first(tmp_path):
    """Under load torchrun may see the echoing rank 0 (connection closed) exit before the SIGKILLed
    rank 1: a failed rank without a record is still the news."""
    write_record(tmp_path, 0, "RuntimeError", "Connection closed by peer", 2.0)
    output = failures_block((1, -9)) + ROOT_CAUSE.format(rank=0, code=1)
    assert failure_report(1, str(tmp_path), output)[0].startswith("hap run: rank 1 was killed by signal 9")


def test_ranks_torchrun_stopped_itself_are_not_the_news(tmp_path):
    write_record(tmp_path, 3, "ValueError", "bad batch", 1.0)
    output = failures_block((0, -15), (1, -15)) + ROOT_CAUSE.format(rank=3, code=1)
    assert failure_report(1, str(tmp_path), output)[0] == "hap run: rank 3 failed: ValueError: bad batch"


def test_without_records_or_summary_the_report_says_torchrun_failed(tmp_path):
    assert failure_report(1, str(tmp_path), "")[0] == "hap run: torchrun exited with status 1"


def test_a_rank_records_only_its_first_failure_and_only_when_asked(tmp_path):
    assert record_failure(1, ValueError("x"), {}) is None
    env = {ERRORS_ENV: str(tmp_path)}
    try:
        raise ValueError("the first")
    except ValueError as e:
        record_failure(1, e, env)
    record_failure(1, RuntimeError("its echo"), env)
    (found,) = read_failures(tmp_path)
    assert (found.rank, found.kind, found.message) == (1, "ValueError", "the first")
    assert "raise ValueError" in found.traceback and found.time <= time.time()
    assert found.headline() == "hap run: rank 1 failed: ValueError: the first"


def test_the_relay_holds_everything_from_the_first_traceback(capsys):
    relay = StderrRelay()
    for line in ["warming up\n", "Traceback (most recent call last):\n", '  File "x.py"\n', "step 1\n"]:
        relay.feed(line)
    assert capsys.readouterr().err == "warming up\n"
    assert len(relay.lines) == 4 and relay.held[0].startswith("Traceback")
    relay.release()
    assert capsys.readouterr().err.startswith("Traceback")


def test_the_raise_fault_raises_in_the_rank_and_step_it_names(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "2:1:raise")
    maybe_inject_fault(1, 1)
    maybe_inject_fault(2, 0)
    with pytest.raises(RuntimeError, match="injected fault in rank 2 at step 1"):
        maybe_inject_fault(2, 1)
