"""Property tests: mutated inputs of every kind end in a typed one-line error or are accepted, never in
a raw exception or a hang (issue 17). The mutations and the outcome rules live in `tests/fuzzing.py`,
shared with `bench/fuzz.py`, which runs thousands of cases per kind and prints the outcome table.

Each case runs under a SIGALRM guard far above the planner's own time budget (`PLAN_BUDGET_S`), so a
hang fails the test instead of stalling the suite. Examples are derandomized: CI sees the same cases
every run, and the bench explores.
"""
from __future__ import annotations

import json

import pytest
from fuzzing import CASES, KINDS, Outcome, classify, make_fixtures, mutate_args, mutate_json, pick_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.planner import load_plan

CASE_TIMEOUT_S = 30.0
"""A case past this is a hang (plans run with a 0.3 s budget; a slow shared CI core is allowed for)."""
EXAMPLES = {"cluster": 60, "graph": 60, "plan": 60, "bundle": 60, "cli": 40, "hostile_bundle": 40,
            "hostile_file": 40}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return make_fixtures(tmp_path_factory.mktemp("fuzz"))


def _chooser(data: st.DataObject):
    return lambda n: data.draw(st.integers(0, n - 1))


@pytest.mark.parametrize("kind", KINDS)
def test_mutated_input_is_refused_with_one_typed_line_or_accepted(fx, kind: str) -> None:
    @settings(max_examples=EXAMPLES[kind], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        run, said = CASES[kind](fx, _chooser(data))
        outcome = classify(run, CASE_TIMEOUT_S)
        assert outcome.kind in ("error", "accepted"), f"{kind} case [{said}] ended {outcome.kind}: {outcome.detail}"

    check()


def test_the_unmutated_inputs_are_accepted(fx) -> None:
    """The fuzzer's starting points are valid, so 'accepted' and 'error' really tell mutations apart."""
    from fuzzing import cli_commands, run_cli

    import engine
    from engine.bundle.archive import check_files
    from engine.model.graph import Graph

    for doc in fx.clusters.values():
        engine.load_cluster(doc)
    for doc in fx.graph_jsons.values():
        Graph.from_dict(doc)
    load_plan(json.dumps(fx.plan_json))
    assert check_files(fx.bundle_files, "bundle").ok
    for program, args in cli_commands(fx):
        assert run_cli(program, args, fx.workdir).kind == "accepted", (program, args)


def test_classify_tells_the_four_outcomes_apart() -> None:
    from engine.errors import ClusterError

    def raise_(e: BaseException):
        def run():
            raise e
        return run

    def spin():
        while True:
            pass

    assert classify(lambda: None, 5).kind == "accepted"
    assert classify(raise_(ClusterError("devices[0].count: too many")), 5).kind == "error"
    assert classify(raise_(ClusterError("two\nlines")), 5).kind == "raw"
    assert classify(raise_(IndexError("tuple index out of range")), 5).detail == "IndexError: tuple index out of range"
    assert classify(raise_(SystemExit(2)), 5).kind == "error"
    assert classify(spin, 0.2).kind == "hang"
    assert classify(lambda: Outcome("raw", "x"), 5).kind == "raw"


def test_mutations_are_deterministic_and_leave_the_original_alone() -> None:
    import random

    doc = {"a": [1, 2, {"b": 3.5}], "c": "x"}
    first = mutate_json(doc, random.Random(7).randrange)
    assert first == mutate_json(doc, random.Random(7).randrange)
    assert doc == {"a": [1, 2, {"b": 3.5}], "c": "x"}
    seen = {mutate_json(doc, random.Random(s).randrange)[1].split(":")[1].split()[0] for s in range(200)}
    assert {"deleted", "nan", "inf", "huge", "zero", "negative", "string_number"} <= seen
    assert pick_path(doc, lambda n: n - 1) == ("c",)
    args, said = mutate_args(["plan", "--segments", "2"], random.Random(3).randrange)
    assert args != ["plan", "--segments", "2"] and said
