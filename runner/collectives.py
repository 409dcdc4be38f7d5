"""Collectives as autograd Functions whose backward is the exact dual (DESIGN: semantics to keep exact).

| forward                         | backward                          |
|---------------------------------|-----------------------------------|
| all_reduce          P -> F      | all_reduce                        |
| reduce_scatter(d)   P -> S(d)   | all_gather(d)                     |
| all_gather(d)       S(d) -> F   | reduce_scatter(d)                 |
| all_to_all(a -> b)  S(a)->S(b)  | all_to_all(b -> a)                |
| resplit(d)          S(d)->S(d)  | resplit back (segment boundary)   |
| slice(d)            F -> S(d)   | zero padding (free)               |
| replicate           F -> F      | all_reduce (a Full parameter)     |
| all_reduce.hier     P -> F      | all_reduce.hier                   |
| all_gather.hier(d)  S(d) -> F   | reduce_scatter.hier(d)            |
| reduce_scatter.hier P -> S(d)   | all_gather.hier(d)                |

Shards are uneven: `sizes[j]` is device j's size along the sharded dim. gloo cannot all-gather
uneven tensors, so `all_gather` pads every shard to the largest, gathers, and trims ("padded"),
or runs one broadcast per device ("grouped"). NCCL takes the same paths: only equal-size buffers
reach the backend.

The `.hier` collectives (`engine.cluster.hierarchy`) take `machines`, the ranks of every machine (M
machines of k ranks), and run on sub-groups: each machine's ranks, and the peers (the r-th rank
of every machine). Shards are padded to the largest, as in `gather_padded`. The sub-groups are
made on first use, by every rank in the same order (all ranks run the same collectives in the
same order, so the first use is reached by all of them).
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def gather_into_fn(d=dist):
    """All-gather into one tensor: `all_gather_single` from torch 2.13 on (which deprecates the old
    name), `all_gather_into_tensor` before it (GPU images still ship torch 2.11)."""
    return getattr(d, "all_gather_single", None) or d.all_gather_into_tensor


_gather_into = gather_into_fn()

_observer = None
"""Who is told when communication starts and ends (a `runner.timing.Pacer`), or None."""
_stream = threading.local()
"""Per thread: the process group its collectives go on and its own observer (duplex runs two
half-batch streams as two threads of one rank, each on its own group, see runner.duplex)."""


def set_observer(observer) -> None:
    """Route every collective (forward and backward) through `observer.comm(name, tag)`; None to stop."""
    global _observer
    _observer = observer


@contextlib.contextmanager
def stream(group, observer=None) -> Iterator[None]:
    """Inside: this thread's collectives go on `group` (None: the default group) and report to
    `observer` (None: the process-wide one). A backend orders collectives per group, so two
    threads of a rank can communicate at once only on groups of their own."""
    saved = getattr(_stream, "group", None), getattr(_stream, "observer", None)
    _stream.group, _stream.observer = group, observer
    try:
        yield
    finally:
        _stream.group, _stream.observer = saved


def capture_stream(ctx) -> None:
    """Remember on an autograd `ctx` the stream its forward ran on: its backward must use the same
    group, and on CUDA the autograd engine runs backward on a thread of its own."""
    ctx.stream = current_group(), getattr(_stream, "observer", None)


def current_observer():
    """This thread's own observer (a duplex stream's pacer), or None."""
    return getattr(_stream, "observer", None)


def current_group():
    """The process group of this thread's collectives (None: the default group)."""
    return getattr(_stream, "group", None)


def group_rank() -> int:
    """This rank's index in the current group: shard sizes list the group's ranks in order (a
    pipeline stage's group numbers its ranks from 0; on the default group it is the global rank)."""
    return dist.get_rank(current_group())


def run_collective(name: str, tag: str, fn, *args):
    """`fn(*args)` as communication `name` (`observed`)."""
    with observed(name, tag, args):
        return fn(*args)


def observed(name: str, tag: str, args: tuple = ()) -> contextlib.AbstractContextManager:
    """What runs inside is communication `name` for this thread's observer (a `runner.timing.Pacer`: it
    pays the emulated time of the computation before it and times it as comm); nothing without one."""
    observer = getattr(_stream, "observer", None) or _observer
    return contextlib.nullcontext() if observer is None else observer.comm(name, tag, args)


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _pad_to(x: Tensor, dim: int, size: int) -> Tensor:
    if x.shape[dim] == size:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()


