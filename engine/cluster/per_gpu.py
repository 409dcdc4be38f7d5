"""The per-GPU view of a cluster: every virtual device of k GPUs becomes k devices of one GPU.

A virtual device (`Device.num_gpus` > 1) is a machine whose GPUs run data parallel inside (HAP §3);
the runner starts one process per plan device, so a plan on virtual devices runs only after it is
expanded to one rank per GPU (`engine.elastic.per_gpu`). Each virtual device becomes a `count` entry
of the cluster JSON, so the spec's own expansion names the new devices (`<name>-0` .. `<name>-{k-1}`);
they keep the machine, group and per-GPU figures, and talk at the virtual device's
`intra_bandwidth_Bps` inside their machine.
"""
from __future__ import annotations

from typing import Any

from engine.cluster.spec import Cluster, Device


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
    d["devices"] = [_one_gpu(dev) for dev in cluster.devices]
    levels = dict(cluster.network.bandwidth_Bps)
    intra = [dev.intra_bandwidth_Bps for dev in virtual] + ([levels["intra_machine"]] if "intra_machine" in levels else [])
    levels["intra_machine"] = min(intra)
    d["network"] = {"latency_s": cluster.network.latency_s, "bandwidth_Bps": levels}
    return Cluster.from_dict(d)


def _one_gpu(device: Device) -> dict[str, Any]:
    """A device's JSON entry with one GPU per device: `count` of them for a virtual device."""
    entry = device.to_dict()
    return entry if device.num_gpus == 1 else {**entry, "num_gpus": 1, "count": device.num_gpus}
