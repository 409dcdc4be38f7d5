"""Online resharding (issue 16): the old ranks send every slice point to point along the same table
that offline resharding reads from files; each new rank ends with exactly its pieces."""
from __future__ import annotations

import pytest
import torch
from dist_harness import init_gloo, run_ranks
from test_runner_checkpoint import sharded_plan
from test_runner_reshard import plan_sharding_weights_on

from engine.elastic.reshard import reshard_table
from runner.reshard import exchange, plan_moves

STATE = ("exp_avg", "exp_avg_sq")


def full_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A distinct value for every element of every tensor (so a misplaced slice cannot pass)."""
    base = sum(map(ord, name)) * 1000.0
    return base + torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)


def piece(name: str, move, layout_of: str, rank: int) -> torch.Tensor:
    lay = getattr(move, layout_of)
    return full_value(name, move.shape)[tuple(slice(a, b) for a, b in lay.region(rank, move.shape))]


def switch_rank(rank: int, world: int, init_method: str, old, new) -> dict:
    init_gloo(rank, world, init_method)
    moves = plan_moves(old, new, STATE)
    table = reshard_table(moves)
    mine = {m.name: piece(m.name, m, "old", rank) for m in moves} if rank < old.world_size else None
    got = exchange(table, moves, mine, rank)
    want = {m.name: piece(m.name, m, "new", rank) for m in moves} if rank < new.world_size else {}
    assert got.keys() == want.keys()
    return {k: bool(torch.equal(got[k], want[k])) for k in want}


@pytest.mark.parametrize("old, new", [
    pytest.param(lambda: sharded_plan("mlp", 4), lambda: sharded_plan("mlp", 3), id="4-to-3"),
    pytest.param(lambda: sharded_plan("mlp", 2), lambda: sharded_plan("mlp", 4), id="2-to-4"),
    pytest.param(lambda: plan_sharding_weights_on({"layers.0.weight": 0, "layers.1.weight": 1}, 2),
                 lambda: plan_sharding_weights_on({"layers.0.weight": 1, "layers.1.weight": 0}, 3),
                 id="rows-to-columns"),
])
def test_every_new_rank_receives_exactly_its_pieces_of_parameters_and_optimizer_state(old, new, tmp_path):
    old, new = old(), new()
    world = max(old.world_size, new.world_size)
    results = run_ranks(switch_rank, world, tmp_path, old, new, timeout_s=120)
    names = {m.name for m in plan_moves(old, new, STATE)}
    for rank, res in enumerate(results):
        assert res == ({n: True for n in names} if rank < new.world_size else {})
