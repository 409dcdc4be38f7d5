"""Collectives forward and backward on 2-4 gloo processes with uneven sizes, against one process.

Each rank feeds its input through the collective, backpropagates `sum(y * G_rank)` and returns
its output and input gradient. The reference runs the same semantics on all ranks' tensors in one
process (cat / sum / split) under autograd. Gradient forms follow DESIGN "semantics to keep
exact": a Partial or Shard input's gradient is complete on every rank; a Full input's gradient is
an addend (the ranks' gradients sum to the reference) unless the op all-reduces it (replicate).
"""
from __future__ import annotations

import pytest
import torch
from dist_harness import init_gloo, run_ranks

import runner.collectives as C

SHAPE = (2, 5, 3)
SIZES = {2: [3, 2], 3: [1, 3, 1], 4: [2, 0, 2, 1]}
"""Uneven shard sizes of dim 1 (5 = sum) per world size; the 4-rank case has an empty shard."""
OTHER = {2: [1, 1], 3: [1, 0, 1], 4: [0, 1, 1, 0]}
"""Sizes of dim 0 (2) for the all-to-all target."""
RESPLIT = {2: [1, 4], 3: [3, 0, 2], 4: [1, 2, 0, 2]}
"""New sizes of dim 1 after a segment boundary (the same total, other cuts)."""
OPS = ["all_reduce", "all_gather.padded", "all_gather.grouped", "reduce_scatter", "all_to_all", "slice", "replicate",
       "resplit"]


