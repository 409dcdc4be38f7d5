"""Fixtures and helpers of the workbench AppTests.

Not a conftest.py: other test modules import `conftest` by name, and a second conftest on
sys.path would shadow theirs. Test modules import the fixtures they use from here.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "app" / "main.py")
TINY_GPT = {"layers": 1, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256, "seq_len": 16, "batch": 8}
"""Plans in well under a second: keeps the AppTest suite fast on a busy 2-core machine."""
TIMEOUT_S = 120


@functools.cache
def _tiny() -> tuple:
    """The tiny model, cluster and plan, computed once per test process (every module imports the fixtures)."""
    import engine

    graph = engine.load_model("zoo:gpt", **TINY_GPT)
    cluster = engine.load_cluster(ROOT / "sample_clusters" / "a100x2_p100x2.json")
    return graph, cluster, engine.plan(graph, cluster, time_budget_s=5)


@pytest.fixture
def tiny_graph():
    return _tiny()[0]


@pytest.fixture
def cpu_cluster():
    return _tiny()[1]


@pytest.fixture
def tiny_plan():
    return _tiny()[2]


@pytest.fixture
def app():
    """An AppTest of the whole app whose session starts with the tiny model, cluster and plan."""
    from streamlit.testing.v1 import AppTest

    from app.services import Keys

    tiny_graph, cpu_cluster, tiny_plan = _tiny()
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT_S)
    at.session_state[Keys.GRAPH] = tiny_graph
    at.session_state[Keys.MODEL_SOURCE] = "zoo:gpt (tiny)"
    at.session_state[Keys.CLUSTER] = cpu_cluster
    at.session_state[Keys.CLUSTER_SOURCE] = "sample_clusters/a100x2_p100x2.json"
    at.session_state[Keys.PLAN] = tiny_plan
    at.session_state[Keys.BUDGET] = 3.0
    return at.run()


def open_page(at, name: str):
    """Switch an AppTest to app/app_pages/<name>.py and run it."""
    return at.switch_page(f"app_pages/{name}.py").run()


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
