"""Build one rank's program from a plan: a readable `torch.fx.GraphModule` (`print(gm.code)`).

Placeholders are the rank's local parameter slices and input slices; every compute instruction
becomes a call of the torch function of its canonical op on local tensors (shapes localised with
the plan's integer shard sizes), every collective a call of `runner.collectives`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from engine.cluster.hierarchy import HIER_KEYS, machine_groups
from engine.errors import PlanError
from engine.model import dropout, ops
from engine.model.graph import Graph, Node
from engine.model.ops import unless_empty
from engine.spmd.plan import Plan
from engine.spmd.program import COMM, LOAD, Instruction
from engine.spmd.recompute import instruction_layers
from engine.spmd.segments import RESPLIT, instruction_segments, source_segments
from engine.theory.core import FULL, PARTIAL

from . import collectives as C
from .recompute import checkpoint_layers, tag_layer
from .timing import probe


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
    uses_rng: bool = False
    """Whether the module's first argument is the step's `engine.model.dropout.RngKey` (the plan has dropout sites)."""


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


@dataclass(frozen=True)
class BatchWindow:
    """Where a part of the batch sits in the whole batch (duplex halves, runner.duplex): the
    program runs on `graph` (the model captured at the part's batch size) and draws its dropout
    masks on the whole batch's global index, shifted by `before` (the first half's graph for the
    second half: along every dim the batch resizes, the part starts after the first half's
    rows; None for the first half)."""

    whole: Graph
    before: Graph | None = None

    def place(self, whole_shape: Sequence[int], part_shape: Sequence[int], before_shape: Sequence[int] | None,
              starts: list[int]) -> tuple[tuple[int, ...], list[int]]:
        """The whole tensor's shape and where this rank's block of the part starts in it."""
        if before_shape is None:
            return tuple(whole_shape), starts
        return tuple(whole_shape), [s + (b if w != p else 0) for s, w, p, b in zip(starts, whole_shape, part_shape, before_shape)]


def build_rank_program(plan: Plan, rank: int, *, probes: bool = False, window: BatchWindow | None = None,
                       piece: ProgramPiece | None = None) -> RankProgram:
    """The rank's program; `probes` adds a `runner.timing.probe` after every compute instruction
    so forward and backward time can be measured per instruction (`--timing`). With a `window`
    (a duplex half) the module returns (loss, the loss's count operand) and draws the masks of
    its rows of the whole batch. With `piece`, only that part of the program (a pipeline stage):
    its cut inputs come first among the placeholders (after the dropout key) and the module
    returns its cut outputs, or the loss for the last piece."""
    g = fx.Graph()
    env: dict[tuple[int, int], fx.Node] = {}
    leaves: list[tuple[int, int]] = []
    graph = plan.graph
    segs = instruction_segments(plan.program, plan.segmentation)
    sources = source_segments(plan.program, plan.segmentation)
    rng = g.placeholder("rng") if has_dropout_sites(graph) else None
    layers = instruction_layers(plan.program, graph) if plan.recompute else []
    for t, f in piece.inputs if piece else ():
        env[(t, f)] = g.placeholder(f"cut_{_safe(graph[t].name)}")
    for k, (ins, seg, src) in enumerate(zip(plan.program, segs, sources)):
        if piece and k not in piece.instructions:
            continue
        if ins.kind == LOAD:
            env[(ins.node, ins.post)] = g.placeholder(_safe(graph[ins.node].name))
            leaves.append((ins.node, ins.post))
        elif ins.kind == COMM:
            env[(ins.node, ins.post)] = _emit_comm(g, plan, ins, env, rank, seg, src)
        else:
            out = _emit_compute(g, plan, ins, env, rank, seg, rng, window)
            if probes:
                out = g.call_function(probe, (out, f"{graph[ins.node].name}:{ins.rule}"))
            env[(ins.node, ins.post)] = out
        if layers:
            tag_layer(g, layers[k])
    loss = graph.loss
    form = PARTIAL if (loss, PARTIAL) in env else FULL
    if piece and piece.outputs:
        g.output(tuple(env[o] for o in piece.outputs))
    else:
        g.output(env[(loss, form)] if window is None else (env[(loss, form)], env[loss_count(plan, form)]))
    gm = fx.GraphModule(torch.nn.Module(), g, class_name=f"Rank{rank}Program")
    if layers:  # activation recomputation: the plan's recomputed layers under checkpoint (runner.recompute)
        gm = checkpoint_layers(g, frozenset(plan.recompute), f"Rank{rank}Program")
    return RankProgram(gm, leaves, form, {n: graph[n].op == "parameter" for n, _ in leaves}, rng is not None)


def loss_count(plan: Plan, form: int) -> tuple[int, int]:
    """The (node, form) of the loss's count operand: a cross entropy over the count of kept
    targets. A duplex half's loss divides by its own count; the halves reweigh by the counts."""
    graph = plan.graph
    node = graph[graph.loss]
    ins = next((i for i in plan.program if i.node == graph.loss and i.post == form and i.kind != LOAD and i.kind != COMM), None)
    if node.op != "cross_entropy" or ins is None or len(ins.pre) < 3:
        raise PlanError(f"duplex needs a mean cross-entropy loss over the batch; the loss '{node.name}' is "
                        f"'{node.op}': run the plan with overlap 'ddp' or 'none'")
    return ins.pre[2]


@dataclass(frozen=True)
class ProgramPiece:
    """Part of a plan's program (a pipeline stage): which instructions, the (tensor, form)s it takes
    from earlier pieces and those it hands to later ones (none for the piece ending in the loss)."""

    instructions: frozenset[int]
    """Indices into `plan.program`."""
    inputs: tuple[tuple[int, int], ...]
    outputs: tuple[tuple[int, int], ...]


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
    if ins.rule in HIER_KEYS:
        return _emit_hier(g, plan, ins, x, sizes, tag)
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


def _emit_hier(g: fx.Graph, plan: Plan, ins: Instruction, x: fx.Node, sizes: Callable[[int], list[int]],
               tag: dict) -> fx.Node:
    """A hierarchical collective over the plan's machines (the validator made sure there are any)."""
    machines = machine_groups(plan.machines)
    if machines is None:
        raise ValueError(f"'{ins.rule}' needs machines of equal size in the plan (cluster.machines: {plan.machines})")
    src = ins.pre[0][1]
    if ins.rule == "all_reduce.hier":
        return g.call_function(C.all_reduce_hierarchical, (x, machines), tag)
    if ins.rule == "reduce_scatter.hier":
        return g.call_function(C.reduce_scatter_hierarchical, (x, ins.post, sizes(ins.post), machines), tag)
    return g.call_function(C.all_gather_hierarchical, (x, src, sizes(src), machines), tag)


def _emit_compute(g: fx.Graph, plan: Plan, ins: Instruction, env: dict, rank: int, seg: int,
                  rng: fx.Node | None = None, window: BatchWindow | None = None) -> fx.Node:
    node = plan.graph[ins.node]
    args = [env[p] for p in ins.pre]
    shape = local_shape(plan, ins.node, ins.post, rank, seg)
    if "rng_site" in node.attrs:
        return _site_dropout(g, plan, ins, args, rank, seg, rng, window)
    if node.op == "embedding":
        return _embedding(g, plan, ins, args, rank, seg)
    return _EMITTERS.get(node.op, _emit_generic)(g, node, plan.graph, args, shape)


def _embedding(g: fx.Graph, plan: Plan, ins: Instruction, args: list, rank: int, seg: int) -> fx.Node:
    """A lookup; with the table sharded on rows (vocabulary parallel) the rank's first row is its offset."""
    node, (w, w_form) = plan.graph[ins.node], ins.pre[0]
    offset = sum(sizes_of(plan, w, 0, seg)[:rank]) if w_form == 0 else 0
    return g.call_function(ops.embedding, (args[0], args[1], offset, plan.graph[w].shape[0], node.attrs.get("padding_idx")))


NO_SITES_IN_PIPELINES = ("pipeline: models with dropout or random draws (stochastic depth's rand, bernoulli) are not run "
                         "as pipelines yet; capture with dropout off (and drop_path_rate=0)")
"""Why a pipeline refuses a plan whose graph has random sites."""


def has_dropout_sites(graph: Graph) -> bool:
    """Whether the graph draws dropout masks (nodes with an `rng_site`, see engine/model/dropout.py)."""
    return any("rng_site" in n.attrs for n in graph.nodes)


def output_starts(plan: Plan, ins: Instruction, rank: int, seg: int) -> list[int]:
    """Where this rank's block of a node's output starts in the global output (its offset on the
    sharded dim, by the plan's integer sizes; all zeros for Full)."""
    starts = [0] * plan.graph[ins.node].rank
    if ins.post >= 0:
        starts[ins.post] = sum(sizes_of(plan, ins.node, ins.post, seg)[:rank])
    return starts


def _site_dropout(g: fx.Graph, plan: Plan, ins: Instruction, args: list, rank: int, seg: int,
                  rng: fx.Node | None, window: BatchWindow | None = None) -> fx.Node:
    """Dropout (or attention dropout, or a `rand` draw) with the exact mask of this rank's block: a function of the
    global shape, the step's key (`rng`), the site and where the block starts (engine/model/dropout.py);
    in a `window` (a duplex half) the global shape and the start are the whole batch's."""
    assert rng is not None and ins.post >= FULL, "dropout sites run Full or sharded, never Partial"
    node, graph = plan.graph[ins.node], plan.graph
    a, starts = node.attrs, output_starts(plan, ins, rank, seg)
    whole = window.whole if window else graph
    before = window.before if window else None
    if node.op in ("dropout", "rand"):
        shape, starts = (window.place(whole[node.id].shape, node.shape, before[node.id].shape if before else None, starts)
                         if window else (tuple(node.shape), starts))
        if node.op == "rand":  # no operand: the rank draws its block of the output
            local = tuple(local_shape(plan, ins.node, ins.post, rank, seg))
            if a.get("normal"):
                return g.call_function(dropout.randn, (rng, a["rng_site"], shape, starts, local, getattr(torch, node.dtype),
                                                       None, a.get("mean", 0.0), a.get("std", 1.0)))
            return g.call_function(dropout.rand, (rng, a["rng_site"], shape, starts, local, getattr(torch, node.dtype), None,
                                                  a.get("low", 0.0), a.get("high", 1.0)))
        return g.call_function(dropout.dropout, (args[0], a["p"], rng, a["rng_site"], shape, starts))
    gqa = a.get("enable_gqa", False)

    def weights_of(gr: Graph) -> tuple[int, ...]:
        return tuple(dropout.attention_weights_shape(gr[node.inputs[0]].shape, gr[node.inputs[1]].shape, gqa))
    weights, starts = weights_of(graph), starts[:-1] + [0]
    if window:
        weights, starts = window.place(weights_of(whole), weights, weights_of(before) if before else None, starts)
    mask = args[3] if len(args) > 3 else None
    return g.call_function(dropout.attention_dropout, (*args[:3], mask, a["is_causal"], a["scale"], a["dropout_p"], rng,
                                                       a["rng_site"], weights, starts, gqa))


def _emit_generic(g, node: Node, graph: Graph, args, shape) -> fx.Node:
    a = node.attrs
    op = node.op
    if op in ops.UNARY:
        return g.call_function(ops.UNARY[op], tuple(args))
    if op in ops.BINARY:
        fn = ops.BINARY[op]
        if len(args) == 2:
            return g.call_function(fn, tuple(args))
        s = a["scalar"]
        return g.call_function(fn, (s, args[0]) if a.get("scalar_first") else (args[0], s))
    if op in ops._INDEX:  # operators that run from their attributes alone (masks, constants, pad, index)
        return g.call_function(ops.call_canonical, (op, dict(a), node.dtype, list(shape), list(args)))
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
        if node.op == "cross_entropy":  # the count of kept targets may be a (Full) operand
            return g.call_function(ops.cross_entropy, (dict(node.attrs), list(args)))
        total = g.call_function(fn, tuple(args), {"reduction": "sum"})
        return g.call_function(torch.div, (total, node.attrs["count"]))
    return emit


def _narrow(x: torch.Tensor, dim: int, start: int, end: int, step: int) -> torch.Tensor:
    """Rows start:end:step of dim (a slice of the local tensor; dim is never the sharded one)."""
    return x[(slice(None),) * dim + (slice(start, end, step),)]


_SHAPE_EMITTERS: dict[str, Callable[..., fx.Node]] = {
    "cat": lambda g, n, gr, a, s: g.call_function(torch.cat, (list(a), n.attrs["dim"])),
    "narrow": lambda g, n, gr, a, s: g.call_function(_narrow, (a[0], n.attrs["dim"], n.attrs["start"], n.attrs["end"],
                                                               n.attrs.get("step", 1))),
    "select": lambda g, n, gr, a, s: g.call_function(torch.select, (a[0], n.attrs["dim"], n.attrs["index"])),
    "expand": lambda g, n, gr, a, s: g.call_method("expand", (a[0], tuple(s))),
}
"""Shape operators; `expand` expands to the local shape (a device's own rows of a broadcast dim)."""
_SHAPE_EMITTERS["roll"] = lambda g, n, gr, a, s: g.call_function(torch.roll, (a[0], n.attrs["shifts"], n.attrs["dims"]))
"""Swin's cyclic shift (engine/theory/shift.py): the rolled dims are whole on every device."""


def _topk(part: str) -> Callable[..., fx.Node]:
    def emit(g, node, graph, args, shape):
        a = node.attrs
        res = g.call_function(torch.topk, (args[0], a["k"]), {"dim": a["dim"], "largest": a["largest"], "sorted": a["sorted"]})
        return g.call_function(getattr, (res, part))
    return emit


_INDEX_EMITTERS: dict[str, Callable[..., fx.Node]] = {
    "einsum": lambda g, n, gr, a, s: g.call_function(torch.einsum, (n.attrs["equation"], *a)),
    "topk_values": _topk("values"), "topk_indices": _topk("indices"),
    "one_hot": lambda g, n, gr, a, s: g.call_function(F.one_hot, (a[0], n.attrs["num_classes"])),
    "cumsum": lambda g, n, gr, a, s: g.call_function(torch.cumsum, (a[0], n.attrs["dim"])),
    "gather": lambda g, n, gr, a, s: g.call_function(torch.gather, (a[0], n.attrs["dim"], a[1])),
    "arange": lambda g, n, gr, a, s: g.call_function(torch.arange, (n.attrs["start"], n.attrs["end"], n.attrs["step"]),
                                                     {"dtype": getattr(torch, n.dtype)}),
    "opaque": lambda g, n, gr, a, s: g.call_function(ops.call_opaque, (n.attrs, list(a))),
}
"""Einsum, MoE gating, index and opaque operators (an opaque op re-resolves its ATen target by name)."""


def conv(x, w, stride, padding, dilation, groups, shape):
    """F.conv1d/2d/3d on local shards (zeros when a channel shard is empty, see engine.model.ops.unless_empty)."""
    fn = (F.conv1d, F.conv2d, F.conv3d)[len(stride) - 1]
    return unless_empty(fn, shape, x, w, None, stride, padding, dilation, groups)


def max_pool(x, kernel, stride, padding, dilation, ceil_mode, shape):
    fn = getattr(F, f"max_pool{len(kernel)}d")
    return unless_empty(fn, shape, x, kernel, stride, padding, dilation, ceil_mode)


def avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, shape):
    fn = getattr(F, f"avg_pool{len(kernel)}d")
    extra = () if len(kernel) == 1 else (divisor_override,)  # avg_pool1d has no divisor_override
    return unless_empty(fn, shape, x, kernel, stride, padding, ceil_mode, count_include_pad, *extra)


