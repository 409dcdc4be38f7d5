"""Communication triples (engine/theory/collectives.py) simulated on m devices in one process.

Each collective is implemented here the way a device program would run it on uneven shards
(padding for the NCCL all-gather, one broadcast per shard for the grouped variant, ...), and the
table's precondition -> postcondition is checked numerically for every row `collectives_from`
yields. The backward duals are checked with torch autograd on the same simulation.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given

from engine.spmd.cost import DUAL
from engine.spmd.segments import RESPLIT
from engine.spmd.sizes import split_sizes as plan_split_sizes
from engine.theory import COLLECTIVES, FULL, PARTIAL, collectives_from
from engine.theory.check import split_sizes
from engine.theory.collectives import ALL_REDUCE, BY_KEY, Collective

from ._helpers import SETTINGS, ratios_st, seeds, shapes

Locals = list[torch.Tensor]

# --- the forms, as data on m devices ----------------------------------------------------------


def make_locals(full: torch.Tensor, form: int, ratios: list[float], gen: torch.Generator) -> Locals:
    """Per-device tensors satisfying `form` for the reference tensor `full`."""
    m = len(ratios)
    if form == FULL:
        return [full.clone() for _ in range(m)]
    if form == PARTIAL:
        parts = [torch.randn(full.shape, generator=gen, dtype=full.dtype) for _ in range(m - 1)]
        return parts + [full - sum(parts)]
    return list(torch.split(full, split_sizes(full.shape[form], ratios), dim=form))


def assert_form(full: torch.Tensor, locs: Locals, form: int, ratios: list[float]) -> None:
    """The per-device tensors satisfy `form` for `full`, with the shard sizes the ratios give."""
    if form == FULL:
        for t in locs:
            torch.testing.assert_close(t, full, rtol=0, atol=1e-12)
    elif form == PARTIAL:
        torch.testing.assert_close(sum(locs), full, rtol=0, atol=1e-12)
    else:
        sizes = split_sizes(full.shape[form], ratios)
        assert [t.shape[form] for t in locs] == sizes
        for t, want in zip(locs, torch.split(full, sizes, dim=form)):
            torch.testing.assert_close(t, want, rtol=0, atol=1e-12)


# --- the collectives, simulated ---------------------------------------------------------------


def all_reduce(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    total = sum(locs)
    return [total.clone() for _ in locs]


def reduce_scatter(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    total = sum(locs)
    return list(torch.split(total, split_sizes(total.shape[post], ratios), dim=post))


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    pad_shape = list(t.shape)
    pad_shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def all_gather_padded(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    """NCCL all-gather needs equal buffers: pad every shard to the largest, gather, then trim."""
    sizes = [t.shape[pre] for t in locs]
    big = max(sizes)
    gathered = torch.cat([_pad_to(t, pre, big) for t in locs], dim=pre)  # what every device receives
    pieces = [gathered.narrow(pre, j * big, s) for j, s in enumerate(sizes)]
    return [torch.cat(pieces, dim=pre) for _ in locs]


def all_gather_grouped(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    """One broadcast per shard (an NCCL group call): every device receives every shard as it is."""
    received = [[src.clone() for src in locs] for _ in locs]  # received[j][k]: shard k on device j
    return [torch.cat(r, dim=pre) for r in received]


def all_to_all(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    """Device k cuts its S(pre) shard along `post` and sends piece j to device j, which concatenates along `pre`."""
    sizes = split_sizes(locs[0].shape[post], ratios)  # dim `post` is whole on every device
    sent = [list(torch.split(t, sizes, dim=post)) for t in locs]  # sent[k][j]: from k to j
    return [torch.cat([sent[k][j] for k in range(len(locs))], dim=pre) for j in range(len(locs))]


def slice_(locs: Locals, ratios: list[float], pre: int, post: int) -> Locals:
    sizes = split_sizes(locs[0].shape[post], ratios)
    return [t.narrow(post, sum(sizes[:j]), sizes[j]) for j, t in enumerate(locs)]


SIMULATE: dict[str, Callable[[Locals, list[float], int, int], Locals]] = {
    "all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather.padded": all_gather_padded,
    "all_gather.grouped": all_gather_grouped, "all_to_all": all_to_all, "slice": slice_,
    # hierarchical implementations (engine.cluster.hierarchy) establish the same forms; the runner's sub-group
    # steps are checked numerically on 4 ranks in tests/runner/test_runner_hierarchical.py
    "all_reduce.hier": all_reduce, "reduce_scatter.hier": reduce_scatter, "all_gather.hier": all_gather_padded,
}

# --- the table, as written in the module docstring (HAP Fig. 9, §4.4) -------------------------


def table_rows(form: int, shape: tuple[int, ...]) -> set[tuple[str, int]]:
    shardable = [d for d, s in enumerate(shape) if s >= 2]
    if form == PARTIAL:
        return ({("all_reduce", FULL), ("all_reduce.hier", FULL)} | {("reduce_scatter", d) for d in shardable}
                | {("reduce_scatter.hier", d) for d in shardable})
    if form == FULL:
        return {("slice", d) for d in shardable}
    return ({("all_gather.padded", FULL), ("all_gather.grouped", FULL), ("all_gather.hier", FULL)}
            | {("all_to_all", d) for d in shardable if d != form})


def forms_of(shape: tuple[int, ...]) -> list[int]:
    return [FULL, PARTIAL] + [d for d, s in enumerate(shape) if s >= 2]


# --- tests ------------------------------------------------------------------------------------


def test_every_collective_has_a_simulation_and_a_dual() -> None:
    assert {c.key for c in COLLECTIVES} == set(SIMULATE) == set(BY_KEY)
    assert set(DUAL) == set(BY_KEY) | {RESPLIT}  # resplit: forced at segment boundaries, not a search choice
    assert DUAL[RESPLIT] == RESPLIT
    assert DUAL["all_reduce"] == "all_reduce"
    assert DUAL["reduce_scatter"] == "all_gather.padded" and DUAL["all_gather.padded"] == "reduce_scatter"
    assert DUAL["all_to_all"] == "all_to_all"
    assert DUAL["all_reduce.hier"] == "all_reduce.hier"
    assert DUAL["reduce_scatter.hier"] == "all_gather.hier" and DUAL["all_gather.hier"] == "reduce_scatter.hier"
    assert [c.key for c in COLLECTIVES if not c.is_communication] == ["slice"]
    assert Collective("all_gather", "padded").key == "all_gather.padded" and ALL_REDUCE.key == "all_reduce"


@pytest.mark.parametrize("shape", [(4, 6), (1, 5, 3), (2,), (1,), (3, 1, 2, 2)])
def test_collectives_from_yields_exactly_the_table(shape: tuple[int, ...]) -> None:
    for form in forms_of(shape):
        got = [(c.key, post) for c, post in collectives_from(form, shape)]
        assert len(got) == len(set(got)), f"duplicate rows from {form}: {got}"
        assert set(got) == table_rows(form, shape), f"pre {form} on {shape}"
        for c, post in collectives_from(form, shape):
            assert post != form, f"{c.key} must change the form"
            assert post in (FULL, PARTIAL) or shape[post] >= 2, "never shards a size-1 dim"


def test_table_pre_and_post_per_collective() -> None:
    """Each collective kind appears with the one pre/post pair of the table."""
    shape = (4, 6, 3)
    kinds: dict[str, set[tuple[str, str]]] = {}
    for form in forms_of(shape):
        for c, post in collectives_from(form, shape):
            kind = lambda f: {FULL: "F", PARTIAL: "P"}.get(f, "S")  # noqa: E731
            kinds.setdefault(c.key, set()).add((kind(form), kind(post)))
    assert kinds == {"all_reduce": {("P", "F")}, "reduce_scatter": {("P", "S")}, "all_gather.padded": {("S", "F")},
                     "all_gather.grouped": {("S", "F")}, "all_to_all": {("S", "S")}, "slice": {("F", "S")},
                     "all_reduce.hier": {("P", "F")}, "reduce_scatter.hier": {("P", "S")},
                     "all_gather.hier": {("S", "F")}}


@SETTINGS
@given(shape=shapes(1, 3, max_side=7), ratios=ratios_st, seed=seeds)
def test_every_row_establishes_its_postcondition(shape: tuple[int, ...], ratios: list[float], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    for pre in forms_of(shape):
        for c, post in collectives_from(pre, shape):
            locs = make_locals(full, pre, ratios, gen)
            assert_form(full, locs, pre, ratios)
            out = SIMULATE[c.key](locs, ratios, pre, post)
            assert len(out) == len(ratios)
            assert_form(full, out, post, ratios)


def test_padded_all_gather_really_pads_uneven_shards() -> None:
    full = torch.arange(10.0, dtype=torch.float64).reshape(10, 1)
    ratios = [0.6, 0.3, 0.1]
    sizes = split_sizes(10, ratios)
    assert sizes == [6, 3, 1] and sizes == plan_split_sizes(10, ratios)
    locs = make_locals(full, 0, ratios, torch.Generator())
    out = all_gather_padded(locs, ratios, 0, FULL)
    assert_form(full, out, FULL, ratios)
    # without trimming, the padded buffer holds m * max(sizes) rows, not the full tensor
    assert torch.cat([_pad_to(t, 0, max(sizes)) for t in locs]).shape[0] == 18


@pytest.mark.parametrize("ratios", [[0.5, 0.3, 0.2], [0.7, 0.1, 0.1, 0.1], [0.05, 0.95]])
def test_split_sizes_agree(ratios: list[float]) -> None:
    for total in range(0, 40):
        a = split_sizes(total, ratios)
        assert a == plan_split_sizes(total, ratios)
        assert sum(a) == total and all(s >= 0 for s in a)
        assert all(abs(s - total * r / sum(ratios)) < 1.0 for s, r in zip(a, ratios))


# --- backward duality, with autograd on the simulation ----------------------------------------


def _grads(inputs: Locals, outputs: Locals, out_grads: Locals) -> Locals:
    gs = torch.autograd.grad(outputs, inputs, grad_outputs=out_grads, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, gs)]


def _leaf_locals(full: torch.Tensor, form: int, ratios: list[float], gen: torch.Generator) -> Locals:
    return [t.detach().clone().requires_grad_(True) for t in make_locals(full, form, ratios, gen)]


def _output_grads(shape: tuple[int, ...], form: int, ratios: list[float], gen: torch.Generator) -> tuple[torch.Tensor, Locals]:
    """Gradients of a tensor in `form`: the gradient of a Full output is held as addends (Partial);
    the gradient of a Shard output is sharded alike."""
    g_full = torch.randn(shape, generator=gen, dtype=torch.float64)
    return g_full, make_locals(g_full, PARTIAL if form == FULL else form, ratios, gen)


@SETTINGS
@given(shape=shapes(1, 3, max_side=7), ratios=ratios_st, seed=seeds)
def test_backward_duals(shape: tuple[int, ...], ratios: list[float], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    for pre in forms_of(shape):
        for c, post in collectives_from(pre, shape):
            xs = _leaf_locals(full, pre, ratios, gen)
            ys = SIMULATE[c.key](xs, ratios, pre, post)
            g_full, gys = _output_grads(shape, post, ratios, gen)
            gxs = _grads(xs, ys, gys)
            if c.key in ("all_gather.padded", "all_gather.grouped", "all_gather.hier"):
                # S(d) -> F backward: reduce_scatter(d) of the addends (grouped: m reduces, same values)
                want = reduce_scatter(gys, ratios, PARTIAL, pre)
            elif c.key in ("reduce_scatter", "reduce_scatter.hier"):
                # P -> S(d) backward: all_gather(d) of the shard gradients, a Full gradient on every device
                want = all_gather_padded(gys, ratios, post, FULL)
            elif c.key in ("all_reduce", "all_reduce.hier"):
                want = all_reduce(gys, ratios, PARTIAL, FULL)  # P -> F backward: all_reduce of the addends
            elif c.key == "all_to_all":
                want = all_to_all(gys, ratios, post, pre)  # S(d1) -> S(d2) backward: all_to_all(d2 -> d1)
            else:
                assert c.key == "slice"
                # F -> S(d) backward: each device's gradient is its shard zero-padded: addends of the gradient
                want = []
                sizes = split_sizes(shape[post], ratios)
                for j, gy in enumerate(gys):
                    z = torch.zeros(shape, dtype=torch.float64)
                    z.narrow(post, sum(sizes[:j]), sizes[j]).copy_(gy)
                    want.append(z)
                torch.testing.assert_close(sum(gxs), g_full, rtol=0, atol=1e-12)
            for got, w in zip(gxs, want, strict=True):
                torch.testing.assert_close(got, w, rtol=0, atol=1e-12, msg=lambda s: f"{c.key} {pre}->{post}: {s}")
            # the dual takes the gradient back to the form of the input: sharded alike, or the full gradient
            if pre >= 0:
                assert_form(g_full, gxs, pre, ratios)
            elif pre == PARTIAL:
                assert_form(g_full, gxs, FULL, ratios)


def test_dual_table_names() -> None:
    """The cost model's duals follow the table and price what the runner runs: both all-gather
    implementations reduce-scatter their gradient in backward (runner.collectives.AllGather), and the
    hierarchical ones run hierarchical duals (runner.collectives.AllGatherHier, ...)."""
    assert DUAL == {"all_reduce": "all_reduce", "reduce_scatter": "all_gather.padded", "all_gather.padded": "reduce_scatter",
                    "all_gather.grouped": "reduce_scatter", "all_to_all": "all_to_all", "slice": "slice",
                    RESPLIT: RESPLIT, "all_reduce.hier": "all_reduce.hier", "all_gather.hier": "reduce_scatter.hier",
                    "reduce_scatter.hier": "all_gather.hier"}
