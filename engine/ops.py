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

from .graph import Graph, Node

Tensor = torch.Tensor
_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu, "exp": torch.exp,
    "rsqrt": torch.rsqrt, "sqrt": torch.sqrt, "neg": torch.neg,
}
_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def run_node(node: Node, graph: Graph, inputs: Sequence[Tensor], out_shape: Sequence[int]) -> Tensor:
    """Run `node` on (possibly sharded) local inputs; `out_shape` is the local output shape (used by views)."""
    op, a = node.op, node.attrs
    if op in _UNARY:
        return _UNARY[op](inputs[0])
    if op in _BINARY:
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
        return F.embedding(inputs[1], inputs[0])
    if op == "sdpa":
        return F.scaled_dot_product_attention(*inputs[:3], is_causal=a["is_causal"], scale=a["scale"])
    if op == "cross_entropy":
        return F.cross_entropy(inputs[0], inputs[1], reduction="sum") / a["count"]
    if op == "mse_loss":
        return F.mse_loss(inputs[0], inputs[1], reduction="sum") / a["count"]
    if op in _SHAPE:
        return _SHAPE[op](node, inputs, out_shape)
    raise NotImplementedError(f"no executor for operator '{op}' (node {node.name})")


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


def _binary(node: Node, inputs: Sequence[Tensor]) -> Tensor:
    fn = _BINARY[node.op]
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
