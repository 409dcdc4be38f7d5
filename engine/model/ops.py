"""Reference implementations of the canonical operators on *local* tensors.

The same function runs a node on one device's shards (the runner, the rule checker) and on full
tensors (single-device reference). Means and mean losses divide by the *global* count recorded in
the graph, so a device's result on its shard is an exact addend of the global result.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.model import dropout
from engine.model.dropout import RngKey
from engine.model.graph import Graph, Node

Tensor = torch.Tensor
UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu, "exp": torch.exp,
    "rsqrt": torch.rsqrt, "sqrt": torch.sqrt, "neg": torch.neg, "cos": torch.cos, "sin": torch.sin,
    "logical_not": torch.logical_not, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "log_sigmoid": F.logsigmoid, "mish": F.mish,
}
"""Elementwise maps of one tensor, by canonical name (the runner calls the same functions)."""
UNARY.update({name: getattr(torch, name) for name in (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cosh", "erf", "expm1", "floor", "log", "log10",
    "log1p", "log2", "reciprocal", "sign", "sinh", "tan", "trunc", "isinf", "isnan", "bitwise_not")})


def div_floor(x: Tensor | float, y: Tensor | float) -> Tensor:
    """`torch.div(x, y, rounding_mode="floor")` (integer position arithmetic, `//`)."""
    return torch.div(x, y, rounding_mode="floor")


def div_trunc(x: Tensor | float, y: Tensor | float) -> Tensor:
    """`torch.div(x, y, rounding_mode="trunc")`."""
    return torch.div(x, y, rounding_mode="trunc")


BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne, "logical_and": torch.logical_and,
    "logical_or": torch.logical_or, "pow": torch.pow, "div_floor": div_floor, "div_trunc": div_trunc,
}
"""Elementwise operators of two operands (a tensor and a tensor or a number), by canonical name."""
BINARY.update({name: getattr(torch, name) for name in (
    "maximum", "minimum", "atan2", "remainder", "fmod", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor")})


def run_node(node: Node, graph: Graph, inputs: Sequence[Tensor], out_shape: Sequence[int],
             offsets: Sequence[int] | None = None, rng: RngKey = RngKey(0, 0), out_offset: int = 0) -> Tensor:
    """Run `node` on (possibly sharded) local inputs; `out_shape` is the local output shape (used by views).

    `offsets[k]` is where input k's local slice starts along its sharded dim (0 when whole): the
    vocabulary-parallel embedding needs it (its rows are a range of the vocabulary), and so does
    dropout (its mask is a function of the global index, engine/model/dropout.py), keyed by `rng`.
    `out_offset` is where the local output starts along its sharded dim: a `rand` node, which has no
    operand, draws that block."""
    op, a = node.op, node.attrs
    if "rng_site" in a:
        return _site_dropout(node, graph, inputs, offsets, rng, out_shape, out_offset)
    if op in _INDEX:
        return _INDEX[op](node, inputs)
    if op in UNARY:
        return UNARY[op](inputs[0])
    if op in BINARY:
        return _binary(node, inputs)
    if op == "gelu":
        return F.gelu(inputs[0], approximate=a.get("approximate", "none"))
    if op == "identity":
        x = inputs[0]
        return x.to(getattr(torch, a["dtype"])) if "dtype" in a else x
    if op == "dropout":
        return F.dropout(inputs[0], a["p"], a["train"])
    if op == "linear":
        return F.linear(inputs[0], inputs[1])
    if op == "matmul":
        return torch.matmul(inputs[0], inputs[1])
    if op == "view":
        return inputs[0].reshape(tuple(out_shape))
    if op == "permute":
        return inputs[0].permute(a["dims"])
    if op in ("softmax", "log_softmax"):
        return getattr(torch, op)(inputs[0], a["dim"])
    if op in ("sum", "mean"):
        return _reduce(node, graph, inputs[0])
    if op == "layer_norm":
        return _layer_norm(node, inputs)
    if op == "embedding":
        return embedding(inputs[0], inputs[1], (offsets or [0])[0], graph[node.inputs[0]].shape[0], a.get("padding_idx"))
    if op == "sdpa":
        mask = inputs[3] if len(inputs) > 3 else None
        return F.scaled_dot_product_attention(*inputs[:3], attn_mask=mask, is_causal=a["is_causal"], scale=a["scale"])
    if op == "opaque":
        return call_opaque(a, inputs)
    if op == "cross_entropy":
        return cross_entropy(a, inputs)
    if op == "mse_loss":
        return F.mse_loss(inputs[0], inputs[1], reduction="sum") / a["count"]
    if op == "stage_output":  # a pipeline stage's end marker (engine/theory/stage.py): zero, it computes nothing
        return inputs[0].new_zeros(())
    if op in _SHAPE:
        return _SHAPE[op](node, inputs, out_shape)
    if op in _VISION:
        return unless_empty(lambda *xs: _VISION[op](a, xs), out_shape, *inputs)
    raise NotImplementedError(f"no executor for operator '{op}' (node {node.name})")


def region_starts(global_shape: Sequence[int], local_shape: Sequence[int], offset: int) -> list[int]:
    """Where a local operand starts in its global tensor: `offset` on the dim it is split along
    (the one whose local size differs), 0 elsewhere (a dim split whole has offset 0)."""
    return [offset if size != whole else 0 for size, whole in zip(local_shape, global_shape)]


def _site_dropout(node: Node, graph: Graph, inputs: Sequence[Tensor], offsets: Sequence[int] | None,
                  rng: RngKey, out_shape: Sequence[int], out_offset: int) -> Tensor:
    """Dropout or attention dropout with the site's exact mask on the local region of the operands, or
    a `rand` node's numbers on the local region of its output."""
    a = node.attrs
    if node.op == "rand":
        starts = region_starts(node.shape, out_shape, out_offset)
        if a.get("normal"):
            return dropout.randn(rng, a["rng_site"], node.shape, starts, out_shape, getattr(torch, node.dtype),
                                 mean=a.get("mean", 0.0), std=a.get("std", 1.0))
        return dropout.rand(rng, a["rng_site"], node.shape, starts, out_shape, getattr(torch, node.dtype),
                            low=a.get("low", 0.0), high=a.get("high", 1.0))
    x = inputs[0]
    starts = region_starts(graph[node.inputs[0]].shape, x.shape, (offsets or [0])[0])
    if node.op == "dropout":
        return dropout.dropout(x, a["p"], rng, a["rng_site"], graph[node.inputs[0]].shape, starts)
    assert node.op == "sdpa", f"rng_site on operator '{node.op}'"
    weights = dropout.attention_weights_shape(graph[node.inputs[0]].shape, graph[node.inputs[1]].shape, a.get("enable_gqa", False))
    mask = inputs[3] if len(inputs) > 3 else None
    return dropout.attention_dropout(*inputs[:3], mask, a["is_causal"], a["scale"], a["dropout_p"], rng, a["rng_site"],
                                     weights, starts[:-1] + [0], a.get("enable_gqa", False))


