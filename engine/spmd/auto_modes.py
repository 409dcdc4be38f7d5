"""What `overlap="auto"` searches (issue 28): every overlap mode's own Q<->B loop, so auto predicts
the best of the three separate searches (`overlap="none"`, `"ddp"`, `"duplex"`), never worse.

Auto used to search ddp and duplex and only *price* the ddp program in none. A separate search
in none can find a different program: on BERT at 1 layer on the paper's 8 machines it predicts
1.485 ms, the priced ddp program 1.499 ms. So auto searches none too, starting exactly as a
forced `none` does (same seeds, same ratios), and keeps the priced ddp program where that is faster.
"""
from __future__ import annotations

from typing import Callable, TypeVar

AUTO_MODES: tuple[str, ...] = ("ddp", "duplex", "none")
"""The modes auto searches, in order: a tie keeps the earlier, so duplex or none wins only by a predicted gain."""
AUTO_MODES_WITHOUT_DUPLEX: tuple[str, ...] = ("ddp", "none")
"""Auto's modes for a model whose half batches would not compute the same (`duplex_run_problem`)."""

C = TypeVar("C")


def best_of_none(searched: C | None, priced: C, rank: Callable[[C], tuple]) -> C:
    """Auto's `none` candidate: the none search's plan, or the ddp plan priced in none where that
    ranks strictly better (`rank`: fits-first, then predicted time)."""
    if searched is None:
        return priced
    return priced if rank(priced) < rank(searched) else searched
