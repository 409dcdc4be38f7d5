"""Embedding rules (engine/theory/embedding.py): `embedding(w[V, C], ids[...]) -> out[..., C]`."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.theory.check import check_rule

from ._helpers import FULL, PARTIAL, SETTINGS, OpRule, check_all, one_op, ratios_st, rule_set, seeds, shapes


def _embedding(vocab: int, width: int, ids: tuple[int, ...]):
    return one_op("embedding", [((vocab, width), "float64"), (ids, "int64")])


@SETTINGS
@given(vocab=st.integers(2, 6), width=st.integers(1, 6), ids=shapes(1, 3), ratios=ratios_st, seed=seeds)
def test_embedding_rules_hold(vocab: int, width: int, ids: tuple[int, ...], ratios: list[float], seed: int) -> None:
    node, g = _embedding(vocab, width, ids)
    assert node.shape == ids + (width,)
    check_all(node, g, ratios, seed)


def test_embedding_rule_forms() -> None:
    node, g = _embedding(5, 6, (4, 3))
    assert rule_set(node, g) == {((FULL, FULL), FULL), ((1, FULL), 2), ((FULL, 0), 0), ((FULL, 1), 1),
                                 ((0, FULL), PARTIAL), ((PARTIAL, FULL), PARTIAL)}


@SETTINGS
@given(vocab=st.integers(2, 12), width=st.integers(1, 4), ids=shapes(1, 2), pad=st.integers(0, 11), ratios=ratios_st, seed=seeds)
def test_vocabulary_parallel_lookup_with_a_padding_row_is_exact(vocab, width, ids, pad, ratios, seed) -> None:
    """Each device looks up the ids of its row range (offset from the uneven sizes), zeros elsewhere."""
    node, g = one_op("embedding", [((vocab, width), "float64"), (ids, "int64")], {"padding_idx": pad % vocab})
    [vocab_rule] = [r for r in check_all(node, g, ratios, seed) if r.rule.startswith("{S(0), F} vocab")]
    assert vocab_rule.ok


def test_checker_rejects_wrong_embedding_rules() -> None:
    node, g = _embedding(6, 4, (4, 3))
    # a vocabulary shard gives addends (zeros outside each device's rows), never the whole result
    assert check_rule(node, g, OpRule("vocab-as-full", (0, FULL), FULL), [0.5, 0.5]).ok is False
    assert check_rule(node, g, OpRule("vocab-as-shard", (0, FULL), 0), [0.5, 0.5]).ok is False
    assert check_rule(node, g, OpRule("hidden-as-batch", (1, FULL), 0), [0.5, 0.5]).ok is False
