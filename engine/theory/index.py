"""Constants and index arithmetic that models build on the fly: `arange`, `full`, `constant`,
`gather`, `index` and `pad` (attention masks, positions, the shifted labels of a causal LM).

- arange, full (ones, zeros, new_ones ...) and constant (a tensor made in forward from Python
  numbers, its value kept in the graph) have no operand: every device builds them whole (F). A
  sharded copy comes from a free slice.
- index(x, i0, i1, ...) is `x[i0, i1, ...]` with some dims left whole (`:`). It is linear in x
  (P, F, ... -> P); a dim of x that is not indexed may be sharded, the index tensors Full, and the
  output is sharded where that dim lands (in place of the indexed dims when they are adjacent,
  after the broadcast index dims otherwise, as torch orders them).
- pad(x) with a constant: a dim that is not padded may be sharded (S(d) -> S(d)); padding with 0
  is linear (P -> P), with another value not (each addend would carry it). Reflect, replicate and
  circular padding copy entries of x: linear too (their `value` is 0).
- gather(x, dim, idx): out[..i..] = x[..idx[..i..]..] along `dim`; any other dim where x and idx
  have the same size may be sharded in both (each slice gathers within itself). Not linear in idx.
- slice_scatter(x, src) / select_scatter(x, src): x with a slice (an index) of `dim` replaced by
  src. Linear in (x, src) together: (P, P) -> P. Any other dim may be sharded in both x and src
  (select_scatter's src lacks `dim`, so its dims past it shift by one): each slice writes its own rows.
- scatter(x, dim, idx, src | value): x with entries along `dim` replaced at idx. A dim other than `dim` where x,
  idx (and src) have the same size may be sharded in all of them (each slice writes within itself, in the same
  order as the whole). With a value of 0 it is linear in x (P, F -> P); with src no Partial rule: where idx
  repeats an entry, which write wins is unspecified (on a GPU), so addends could each keep a different one.
- tril / triu(x, diagonal): entries kept by their global (row, column) in the last two dims, which therefore
  stay whole (a shard would need its offset); every other dim may be sharded, and the mask is linear (P -> P).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node
from engine.theory.core import FULL, PARTIAL, OpRule, replicate, rule


@rule("arange", "constant", "full")
def arange_rules(node: Node, graph: Graph) -> list[OpRule]:
    return [replicate(node)]


@rule("gather")
def gather_rules(node: Node, graph: Graph) -> list[OpRule]:
    x, idx = graph[node.inputs[0]], graph[node.inputs[1]]
    dim = node.attrs["dim"]
    rules = [replicate(node), OpRule("partial", (PARTIAL, FULL), PARTIAL)]  # a selection is linear in x
    rules += [OpRule("rows", (d, d), d) for d in range(node.rank) if d != dim and x.shape[d] == idx.shape[d]]
    return rules


def index_out_dim(slots: list[bool], d: int, x_rank: int, out_rank: int) -> int:
    """Where a non-indexed dim d of x lands in the output of `x[slots...]` (torch's ordering)."""
    used = [i for i, u in enumerate(slots) if u]
    broadcast = out_rank - (x_rank - len(used))
    adjacent = used == list(range(used[0], used[-1] + 1))
    if adjacent:
        return d if d < used[0] else d - len(used) + broadcast
    return broadcast + sum(1 for i in range(d) if i >= len(slots) or not slots[i])


@rule("index")
def index_rules(node: Node, graph: Graph) -> list[OpRule]:
    x = graph[node.inputs[0]]
    slots = node.attrs["slots"]
    n_idx = len(node.inputs) - 1
    rules = [replicate(node), OpRule("partial", (PARTIAL,) + (FULL,) * n_idx, PARTIAL)]
    for d in range(x.rank):
        if d < len(slots) and slots[d]:
            continue
        rules.append(OpRule("rows", (d,) + (FULL,) * n_idx, index_out_dim(slots, d, x.rank, node.rank)))
    return rules


@rule("pad")
def pad_rules(node: Node, graph: Graph) -> list[OpRule]:
    padded = {node.rank - 1 - i // 2 for i, p in enumerate(node.attrs["pad"]) if p != 0}
    rules = [replicate(node)] + [OpRule("shard", (d,), d) for d in range(node.rank) if d not in padded]
    if node.attrs["value"] == 0:
        rules.append(OpRule("partial", (PARTIAL,), PARTIAL))
    return rules


@rule("slice_scatter", "select_scatter")
def scatter_slice_rules(node: Node, graph: Graph) -> list[OpRule]:
    dim = node.attrs["dim"]
    gone = 1 if node.op == "select_scatter" else 0
    rules = [replicate(node), OpRule("partial", (PARTIAL, PARTIAL), PARTIAL)]
    return rules + [OpRule("rows", (d, d - gone if d > dim else d), d) for d in range(node.rank) if d != dim]


@rule("scatter")
def scatter_rules(node: Node, graph: Graph) -> list[OpRule]:
    operands = [graph[i] for i in node.inputs]
    dim = node.attrs["dim"]
    rules = [replicate(node)]
    if len(operands) == 2 and node.attrs["value"] == 0:
        rules.append(OpRule("partial", (PARTIAL, FULL), PARTIAL))
    same = [d for d in range(node.rank) if d != dim and len({x.shape[d] for x in operands}) == 1]
    return rules + [OpRule("rows", (d,) * len(operands), d) for d in same]


@rule("tril", "triu")
def triangle_rules(node: Node, graph: Graph) -> list[OpRule]:
    rules = [replicate(node), OpRule("partial", (PARTIAL,), PARTIAL)]
    return rules + [OpRule("shard", (d,), d) for d in range(node.rank - 2)]