def gather_padded(x: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    """Concatenate uneven shards along `dim` on every rank: pad to the max, all_gather_into_tensor, trim."""
    top = max(sizes)
    padded = _pad_to(x, dim, top).movedim(dim, 0).contiguous()
    out = padded.new_empty((len(sizes) * top,) + tuple(padded.shape[1:]))
    _gather_into(out, padded, group=current_group())
    parts = [out[j * top: j * top + s] for j, s in enumerate(sizes)]
    return torch.cat(parts, dim=0).movedim(0, dim).contiguous()


def gather_grouped(x: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    """Concatenate uneven shards with one broadcast per rank (no padding; HAP §2.5.1)."""
    rank = group_rank()
    parts = []
    for j, s in enumerate(sizes):
        shape = list(x.shape)
        shape[dim] = s
        buf = x.contiguous() if j == rank else x.new_empty(shape)
        if s > 0:
            dist.broadcast(buf, group=current_group(), group_src=j)
        parts.append(buf)
    return torch.cat(parts, dim=dim)


def reduce_scatter_uneven(x: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    """Sum `x` over ranks and keep this rank's slice along `dim` (list reduce_scatter takes uneven sizes)."""
    chunks = [c.contiguous() for c in torch.split(x, list(sizes), dim=dim)]
    out = torch.empty_like(chunks[group_rank()])
    dist.reduce_scatter(out, chunks, group=current_group())
    return out


def all_to_all_uneven(x: Tensor, src_dim: int, dst_dim: int, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> Tensor:
    """Re-shard from `src_dim` to `dst_dim` with one all_to_all_single over flattened pieces."""
    rank = group_rank()
    send = [c.contiguous() for c in torch.split(x, list(dst_sizes), dim=dst_dim)]
    recv_shapes = []
    for j in range(len(src_sizes)):
        shape = list(x.shape)
        shape[src_dim], shape[dst_dim] = src_sizes[j], dst_sizes[rank]
        recv_shapes.append(shape)
    recv_numel = [int(torch.Size(s).numel()) for s in recv_shapes]
    flat_in = torch.cat([c.reshape(-1) for c in send])
    flat_out = flat_in.new_empty(sum(recv_numel))
    dist.all_to_all_single(flat_out, flat_in, output_split_sizes=recv_numel, input_split_sizes=[c.numel() for c in send],
                           group=current_group())
    pieces = [p.reshape(s) for p, s in zip(torch.split(flat_out, recv_numel), recv_shapes)]
    return torch.cat(pieces, dim=src_dim)


def resplit_uneven(x: Tensor, dim: int, src_sizes: Sequence[int], dst_sizes: Sequence[int]) -> Tensor:
    """Move a Shard(dim) tensor from one segment's sizes to another's (HAP §5.2): every rank sends
    each other rank the rows where its old range meets their new one, in one all_to_all_single."""
    rank = group_rank()
    src_off, dst_off = _offsets(src_sizes), _offsets(dst_sizes)

    def overlap(i: int, j: int) -> int:  # rows of old shard i that belong to new shard j
        return max(0, min(src_off[i] + src_sizes[i], dst_off[j] + dst_sizes[j]) - max(src_off[i], dst_off[j]))

    m = len(src_sizes)
    rows = x.movedim(dim, 0).contiguous()
    row_numel = math.prod(rows.shape[1:])
    send = [overlap(rank, j) * row_numel for j in range(m)]
    recv = [overlap(i, rank) * row_numel for i in range(m)]
    out = rows.new_empty((dst_sizes[rank], *rows.shape[1:]))
    dist.all_to_all_single(out.view(-1), rows.view(-1), output_split_sizes=recv, input_split_sizes=send,
                           group=current_group())
    return out.movedim(0, dim)


class AllReduce(torch.autograd.Function):
    """Partial -> Full; the gradient of a Full output is partial, so backward all-reduces too."""

    @staticmethod
    def forward(ctx, x: Tensor, tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.tag = tag
        return run_collective("all_reduce", tag, all_reduce_copy, x)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("all_reduce", ctx.tag, all_reduce_copy, g), None


def all_reduce_copy(x: Tensor) -> Tensor:
    """The sum over ranks of `x` in a fresh tensor (the input is left alone: autograd may still need it)."""
    y = x.contiguous().clone()
    dist.all_reduce(y, group=current_group())
    return y


class AllGather(torch.autograd.Function):
    """Shard(d) -> Full (padded or grouped); backward reduce-scatters the partial gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, sizes: list[int], impl: str, tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.dim, ctx.sizes, ctx.tag = dim, sizes, tag
        gather = gather_grouped if impl == "grouped" else gather_padded
        return run_collective(f"all_gather.{impl}", tag, gather, x, dim, sizes)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("reduce_scatter", ctx.tag, reduce_scatter_uneven, g, ctx.dim, ctx.sizes), None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """Partial -> Shard(d); backward all-gathers (each rank's slice gradient is complete)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, sizes: list[int], tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.dim, ctx.sizes, ctx.tag = dim, sizes, tag
        return run_collective("reduce_scatter", tag, reduce_scatter_uneven, x, dim, sizes)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("all_gather.padded", ctx.tag, gather_padded, g, ctx.dim, ctx.sizes), None, None, None


class AllToAll(torch.autograd.Function):
    """Shard(a) -> Shard(b); backward runs the reverse re-shard."""

    @staticmethod
    def forward(ctx, x: Tensor, src: int, dst: int, src_sizes: list[int], dst_sizes: list[int], tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.args, ctx.tag = (dst, src, dst_sizes, src_sizes), tag
        return run_collective("all_to_all", tag, all_to_all_uneven, x, src, dst, src_sizes, dst_sizes)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("all_to_all", ctx.tag, all_to_all_uneven, g, *ctx.args), None, None, None, None, None


class Resplit(torch.autograd.Function):
    """Shard(d) with one segment's sizes -> Shard(d) with the next segment's; backward moves back."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, src_sizes: list[int], dst_sizes: list[int], tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.args, ctx.tag = (dim, dst_sizes, src_sizes), tag
        return run_collective("resplit", tag, resplit_uneven, x, dim, src_sizes, dst_sizes)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("resplit", ctx.tag, resplit_uneven, g, *ctx.args), None, None, None, None


class Replicate(torch.autograd.Function):
    """A Full parameter's use: identity forward; its gradient on each device is an addend (partial),
    so backward all-reduces it. The training loop applies the same all-reduce to all Full
    parameters at once (`all_reduce_coalesced`) instead of one call per parameter."""

    @staticmethod
    def forward(ctx, x: Tensor, tag: str) -> Tensor:
        capture_stream(ctx)
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        with stream(*ctx.stream):
            return run_collective("all_reduce", ctx.tag, all_reduce_copy, g), None


def local_slice(x: Tensor, dim: int, sizes: Sequence[int], rank: int) -> Tensor:
    """Full -> Shard(d) for free; autograd's backward of narrow is the zero padding."""
    return x.narrow(dim, _offsets(sizes)[rank], sizes[rank])


Machines = tuple[tuple[int, ...], ...]
"""Global ranks of every machine, each in ascending order (`engine.cluster.hierarchy.machine_groups`)."""


@dataclass(frozen=True)
class Levels:
    """This rank's two sub-groups of a machine layout, and where every rank sits in them."""

    machine_group: object
    """Process group of this rank's machine (group rank l = the l-th rank of the machine)."""
    peer_group: object
    """Process group of the ranks that hold this rank's local index on every machine (group rank q =
    the q-th of them in ascending order)."""
    local: int
    """This rank's index in its machine."""
    place: dict[int, tuple[int, int]]
    """Global rank -> (index in its machine l, position in its peer group q)."""
    members: tuple[int, ...]
    """Ranks of this rank's machine."""
    peers: tuple[int, ...]
    """Ranks of this rank's peer group, ascending."""


_levels: dict[tuple, Levels] = {}


def levels_of(machines: Machines) -> Levels:
    """This rank's sub-groups for `machines`, made (by every rank, in one order) on first use."""
    key = (id(dist.group.WORLD), machines)
    if key not in _levels:
        rank = dist.get_rank()
        peer_lists = [tuple(sorted(p)) for p in zip(*machines)]
        made = {}
        for group in [*machines, *peer_lists]:  # every rank creates every group, in the same order
            made[group] = dist.new_group(list(group))
        place = {j: (m.index(j), p.index(j)) for m in machines for j in m for p in peer_lists if j in p}
        mine = next(m for m in machines if rank in m)
        peers = next(p for p in peer_lists if rank in p)
        _levels[key] = Levels(made[mine], made[peers], mine.index(rank), place, mine, peers)
    return _levels[key]


def _rows(x: Tensor, dim: int, top: int) -> Tensor:
    """`x` with `dim` moved first and padded to `top` rows."""
    return _pad_to(x.movedim(dim, 0), 0, top)


def gather_hier(x: Tensor, dim: int, sizes: Sequence[int], machines: Machines) -> Tensor:
    """Shard(dim) -> Full in two steps: all-gather across the peers, then inside the machine."""
    lv, top = levels_of(machines), max(sizes)
    mine = _rows(x, dim, top)
    rest = tuple(mine.shape[1:])
    across = mine.new_empty((len(lv.peers) * top,) + rest)
    _gather_into(across, mine, group=lv.peer_group)
    inside = across.new_empty((len(lv.members) * len(lv.peers) * top,) + rest)
    _gather_into(inside, across, group=lv.machine_group)
    inside = inside.view((len(lv.members), len(lv.peers), top) + rest)
    parts = [inside[lv.place[j][0], lv.place[j][1], :s] for j, s in enumerate(sizes)]
    return torch.cat(parts, dim=0).movedim(0, dim).contiguous()


def reduce_scatter_hier(x: Tensor, dim: int, sizes: Sequence[int], machines: Machines) -> Tensor:
    """Partial -> Shard(dim) in two steps: reduce-scatter inside the machine (each member gets its
    peers' slices), then across the peers (each gets its own)."""
    lv, top = levels_of(machines), max(sizes)
    slices = [_rows(c, dim, top) for c in torch.split(x, list(sizes), dim=dim)]
    blocks = [torch.stack([torch.zeros_like(slices[0])] * len(lv.peers)) for _ in lv.members]
    for j, piece in enumerate(slices):
        blocks[lv.place[j][0]][lv.place[j][1]] = piece
    across = torch.empty_like(blocks[0])
    dist.reduce_scatter(across, blocks, group=lv.machine_group)
    mine = torch.empty_like(across[0])
    dist.reduce_scatter(mine, [c.contiguous() for c in across], group=lv.peer_group)
    return mine[:sizes[dist.get_rank()]].movedim(0, dim).contiguous()


def all_reduce_hier(x: Tensor, machines: Machines) -> Tensor:
    """Partial -> Full in three steps: reduce-scatter inside the machine, all-reduce each piece
    across the peers, all-gather inside the machine (a fresh tensor, as `all_reduce_copy`)."""
    lv = levels_of(machines)
    k = len(lv.members)
    flat = x.contiguous().reshape(-1)
    per = -(-flat.numel() // k)
    pieces = list(_pad_to(flat, 0, per * k).view(k, per).clone().unbind(0))
    piece = torch.empty_like(pieces[0])
    dist.reduce_scatter(piece, pieces, group=lv.machine_group)
    dist.all_reduce(piece, group=lv.peer_group)
    out = piece.new_empty(per * k)
    _gather_into(out, piece, group=lv.machine_group)
    return out[:flat.numel()].view_as(x)


class AllReduceHier(torch.autograd.Function):
    """Partial -> Full over machines and peers; the gradient of a Full output is partial: the same backward."""

    @staticmethod
    def forward(ctx, x: Tensor, machines: Machines, tag: str) -> Tensor:
        ctx.machines, ctx.tag = machines, tag
        return run_collective("all_reduce.hier", tag, all_reduce_hier, x, machines)

    @staticmethod
    def backward(ctx, g: Tensor):
        return run_collective("all_reduce.hier", ctx.tag, all_reduce_hier, g, ctx.machines), None, None


class AllGatherHier(torch.autograd.Function):
    """Shard(d) -> Full over peers and machines; backward reduce-scatters hierarchically."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, sizes: list[int], machines: Machines, tag: str) -> Tensor:
        ctx.args, ctx.tag = (dim, sizes, machines), tag
        return run_collective("all_gather.hier", tag, gather_hier, x, dim, sizes, machines)

    @staticmethod
    def backward(ctx, g: Tensor):
        return run_collective("reduce_scatter.hier", ctx.tag, reduce_scatter_hier, g, *ctx.args), None, None, None, None


class ReduceScatterHier(torch.autograd.Function):
    """Partial -> Shard(d) over machines and peers; backward all-gathers hierarchically."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, sizes: list[int], machines: Machines, tag: str) -> Tensor:
        ctx.args, ctx.tag = (dim, sizes, machines), tag
        return run_collective("reduce_scatter.hier", tag, reduce_scatter_hier, x, dim, sizes, machines)

    @staticmethod
    def backward(ctx, g: Tensor):
        return run_collective("all_gather.hier", ctx.tag, gather_hier, g, *ctx.args), None, None, None, None


def all_reduce(x: Tensor, tag: str = "") -> Tensor:
    return AllReduce.apply(x, tag)


def replicate(x: Tensor, tag: str = "") -> Tensor:
    return Replicate.apply(x, tag)


def all_gather(x: Tensor, dim: int, sizes: list[int], impl: str = "padded", tag: str = "") -> Tensor:
    return AllGather.apply(x, dim, sizes, impl, tag)


def reduce_scatter(x: Tensor, dim: int, sizes: list[int], tag: str = "") -> Tensor:
    return ReduceScatter.apply(x, dim, sizes, tag)


def all_reduce_hierarchical(x: Tensor, machines: Machines, tag: str = "") -> Tensor:
    return AllReduceHier.apply(x, machines, tag)


def all_gather_hierarchical(x: Tensor, dim: int, sizes: list[int], machines: Machines, tag: str = "") -> Tensor:
    return AllGatherHier.apply(x, dim, sizes, machines, tag)


def reduce_scatter_hierarchical(x: Tensor, dim: int, sizes: list[int], machines: Machines, tag: str = "") -> Tensor:
    return ReduceScatterHier.apply(x, dim, sizes, machines, tag)


def all_to_all(x: Tensor, src: int, dst: int, src_sizes: list[int], dst_sizes: list[int], tag: str = "") -> Tensor:
    return AllToAll.apply(x, src, dst, src_sizes, dst_sizes, tag)


def resplit(x: Tensor, dim: int, src_sizes: list[int], dst_sizes: list[int], tag: str = "") -> Tensor:
    return Resplit.apply(x, dim, src_sizes, dst_sizes, tag)


class FlatBuffer:
    """One flat tensor kept from step to step to concatenate gradients into, as DDP keeps its buckets:
    a fresh multi-MiB tensor every step costs the device an allocation (on a CPU, page faults that
    took as long as the copy itself)."""

    def __init__(self) -> None:
        self.data: Tensor | None = None

    def cat(self, tensors: list[Tensor], dtype: torch.dtype | None = None) -> Tensor:
        """The tensors flattened end to end, in the kept tensor (reallocated when the size or dtype changes),
        cast to `dtype` when given (a bf16 gradient bucket)."""
        n = sum(t.numel() for t in tensors)
        dtype = dtype or functools.reduce(torch.promote_types, (t.dtype for t in tensors))
        d = self.data
        if d is None or d.numel() != n or d.dtype != dtype or d.device != tensors[0].device:
            d = self.data = torch.empty(n, dtype=dtype, device=tensors[0].device)
        return torch.cat([t.reshape(-1) for t in tensors], out=d)

    @staticmethod
    def scatter(flat: Tensor, tensors: list[Tensor]) -> None:
        """Copy a flat bucket back into `tensors`, end to end (the inverse of `cat`); `flat` may hold
        more after them (a bucket that also carries the loss)."""
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_coalesced(tensors: list[Tensor], tag: str = "gradients", buffer: FlatBuffer | None = None,
                         dtype: torch.dtype | None = None) -> None:
    """Sum `tensors` over ranks in place with one flat all-reduce (DDP's bucket, one bucket), built
    in `buffer` when the caller keeps one across steps, in `dtype` when given (cast in, summed, cast
    back: the plan's grad_dtype bf16, `runner.precision`)."""
    if not tensors:
        return
    flat = (buffer or FlatBuffer()).cat(tensors, dtype)
    run_collective("all_reduce", tag, dist.all_reduce, flat, dist.ReduceOp.SUM, current_group())
    FlatBuffer.scatter(flat, tensors)
