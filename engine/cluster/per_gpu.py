"""The per-GPU view of a cluster: every virtual device of k GPUs becomes k devices of one GPU.

A virtual device (`Device.num_gpus` > 1) is a machine whose GPUs run data parallel inside (HAP §3);
the runner starts one process per plan device, so a plan on virtual devices runs only after it is
expanded to one rank per GPU (`engine.elastic.per_gpu`). The new devices are named like a `count`
entry of the cluster JSON (`<name>-0` .. `<name>-{k-1}`), keep the machine, group and per-GPU
figures, and talk at the virtual device's `intra_bandwidth_Bps` inside their machine.
"""
from __future__ import annotations

from typing import Any

from engine.cluster.spec import Cluster, Device


def gpu_names(device: Device) -> list[str]:
    """Names of a device's GPUs in the per-GPU cluster (the device's own name when it has one GPU)."""
    return [device.name] if device.num_gpus == 1 else [f"{device.name}-{j}" for j in range(device.num_gpus)]


def per_gpu_cluster(cluster: Cluster) -> Cluster:
    """`cluster` with every virtual device split into its GPUs (the cluster itself when it has none).

    The intra-machine link level becomes the slowest intra bandwidth of the split devices (or of the
    level the cluster already gives); collective fits are dropped so they are derived again for the
    new layout, since a fit measured between machines does not price rings of GPUs."""
    virtual = [d for d in cluster.devices if d.num_gpus > 1]
    if not virtual:
        return cluster
    d = cluster.to_dict()
    d["name"] = f"{cluster.name}_per_gpu"
    d["description"] = f"{cluster.name} with each virtual device split into its GPUs, one device per GPU. " \
                       + cluster.description
    d["devices"] = [_one_gpu(dev.to_dict(), name) for dev in cluster.devices for name in gpu_names(dev)]
    levels = dict(cluster.network.bandwidth_Bps)
    intra = [dev.intra_bandwidth_Bps for dev in virtual] + ([levels["intra_machine"]] if "intra_machine" in levels else [])
    levels["intra_machine"] = min(intra)
    d["network"] = {"latency_s": cluster.network.latency_s, "bandwidth_Bps": levels}
    return Cluster.from_dict(d)


def _one_gpu(device: dict[str, Any], name: str) -> dict[str, Any]:
    return {**device, "name": name, "num_gpus": 1}
