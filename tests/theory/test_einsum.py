"""Einsum rules (engine/theory/einsum.py): derived from the equation, checked on uneven shards."""
from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from engine.theory import op_rules
from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds


@st.composite
def equations(draw: st.DrawFn) -> tuple[str, list[tuple[int, ...]]]:
    """A random einsum of 1-3 operands over up to 5 letters (each used once per operand); some
    letters are broadcast (size 1) in one operand."""
    letters = string.ascii_lowercase[: draw(st.integers(1, 5))]
    sizes = {c: draw(st.integers(1, 5)) for c in letters}
    operands = []
    for _ in range(draw(st.integers(1, 3))):
        subs = "".join(draw(st.permutations(letters))[: draw(st.integers(1, len(letters)))])
        operands.append(subs)
    used = sorted(set("".join(operands)))
    out = "".join(c for c in draw(st.permutations(used)) if draw(st.booleans()))
    shapes = [tuple(1 if draw(st.integers(0, 5)) == 0 else sizes[c] for c in subs) for subs in operands]
    return f"{','.join(operands)}->{out}", shapes


@SETTINGS
@given(eq=equations(), ratios=ratios_st, seed=seeds)
def test_einsum_rules_hold(eq, ratios: list[float], seed: int) -> None:
    equation, shapes = eq
    node, g = one_op("einsum", shapes, {"equation": equation})
    check_all(node, g, ratios, seed)


def test_rules_are_derived_from_the_equation() -> None:
    # expert layer: e batch-like (all operands and output), b, c free in x, f free in w, d contracted
    node, g = one_op("einsum", [(5, 4, 3, 6), (5, 6, 7)], {"equation": "ebcd,edf->ebcf"})
    assert node.shape == (5, 4, 3, 7)
    assert rule_set(node, g) == {
        ((FULL, FULL), FULL), ((PARTIAL, FULL), PARTIAL), ((FULL, PARTIAL), PARTIAL),
        ((0, 0), 0),              # e: batch-like, every device holds whole experts
        ((1, FULL), 1), ((2, FULL), 2), ((FULL, 2), 3),  # free dims of one operand
        ((3, 1), PARTIAL),        # d: contracted, addends
    }
    names = {(r.inputs, r.output): r.name for r in op_rules(node, g)}
    assert names[((0, 0), 0)] == "batch" and names[((1, FULL), 1)] == "free" and names[((3, 1), PARTIAL)] == "contract"


def test_moe_dispatch_and_combine_shard_the_expert_dim_unevenly() -> None:
    """5 experts on 3 devices at 0.5/0.3/0.2: whole experts 3/1/1 (HAP §7.6), no padding."""
    dispatch, g = one_op("einsum", [(2, 4, 5, 3), (2, 4, 6)], {"equation": "btec,btd->ebcd"})
    assert ((2, FULL), 0) in rule_set(dispatch, g)  # dispatch mask split by expert -> expert inputs split
    check_all(dispatch, g, UNEVEN)
    combine, g = one_op("einsum", [(2, 4, 5, 3), (5, 2, 3, 6)], {"equation": "btec,ebcd->btd"})
    assert ((2, 0), PARTIAL) in rule_set(combine, g)  # experts contracted: each device's experts add up
    check_all(combine, g, UNEVEN)


def test_diagonals_and_repeated_output_letters_are_never_sharded() -> None:
    node, g = one_op("einsum", [(4, 4)], {"equation": "ii->i"})
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL)}
    check_all(node, g, UNEVEN)


def test_checker_rejects_wrong_einsum_rules() -> None:
    node, g = one_op("einsum", [(4, 6), (6, 5)], {"equation": "ik,kj->ij"})
    assert check_rule(node, g, OpRule("contract-as-full", (1, 0), FULL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("both-partial", (PARTIAL, PARTIAL), PARTIAL), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("free-on-wrong-output-dim", (0, FULL), 1), UNEVEN).ok is False
    assert check_rule(node, g, OpRule("free-as-partial", (0, FULL), PARTIAL), UNEVEN).ok is False
