"""Activations kept for the backward pass: the tensors autograd saves, in the form their saver receives.

Memory per GPU (`engine.spmd.cost`) counts, beside the parameter state, what autograd keeps from
forward to backward. An operator's output is not kept just because it was computed: `add`, `neg`,
`cat`, a slice, a cast, or a product with a tensor that needs no gradient (a rotary `cos` table)
save nothing, and their results are freed once their consumers have run. What stays is what some
operator saves for its backward formula (PyTorch's `derivatives.yaml`): a matmul its activation
operand (to form the weight's gradient), `silu`, `gelu`, `pow` their input, `exp`, `rsqrt`,
`softmax` their output, attention its q, k, v, mask and output, a norm its input.

Counting every output instead charged a Llama layer's rotary chain (mul, narrow, neg, cat, add on
q and k) as seven kept tensors, and full-size on every device where the search ran it on the
Partial sums of a row-parallel projection: 11 GiB of a 20.7 GiB estimate for an 8-layer 1.9B Llama
on 16 GPUs, of which autograd keeps none (issue 26).

Rules of the count:
- A saved view keeps its base's storage, so a save is charged to its *root*: the tensor found by
  following views (`ALIAS_OPS`) back to the operator that allocated it. Leaves are not charged
  here (parameters are state; inputs are the batch), except a pipeline stage's input received
  from the previous stage (a `cut` placeholder): an activation, as it is in the whole model.
- Each root is charged once, split evenly between the instructions that save it, and each share in
  the form its saver receives the operand: a column-parallel matmul whose input was all-gathered
  keeps the Full copy on every device, and attention fed by a reduce-scatter keeps a shard though
  its operand was produced Partial. The split is exact when the savers receive one form (the usual
  case) and an average otherwise; it stays a sum of per-instruction terms, as the search and the LP
  need. (A free slice of a Full tensor is a view, so a saver of the slice really keeps the whole;
  it is counted as a shard.)
- Operators not in the tables keep their output, as every operator did before this count
  (conservative: dropout, opaque and MoE operators).
"""
from __future__ import annotations

from typing import Sequence

from engine.model.graph import Graph, Node

OUTPUT = -1
"""Position that stands for an instruction's own result in a save."""

ALIAS_OPS = frozenset({"view", "permute", "expand", "narrow", "select", "identity"})
"""Operators whose result aliases their operand's storage (an `identity` that changes the dtype is a
copy and is not one of them)."""
SAVES_OUTPUT = frozenset({"relu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "softmax", "log_softmax", "expm1", "tan",
                          "reciprocal"})
"""Operators whose backward reads their result."""
SAVES_OPERANDS = frozenset({"gelu", "silu", "cos", "sin", "pow", "clamp", "softplus", "layer_norm", "batch_norm", "cross_entropy",
                            "mse_loss", "avg_pool", "adaptive_avg_pool", "abs", "acos", "asin", "atan", "acosh", "asinh",
                            "atanh", "cosh", "sinh", "erf", "log", "log10", "log1p", "log2", "elu", "leaky_relu",
                            "maximum", "minimum", "atan2", "remainder", "fmod", "var", "group_norm"})
"""Operators whose backward reads their operands (a norm's weight and bias are leaves: state, not here;
cross-entropy keeps a log-softmax of the logits' size)."""
SAVES_OTHER_OPERANDS = frozenset({"linear", "matmul", "einsum", "conv", "mul"})
"""Products: an operand is kept when another operand needs a gradient (that gradient reads it). A
product with a Python number keeps nothing."""
SAVES_INDICES = {"embedding": slice(1, None), "gather": slice(1, None), "index": slice(1, None), "where": slice(0, 1)}
"""Selections: they keep their index operands (`where` its condition)."""
SAVES_NOTHING = frozenset({"add", "sub", "neg", "cat", "pad", "upsample", "sum", "mean", "roll", "cumsum", "stage_output", "arange",
                           "full", "constant", "one_hot", "histc", "topk_indices", "eq", "ne", "lt", "le", "gt", "ge",
                           "logical_and", "logical_or", "logical_not", "floor", "ceil", "round", "trunc", "sign", "isinf",
                           "isnan", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "argmax",
                           "argmin", "any", "all", "rand", "div_floor", "div_trunc", "sort_indices", "flip", "slice_scatter",
                           "select_scatter"})
