"""Elementwise operators: unary maps and broadcasting binary arithmetic.

Rows, with why they hold:
- S(d) -> S(d): an elementwise op on slices gives the slice of the result.
- P -> P for linear unary maps (neg, identity): f(sum x_i) = sum f(x_i).
- add/sub(P, P) -> P: the sum of addends' sums is the sum's addends.
- mul(P, F) -> P, div(P, F) -> P: scaling by a replicated factor distributes over the addends.
- comparisons, logical and bitwise ops, pow, maximum/minimum, atan2, remainder/fmod, rounded
  division, and every other unary map (floor, erf, log1p, ...): elementwise but not linear, so only
  S(d) -> S(d) and all-Full.
- dropout: S(d) -> S(d) and F -> F are exact because every device derives the mask of its block
  from the global index (engine/model/dropout.py). No P -> P: with that shared mask it would even be
  exact (the mask distributes over the addends), but a device would draw the whole mask and scale
  the whole tensor to save no communication; with per-device random streams it would be wrong.
- where(cond, x, y) (and masked_fill): S(d) on every operand -> S(d); with cond Full it is linear
  in (x, y) together, so (F, P, P) -> P, where a number in place of x or y must be 0 (each
  addend would carry any other).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule

_LINEAR_UNARY = {"neg", "identity"}
NONLINEAR_BINARY = ("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "pow", "maximum", "minimum", "atan2",
                    "remainder", "fmod", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "div_floor",
                    "div_trunc")
"""Elementwise binary operators (tensor-tensor or tensor-scalar) that are not linear in any operand."""
UNARY = ("relu", "gelu", "tanh", "sigmoid", "silu", "exp", "rsqrt", "sqrt", "neg", "identity", "dropout", "cos", "sin",
         "logical_not", "clamp", "softplus", "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cosh",
         "erf", "expm1", "floor", "log", "log10", "log1p", "log2", "reciprocal", "sign", "sinh", "tan", "trunc", "isinf",
         "isnan", "bitwise_not", "round", "elu", "leaky_relu", "hardswish", "hardsigmoid", "log_sigmoid", "mish")
"""Elementwise maps of one tensor (with number attributes: clamp's bounds, round's decimals, elu's alpha ...)."""


@rule(*UNARY)
def unary_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = [replicate(node)] + [OpRule("shard", (d,), d) for d in range(node.rank)]
    if node.op in _LINEAR_UNARY and "dtype" not in node.attrs:  # a cast is not linear (it rounds)
        rules.append(OpRule("partial", (PARTIAL,), PARTIAL))
    return rules


def _aligned_dim(out_dim: int, out_rank: int, operand: Node) -> int:
    """The operand dim broadcast into `out_dim`, or FULL when the operand is broadcast along it."""
    d = out_dim - (out_rank - operand.rank)
    if d < 0 or operand.shape[d] == 1:
        return FULL
    return d


def _elementwise(node: Node, graph: Graph) -> list[OpRule]:
    operands = [graph[i] for i in node.inputs]
    rules = [replicate(node)]
    for d in range(node.rank):
        rules.append(OpRule("shard", tuple(_aligned_dim(d, node.rank, x) for x in operands), d))
    return rules


@rule(*NONLINEAR_BINARY)
def nonlinear_binary_rules(node: Node, graph: Graph) -> list[OpRule]:
    return _elementwise(node, graph)


@rule("add", "sub", "mul", "div")
def binary_rules(node: Node, graph: Graph) -> list[OpRule]:
    operands = [graph[i] for i in node.inputs]
    rules = _elementwise(node, graph)
    if len(operands) == 1:
        scalar_keeps_partial = node.op in ("mul",) or (node.op == "div" and not node.attrs.get("scalar_first"))
        if scalar_keeps_partial:
            rules.append(OpRule("partial", (PARTIAL,), PARTIAL))
        return rules
    if node.op in ("add", "sub"):
        rules.append(OpRule("partial", (PARTIAL, PARTIAL), PARTIAL))
    elif node.op == "mul":
        rules += [OpRule("partial", (PARTIAL, FULL), PARTIAL), OpRule("partial", (FULL, PARTIAL), PARTIAL)]
    else:  # div
        rules.append(OpRule("partial", (PARTIAL, FULL), PARTIAL))
    return rules


@rule("where")
def where_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = _elementwise(node, graph)
    if all(node.attrs[k] in (None, 0) for k in ("x", "y")):
        rules.append(OpRule("partial", (FULL,) + (PARTIAL,) * (len(node.inputs) - 1), PARTIAL))
    return rules
