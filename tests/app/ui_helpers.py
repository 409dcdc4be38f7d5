"""Fixtures and helpers of the workbench AppTests.

Not a conftest.py: other test modules import `conftest` by name, and a second conftest on
sys.path would shadow theirs. Test modules import the fixtures they use from here.
"""
from __future__ import annotations

import functools
import re
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


# ----------------------------------------------------------------------------- prose for a browser user (issue 30)

CLI_PREFIX = re.compile(r"\bhap: error\b|\bhap [a-z]+:(?=\s)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")
NONE = re.compile(r"\bNone\b")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])")
DIGEST = re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{12,}\b")
INLINE_CODE = re.compile(r"`[^`]*`")
MAX_INTEGER_DIGITS = 9
"""Integers are exact counts (states expanded, parameters, ranks); one of 10 digits or more is a raw figure
(42949672960 bytes) that wants a unit."""


def significant_digits(number: str) -> int:
    """Significant digits of a decimal number as written ('0.000157' -> 3, '38.50' -> 4, '1.2e-08' -> 2)."""
    mantissa = number.lower().split("e")[0]
    digits = mantissa.replace(".", "").lstrip("0")
    return len(digits) if "." in mantissa else len(digits.rstrip("0")) or 1


def prose_problems(text: str) -> list[str]:
    """What a sentence for a browser user must not hold (inline code and digests left out)."""
    prose = DIGEST.sub("", INLINE_CODE.sub("", text))
    found = [f"CLI prefix {m.group()!r}" for m in CLI_PREFIX.finditer(prose)]
    found += [f"flag {m.group()!r}" for m in FLAG.finditer(prose)]
    found += ["None" for _ in NONE.finditer(prose)]
    for m in NUMBER.finditer(prose):
        n = m.group()
        decimal = "." in n or "e" in n
        if (decimal and significant_digits(n) > 4) or (not decimal and len(n) > MAX_INTEGER_DIGITS):
            found.append(f"number {n}")
    return found


def page_prose(at) -> list[str]:
    """Every piece of prose the page drew: titles, markdown, captions, alerts, metric labels and values, button
    labels (code blocks are commands to copy: not prose)."""
    texts = [e.value for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning", "error",
                                  "success") for e in getattr(at, kind)]
    texts += [f"{m.label}: {m.value}" for m in at.metric]
    texts += [w.label for kind in ("button", "selectbox", "radio", "slider", "number_input", "text_area", "text_input",
                                   "multiselect", "checkbox", "toggle") for w in getattr(at, kind)]
    return texts


def assert_prose_for_people(at) -> None:
    """No exception, and none of `prose_problems` in any prose the page drew."""
    no_exception(at)
    problems = {text: found for text in page_prose(at) if (found := prose_problems(text))}
    assert not problems, problems
