"""The shared timeline simulator: resource order, dependencies, and refusals."""
import pytest

from engine.errors import PlanError
from engine.timeline import Task, chain, simulate


def test_one_resource_runs_its_tasks_back_to_back_in_list_order():
    s = simulate(chain("c", "gpu0", [1.0, 2.0, 0.5]))
    assert [(x.start_s, x.end_s) for x in s.spans] == [(0.0, 1.0), (1.0, 3.0), (3.0, 3.5)]
    assert s.makespan_s == 3.5 and s.busy_s("gpu0") == 3.5


def test_a_task_waits_for_its_dependencies_on_other_resources():
    tasks = [Task("a", "gpu", 2.0), Task("net", "link", 1.0, ("a",), "comm"), Task("b", "gpu", 1.0),
             Task("c", "gpu", 1.0, ("net",))]
    s = simulate(tasks)
    assert s.end_of("net") == 3.0 and s.end_of("b") == 3.0 and s.end_of("c") == 4.0
    assert s.busy_s("link") == 1.0


def test_resource_order_is_kept_even_when_a_later_task_is_ready_first():
    # 'late' is listed first on the link and waits for 'slow'; 'early' must queue behind it
    tasks = [Task("slow", "gpu", 5.0), Task("late", "link", 1.0, ("slow",)), Task("early", "link", 1.0)]
    s = simulate(tasks)
    assert s.end_of("late") == 6.0 and s.end_of("early") == 7.0


def test_bad_schedules_are_refused_by_name():
    with pytest.raises(PlanError, match="two tasks are named 'x'"):
        simulate([Task("x", "r", 1.0), Task("x", "r", 1.0)])
    with pytest.raises(PlanError, match="unknown task"):
        simulate([Task("x", "r", 1.0, ("nope",))])
    with pytest.raises(PlanError, match="durations must be >= 0"):
        simulate([Task("x", "r", -1.0)])
    with pytest.raises(PlanError, match="deadlocks"):
        simulate([Task("a", "r", 1.0, ("b",)), Task("b", "r", 1.0)])
