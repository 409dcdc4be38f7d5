"""Figures in words: milliseconds, bandwidths, GiB and the plan's compute bound and MFU, as the
workbench pages and the notebook displays print them."""
from __future__ import annotations

from typing import Any

from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from engine.spmd.utilisation import percent

GIB = 2**30


def bandwidth_label(bps: float) -> str:
    """Bytes/s as GB/s (the unit datasheets use)."""
    return f"{bps / 1e9:.3g} GB/s"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 4 significant digits (tiny and large plans both stay readable)."""
    return f"{seconds * 1e3:.4g} ms"


def utilisation_metrics(plan: Plan | PipelinePlan) -> list[tuple[str, str, str]]:
    """(label, value, help) of the plan's compute bound and MFU (`engine.spmd.utilisation`), shown
    beside its predicted time; 'unknown' for a plan that records no peak FLOP/s."""
    u, precision = plan.utilisation, plan.options.precision
    bound = u.compute_bound_s
    why = (f"the model's {u.model_flops:.3g} FLOPs per iteration (forward and backward, recomputation not counted) "
           f"at the devices' summed {precision} peak of {u.peak_flops:.3g} FLOP/s: no plan is faster"
           if bound is not None else "the plan records no peak FLOP/s (made before plans recorded it): plan it again")
    return [("Compute bound", "unknown" if bound is None else ms(bound), why),
            ("MFU", percent(u.mfu), "model FLOPs utilisation: the compute bound over the predicted iteration")]


def in_percent(rows: list[dict[str, Any]], key: str = "mfu") -> list[dict[str, Any]]:
    """The rows with `key` (a fraction, e.g. an MFU) in percent, for a "%.3g%%" table column (None stays None)."""
    return [{**r, key: None if r.get(key) is None else r[key] * 100} for r in rows]
