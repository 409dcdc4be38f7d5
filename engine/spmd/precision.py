"""Mixed precision in the cost model: the rate of each operator, the bytes of activations and of the
gradient bucket, and autocast's cast cache (`PlanOptions.precision`, `PlanOptions.grad_dtype`).

Under `torch.autocast` in bf16 or fp16 the parameters, their gradients and the optimizer state stay
fp32 (`engine.spmd.cost.STATE_BYTES_PER_PARAM_BYTE`); what changes:

- the matmul-class operators (`AUTOCAST_OPS`) run in the low dtype, at the spec's rate for it
  (`Device.flops_per_gpu_in`); every other operator keeps the fp32 rate (or, under the roofline
  split, its bytes);
- the activations (non-leaf float32 tensors of the captured graph) are 2 bytes an element instead of 4
  (`ACTIVATION_BYTES`): memory kept for backward, roofline traffic and the payloads of the
  collectives that move them all halve (a simplification: autocast keeps a few ops, e.g. the loss,
  in fp32);
- autocast caches the low-precision copy of every weight an autocast op reads (`CAST_CACHE_BYTES`,
  2 bytes per parameter): made in forward, saved by autograd for backward, so it counts at the peak;
- `grad_dtype` bf16 all-reduces the gradient bucket in bf16 (DDP's compression hook): half the bytes
  on the wire (`GRAD_WIRE`) and fewer bytes copied around it (`GRAD_BUCKET_TRAFFIC`).

A device whose spec gives no rate for the plan's dtype cannot be priced: `check_rates` refuses it.
"""
from __future__ import annotations

from engine.cluster.spec import Cluster, Device
from engine.errors import ClusterError
from engine.model.graph import Graph

AUTOCAST_OPS = frozenset({"linear", "matmul", "einsum", "conv", "sdpa"})
"""Operators autocast runs in the low dtype (on tensor cores): priced at the dtype's rate. The
matmul class of `engine.spmd.cost.FLOPS_BOUND_OPS` less `opaque`, whose dtype is unknown."""
ACTIVATION_BYTES = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}
"""Bytes of an activation per byte the graph captured in float32: autocast's outputs are 2-byte floats."""
CAST_CACHE_BYTES = {"fp32": 0.0, "bf16": 0.5, "fp16": 0.5}
"""Bytes of autocast's low-precision copy per fp32 parameter byte (2 of 4), for weights autocast ops read."""
GRAD_WIRE = {"fp32": 1.0, "bf16": 0.5}
"""Bytes all-reduced per fp32 gradient byte: a bf16 bucket carries 2 bytes per parameter."""
GRAD_BUCKET_TRAFFIC = {"fp32": 1.0, "bf16": 0.75}
"""Bytes copied around the bucket per fp32 copy (`engine.spmd.cost.BUCKET_TRAFFIC`): casting a gradient
into a bf16 bucket reads 4 and writes 2 bytes, and copying the sum back reads 2 and writes 4: 12 of 16."""


def is_mixed(precision: str) -> bool:
    return precision != "fp32"


def device_flops(device: Device, precision: str) -> float:
    """FLOP/s of the whole (virtual) device for matmul-class operators in `precision` (fp32: `Device.flops`)."""
    if precision == "fp32":
        return device.flops
    rate = device.flops_per_gpu_in(precision)
    if rate is None:
        raise ClusterError(f"device '{device.name}' has no {precision} rate in flops_per_gpu")
    return device.num_gpus * rate


def check_rates(cluster: Cluster, precision: str) -> None:
    """Refuse a precision some devices give no rate for, naming them by GPU model and saying what to do."""
    if precision == "fp32":
        return
    lacking = [d for d in cluster.devices if d.flops_per_gpu_in(precision) is None]
    if not lacking:
        return
    models = dict.fromkeys(d.gpu_model for d in lacking)
    named = "; ".join(f"{_span([d.name for d in lacking if d.gpu_model == m])} ({m})" for m in models)
    others = [p for p in ("bf16", "fp16") if p != precision
              and all(d.flops_per_gpu_in(p) is not None for d in cluster.devices)]
    fix = f"plan with --precision {others[0]} (precision='{others[0]}'), which every device rates, or " if others else ""
    why = " (V100 and P100 GPUs have no bf16 tensor cores)" if precision == "bf16" else ""
    raise ClusterError(f"precision {precision}: no {precision} rate in flops_per_gpu for {named}{why}; "
                       f"{fix}give the devices' {precision} rate, e.g. "
                       f"\"flops_per_gpu\": {{\"fp32\": 1.95e13, \"{precision}\": 3.12e14}}, or plan in fp32")


def _span(names: list[str]) -> str:
    """Device names compactly: 'v100-0 .. v100-7' for a run of three or more, else listed."""
    if len(names) >= 3:
        return f"{names[0]} .. {names[-1]}"
    return ", ".join(names)


def priced_bytes(graph: Graph, precision: str) -> list[float] | list[int]:
    """Bytes of every tensor as the plan runs it: activations (non-leaf float32 tensors, and a pipeline
    stage's input received from the previous stage, a `cut` placeholder) at `ACTIVATION_BYTES`; leaves
    (parameters, inputs, buffers) and integer tensors as captured."""
    if precision == "fp32":
        return [n.nbytes for n in graph.nodes]
    scale = ACTIVATION_BYTES[precision]
    return [n.nbytes * scale if (not n.is_leaf or "cut" in n.attrs) and n.dtype == "float32" else n.nbytes
            for n in graph.nodes]


def cast_parameters(graph: Graph) -> frozenset[int]:
    """Parameters read by an autocast op: autocast caches a low-precision copy of each."""
    return frozenset(i for n in graph.nodes if n.op in AUTOCAST_OPS for i in n.inputs if graph[i].op == "parameter")