def _full(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _with_dim(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    s = list(shape)
    s[dim] = size
    return tuple(s)


def inputs(op: str, world: int) -> list[torch.Tensor]:
    """Each rank's input: an addend (Partial), a shard of dim 1, or the same Full tensor."""
    sizes = SIZES[world]
    if op in ("all_reduce", "reduce_scatter"):
        return [_full(100 + r) for r in range(world)]
    if op in ("slice", "replicate"):
        return [_full(100)] * world
    return list(torch.split(_full(100), sizes, dim=1))


def out_grads(op: str, world: int) -> list[torch.Tensor]:
    """The upstream gradient G_rank of each rank's output."""
    sizes, other = SIZES[world], OTHER[world]
    shapes = {"all_reduce": [SHAPE] * world, "all_gather.padded": [SHAPE] * world, "all_gather.grouped": [SHAPE] * world,
              "replicate": [SHAPE] * world,
              "reduce_scatter": [_with_dim(SHAPE, 1, s) for s in sizes],
              "slice": [_with_dim(SHAPE, 1, s) for s in sizes],
              "all_to_all": [_with_dim(SHAPE, 0, s) for s in other],
              "resplit": [_with_dim(SHAPE, 1, s) for s in RESPLIT[world]]}[op]
    return [_full(200 + r, shape) for r, shape in enumerate(shapes)]


def apply_distributed(op: str, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    sizes, other = SIZES[world], OTHER[world]
    if op == "all_reduce":
        return C.all_reduce(x)
    if op.startswith("all_gather"):
        return C.all_gather(x, 1, sizes, op.split(".")[1])
    if op == "reduce_scatter":
        return C.reduce_scatter(x, 1, sizes)
    if op == "all_to_all":
        return C.all_to_all(x, 1, 0, sizes, other)
    if op == "slice":
        return C.local_slice(x, 1, sizes, rank)
    if op == "resplit":
        return C.resplit(x, 1, sizes, RESPLIT[world])
    return C.replicate(x)


def apply_reference(op: str, xs: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """What every rank must hold, computed in one process from all ranks' inputs."""
    sizes, other = SIZES[world], OTHER[world]
    if op == "all_reduce":
        return [sum(xs)] * world
    if op.startswith("all_gather"):
        return [torch.cat(xs, 1)] * world
    if op == "reduce_scatter":
        return list(torch.split(sum(xs), sizes, 1))
    if op == "all_to_all":
        return list(torch.split(torch.cat(xs, 1), other, 0))
    if op == "slice":
        return list(torch.split(xs[0], sizes, 1))
    if op == "resplit":
        return list(torch.split(torch.cat(xs, 1), RESPLIT[world], 1))
    return [xs[0]] * world


def rank_body(rank: int, world: int, init_method: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    init_gloo(rank, world, init_method)
    out = {}
    for op in OPS:
        x = inputs(op, world)[rank].clone().requires_grad_(True)
        y = apply_distributed(op, x, rank, world)
        (y * out_grads(op, world)[rank]).sum().backward()
        out[op] = (y.detach(), x.grad.detach())
    return out


def reference(op: str, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs per rank, and the gradient each rank must hold (the sum over ranks for `slice`)."""
    if op in ("slice", "replicate"):
        shared = inputs(op, world)[0].clone().requires_grad_(True)
        xs = [shared] * world
    else:
        xs = [t.clone().requires_grad_(True) for t in inputs(op, world)]
    ys = apply_reference(op, xs, world)
    sum((y * g).sum() for y, g in zip(ys, out_grads(op, world))).backward()
    grads = [shared.grad] * world if op in ("slice", "replicate") else [x.grad for x in xs]
    return [y.detach() for y in ys], grads


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_single_process_forward_and_backward(world, tmp_path):
    results = run_ranks(rank_body, world, tmp_path)
    for op in OPS:
        ys, grads = reference(op, world)
        got_y = [r[op][0] for r in results]
        got_g = [r[op][1] for r in results]
        for rank in range(world):
            torch.testing.assert_close(got_y[rank], ys[rank], rtol=1e-6, atol=1e-6, msg=f"{op} forward, rank {rank}")
        if op == "slice":  # a Full input's gradients are addends of the true gradient
            torch.testing.assert_close(sum(got_g), grads[0], rtol=1e-6, atol=1e-6, msg="slice backward")
        else:
            for rank in range(world):
                torch.testing.assert_close(got_g[rank], grads[rank], rtol=1e-6, atol=1e-6, msg=f"{op} backward, rank {rank}")



def test_gather_into_falls_back_to_the_pre_2_13_name():
    """torch 2.11 (the GPU images) has no `all_gather_single`: the runner then uses the old name,
    so an all-gather never dies with an AttributeError on an older torch."""
    from types import SimpleNamespace

    def old(*a, **k):
        return "old"

    def new(*a, **k):
        return "new"

    assert C.gather_into_fn(SimpleNamespace(all_gather_into_tensor=old)) is old
    assert C.gather_into_fn(SimpleNamespace(all_gather_into_tensor=old, all_gather_single=new)) is new


def test_a_flat_buffer_builds_every_step_s_bucket_in_the_same_tensor():
    """Gradient buckets are concatenated into one tensor kept across steps (as DDP keeps its buckets),
    reallocated only when the bucket's size or dtype changes."""
    from runner.collectives import FlatBuffer

    buffer, grads = FlatBuffer(), [torch.randn(3, 4), torch.randn(5)]
    first = buffer.cat(grads)
    assert torch.equal(first, torch.cat([g.reshape(-1) for g in grads]))
    again = buffer.cat([g * 2 for g in grads])
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, 2 * torch.cat([g.reshape(-1) for g in grads]))
    assert buffer.cat([torch.ones(2)]).numel() == 2 and buffer.data.data_ptr() != first.data_ptr()
    assert buffer.cat([torch.ones(2), torch.ones(1, dtype=torch.float64)]).dtype == torch.float64


def test_a_flat_bucket_scatters_back_into_its_tensors_and_leaves_what_follows():
    """`FlatBuffer.scatter` is `cat`'s inverse for the gradients, whatever their shapes; a bucket that
    also carries the loss (the overlap's last bucket) has one more element, left to its own tensor."""
    grads = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = torch.cat([C.FlatBuffer().cat(grads) * 2, torch.tensor([7.0])])
    out = [torch.zeros_like(g) for g in grads]
    loss = torch.zeros(())
    C.FlatBuffer.scatter(flat, out + [loss])
    for g, o in zip(grads, out):
        assert torch.equal(o, g * 2)
    assert loss.item() == 7.0
    partial = [torch.zeros_like(g) for g in grads]
    C.FlatBuffer.scatter(flat, partial)  # the loss element stays in the bucket
    assert all(torch.equal(p, g * 2) for p, g in zip(partial, grads))
