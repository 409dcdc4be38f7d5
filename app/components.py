"""Streamlit-side helpers of the pages: the cluster page's editable device and link tables and their way
back to JSON. Every row, DOT text and chart the pages show is built by `engine.views` (shared with the
notebook displays)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from engine import Cluster

FLOPS_COLUMN = "flops_per_gpu_"
"""Prefix of the table columns of a device's mixed-precision rates (`flops_per_gpu_bf16`, `flops_per_gpu_fp16`):
a table cell holds no map, so `flops_per_gpu` shows the fp32 rate and each dtype has a column."""


UNITS = {"flops_per_gpu": ("TFLOP/s", 1e12), "memory_bytes_per_gpu": ("GiB", 2**30), "memory_bandwidth_Bps": ("GB/s", 1e9),
         "intra_bandwidth_Bps": ("GB/s", 1e9), "activation_bandwidth_Bps": ("GB/s", 1e9), "bandwidth_Bps": ("GB/s", 1e9),
         "op_overhead_s": ("us", 1e-6)}
"""The unit each figure of the cluster tables is edited in (a field, or a field's prefix: `flops_per_gpu_bf16`),
and its size in the JSON's unit: people read 19.5 TFLOP/s and 40 GiB, not 19500000000000 and 42949672960."""


def _unit(field: str) -> tuple[str, float] | None:
    return UNITS.get(field) or next((u for k, u in UNITS.items() if field.startswith(f"{k}_")), None)


def in_table_units(row: dict[str, Any]) -> dict[str, Any]:
    """A row of JSON fields as table columns in people's units ("flops_per_gpu (TFLOP/s)": 19.5)."""
    out = {}
    for k, v in row.items():
        unit = _unit(k)
        out[f"{k} ({unit[0]})" if unit else k] = v / unit[1] if unit and isinstance(v, (int, float)) else v
    return out


def from_table_units(row: dict[str, Any]) -> dict[str, Any]:
    """A table row back to JSON fields in the JSON's units (the inverse of `in_table_units`)."""
    out = {}
    for k, v in row.items():
        field = k.rsplit(" (", 1)[0]
        unit = _unit(field) if field != k else None
        out[field] = v * unit[1] if unit and isinstance(v, (int, float)) else v
    return out


def device_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """Devices as editable table rows in people's units (the JSON fields of a device, less the Slurm hints: a
    nested object no table cell holds; `services.cluster_with_edits` keeps them by device name; a per-dtype
    `flops_per_gpu` is spread over one column per dtype, `flops_map` folds it back)."""
    rows = []
    for d in cluster.devices:
        row: dict[str, Any] = {}
        for k, v in d.to_dict().items():
            if k == "flops_per_gpu":
                row[k] = d.flops_per_gpu
                row.update({f"{FLOPS_COLUMN}{dtype}": rate for dtype, rate in d.flops_by_dtype})
            elif k != "slurm":
                row[k] = v
        rows.append(in_table_units(row))
    return rows


def flops_map(row: dict[str, Any]) -> dict[str, Any]:
    """A table row back to a device's JSON: units undone, per-dtype rate columns folded back into `flops_per_gpu`
    (the inverse of `device_rows`)."""
    row = from_table_units(row)
    rates = {k[len(FLOPS_COLUMN):]: row[k] for k in row if k.startswith(FLOPS_COLUMN)}
    out = {k: v for k, v in row.items() if not k.startswith(FLOPS_COLUMN)}
    if rates and "flops_per_gpu" in out:
        out["flops_per_gpu"] = {"fp32": out["flops_per_gpu"], **rates}
    return out


def link_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """Link levels and their bandwidth as editable table rows (GB/s; `from_table_units` reads them back)."""
    return [in_table_units({"level": k, "bandwidth_Bps": v}) for k, v in cluster.network.bandwidth_Bps.items()]


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Table rows as JSON-style dicts: empty cells left out (the engine then names the missing
    field), numpy scalars as Python numbers."""
    out = []
    for row in df.to_dict("records"):
        out.append({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if not _empty(v)})
    return out


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v) or v is pd.NA or v is pd.NaT
