"""Shared fixtures of the workbench tests: AppTest runs of app/main.py with a tiny default model."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "app" / "main.py")
TINY_GPT = {"layers": 1, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256, "seq_len": 16, "batch": 8}
"""Plans in well under a second: keeps the AppTest suite fast on a busy 2-core machine."""
TIMEOUT_S = 120


@pytest.fixture(scope="session")
def tiny_graph():
    import engine

    return engine.load_model("zoo:gpt", **TINY_GPT)


@pytest.fixture(scope="session")
def cpu_cluster():
    import engine

    return engine.load_cluster(ROOT / "sample_clusters" / "a100x2_p100x2.json")


@pytest.fixture(scope="session")
def tiny_plan(tiny_graph, cpu_cluster):
    import engine

    return engine.plan(tiny_graph, cpu_cluster, time_budget_s=5)


@pytest.fixture
def app(tiny_graph, cpu_cluster, tiny_plan):
    """An AppTest of the whole app whose session starts with the tiny model, cluster and plan."""
    from streamlit.testing.v1 import AppTest

    from app.services import Keys

    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT_S)
    at.session_state[Keys.GRAPH] = tiny_graph
    at.session_state[Keys.MODEL_SOURCE] = "zoo:gpt (tiny)"
    at.session_state[Keys.CLUSTER] = cpu_cluster
    at.session_state[Keys.CLUSTER_SOURCE] = "sample_clusters/a100x2_p100x2.json"
    at.session_state[Keys.PLAN] = tiny_plan
    at.session_state[Keys.BUDGET] = 3.0
    return at.run()