def _narrow(x: Tensor, a: dict) -> Tensor:
    index = [slice(None)] * a["dim"] + [slice(a["start"], a["end"], a.get("step", 1))]
    return x[tuple(index)]


_SHAPE: dict[str, Callable[[Node, Sequence[Tensor], Sequence[int]], Tensor]] = {
    "cat": lambda n, xs, s: torch.cat(list(xs), n.attrs["dim"]),
    "narrow": lambda n, xs, s: _narrow(xs[0], n.attrs),
    "select": lambda n, xs, s: xs[0].select(n.attrs["dim"], n.attrs["index"]),
    "expand": lambda n, xs, s: xs[0].expand(tuple(s)),
}
"""Shape operators; `expand` takes the local output shape (a device expands to its own rows)."""
_SHAPE.update({
    "roll": lambda n, xs, s: torch.roll(xs[0], n.attrs["shifts"], n.attrs["dims"]),
})
"""Swin's cyclic window shift (theory/shift.py)."""


def unless_empty(fn: Callable[..., Tensor], out_shape: Sequence[int], *args: object) -> Tensor:
    """`fn(*args)`, or zeros of `out_shape` when an operand or the result is empty.

    A device may hold no channel of a sharded dim (uneven ratios round to 0), which convolution,
    pooling and batch norm reject. The result is then empty, or a sum over no channels (zeros).
    The zeros depend on the operands, so backward still reaches (and runs) every collective that
    produced them, as on the other devices.
    """
    tensors = [t for t in args if isinstance(t, Tensor)]
    if math.prod(out_shape) == 0 or any(t.numel() == 0 for t in tensors):
        return tensors[0].new_zeros(tuple(out_shape)) + sum(t.sum() for t in tensors) * 0
    return fn(*args)


def _conv(a: dict, xs: Sequence[Tensor]) -> Tensor:
    fn = (F.conv1d, F.conv2d, F.conv3d)[xs[1].dim() - 3]
    return fn(xs[0], xs[1], None, a["stride"], a["padding"], a["dilation"], a["groups"])


