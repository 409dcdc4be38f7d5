"""Auto's overlap modes searched side by side (engine.spmd.side_by_side): the plan is the one the modes give in
turn, record for record; a child's failure is raised in the parent."""
from __future__ import annotations

import os

import pytest
from conftest import sample_path

import engine
from engine.errors import InfeasibleError, PlanError
from engine.spmd import side_by_side
from engine.spmd.side_by_side import ENV, can_fork, run_side_by_side

TIMING = ("elapsed_s", "baselines_s")


def _untimed(d):
    """A plan's dict without its wall-clock figures (they differ between any two runs)."""
    if isinstance(d, dict):
        return {k: _untimed(v) for k, v in d.items() if k not in TIMING}
    if isinstance(d, list):
        return [_untimed(v) for v in d]
    return d


def test_modes_searched_side_by_side_give_the_plan_they_give_in_turn(monkeypatch):
    graph = engine.load_model("zoo:gpt", layers=2, hidden=64, heads=4, ffn=256, vocab=256, seq_len=16, batch=16)
    cluster = engine.load_cluster(sample_path("hap_paper_testbed_machines"))
    plans = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(ENV, setting)
        plans[setting] = engine.plan(graph, cluster)
    serial, parallel = (plans[k].to_dict() for k in ("0", "1"))
    assert len(plans["1"].search["overlap_s"]) == 3  # ddp, duplex and none were all searched
    assert _untimed(parallel) == _untimed(serial)
    assert [h["iteration"] for h in plans["1"].history] == [h["iteration"] for h in plans["0"].history]


def _fail() -> None:
    raise InfeasibleError("no program fits: made up in a child")


def _die() -> None:
    os._exit(3)


def test_a_child_s_error_is_raised_in_the_parent_with_its_type_and_message():
    assert run_side_by_side([lambda: 1, lambda: 2, lambda: 3], parallel=True) == [1, 2, 3]
    with pytest.raises(InfeasibleError, match="made up in a child"):
        run_side_by_side([lambda: 1, _fail], parallel=True)
    with pytest.raises(PlanError, match=f"ended without a result \\(exit code 3\\); set {ENV}=0"):
        run_side_by_side([lambda: 1, _die], parallel=True)


def test_children_are_forked_only_where_it_is_safe_and_pays(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(side_by_side.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(side_by_side.threading, "active_count", lambda: 1)
    assert can_fork(side_by_side.MIN_NODES, 3)
    assert not can_fork(side_by_side.MIN_NODES - 1, 3)  # too small to pay
    assert not can_fork(side_by_side.MIN_NODES, 1)  # one mode
    monkeypatch.setattr(side_by_side.threading, "active_count", lambda: 2)
    assert not can_fork(side_by_side.MIN_NODES, 3)  # another thread could hold a lock the child needs
    monkeypatch.setattr(side_by_side.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(side_by_side.threading, "active_count", lambda: 1)
    assert not can_fork(side_by_side.MIN_NODES, 3)  # one CPU
    monkeypatch.setenv(ENV, "1")
    assert can_fork(10, 3)
    monkeypatch.setenv(ENV, "0")
    assert not can_fork(10**6, 3)
