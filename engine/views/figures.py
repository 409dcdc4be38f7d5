"""Figures in words: milliseconds, bandwidths, GiB and the plan's compute bound and MFU, as the
workbench pages and the notebook displays print them."""
from __future__ import annotations

from typing import Any

from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from engine.spmd.utilisation import percent

GIB = 2**30


SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"),
               (1e-9, "n"))
"""The prefixes `in_units` picks from, largest first."""


def in_units(value: float, unit: str, digits: int = 3) -> str:
    """A figure with the SI prefix its magnitude calls for and `digits` significant digits: the one way the views
    write FLOPs, bytes/s and seconds ('157 MFLOP', '625 MB/s', '1.5 TFLOP/s', '50 µs', '0 B/s')."""
    if value == 0 or value != value:
        return f"{value:g} {unit}"
    for k, (scale, prefix) in enumerate(SI_PREFIXES):
        shown = float(f"{abs(value) / scale:.{digits}g}")
        if shown >= 1 or k == len(SI_PREFIXES) - 1:
            if shown >= 1000 and k > 0:  # rounding carried it up to the next prefix
                scale, prefix = SI_PREFIXES[k - 1]
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    raise AssertionError("unreachable: the last prefix always returns")


def bandwidth_label(bps: float) -> str:
    """Bytes/s with the prefix its magnitude calls for ('150 GB/s', '625 MB/s')."""
    return in_units(bps, "B/s")


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


def blank_missing(rows: list[dict[str, Any]], filler: str = "") -> list[dict[str, Any]]:
    """The rows with every missing value of a text column (one holding a string somewhere) as `filler`: a table
    shows no literal "None" for a note a row lacks. Numeric columns keep None (an empty cell) and their format."""
    text = {k for r in rows for k, v in r.items() if isinstance(v, str)}
    return [{k: filler if v is None and k in text else v for k, v in r.items()} for r in rows]