"""Operators whose backward needs only shapes (or that have none)."""


def is_alias(n: Node) -> bool:
    return n.op in ALIAS_OPS and not (n.op == "identity" and "dtype" in n.attrs)


def requires_grad(graph: Graph) -> list[bool]:
    """Whether each tensor needs a gradient: parameters, what depends on one, and a pipeline stage's
    input whose gradient goes back to the previous stage (a `cut` placeholder marked `requires_grad`)."""
    out: list[bool] = []
    for n in graph.nodes:
        out.append(n.op == "parameter" or bool(n.attrs.get("requires_grad")) if n.is_leaf
                   else any(out[i] for i in n.inputs))
    return out


def saved_positions(n: Node, requires_grad: list[bool]) -> tuple[tuple[int, ...], bool]:
    """(positions of the operands node `n` saves, whether it saves its result) when it takes part in
    the backward pass; an operator of no table keeps its result."""
    if n.is_leaf or not requires_grad[n.id] or is_alias(n) or n.op in SAVES_NOTHING:
        return (), False
    k = len(n.inputs)
    if n.op in SAVES_OUTPUT:
        return (), True
    if n.op in SAVES_OPERANDS:
        return tuple(range(k)), False
    if n.op == "sdpa":
        return tuple(range(k)), True
    if n.op == "max_pool":  # its input, and indices of its result's size
        return (0,), True
    if n.op in SAVES_OTHER_OPERANDS:
        return tuple(i for i in range(k) if any(requires_grad[t] for j, t in enumerate(n.inputs) if j != i)), False
    if n.op == "div":  # x / y: x's gradient reads y, y's reads x and y
        if k < 2:
            return (), False
        return ((0, 1) if requires_grad[n.inputs[1]] else (1,) if requires_grad[n.inputs[0]] else ()), False
    if n.op in SAVES_INDICES:
        return tuple(range(k))[SAVES_INDICES[n.op]], False
    return (), True


def root_of(graph: Graph, t: int) -> int:
    """The tensor whose storage `t` aliases (itself unless `t` is a view)."""
    while is_alias(graph[t]):
        t = graph[t].inputs[0]
    return t


def saves_by_node(graph: Graph, requires_grad: list[bool],
                  nbytes: Sequence[float] | None = None) -> list[tuple[tuple[int, float], ...]]:
    """For every node, what its instruction keeps for backward: (operand position or `OUTPUT`, bytes)
    pairs, each root's bytes split evenly between the saves that reach it. `nbytes`: each tensor's
    bytes as the plan runs it (2-byte activations under mixed precision); default as captured."""
    size = [n.nbytes for n in graph.nodes] if nbytes is None else nbytes
    saves: list[list[tuple[int, int]]] = [[] for _ in graph.nodes]  # node -> (position, root)
    count = [0] * len(graph)
    for n in graph.nodes:
        positions, output = saved_positions(n, requires_grad)
        for i in positions:
            r = root_of(graph, n.inputs[i])
            if not graph[r].is_leaf or "cut" in graph[r].attrs:
                saves[n.id].append((i, r))
                count[r] += 1
        if output:
            saves[n.id].append((OUTPUT, n.id))
            count[n.id] += 1
    return [tuple((i, size[r] / count[r]) for i, r in s) for s in saves]


def kept_split(saves: tuple[tuple[int, float], ...], inputs: tuple[int, ...], output: int) -> tuple[float, float]:
    """(sharded, replicated) bytes an instruction keeps, given its operands' and result's forms: a
    sharded form keeps the device's slice, Full and Partial keep the whole on every device."""
    sharded = replicated = 0.0
    for i, nbytes in saves:
        if (output if i == OUTPUT else inputs[i]) >= 0:
            sharded += nbytes
        else:
            replicated += nbytes
    return sharded, replicated
