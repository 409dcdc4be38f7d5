"""The resharding table: which slice of which tensor every new rank reads from which old rank.

Switching plans (Hetu v2 §4.3, §6: the batched send-receive, BSR, table) moves every parameter and
every optimizer state tensor from its layout under the old plan to its layout under the new one. A
layout is Full (every rank holds the whole tensor) or Shard(d) with uneven integer sizes. For each
tensor the finest common partition of the two layouts cuts it into boxes (one interval per dim);
each box has owners (old ranks whose piece contains it) and receivers (new ranks whose piece
contains it). Every receiver reads every box it needs exactly once, from one owner chosen over all
tensors together (fused): a local copy first, then the fastest link, then the least-loaded sender
(the one with the fewest bytes assigned so far), larger boxes first so the balance evens out.

Pure Python: the runner reads the table to load checkpoint slices, the re-planner prices a switch
with it. Rank numbers are plan device indices; `link(sender, receiver)` gives bytes/s between an
old and a new rank (math.inf for a copy that stays on one device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Sequence

from engine.errors import PlanError

FULL_DIM = -1
"""The `dim` of a Full layout (the plan's FULL form)."""

Box = tuple[tuple[int, int], ...]
"""[start, stop) on every dim of a tensor."""
Link = Callable[[int, int], float]


@dataclass(frozen=True)
class Layout:
    """One tensor split over the ranks of one plan: Full (`dim` -1) or Shard(`dim`) with `sizes` per rank."""

    world: int
    dim: int = FULL_DIM
    sizes: tuple[int, ...] = ()

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """PlanError naming the tensor when the layout cannot split `shape` over `world` ranks."""
        if self.world < 1:
            raise PlanError(f"{name}: a layout needs at least one rank, got world {self.world}")
        if self.dim == FULL_DIM:
            return
        if not 0 <= self.dim < len(shape):
            raise PlanError(f"{name}: shard dim {self.dim} is not a dim of shape {list(shape)}")
        if len(self.sizes) != self.world or any(s < 0 for s in self.sizes) or sum(self.sizes) != shape[self.dim]:
            raise PlanError(f"{name}: shard sizes {list(self.sizes)} do not split dim {self.dim} of shape "
                            f"{list(shape)} over {self.world} ranks")

    def offsets(self) -> list[int]:
        """Start of every rank's piece on `dim`, and the end (len world + 1)."""
        out = [0]
        for s in self.sizes:
            out.append(out[-1] + s)
        return out

    def region(self, rank: int, shape: tuple[int, ...]) -> Box:
        """The box rank `rank` holds."""
        box = [(0, n) for n in shape]
        if self.dim != FULL_DIM:
            off = self.offsets()
            box[self.dim] = (off[rank], off[rank + 1])
        return tuple(box)


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@dataclass(frozen=True)
class TensorMove:
    """One tensor to move: its name, full shape, bytes per element, and its old and new layouts."""

    name: str
    shape: tuple[int, ...]
    old: Layout
    new: Layout
    itemsize: int = 4


@dataclass(frozen=True)
class Transfer:
    """One row of the table: `receiver` (a new rank) reads `box` of `tensor` from `sender` (an old rank)."""

    tensor: str
    box: Box
    sender: int
    receiver: int
    nbytes: int
    local: bool
    """The sender and the receiver are one device: a copy, no network."""


@dataclass
class ReshardTable:
    """Every transfer of one switch, fused over all tensors."""

    transfers: list[Transfer]
    old_world: int
    new_world: int
    sent_bytes: list[int] = field(default_factory=list)
    """Bytes each old rank sends over links (local copies excluded)."""
    received_bytes: list[int] = field(default_factory=list)
    """Bytes each new rank receives over links (local copies excluded)."""

    def for_receiver(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.receiver == rank]

    @property
    def moved_bytes(self) -> int:
        return sum(self.sent_bytes)


def switch_seconds(table: ReshardTable, link: Link) -> float:
    """Predicted time of the switch: the busiest device's seconds of sending or of receiving, each
    transfer at its link's bandwidth (links full duplex, latencies and contention ignored)."""
    send = [0.0] * table.old_world
    recv = [0.0] * table.new_world
    for t in table.transfers:
        if not t.local:
            send[t.sender] += t.nbytes / link(t.sender, t.receiver)
            recv[t.receiver] += t.nbytes / link(t.sender, t.receiver)
    return max([*send, *recv], default=0.0)


def same_rank(sender: int, receiver: int) -> float:
    """The default link: a rank keeps its own number across plans (a local copy), every other link alike."""
    return math.inf if sender == receiver else 1.0


def common_boxes(move: TensorMove) -> list[Box]:
    """The finest common partition of the old and the new layout of one tensor (empty boxes dropped)."""
    cuts: dict[int, set[int]] = {}
    for lay in (move.old, move.new):
        if lay.dim != FULL_DIM:
            cuts.setdefault(lay.dim, {0, move.shape[lay.dim]}).update(lay.offsets())
    axes = []
    for d, n in enumerate(move.shape):
        points = sorted(cuts.get(d, {0, n}))
        axes.append([(a, b) for a, b in zip(points, points[1:])] or [(0, n)])
    return [box for box in product(*axes) if numel(box) > 0]


def reshard_table(moves: Sequence[TensorMove], link: Link = same_rank) -> ReshardTable:
    """The fused table of `moves` (all with the same old and new world sizes)."""
    if not moves:
        return ReshardTable([], 0, 0)
    old_world, new_world = moves[0].old.world, moves[0].new.world
    requests = []
    for m in moves:
        if (m.old.world, m.new.world) != (old_world, new_world):
            raise PlanError(f"{m.name}: layouts over {m.old.world}->{m.new.world} ranks in a switch of "
                            f"{old_world}->{new_world} ranks")
        m.old.check(m.name, m.shape)
        m.new.check(m.name, m.shape)
        old_regions = [m.old.region(r, m.shape) for r in range(old_world)]
        new_regions = [m.new.region(r, m.shape) for r in range(new_world)]
        for box in common_boxes(m):
            owners = [r for r, reg in enumerate(old_regions) if contains(reg, box)]
            for receiver in (r for r, reg in enumerate(new_regions) if contains(reg, box)):
                requests.append((m.name, box, owners, receiver, numel(box) * m.itemsize))
    load = [0] * old_world
    transfers = []
    for name, box, owners, receiver, nbytes in sorted(requests, key=lambda q: -q[4]):
        sender = min(owners, key=lambda o: (-link(o, receiver), load[o], o))
        local = math.isinf(link(sender, receiver))
        if not local:
            load[sender] += nbytes
        transfers.append(Transfer(name, box, sender, receiver, nbytes, local))
    received = [0] * new_world
    for t in transfers:
        if not t.local:
            received[t.receiver] += t.nbytes
    return ReshardTable(transfers, old_world, new_world, load, received)
