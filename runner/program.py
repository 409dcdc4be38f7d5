"""Build one rank's program from a plan: a readable `torch.fx.GraphModule` (`print(gm.code)`).

Placeholders are the rank's local parameter slices and input slices; every compute instruction
becomes a call of the torch function of its canonical op on local tensors (shapes localised with
the plan's integer shard sizes), every collective a call of `runner.collectives`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from engine.graph import Graph, Node
from engine.plan import Plan
from engine.program import COMM, LOAD, Instruction
from engine.segments import RESPLIT, instruction_segments, source_segments
from engine.theory.core import FULL, PARTIAL

from . import collectives as C
from .timing import probe

_UNARY: dict[str, Callable] = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu,
                               "exp": torch.exp, "rsqrt": torch.rsqrt, "sqrt": torch.sqrt, "neg": torch.neg}
_BINARY: dict[str, Callable] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


@dataclass
class RankProgram:
    """The GraphModule of one rank plus what feeding it needs."""

    module: fx.GraphModule
    leaves: list[tuple[int, int]]
    """(leaf node, form) of each placeholder of `module`, in call order (parameters and inputs interleaved)."""
    loss_form: int

    @property
    def params(self) -> list[tuple[int, int]]:
        return [(n, f) for n, f in self.leaves if self.is_param[n]]

    @property
    def inputs(self) -> list[tuple[int, int]]:
        return [(n, f) for n, f in self.leaves if not self.is_param[n]]

    is_param: dict[int, bool] = None  # type: ignore[assignment]


def sizes_of(plan: Plan, tensor: int, dim: int, segment: int | None = None) -> list[int]:
    """Sizes of a sharded dim on every rank inside `segment` (default: the tensor's own segment)."""
    return plan.sizes(tensor, dim, segment)


def local_shape(plan: Plan, tensor: int, form: int, rank: int, segment: int | None = None) -> list[int]:
    shape = list(plan.graph[tensor].shape)
    if form >= 0:
        shape[form] = sizes_of(plan, tensor, form, segment)[rank]
    return shape


def shard(plan: Plan, tensor: int, form: int, rank: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of a Full tensor in `form` (a copy for Full)."""
    if form < 0:
        return full
    sizes = sizes_of(plan, tensor, form)
    return C.local_slice(full, form, sizes, rank)


def build_rank_program(plan: Plan, rank: int, *, probes: bool = False) -> RankProgram:
    """The rank's program; `probes` adds a `runner.timing.probe` after every compute instruction
    so forward and backward time can be measured per instruction (`--timing`)."""
    g = fx.Graph()
    env: dict[tuple[int, int], fx.Node] = {}
    leaves: list[tuple[int, int]] = []
    graph = plan.graph
    segs = instruction_segments(plan.program, plan.segmentation)
    sources = source_segments(plan.program, plan.segmentation)
    for ins, seg, src in zip(plan.program, segs, sources):
        if ins.kind == LOAD:
            env[(ins.node, ins.post)] = g.placeholder(_safe(graph[ins.node].name))
            leaves.append((ins.node, ins.post))
        elif ins.kind == COMM:
            env[(ins.node, ins.post)] = _emit_comm(g, plan, ins, env, rank, seg, src)
        else:
            out = _emit_compute(g, plan, ins, env, rank, seg)
            if probes:
                out = g.call_function(probe, (out, f"{graph[ins.node].name}:{ins.rule}"))
            env[(ins.node, ins.post)] = out
    loss = graph.loss
    form = PARTIAL if (loss, PARTIAL) in env else FULL
    g.output(env[(loss, form)])
    gm = fx.GraphModule(torch.nn.Module(), g, class_name=f"Rank{rank}Program")
    return RankProgram(gm, leaves, form, {n: graph[n].op == "parameter" for n, _ in leaves})


def _safe(name: str) -> str:
    return name.replace(".", "_")


def _emit_comm(g: fx.Graph, plan: Plan, ins: Instruction, env: dict, rank: int, seg: int, from_seg: int) -> fx.Node:
    """A collective in segment `seg`; a resplit moves its tensor there from segment `from_seg`."""
    (t, src), = ins.pre
    x = env[(t, src)]
    tag = {"tag": plan.graph[t].name}

    def sizes(dim: int) -> list[int]:
        return sizes_of(plan, t, dim, seg)
    if ins.rule == "slice":
        return g.call_function(C.local_slice, (x, ins.post, sizes(ins.post), rank))
    if ins.rule == "all_reduce":
        return g.call_function(C.all_reduce, (x,), tag)
    if ins.rule == "reduce_scatter":
        return g.call_function(C.reduce_scatter, (x, ins.post, sizes(ins.post)), tag)
    if ins.rule.startswith("all_gather"):
        return g.call_function(C.all_gather, (x, src, sizes(src), ins.rule.split(".")[1]), tag)
    if ins.rule == "all_to_all":
        return g.call_function(C.all_to_all, (x, src, ins.post, sizes(src), sizes(ins.post)), tag)
    if ins.rule == RESPLIT:
        return g.call_function(C.resplit, (x, src, sizes_of(plan, t, src, from_seg), sizes(src)), tag)
    raise ValueError(f"unknown collective '{ins.rule}' in plan")


def _emit_compute(g: fx.Graph, plan: Plan, ins: Instruction, env: dict, rank: int, seg: int) -> fx.Node:
    node = plan.graph[ins.node]
    args = [env[p] for p in ins.pre]
    shape = local_shape(plan, ins.node, ins.post, rank, seg)
    return _EMITTERS.get(node.op, _emit_generic)(g, node, plan.graph, args, shape)


def _emit_generic(g, node: Node, graph: Graph, args, shape) -> fx.Node:
    a = node.attrs
    op = node.op
    if op in _UNARY:
        return g.call_function(_UNARY[op], tuple(args))
    if op in _BINARY:
        fn = _BINARY[op]
        if len(args) == 2:
            return g.call_function(fn, tuple(args))
        s = a["scalar"]
        return g.call_function(fn, (s, args[0]) if a.get("scalar_first") else (args[0], s))
    raise NotImplementedError(f"runner has no emitter for operator '{op}' (node {node.name})")


def _identity(g, node, graph, args, shape):
    if "dtype" in node.attrs:
        return g.call_method("to", (args[0], getattr(torch, node.attrs["dtype"])))
    return args[0]


def _reduce(g, node, graph, args, shape):
    out = g.call_function(torch.sum, (args[0], node.attrs["dims"]), {"keepdim": node.attrs["keepdim"]})
    if node.op == "mean":  # divide by the global count: shards give addends of the mean
        full = graph[node.inputs[0]].shape
        out = g.call_function(torch.div, (out, math.prod(full[d] for d in node.attrs["dims"])))
    return out


def _layer_norm(g, node, graph, args, shape):
    a = node.attrs
    rest = list(args[1:])
    w = rest.pop(0) if a.get("has_weight") else None
    b = rest.pop(0) if a.get("has_bias") else None
    return g.call_function(F.layer_norm, (args[0], a["normalized_shape"], w, b, a["eps"]))


def _mean_loss(fn: Callable) -> Callable:
    def emit(g, node, graph, args, shape):
        total = g.call_function(fn, tuple(args), {"reduction": "sum"})
        return g.call_function(torch.div, (total, node.attrs["count"]))
    return emit


_EMITTERS: dict[str, Callable[..., fx.Node]] = {
    "identity": _identity,
    "gelu": lambda g, n, gr, a, s: g.call_function(F.gelu, tuple(a), {"approximate": n.attrs.get("approximate", "none")}),
    "dropout": lambda g, n, gr, a, s: g.call_function(F.dropout, (a[0], n.attrs["p"], n.attrs["train"])),
    "linear": lambda g, n, gr, a, s: g.call_function(F.linear, tuple(a)),
    "matmul": lambda g, n, gr, a, s: g.call_function(torch.matmul, tuple(a)),
    "view": lambda g, n, gr, a, s: g.call_function(torch.reshape, (a[0], tuple(s))),
    "permute": lambda g, n, gr, a, s: g.call_function(torch.permute, (a[0], tuple(n.attrs["dims"]))),
    "softmax": lambda g, n, gr, a, s: g.call_function(torch.softmax, (a[0], n.attrs["dim"])),
    "log_softmax": lambda g, n, gr, a, s: g.call_function(torch.log_softmax, (a[0], n.attrs["dim"])),
    "sum": _reduce, "mean": _reduce, "layer_norm": _layer_norm,
    "embedding": lambda g, n, gr, a, s: g.call_function(F.embedding, (a[1], a[0])),
    "sdpa": lambda g, n, gr, a, s: g.call_function(F.scaled_dot_product_attention, tuple(a[:3]),
                                                   {"is_causal": n.attrs["is_causal"], "scale": n.attrs["scale"]}),
    "cross_entropy": _mean_loss(F.cross_entropy),
    "mse_loss": _mean_loss(F.mse_loss),
}

