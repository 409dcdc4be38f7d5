"""Pipeline schedules (HAPT §4) on the shared timeline simulator: warm-up counts, bubbles, Eq. 13, memory."""
import random

import pytest

from engine.errors import PlanError
from engine.pipeline.schedule import (SCHEDULES, Pipeline, StageTimes, closed_form_s, h1f1b_counts, in_flight,
                                      run_schedule, stage_order, steady_idle_s, warmup_counts)


def _worked_example(microbatches: int = 8) -> Pipeline:
    """HAPT §2.3.2 / Fig. 3: three equal stages, a slow link (t_max/2 < c <= t_max) between stages 1 and 2 only."""
    stage = StageTimes(1.0, 2.0, activation_bytes=10.0)
    return Pipeline((stage,) * 3, (2.0, 0.0), microbatches)


def test_worked_example_warmup_counts_of_each_schedule():
    p = _worked_example()
    assert warmup_counts("h-1f1b", p) == (5, 2, 1)
    assert warmup_counts("eager-1f1b", p) == (5, 3, 1)
    assert warmup_counts("1f1b", p) == (3, 2, 1)
    assert warmup_counts("gpipe", p) == (8, 8, 8)


def test_worked_example_h1f1b_hides_the_slow_link_and_1f1b_does_not():
    p = _worked_example()
    h, plain = run_schedule(p, "h-1f1b"), run_schedule(p, "1f1b")
    assert all(steady_idle_s(h, s) == pytest.approx(0.0, abs=1e-12) for s in range(3))
    assert steady_idle_s(plain, 0) > 0 and plain.iteration_s > h.iteration_s
    assert h.iteration_s == pytest.approx(closed_form_s(p))
    # eager-1f1b holds one more microbatch than needed on stage 2 (fast link) for the same time here
    eager = run_schedule(p, "eager-1f1b")
    assert eager.in_flight == (5, 3, 1) and h.in_flight == (5, 2, 1)
    assert h.peak_activation_bytes == (50.0, 20.0, 10.0)


def test_gpipe_holds_every_microbatch_and_1f1b_holds_its_warmup():
    p = _worked_example(microbatches=6)
    assert run_schedule(p, "gpipe").in_flight == (6, 6, 6)
    assert run_schedule(p, "1f1b").in_flight == (3, 2, 1)
    assert in_flight(4, 2) == 2  # capped by B


def test_stage_order_is_warmup_then_one_backward_one_forward():
    assert stage_order(2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]


def test_h1f1b_delta_follows_the_transfer_to_tmax_ratio():
    # delta = 1 for c = 0, 2 for 0 < c <= t/2, 3 for t/2 < c <= t (HAPT Eq. 2); epsilon absorbs tiny transfers
    assert h1f1b_counts((0.0, 0.5, 1.0, 0.001), 1.0) == [9, 8, 6, 3, 1]  # deltas 1, 2, 3, 2 from the last stage up
    assert h1f1b_counts((0.001,), 1.0, epsilon=0.01) == [2, 1]
    assert h1f1b_counts((0.6,), 1.0) == [4, 1]


def _random_balanced(rng: random.Random, max_c: float) -> Pipeline | None:
    S = rng.randint(1, 6)
    f = rng.uniform(0.2, 2.0)
    b = f * rng.uniform(1.0, 3.0)
    cs = tuple(rng.choice([0.0, rng.uniform(0.0, max_c * (f + b))]) for _ in range(S - 1))
    B = rng.randint(1, 16)
    if max(h1f1b_counts(cs, f + b)) > B:
        return None
    return Pipeline((StageTimes(f, b),) * S, cs, B)


def test_closed_form_equals_the_simulator_on_random_balanced_pipelines():
    rng, checked = random.Random(7), 0
    while checked < 300:
        p = _random_balanced(rng, max_c=0.5)
        if p is None:
            continue
        checked += 1
        assert run_schedule(p, "h-1f1b").iteration_s == pytest.approx(closed_form_s(p), rel=1e-12, abs=1e-12)


def test_h1f1b_steady_phase_is_bubble_free_whenever_transfers_fit_in_tmax():
    rng, checked = random.Random(11), 0
    while checked < 200:
        S, B = rng.randint(2, 6), rng.randint(4, 20)
        stages = tuple(StageTimes(f, f * rng.uniform(1.0, 3.0)) for f in (rng.uniform(0.2, 2.0) for _ in range(S)))
        t_max = max(s.total_s for s in stages)
        cs = tuple(rng.choice([0.0, rng.uniform(0.0, t_max)]) for _ in range(S - 1))
        p = Pipeline(stages, cs, B)
        if max(h1f1b_counts(cs, t_max)) > B:
            continue
        checked += 1
        run = run_schedule(p, "h-1f1b")
        bottleneck = max(range(S), key=lambda i: stages[i].total_s)
        assert steady_idle_s(run, bottleneck) == pytest.approx(0.0, abs=1e-9)


def test_a_transfer_slower_than_tmax_shows_in_the_time_and_the_closed_form_refuses_it():
    p = Pipeline((StageTimes(1.0, 2.0),) * 2, (4.0,), 12)
    run = run_schedule(p, "h-1f1b")
    assert run.iteration_s >= 12 * 4.0  # the link is the bottleneck: B transfers of 4 s each way
    with pytest.raises(PlanError, match="exceeds t_max"):
        closed_form_s(p)


def test_sync_runs_after_the_last_backward_and_counts_in_the_iteration():
    base = Pipeline((StageTimes(1.0, 2.0),) * 2, (0.0,), 4)
    synced = Pipeline((StageTimes(1.0, 2.0, sync_s=5.0), StageTimes(1.0, 2.0)), (0.0,), 4)
    assert run_schedule(synced, "1f1b").iteration_s == pytest.approx(run_schedule(base, "1f1b").iteration_s + 5.0)


def test_every_schedule_simulates_and_bad_input_is_refused():
    p = _worked_example(microbatches=3)
    for name in SCHEDULES:
        assert run_schedule(p, name).iteration_s > 0
    with pytest.raises(PlanError, match="unknown pipeline schedule"):
        warmup_counts("zb-h1", p)
    with pytest.raises(PlanError, match="one per boundary"):
        Pipeline((StageTimes(1.0, 1.0),) * 2, (), 2)
    with pytest.raises(PlanError, match="microbatches"):
        Pipeline((StageTimes(1.0, 1.0),), (), 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_without_transfers_take_b_plus_s_minus_one_slots(schedule):
    # the textbook pipeline time: (B + S - 1)(t_f + t_b) for GPipe and 1F1B alike
    for S, B in [(1, 5), (3, 3), (4, 8), (5, 2)]:
        p = Pipeline((StageTimes(1.0, 2.0),) * S, (0.0,) * (S - 1), B)
        assert run_schedule(p, schedule).iteration_s == pytest.approx((B + S - 1) * 3.0)
