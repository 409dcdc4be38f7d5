"""A bundle zip's scratch folder (`hap-bundle-*`) never outlives its process (issue 24): removed on a return, an
error, Ctrl-C and SIGTERM, which `runner.scratch.sigterm_exits` turns into an unwinding exit while it is held."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, sample_path

import engine
from engine.bundle.archive import export_bundle
from engine.errors import BundleError
from runner.rank_setup import opened_source
from runner.scratch import STATUS, scratch_folder

HOLD = """import sys, time
from {module} import {name}
with {name}({args}) as held:
    try:
        print(held[2] if isinstance(held, tuple) else held, flush=True)
        time.sleep(120)
    finally:
        open(sys.argv[2], "w").close()  # a finally block inside the guarded block ran
"""


@pytest.fixture(scope="module")
def bundle_zip(tmp_path_factory) -> Path:
    graph = engine.load_model("zoo:mlp", layers=1, in_features=8, hidden=16, classes=4, batch=8)
    plan = engine.evaluate(graph, engine.load_cluster(sample_path("cpu_4_uneven")), "dp-even", optimizer="sgd")
    return export_bundle(plan, None, tmp_path_factory.mktemp("b") / "mlp", zip=True).with_name("mlp.zip")


def terminated_holder(code: str, tmp_path: Path, *args: str) -> tuple[Path, int]:
    """(the folder a child printed while holding it, the child's exit status after SIGTERM); asserts its finally ran."""
    marker = tmp_path / "finally-ran"
    child = subprocess.Popen([sys.executable, "-c", code, *args, str(marker)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        folder = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert folder.name.startswith("hap-bundle-") and folder.is_dir(), child.stderr.read()  # type: ignore[union-attr]
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert marker.exists()
    return folder, child.returncode


def test_sigterm_removes_the_scratch_folder_and_still_kills_by_sigterm(tmp_path):
    code = HOLD.format(module="runner.scratch", name="scratch_folder", args="")
    folder, status = terminated_holder(code, tmp_path, "-")
    assert not folder.exists()
    assert status == -signal.SIGTERM  # as a process without a handler: torchrun counts it as stopped, not failed


def test_sigterm_removes_the_extracted_bundle_zip_of_opened_source(tmp_path, bundle_zip):
    code = HOLD.format(module="runner.rank_setup", name="opened_source", args="sys.argv[1]")
    folder, status = terminated_holder(code, tmp_path, str(bundle_zip))
    assert not folder.exists() and status == -signal.SIGTERM


def test_opened_source_removes_its_folder_on_return_and_on_error(bundle_zip, tmp_path, monkeypatch):
    with opened_source(str(bundle_zip)) as (plan_path, opened, scratch):
        assert opened is not None and Path(plan_path).is_file() and Path(scratch).name.startswith("hap-bundle-")
    assert not Path(scratch).exists()
    with pytest.raises(KeyboardInterrupt), opened_source(str(bundle_zip)) as (_, _, scratch):
        raise KeyboardInterrupt
    assert not Path(scratch).exists()
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bundle_zip.read_bytes().replace(b"launch_node.sh", b"launch_node.sx"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(BundleError, match="launch_node.s"), opened_source(str(bad)):
        pass
    assert not list((tmp_path / "tmp").iterdir())


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers: main thread")
def test_under_another_handler_sigterm_unwinds_as_exit_143_and_the_handler_comes_back():
    caught: list[int] = []

    def other(signum, _frame):
        caught.append(signum)

    before = signal.signal(signal.SIGTERM, other)
    try:
        with pytest.raises(SystemExit) as e, scratch_folder() as folder:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted: the handler raises at the next bytecode
        assert e.value.code == STATUS == 143 and not Path(folder).exists()
        assert signal.getsignal(signal.SIGTERM) is other and caught == []
    finally:
        signal.signal(signal.SIGTERM, before)