def _pool_fn(kind: str, spatial: int) -> Callable:
    return getattr(F, f"{kind}{spatial}d")


def _max_pool(a: dict, xs: Sequence[Tensor]) -> Tensor:
    return _pool_fn("max_pool", a["spatial"])(xs[0], a["kernel"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])


def _avg_pool(a: dict, xs: Sequence[Tensor]) -> Tensor:
    fn = _pool_fn("avg_pool", a["spatial"])
    if a["spatial"] == 1:  # avg_pool1d has no divisor_override
        return fn(xs[0], a["kernel"], a["stride"], a["padding"], a["ceil_mode"], a["count_include_pad"])
    return fn(xs[0], a["kernel"], a["stride"], a["padding"], a["ceil_mode"], a["count_include_pad"], a["divisor_override"])


def _batch_norm(a: dict, xs: Sequence[Tensor]) -> Tensor:
    rest = list(xs[1:])
    w = rest.pop(0) if a.get("has_weight") else None
    b = rest.pop(0) if a.get("has_bias") else None
    return F.batch_norm(xs[0], None, None, w, b, training=True, eps=a["eps"])


_VISION: dict[str, Callable[[dict, Sequence[Tensor]], Tensor]] = {
    "conv": _conv, "max_pool": _max_pool, "avg_pool": _avg_pool, "batch_norm": _batch_norm,
    "adaptive_avg_pool": lambda a, xs: _pool_fn("adaptive_avg_pool", a["spatial"])(xs[0], a["output_size"]),
}
"""Convolution, pooling and training-mode batch norm (statistics of the local batch: see theory/batchnorm)."""


