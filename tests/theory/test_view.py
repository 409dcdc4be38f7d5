"""Layout rules (engine/theory/view.py): `view` (split/merge dims, unit dims) and `permute`."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule
from engine.theory.view import view_groups

from ._helpers import FULL, PARTIAL, SETTINGS, UNEVEN, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


def _group(atoms: list[int], cuts: list[bool]) -> tuple[int, ...]:
    """Multiply consecutive atoms together, starting a new dim after each atom whose cut is True."""
    out, cur = [], 1
    for a, cut in zip(atoms, cuts):
        cur *= a
        if cut:
            out.append(cur)
            cur = 1
    out.append(cur)
    return tuple(out)


def _with_units(shape: tuple[int, ...], where: list[int]) -> tuple[int, ...]:
    s = list(shape)
    for w in where:
        s.insert(w % (len(s) + 1), 1)
    return tuple(s)


@st.composite
def view_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A source shape and a reshape of it that splits and merges dims and inserts unit dims."""
    atoms = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    src = _group(atoms, draw(st.lists(st.booleans(), min_size=len(atoms) - 1, max_size=len(atoms) - 1)) + [False])
    dst = _group(atoms, draw(st.lists(st.booleans(), min_size=len(atoms) - 1, max_size=len(atoms) - 1)) + [False])
    src = _with_units(src, draw(st.lists(st.integers(0, 5), max_size=1)))
    dst = _with_units(dst, draw(st.lists(st.integers(0, 5), max_size=2)))
    return src, dst


@SETTINGS
@given(pair=view_pair(), ratios=ratios_st, seed=seeds)
def test_view_rules_hold(pair: tuple, ratios: list[float], seed: int) -> None:
    src, dst = pair
    assert math.prod(src) == math.prod(dst)
    node, g = one_op("view", [src], {"shape": list(dst)}, out_shape=dst)
    check_all(node, g, ratios, seed)


@SETTINGS
@given(shape=shapes(1, 4), data=st.data(), ratios=ratios_st, seed=seeds)
def test_permute_rules_hold(shape: tuple[int, ...], data: st.DataObject, ratios: list[float], seed: int) -> None:
    dims = data.draw(st.permutations(range(len(shape))))
    node, g = one_op("permute", [shape], {"dims": list(dims)})
    check_all(node, g, ratios, seed)


def test_view_split_and_merge_rule_forms() -> None:
    split, g = one_op("view", [(4, 8, 32)], {"shape": [4, 8, 4, 8]}, out_shape=(4, 8, 4, 8))  # heads split
    assert rule_set(split, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0), ((1,), 1), ((2,), 2)}
    merge, g = one_op("view", [(4, 8, 4, 8)], {"shape": [32, 32]}, out_shape=(32, 32))
    assert rule_set(merge, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((0,), 0), ((2,), 1)}
    check_all(merge, g, UNEVEN)
    unit, g = one_op("view", [(1, 6, 1)], {"shape": [6]}, out_shape=(6,))
    assert rule_set(unit, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((1,), 0)}
    assert view_groups((4, 8, 32), (4, 8, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]


def test_permute_rule_forms() -> None:
    node, g = one_op("permute", [(2, 3, 4)], {"dims": [2, 0, 1]})
    assert node.shape == (4, 2, 3)
    assert rule_set(node, g) == {((FULL,), FULL), ((PARTIAL,), PARTIAL), ((2,), 0), ((0,), 1), ((1,), 2)}


def test_checker_rejects_wrong_layout_rules() -> None:
    node, g = one_op("permute", [(6, 6)], {"dims": [1, 0]})
    assert check_rule(node, g, OpRule("same-dim", (0,), 0), [0.5, 0.5]).ok is False
    merge, g = one_op("view", [(4, 6)], {"shape": [24]}, out_shape=(24,))
    assert check_rule(merge, g, OpRule("inner-dim", (1,), 0), UNEVEN).ok is False  # column slices are strided


def test_checker_reports_misshaped_shards_as_wrong() -> None:
    """A rule whose local outputs do not even concatenate along the claimed dim is WRONG (not a crash).

    `_combine_error` returns inf when the concatenation has the wrong shape; it must do the same when
    the shards cannot be concatenated at all (here: uneven row blocks of x become uneven *column*
    blocks of x^T, which torch.cat along dim 0 rejects).
    """
    node, g = one_op("permute", [(4, 6)], {"dims": [1, 0]})
    assert check_rule(node, g, OpRule("same-dim", (0,), 0), UNEVEN).ok is False
