"""General `einsum(equation, *operands)`: rules derived from the equation (DTensor-style, as data).

For every index letter of the equation, at most one dimension per operand carries it:
- a letter kept in the output is sharded in every operand that has it (at full size) and in the
  output: shared by all operands it is "batch-like", in one operand a "free" dim (the other
  operands stay Full, each device computes its slice of the output);
- a contracted letter (absent from the output) sharded in every operand that has it gives each
  device the sum over its slice: addends of the result, `Partial`;
- einsum is linear in each operand: one operand `Partial`, the others Full -> `Partial`.
A letter repeated inside one operand (a diagonal) or broadcast (size 1 in an operand) is left
unsharded in that operand. Dispatch and combine of an MoE layer are einsums of this kind, and the
expert dim is an ordinary letter, so experts split unevenly like any other dim (HAP §7.6).
"""
from __future__ import annotations

from engine.model.graph import Graph, Node, parse_equation
from engine.theory.core import FULL, PARTIAL, Form, OpRule, replicate, rule


def _letter_form(letter: str, subs: str, shape: tuple[int, ...], size: int) -> Form | None:
    """The dim of an operand carrying `letter` at full size; FULL if absent/broadcast; None if it is a diagonal."""
    if subs.count(letter) > 1:
        return None
    if letter not in subs:
        return FULL
    d = subs.index(letter)
    return d if shape[d] == size else FULL


@rule("einsum")
def einsum_rules(node: Node, graph: Graph) -> list[OpRule]:
    ins, out = parse_equation(node.attrs["equation"])
    shapes = [graph[i].shape for i in node.inputs]
    sizes: dict[str, int] = {}
    for subs, shape in zip(ins, shapes):
        for letter, s in zip(subs, shape):
            sizes[letter] = max(sizes.get(letter, 1), s)
    rules = [replicate(node)]
    for k in range(len(ins)):
        rules.append(OpRule("partial", tuple(PARTIAL if j == k else FULL for j in range(len(ins))), PARTIAL))
    for letter in sorted(sizes):
        if out.count(letter) > 1:
            continue
        forms = [_letter_form(letter, subs, shape, sizes[letter]) for subs, shape in zip(ins, shapes)]
        if None in forms:
            continue
        if letter in out:
            kind = "batch" if all(f >= 0 for f in forms) else "free"
            rules.append(OpRule(kind, tuple(forms), out.index(letter)))
        elif any(f >= 0 for f in forms):
            rules.append(OpRule("contract", tuple(forms), PARTIAL))
    return rules