def _binary(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    fn = BINARY[node.op]
    if len(inputs) == 2:
        return fn(inputs[0], inputs[1])
    s = node.attrs["scalar"]
    return fn(s, inputs[0]) if node.attrs.get("scalar_first") else fn(inputs[0], s)


def _reduce(node: Node, graph: Graph, x: Tensor) -> Tensor:
    dims, keep = node.attrs["dims"], node.attrs["keepdim"]
    out = x.sum(dim=dims, keepdim=keep)
    if node.op == "mean":
        full = graph[node.inputs[0]].shape
        out = out / math.prod(full[d] for d in dims)  # global count: shards give addends of the mean
    return out


def _layer_norm(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a = node.attrs
    rest = list(inputs[1:])
    w = rest.pop(0) if a.get("has_weight") else None
    b = rest.pop(0) if a.get("has_bias") else None
    return F.layer_norm(inputs[0], a["normalized_shape"], w, b, a["eps"])


def embedding(w: Tensor, ids: Tensor, offset: int, vocab: int, padding_idx: int | None = None) -> Tensor:
    """Lookup of `ids` in rows [offset, offset + len(w)) of a `vocab`-row table; zeros for ids outside
    (the vocabulary-parallel lookup: every id is inside exactly one device's range)."""
    rows = w.shape[0]
    pad = None if padding_idx is None or not offset <= padding_idx < offset + rows else padding_idx - offset
    if rows == vocab:
        return F.embedding(ids, w, padding_idx=pad)
    inside = (ids >= offset) & (ids < offset + rows)
    if rows == 0:
        return w.new_zeros(tuple(ids.shape) + (w.shape[1],)) + 0.0 * w.sum()
    local = F.embedding(torch.where(inside, ids - offset, 0), w, padding_idx=pad)
    return local * inside.unsqueeze(-1).to(local.dtype)


def cross_entropy(attrs: dict, inputs: Sequence[Tensor]) -> Tensor:
    """Sum of the per-target losses (targets equal to `ignore_index` add nothing) over the count: a
    third (Full) operand, the number of kept targets of the whole batch, or the static `count`."""
    total = F.cross_entropy(inputs[0], inputs[1], reduction="sum", ignore_index=attrs.get("ignore_index", -100))
    return total / (inputs[2] if len(inputs) > 2 else attrs["count"])


def _full(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    return torch.full(tuple(node.attrs["shape"]), node.attrs["value"], dtype=getattr(torch, node.dtype))


def _pad(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    mode = node.attrs.get("mode", "constant")
    return F.pad(inputs[0], node.attrs["pad"], mode=mode, value=node.attrs["value"] if mode == "constant" else None)


def _reduce_by(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    """amax, amin, any, all, var over `dims`; prod, argmax, argmin over one dim or (all dims) the flattened tensor."""
    a, x, op = node.attrs, inputs[0], node.op
    dims, keep = a["dims"], a["keepdim"]
    if op == "var":
        return torch.var(x, dims, correction=a["correction"], keepdim=keep)
    if op in ("amax", "amin", "any", "all"):
        return getattr(torch, op)(x, dim=dims, keepdim=keep) if dims else x.clone()
    if len(dims) == 1 and x.dim() > 0:
        return getattr(torch, op)(x, dims[0], keepdim=keep)
    out = getattr(torch, op)(x.reshape(-1), 0)
    return out.reshape([1] * x.dim()) if keep else out


def _group_norm(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a, rest = node.attrs, list(inputs[1:])
    w = rest.pop(0) if a.get("has_weight") else None
    b = rest.pop(0) if a.get("has_bias") else None
    return F.group_norm(inputs[0], a["groups"], w, b, a["eps"])


def _slice_scatter(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a = node.attrs
    return torch.slice_scatter(inputs[0], inputs[1], a["dim"], a["start"], a["end"], a["step"])


def _where(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    """`where(cond, x, y)`, x or y a number where attrs hold one (masked_fill's value)."""
    rest, cond = iter(inputs[1:]), inputs[0].bool()  # (a no-op on the boolean masks capture sees)
    x = next(rest) if node.attrs["x"] is None else node.attrs["x"]
    y = next(rest) if node.attrs["y"] is None else node.attrs["y"]
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        return torch.where(cond, torch.tensor(x, dtype=getattr(torch, node.dtype)), y)
    return torch.where(cond, x, y)


def _index(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    """`x[i0, i1, ...]` with a None (`:`) wherever `slots` is False."""
    rest = iter(inputs[1:])
    return inputs[0][tuple(next(rest) if used else slice(None) for used in node.attrs["slots"])]


def _topk(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a = node.attrs
    res = torch.topk(inputs[0], a["k"], dim=a["dim"], largest=a["largest"], sorted=a["sorted"])
    return res.values if node.op == "topk_values" else res.indices


def _sort(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a = node.attrs
    res = torch.sort(inputs[0], dim=a["dim"], descending=a["descending"], stable=a["stable"])
    return res.values if node.op == "sort_values" else res.indices


def _arange(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    a = node.attrs
    return torch.arange(a["start"], a["end"], a["step"], dtype=getattr(torch, node.dtype))


def _im2col(a: dict, x: Tensor) -> Tensor:
    """`im2col` (F.unfold) of x (N, C, H, W) or (C, H, W); a device holding no channel of a split channel dim gets
    its empty block (im2col itself rejects an empty channel dim)."""
    k, d, p, s = a["kernel_size"], a["dilation"], a["padding"], a["stride"]
    places = math.prod((size + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i, size in enumerate(x.shape[-2:]))
    out_shape = tuple(x.shape[:-3]) + (x.shape[-3] * math.prod(k), places)
    return unless_empty(lambda t: torch.ops.aten.im2col(t, k, d, p, s), out_shape, x)


def _col2im(a: dict, x: Tensor) -> Tensor:
    """`col2im` (F.fold) of x (N, C*kh*kw, L) or (C*kh*kw, L) into (N, C, H, W); a device holding no channel of a
    split channel dim gets its empty block (col2im rejects an empty one)."""
    k, d, p, s = a["kernel_size"], a["dilation"], a["padding"], a["stride"]
    out_shape = tuple(x.shape[:-2]) + (x.shape[-2] // math.prod(k),) + tuple(a["output_size"])
    return unless_empty(lambda t: torch.ops.aten.col2im(t, a["output_size"], k, d, p, s), out_shape, x)


def _fft(a: dict, x: Tensor) -> Tensor:
    """`fft` over `dims` of a real tensor or of a complex one held as a (re, im) pair (a trailing dim of 2), into a
    pair; half-precision operands are transformed in float32 (torch's FFT takes no half dtypes on the CPU), and a
    device holding no row of a split dim gets its empty block."""
    def transform(t: Tensor) -> Tensor:
        z = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        z = torch.view_as_complex(z.contiguous()) if a["pair"] else z  # a pair's trailing 2 is (re, im)
        out = (torch.fft.ifftn if a.get("inverse") else torch.fft.fftn)(z, dim=a["dims"], norm=a["norm"])
        return torch.view_as_real(out).to(t.dtype)

    return unless_empty(transform, tuple(x.shape[:x.dim() - a["pair"]]) + (2,), x)


_INDEX: dict[str, Callable[[Node, Sequence[Tensor]], Tensor]] = {
    "clamp": lambda n, x: torch.clamp(x[0], n.attrs["min"], n.attrs["max"]),
    "round": lambda n, x: torch.round(x[0], decimals=n.attrs.get("decimals", 0)),
    **{op: _reduce_by for op in ("amax", "amin", "any", "all", "var", "prod", "argmax", "argmin")},
    "slice_scatter": _slice_scatter, "group_norm": _group_norm,
    "upsample": lambda n, x: resolve_aten(n.attrs["target"])(x[0], *n.attrs["args"]),
    "select_scatter": lambda n, x: torch.select_scatter(x[0], x[1], n.attrs["dim"], n.attrs["index"]),
    "flip": lambda n, x: torch.flip(x[0], n.attrs["dims"]),
    "unfold": lambda n, x: x[0].unfold(n.attrs["dim"], n.attrs["size"], n.attrs["step"]),
    "elu": lambda n, x: torch.ops.aten.elu(x[0], n.attrs["alpha"], n.attrs["scale"], n.attrs["input_scale"]),
    "leaky_relu": lambda n, x: F.leaky_relu(x[0], n.attrs["negative_slope"]),
    "softplus": lambda n, x: F.softplus(x[0], n.attrs["beta"], n.attrs["threshold"]),
    "einsum": lambda n, x: torch.einsum(n.attrs["equation"], *x),
    "topk_values": _topk, "topk_indices": _topk, "sort_values": _sort, "sort_indices": _sort,
    "one_hot": lambda n, x: F.one_hot(x[0], n.attrs["num_classes"]),
    "cumsum": lambda n, x: torch.cumsum(x[0], n.attrs["dim"]),
    "gather": lambda n, x: torch.gather(x[0], n.attrs["dim"], x[1]),
    "arange": _arange,
    "constant": lambda n, x: torch.tensor(n.attrs["value"], dtype=getattr(torch, n.dtype)).reshape(n.shape),
    "full": _full, "pad": _pad, "index": _index, "where": _where,
    "index_add": lambda n, x: torch.index_add(x[0], n.attrs["dim"], x[1], x[2]),
    "scatter_add": lambda n, x: torch.scatter_add(x[0], n.attrs["dim"], x[1], x[2]),
    "histc": lambda n, x: torch.histc(x[0], n.attrs["bins"], n.attrs["min"], n.attrs["max"]),
    "tril": lambda n, x: torch.tril(x[0], n.attrs["diagonal"]),
    "triu": lambda n, x: torch.triu(x[0], n.attrs["diagonal"]),
    "scatter": lambda n, x: torch.scatter(x[0], n.attrs["dim"], x[1], x[2] if len(x) > 2 else n.attrs["value"]),
    "im2col": lambda n, x: _im2col(n.attrs, x[0]),
    "col2im": lambda n, x: _col2im(n.attrs, x[0]),
    "fft": lambda n, x: _fft(n.attrs, x[0]),
}


def call_canonical(op: str, attrs: dict, dtype: str, out_shape: Sequence[int], inputs: Sequence[Tensor]) -> Tensor:
    """Run an operator of `_INDEX` from its attributes alone (the runner calls this: no graph needed)."""
    node = Node(id=len(inputs), name=op, op=op, inputs=tuple(range(len(inputs))), shape=tuple(out_shape), dtype=dtype,
                attrs=attrs)
    return _INDEX[op](node, inputs)


def resolve_aten(target: str) -> Callable:
    """`"aten::name.overload"` -> the op in `torch.ops` (looked up by name: nothing is unpickled)."""
    ns, _, qual = target.partition("::")
    name, _, overload = qual.partition(".")
    packet = getattr(getattr(torch.ops, ns), name)
    return getattr(packet, overload or "default")


def _decode(value, tensors: Sequence[Tensor], device: torch.device):
    if isinstance(value, list):
        return [_decode(v, tensors, device) for v in value]
    if isinstance(value, dict):
        (kind, v), = value.items()
        if kind == "tensor":
            return tensors[v]
        if kind == "device":
            return device
        return getattr(torch, v)  # dtype, layout or memory_format, by name
    return value


def call_opaque(attrs: dict, tensors: Sequence[Tensor]) -> Tensor:
    """Run an opaque node: its original ATen op on whole (Full) inputs (see theory/opaque.py)."""
    device = tensors[0].device if tensors else torch.get_default_device()
    args = _decode(attrs["args"], tensors, device)
    kwargs = {k: _decode(v, tensors, device) for k, v in attrs["kwargs"].items()}
    out = resolve_aten(attrs["target"])(*args, **kwargs)
    index = attrs.get("output_index")
    return out if index is None else out[index]
