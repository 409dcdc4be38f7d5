"""Memoised cost terms of the A* search's steps (`engine.spmd.synthesis`, issue 28's hot path).

The search prices the same (leaf, form, segment), (position, rule) and (collective, tensor,
segments) terms for thousands of children: profiled on a 24-layer GPT, recomputing them per child
took a fifth of the search. `StepTerms` computes each once per search (one cost model, one set
of ratios), by the same arithmetic as before, so every score and every plan stays bit-identical.
"""
from __future__ import annotations

from engine.spmd.cost import Acc, CostModel


class StepTerms:
    """Per-search caches of the cost terms the search's children share."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._loads: dict[tuple[int, int, int], tuple[Acc, tuple[float, ...], tuple[float, ...] | None]] = {}
        self._rules: dict[tuple, tuple[Acc, Acc, tuple[float, ...]]] = {}
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

    def rule(self, search, position: int, nid: int, rule) -> tuple[Acc, Acc, tuple[float, ...]]:
        """(forward work, backward work, per-class memory) of computing `position` by `rule`: the
        search's tables `deltas` and `rule_memory`, looked up once per rule."""
        key = (position, rule.inputs, rule.output, rule.sharded)
        got = self._rules.get(key)
        if got is None:
            df, db = search.deltas[position][(rule.sharded, self.cm.weights_whole(nid, rule.inputs))]
            got = self._rules[key] = (df, db, search.rule_memory[position][(rule.inputs, rule.output)])
        return got

    def half_time(self, key: str, t: int, segments: tuple[int, ...]) -> float:
        """Seconds of collective `key` on `t` for one duplex half while `segments`' ratios bound it."""
        k = (key, t, segments)
        got = self._halves.get(k)
        if got is None:
            const, per = self.cm.half_comm_terms(key, t)
            got = self._halves[k] = const + per * max(self.cm.max_ratios[s] for s in segments)
        return got