def adaptive_avg_pool(x, output_size, shape):
    return unless_empty(getattr(F, f"adaptive_avg_pool{len(output_size)}d"), shape, x, output_size)


def batch_norm(x, weight, bias, eps, shape):
    """Training-mode batch norm on whole channels: the local statistics are the global ones."""
    return unless_empty(F.batch_norm, shape, x, None, None, weight, bias, True, 0.0, eps)


def _emit_batch_norm(g, node, graph, args, shape):
    a = node.attrs
    rest = list(args[1:])
    w = rest.pop(0) if a.get("has_weight") else None
    b = rest.pop(0) if a.get("has_bias") else None
    return g.call_function(batch_norm, (args[0], w, b, a["eps"], tuple(shape)))


def _attrs_call(fn: Callable, *keys: str) -> Callable[..., fx.Node]:
    """An emitter calling `fn(x, *attrs[keys], local shape)`."""
    return lambda g, n, gr, a, s: g.call_function(fn, (a[0], *(n.attrs[k] for k in keys), tuple(s)))


_VISION_EMITTERS: dict[str, Callable[..., fx.Node]] = {
    "conv": lambda g, n, gr, a, s: g.call_function(conv, (a[0], a[1], n.attrs["stride"], n.attrs["padding"],
                                                         n.attrs["dilation"], n.attrs["groups"], tuple(s))),
    "max_pool": _attrs_call(max_pool, "kernel", "stride", "padding", "dilation", "ceil_mode"),
    "avg_pool": _attrs_call(avg_pool, "kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    "adaptive_avg_pool": _attrs_call(adaptive_avg_pool, "output_size"),
    "batch_norm": _emit_batch_norm,
}
"""Convolution, pooling, batch norm: named local functions, so `print(gm.code)` reads `conv(x, w, ...)`."""

_EMITTERS: dict[str, Callable[..., fx.Node]] = {
    **_SHAPE_EMITTERS, **_VISION_EMITTERS,
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
    "sdpa": lambda g, n, gr, a, s: g.call_function(F.scaled_dot_product_attention, tuple(a[:3]),
                                                   {"attn_mask": a[3] if len(a) > 3 else None,
                                                    "is_causal": n.attrs["is_causal"], "scale": n.attrs["scale"]}),
    **_INDEX_EMITTERS,
    "cross_entropy": _mean_loss(F.cross_entropy),
    "mse_loss": _mean_loss(F.mse_loss),
}

