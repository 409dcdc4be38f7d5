"""Memoised cost terms of the A* search's steps (`engine.spmd.synthesis`, issue 28's hot path).

The search prices the same (leaf, form, segment), (position, rule) and (collective, tensor,
segments) terms for thousands of children: profiled on a 24-layer GPT, recomputing them per child
took a fifth of the search. `StepTerms` computes each once per search (one cost model, one set
of ratios). A rule's work is priced per device class here too, so a child adds per-class seconds to
its open stages instead of pricing the summed work again (the same linear arithmetic, summed in
another order: scores agree to rounding).
"""
from __future__ import annotations

from engine.spmd.cost import Acc, CostModel
from engine.spmd.program import COMPUTE

Times = tuple[float, ...]
"""Seconds (or bytes) per device class."""


class StepTerms:
    """Per-search caches of the cost terms the search's children share."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._loads: dict[tuple[int, int, int], tuple[Acc, tuple[float, ...], tuple[float, ...] | None]] = {}
        self._rules: dict[tuple[int, int], tuple] = {}
        self._halves: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def load(self, t: int, form: int, segment: int) -> tuple[Acc, tuple[float, ...], tuple[float, ...] | None]:
        """(backward sync work, per-class memory, per-class sync seconds or None when there is no sync
        work) of loading leaf `t` in `form` inside `segment` (`CostModel.load_delta`)."""
        key = (t, form, segment)
        got = self._loads.get(key)
        if got is None:
            sync, m = self.cm.load_delta(t, form)
            times = tuple(self.cm.class_times(sync, segment)) if any(sync) else None
            got = self._loads[key] = (sync, self.cm.memory_by_class(m, segment), times)
        return got

    def rule(self, search, position: int, nid: int, rule) -> tuple:
        """(forward seconds, backward seconds, memory: each per class; whether there is any forward,
        any backward work; the compute instruction as a tuple) of
        computing `position` by `rule`, in the segment of `position`: the search's tables `deltas` and
        `rule_memory`, looked up and priced once per rule. The open stages sum these per-class seconds,
        which `CostModel.class_times` of the summed work equals up to rounding (it is linear in the work)."""
        key = (position, id(rule))  # the rules live as long as the search (`_Prepared.rules`)
        got = self._rules.get(key)
        if got is None:
            df, db = search.deltas[position][(rule.sharded, self.cm.weights_whole(nid, rule.inputs))]
            k = search.seg[position]
            inputs = search.graph[nid].inputs
            got = self._rules[key] = (tuple(self.cm.class_times(df, k)), tuple(self.cm.class_times(db, k)),
                                      search.rule_memory[position][(rule.inputs, rule.output)], any(df), any(db),
                                      (COMPUTE, nid, rule.name, tuple(zip(inputs, rule.inputs)), rule.output))
        return got

    def half_time(self, key: str, t: int, segments: tuple[int, ...]) -> float:
        """Seconds of collective `key` on `t` for one duplex half while `segments`' ratios bound it."""
        k = (key, t, segments)
        got = self._halves.get(k)
        if got is None:
            got = self._halves[k] = self.cm.half_comm_seconds(key, t, max(self.cm.max_ratios[s] for s in segments))
        return got
