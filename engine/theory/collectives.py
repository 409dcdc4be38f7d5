"""Communication triples (HAP Fig. 9 and §4.4), as data.

| collective                 | pre     | post    | backward (dual)            |
|----------------------------|---------|---------|----------------------------|
| all_reduce                 | P       | F       | all_reduce                 |
| reduce_scatter(d)          | P       | S(d)    | all_gather(d), padded      |
| all_gather(d), padded      | S(d)    | F       | reduce_scatter(d)          |
| all_gather(d), grouped     | S(d)    | F       | grouped reduce (m reduces) |
| all_reduce, hier           | P       | F       | all_reduce, hier           |
| reduce_scatter(d), hier    | P       | S(d)    | all_gather(d), hier        |
| all_gather(d), hier        | S(d)    | F       | reduce_scatter(d), hier    |
| all_to_all(d1 -> d2)       | S(d1)   | S(d2)   | all_to_all(d2 -> d1)       |
| slice(d) (free, local)     | F       | S(d)    | zero-padding, free         |

A full parameter's gradient is all-reduced in the backward pass (counted by the cost model where
the parameter is loaded). All collectives but `slice` are synchronisation points (stage borders).
The `hier` implementations run in the machine, across machines, in the machine again
(`engine.cluster.hierarchy`); they establish the same forms as the flat ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from engine.theory.core import FULL, PARTIAL, Form


@dataclass(frozen=True)
class Collective:
    """One communication instruction kind."""

    name: str
    """`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all` or `slice`."""
    impl: str = ""
    """Implementation choice: `padded`, `grouped` or `hier` for all_gather, `hier` for all_reduce and
    reduce_scatter, else empty."""

    @property
    def key(self) -> str:
        return f"{self.name}.{self.impl}" if self.impl else self.name

    @property
    def is_communication(self) -> bool:
        return self.name != "slice"


ALL_REDUCE = Collective("all_reduce")
REDUCE_SCATTER = Collective("reduce_scatter")
ALL_GATHER_PADDED = Collective("all_gather", "padded")
ALL_GATHER_GROUPED = Collective("all_gather", "grouped")
ALL_TO_ALL = Collective("all_to_all")
SLICE = Collective("slice")
ALL_REDUCE_HIER = Collective("all_reduce", "hier")
REDUCE_SCATTER_HIER = Collective("reduce_scatter", "hier")
ALL_GATHER_HIER = Collective("all_gather", "hier")
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER_PADDED, ALL_GATHER_GROUPED, ALL_TO_ALL, SLICE,
               ALL_REDUCE_HIER, REDUCE_SCATTER_HIER, ALL_GATHER_HIER)
BY_KEY = {c.key: c for c in COLLECTIVES}


def collectives_from(form: Form, shape: tuple[int, ...]) -> Iterator[tuple[Collective, Form]]:
    """Every collective whose precondition is `form`, with the form it establishes."""
    shardable = [d for d, s in enumerate(shape) if s >= 2]
    if form == PARTIAL:
        yield ALL_REDUCE, FULL
        yield ALL_REDUCE_HIER, FULL
        for d in shardable:
            yield REDUCE_SCATTER, d
            yield REDUCE_SCATTER_HIER, d
    elif form == FULL:
        for d in shardable:
            yield SLICE, d
    else:
        yield ALL_GATHER_PADDED, FULL
        yield ALL_GATHER_GROUPED, FULL
        yield ALL_GATHER_HIER, FULL
        for d in shardable:
            if d != form:
                yield ALL_TO_ALL, d
