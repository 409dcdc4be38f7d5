"""The Q<->B loop confirms a moved B with a narrow search (issue 28, item 2): after an LP that moves
the ratios, the next search runs with `CONFIRM_BEAM` and the previous program as its incumbent; the
loop stops when that finds nothing better, and searches in full at the same ratios when it does."""
from __future__ import annotations

import engine
import pytest
from conftest import ZOO_SMALL
from engine.spmd import iteration
from engine.spmd.iteration import CONFIRM_BEAM

CASES = [("gpt", "a100_v100_mixed"), ("gpt", "hap_paper_testbed_machines"), ("bert", "a100x2_p100x2"),
         ("vit", "hap_paper_testbed_machines")]
"""Tiny zoo models where the LP moves the first search's ratios (data parallelism on the fast devices
only, then a HAP program spread over all): both of the confirmation's outcomes occur among them."""

def _searches(monkeypatch, graph, cluster, **options) -> list[list[dict]]:
    """Every search of the plan's Q<->B loops, one list per loop: beam, ratios, incumbent and result."""
    loops: list[list[dict]] = []
    run, synthesize = iteration.Loop.run, iteration.synthesize

    def loop_run(self, *args, **kwargs):
        loops.append([])
        return run(self, *args, **kwargs)

    def search(graph, cm, **kw):
        res = synthesize(graph, cm, **kw)
        loops[-1].append({"beam": kw["beam_width"], "ratios": [list(r) for r in cm.ratios],
                          "incumbent": kw["incumbent"], "program": tuple(res.program)})
        return res

    monkeypatch.setattr(iteration.Loop, "run", loop_run)
    monkeypatch.setattr(iteration, "synthesize", search)
    engine.plan(graph, cluster, **options)
    return loops


def test_a_moved_b_is_confirmed_narrowly_and_a_better_find_is_searched_in_full(monkeypatch, load_sample):
    stopped = searched_on = 0
    for name, cluster_name in CASES:
        graph = engine.load_model(f"zoo:{name}", **ZOO_SMALL[name])
        for loop in _searches(monkeypatch, graph, load_sample(cluster_name)):
            assert loop[0]["beam"] == engine.PlanOptions().beam_width, (name, cluster_name)
            for k, s in enumerate(loop[1:], start=1):
                before = loop[k - 1]
                if before["beam"] != CONFIRM_BEAM and s["ratios"] != before["ratios"]:
                    assert s["beam"] == CONFIRM_BEAM and s["incumbent"] == before["program"]
                if s["beam"] != CONFIRM_BEAM:
                    continue
                if s["program"] == s["incumbent"]:
                    assert k == len(loop) - 1, "a confirmed incumbent ends the loop"
                    stopped += 1
                else:
                    after = loop[k + 1]
                    assert after["beam"] == engine.PlanOptions().beam_width and after["ratios"] == s["ratios"]
                    assert after["incumbent"] == s["program"]
                    searched_on += 1
    assert stopped and searched_on, (stopped, searched_on)


@pytest.mark.parametrize("beam", [None, CONFIRM_BEAM])
def test_no_narrow_confirmation_for_an_exact_search_or_a_beam_no_wider(monkeypatch, load_sample, beam):
    graph = engine.load_model("zoo:gpt", **ZOO_SMALL["gpt"])
    loops = _searches(monkeypatch, graph, load_sample("hap_paper_testbed_machines"), beam_width=beam,
                      overlap="none", time_budget_s=60)
    assert {s["beam"] for loop in loops for s in loop} == {beam}
    if beam is not None:
        assert any(len(loop) > 1 for loop in loops)  # B moved: a confirmation would have had its chance


def test_the_history_records_each_searchs_beam(load_sample):
    graph = engine.load_model("zoo:gpt", **ZOO_SMALL["gpt"])
    p = engine.plan(graph, load_sample("hap_paper_testbed_machines"), overlap="none")
    beams = [h["beam_width"] for h in p.history if h["step"] == "Q"]
    assert beams[0] == engine.PlanOptions().beam_width and CONFIRM_BEAM in beams
