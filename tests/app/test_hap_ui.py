"""`hap ui`: the command line, the busy-port refusal, and the engine's independence of Streamlit."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from ui_helpers import ROOT

from engine import cli


def test_ui_command_runs_streamlit_on_loopback():
    cmd = cli.ui_command("127.0.0.1", 8600)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("app/main.py")
    args = dict(zip(cmd[5::2], cmd[6::2]))
    assert args["--server.address"] == "127.0.0.1" and args["--server.port"] == "8600"
    assert args["--server.headless"] == "true"
    assert cli.build_parser().parse_args(["ui"]).host == "127.0.0.1"
    assert cli.build_parser().parse_args(["ui"]).port == 8501


def test_busy_port_is_refused_with_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "runner.hap", "ui", "--port", str(port)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == f"hap: error: port {port} on 127.0.0.1 is busy (another server listens there); choose another with --port N"


def test_engine_never_imports_streamlit():
    code = "import sys, engine, engine.cli, engine.compare; assert 'streamlit' not in sys.modules, 'streamlit imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_stopping_hap_ui_stops_the_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "runner.hap", "ui", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while cli.port_is_free("127.0.0.1", port):  # wait for Streamlit to listen
            assert proc.poll() is None and time.monotonic() < deadline, "the server never started"
            time.sleep(0.5)
        proc.terminate()  # SIGTERM to `hap ui` only, not to its child
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 60
        while not cli.port_is_free("127.0.0.1", port):
            assert time.monotonic() < deadline, "the Streamlit server outlived `hap ui`"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
