"""Tests of engine.spmd.saved: the activations counted in memory per device are those autograd keeps
for backward, each in the form its saving instruction receives it (issue 26, item 5)."""
from __future__ import annotations

from conftest import build_graph, cluster_dict

from engine.cluster.spec import Cluster
from engine.spmd.cost import CostModel
from engine.spmd.saved import saves_by_node
from engine.theory.core import FULL, PARTIAL

B, T, H = 4, 8, 16
CLUSTER = Cluster.from_dict(cluster_dict([1e12, 1e12]))


def rotary_graph():
    """q = x W; q2 = q * cos + cat(-q[..., H/2:], q[..., :H/2]) * sin (a Llama's rotate_half); mse_loss(q2, y)."""
    half = H // 2
    return build_graph([
        ("x", "placeholder", (), (B, T, H)),
        ("w", "parameter", (), (H, H)),
        ("q", "linear", (0, 1), (B, T, H), 2 * B * T * H * H),
        ("cos", "buffer", (), (T, H)),
        ("sin", "buffer", (), (T, H)),
        ("qc", "mul", (2, 3), (B, T, H), B * T * H),
        ("lo", "narrow", (2,), (B, T, half), 0.0, {"dim": 2, "start": 0, "end": half, "step": 1}),
        ("hi", "narrow", (2,), (B, T, half), 0.0, {"dim": 2, "start": half, "end": H, "step": 1}),
        ("neg", "neg", (7,), (B, T, half), B * T * half),
        ("rot", "cat", (8, 6), (B, T, H), 0.0, {"dim": 2}),
        ("rs", "mul", (9, 4), (B, T, H), B * T * H),
        ("q2", "add", (5, 10), (B, T, H), B * T * H),
        ("y", "placeholder", (), (B, T, H)),
        ("loss", "mse_loss", (11, 12), (), 3 * B * T * H, {"count": B * T * H}),
    ], name="hand_rotary")


def test_a_rotary_chain_keeps_nothing_but_what_its_loss_saves():
    g = rotary_graph()
    cm = CostModel(g, CLUSTER, [0.5, 0.5])
    kept = {g[n].name: sum(b for _, b in s) for n, s in enumerate(cm.saves) if s}
    # a product with a table that needs no gradient keeps the table (a leaf), not q; narrow, neg,
    # cat and add keep nothing; x is the batch (a leaf)
    assert kept == {"loss": g[11].nbytes}


def test_an_instruction_on_partial_sums_keeps_nothing_it_does_not_save():
    g = rotary_graph()
    cm = CostModel(g, CLUSTER, [0.5, 0.5])
    for n in (5, 6, 8, 9, 10, 11):  # the chain run on the Partial sums of a row-parallel q
        forms = tuple(FULL if g[i].is_leaf else PARTIAL for i in g[n].inputs)
        assert cm.compute_delta(n, False, forms=(forms, PARTIAL))[2] == (0.0,) * 5, g[n].name


def fan_out_graph():
    """h = x W1; three projections of h (q, k, v); their sum's mse: h is saved by all three, kept once."""
    return build_graph([
        ("x", "placeholder", (), (B, H)),
        ("w1", "parameter", (), (H, H)),
        ("h", "linear", (0, 1), (B, H)),
        ("wq", "parameter", (), (H, H)),
        ("q", "linear", (2, 3), (B, H)),
        ("wk", "parameter", (), (H, H)),
        ("k", "linear", (2, 5), (B, H)),
        ("wv", "parameter", (), (H, H)),
        ("v", "linear", (2, 7), (B, H)),
        ("qk", "add", (4, 6), (B, H)),
        ("s", "add", (9, 8), (B, H)),
        ("y", "placeholder", (), (B, H)),
        ("loss", "mse_loss", (10, 11), (), 0.0, {"count": B * H}),
    ], name="hand_fan_out")


def test_a_tensor_saved_by_several_instructions_is_kept_once_in_the_form_they_receive():
    g = fan_out_graph()
    cm = CostModel(g, CLUSTER, [0.5, 0.5])
    h = g[2].nbytes
    column = [cm.activation_memory(n, (FULL, 0), 1) for n in (4, 6, 8)]  # h all-gathered, weights split by rows
    assert sum(m[3] for m in column) == h and not any(m[2] for m in column), "one Full copy on every device"
    batch = [cm.activation_memory(n, (0, FULL), 0) for n in (4, 6, 8)]
    assert sum(m[2] for m in batch) == h and not any(m[3] for m in batch), "one shard of it"


def test_a_saved_view_keeps_its_base_once():
    g = build_graph([
        ("x", "placeholder", (), (B, H)),
        ("w", "parameter", (), (3 * H, H)),
        ("qkv", "linear", (0, 1), (B, 3 * H)),
        ("q", "narrow", (2,), (B, H), 0.0, {"dim": 1, "start": 0, "end": H, "step": 1}),
        ("k", "narrow", (2,), (B, H), 0.0, {"dim": 1, "start": H, "end": 2 * H, "step": 1}),
        ("qk", "mul", (3, 4), (B, H)),
        ("loss", "sum", (5,), (), 0.0, {"dims": [0, 1], "keepdim": False}),
    ])
    saves = saves_by_node(g, CostModel(g, CLUSTER, [0.5, 0.5]).requires_grad)
    assert [(i, b) for i, b in saves[5]] == [(0, g[2].nbytes / 2), (1, g[2].nbytes / 2)], "q and k alias qkv"
    assert sum(b for s in saves for _, b in s) == g[2].nbytes

