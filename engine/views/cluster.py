"""Rows of a cluster: each device's compute and memory, and the headline figures of the whole."""
from __future__ import annotations

from typing import Any

from engine.cluster.spec import Cluster
from engine.views.figures import GIB, bandwidth_label


def capacity_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """One row per device: its GPU model and count, its fp32 TFLOP/s (all its GPUs) and memory per GPU."""
    return [{"device": d.name, "gpu_model": d.gpu_model, "machine": d.machine, "gpus": d.num_gpus,
             "tflops": d.flops / 1e12, "memory_gib": d.memory_bytes_per_gpu / GIB} for d in cluster.devices]


def cluster_figures(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(label, value, help) of a cluster's headline figures: devices, GPUs, summed fp32 peak, memory, links."""
    gpus = sum(d.num_gpus for d in cluster.devices)
    models = sorted({d.gpu_model for d in cluster.devices})
    links = ", ".join(f"{k} {bandwidth_label(v)}" for k, v in cluster.network.bandwidth_Bps.items())
    return [("Devices", str(cluster.num_devices), f"on {len(cluster.machines)} machines"),
            ("GPUs", str(gpus), ", ".join(models)),
            ("fp32 peak", f"{sum(cluster.flops) / 1e12:.4g} TFLOP/s", "summed over every GPU"),
            ("Memory", f"{sum(d.num_gpus * d.memory_bytes_per_gpu for d in cluster.devices) / GIB:.4g} GiB",
             "summed over every GPU"),
            ("Links", links or "none", f"latency {cluster.network.latency_s:.3g} s per hop")]
