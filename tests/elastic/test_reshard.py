"""The resharding table (engine.elastic.reshard): every receiver gets exactly its piece, once, from an owner."""
from __future__ import annotations

import math

import pytest

from engine.elastic.reshard import (FULL_DIM, Layout, TensorMove, common_boxes, contains, numel, reshard_table,
                                    switch_seconds)
from engine.errors import PlanError


def covered_exactly(move: TensorMove, table) -> None:
    """Each new rank's boxes of `move` tile its region (no gap, no overlap) and come from owners."""
    for r in range(move.new.world):
        region = move.new.region(r, move.shape)
        rows = [t for t in table.for_receiver(r) if t.tensor == move.name]
        assert all(contains(region, t.box) for t in rows)
        assert all(contains(move.old.region(t.sender, move.shape), t.box) for t in rows)
        assert sum(numel(t.box) for t in rows) == numel(region)
        for i, a in enumerate(rows):  # pairwise disjoint
            for b in rows[i + 1:]:
                assert any(max(x0, y0) >= min(x1, y1) for (x0, x1), (y0, y1) in zip(a.box, b.box))


def test_uneven_shards_on_one_dim_4_to_3_ranks():
    move = TensorMove("w", (10, 3), Layout(4, 0, (4, 3, 2, 1)), Layout(3, 0, (5, 3, 2)))
    table = reshard_table([move])
    covered_exactly(move, table)
    cuts = sorted({t.box[0] for t in table.transfers})
    assert cuts == [(0, 4), (4, 5), (5, 7), (7, 8), (8, 9), (9, 10)]
    # rank 0 keeps rows 0-4 locally; rows 4-5 come from old rank 1 over a link
    assert [(t.box[0], t.sender, t.local) for t in table.for_receiver(0)] == [((0, 4), 0, True), ((4, 5), 1, False)]
    assert table.sent_bytes == [0, 4 * 1 * 3, 4 * 3 * 1, 4 * 1 * 3]
    assert sum(table.received_bytes) == table.moved_bytes


def test_different_shard_dims_cut_into_blocks():
    move = TensorMove("w", (6, 4), Layout(2, 0, (4, 2)), Layout(3, 1, (2, 1, 1)))
    boxes = common_boxes(move)
    assert len(boxes) == 2 * 3 and sum(map(numel, boxes)) == 24
    table = reshard_table([move])
    covered_exactly(move, table)
    # new rank 2 holds column 3 of every row: rows 0-4 from old rank 0, rows 4-6 from old rank 1
    assert sorted((t.box, t.sender) for t in table.for_receiver(2)) == [(((0, 4), (3, 4)), 0), (((4, 6), (3, 4)), 1)]


def test_growing_from_full_copies_spreads_the_load_over_the_owners():
    moves = [TensorMove(f"p{i}", (8,), Layout(2), Layout(4, 0, (3, 2, 2, 1))) for i in range(4)]
    table = reshard_table(moves)
    for m in moves:
        covered_exactly(m, table)
    assert all(t.local for t in table.transfers if t.receiver < 2)
    assert table.received_bytes == [0, 0, 4 * 2 * 4, 4 * 1 * 4]
    assert abs(table.sent_bytes[0] - table.sent_bytes[1]) <= 4 * 2  # least-loaded sender, fused over tensors


def test_to_full_every_receiver_gathers_every_piece_and_prefers_the_fastest_link():
    move = TensorMove("b", (5,), Layout(3, 0, (2, 2, 1)), Layout(2))
    fast = {(2, 1)}

    def link(s: int, r: int) -> float:
        return math.inf if s == r else 10.0 if (s, r) in fast else 1.0

    table = reshard_table([move], link)
    covered_exactly(move, table)
    assert len(table.for_receiver(1)) == 3


def test_a_full_box_with_several_owners_goes_to_the_fastest_one():
    move = TensorMove("b", (5,), Layout(3), Layout(4, 0, (2, 1, 1, 1)))

    def link(s: int, r: int) -> float:
        return math.inf if s == r else 10.0 if s == 2 else 1.0

    table = reshard_table([move], link)
    assert [(t.sender, t.local) for t in table.for_receiver(3)] == [(2, False)]
    assert [(t.sender, t.local) for t in table.for_receiver(0)] == [(0, True)]


def test_scalars_and_full_to_full_are_local_copies():
    moves = [TensorMove("step", (), Layout(4), Layout(3)), TensorMove("w", (3, 3), Layout(4), Layout(3))]
    table = reshard_table(moves)
    assert all(t.local for t in table.transfers) and table.moved_bytes == 0
    assert len(table.transfers) == 2 * 3


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(PlanError, match="w: shard sizes \\[4, 4\\] do not split dim 0 of shape \\[10, 3\\]"):
        reshard_table([TensorMove("w", (10, 3), Layout(2, 0, (4, 4)), Layout(2))])
    with pytest.raises(PlanError, match="w: shard dim 2 is not a dim"):
        reshard_table([TensorMove("w", (10, 3), Layout(2), Layout(2, 2, (1, 1)))])
    with pytest.raises(PlanError, match="v: layouts over 3->2 ranks in a switch of 2->2"):
        reshard_table([TensorMove("w", (4,), Layout(2), Layout(2)), TensorMove("v", (4,), Layout(3), Layout(2))])
    assert FULL_DIM == -1


def test_switch_seconds_is_the_busiest_device_at_its_links_bandwidth():
    move = TensorMove("w", (10,), Layout(2, 0, (5, 5)), Layout(3, 0, (4, 3, 3)))

    def link(s: int, r: int) -> float:
        return math.inf if s == r else 4.0

    table = reshard_table([move], link)
    # rank 1 receives row 4 (from 0); rank 2 receives rows 7-10 (from 1): 3 rows * 4 bytes at 4 B/s
    assert table.received_bytes == [0, 4, 12]
    assert switch_seconds(table, link) == 3.0
    assert switch_seconds(reshard_table([TensorMove("s", (), Layout(2), Layout(2))], link), link) == 0.0
