"""Exact dropout (engine/model/dropout.py): a sharded dropout draws the mask of single-device dropout.

In-process, no process group: m simulated devices each run their block of every rule that can
shard a dropout input (Full, Shard on each dim, uneven sizes, 2 and 3 devices); the blocks put
together must equal the eager single-device call under `SiteKeyedDropout`, bit for bit for
dropout and to float64 rounding for attention dropout. Capture numbers the sites in forward
order, pruned ones included, so an eager forward and the captured graph draw the same masks.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import cluster_dict
from test_ecosystem import interpret

import engine
from engine.cluster.spec import Cluster
from engine.errors import UnsupportedOpError
from engine.model.capture import LossOf, _to_graph, export_program
from engine.model.dropout import RngKey, SiteKeyedDropout, keep_mask, uniform
from engine.model.graph import Graph, Node
from engine.model.ops import run_node
from engine.options import PlanOptions
from engine.spmd.cost import CostModel
from engine.theory import FULL, PARTIAL, op_rules
from engine.theory.check import split_sizes

KEY = RngKey(seed=7, step=3)
WORLDS = [[0.6, 0.4], [0.5, 0.3, 0.2]]


def one_node(op: str, operands: list[tuple[int, ...]], shape: tuple[int, ...], attrs: dict) -> tuple[Node, Graph]:
    leaves = [Node(id=i, name=f"in{i}", op="placeholder", inputs=(), shape=s, dtype="float64")
              for i, s in enumerate(operands)]
    node = Node(id=len(leaves), name=op, op=op, inputs=tuple(range(len(leaves))), shape=shape, dtype="float64", attrs=attrs)
    return node, Graph(nodes=tuple(leaves) + (node,), loss=node.id)


def run_sharded(node: Node, graph: Graph, inputs: list[torch.Tensor], forms: tuple[int, ...], out_form: int,
                ratios: list[float]) -> torch.Tensor:
    """Every simulated device runs its block (uneven sizes from the plan's rounding); the blocks, put together."""
    dims = {f for f in forms if f >= 0} | ({out_form} if out_form >= 0 else set())
    assert len(dims) <= 1
    if not dims:
        outs = [run_node(node, graph, inputs, node.shape, rng=KEY) for _ in ratios]
        assert all(torch.equal(o, outs[0]) for o in outs), "Full: every device holds the whole result"
        return outs[0]
    d = dims.pop()
    sizes = split_sizes(node.shape[d], ratios)
    assert len(set(sizes)) > 1, f"sizes {sizes} should be uneven"
    outs, start = [], 0
    for size in sizes:
        local = [x.narrow(f, start, size) if f >= 0 else x for x, f in zip(inputs, forms)]
        offsets = [start if f >= 0 else 0 for f in forms]
        shape = list(node.shape)
        shape[d] = size
        outs.append(run_node(node, graph, local, shape, offsets, rng=KEY, out_offset=start))
        start += size
    return torch.cat(outs, dim=out_form)


@pytest.mark.parametrize("ratios", WORLDS, ids=["2-devices", "3-devices"])
@pytest.mark.parametrize("shape", [(10, 7), (7, 5, 6)])
def test_every_dropout_rule_draws_the_single_device_mask(shape, ratios):
    node, graph = one_node("dropout", [shape], shape, {"p": 0.4, "train": True, "rng_site": 0})
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with SiteKeyedDropout(KEY):
        single = F.dropout(x, 0.4)  # the first dropout call of a forward: site 0
    assert 0 < int((single == 0).sum()) < x.numel(), "the mask drops some elements and keeps others"
    rules = op_rules(node, graph)
    assert {r.inputs for r in rules} == {(FULL,)} | {(d,) for d in range(len(shape))}, "Full and Shard on each dim"
    for r in rules:
        assert torch.equal(run_sharded(node, graph, [x], r.inputs, r.output, ratios), single), str(r)


def test_dropout_has_no_partial_rule():
    node, graph = one_node("dropout", [(6, 4)], (6, 4), {"p": 0.1, "train": True, "rng_site": 0})
    assert all(PARTIAL not in r.inputs and r.output != PARTIAL for r in op_rules(node, graph))


SDPA_CASES = {
    "bidirectional": ((7, 5, 6, 4), (7, 5, 9, 4), False, None),
    "additive-mask": ((7, 5, 6, 4), (7, 5, 9, 4), False, (7, 1, 6, 9)),
    "causal": ((7, 5, 6, 4), (7, 5, 6, 4), True, None),
}


@pytest.mark.parametrize("ratios", WORLDS, ids=["2-devices", "3-devices"])
@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_every_attention_dropout_rule_draws_the_single_device_mask(case, ratios):
    q_shape, kv_shape, causal, mask_shape = SDPA_CASES[case]
    gen = torch.Generator().manual_seed(2)
    operands = [q_shape, kv_shape, kv_shape] + ([mask_shape] if mask_shape else [])
    inputs = [torch.randn(s, dtype=torch.float64, generator=gen) for s in operands]
    attrs = {"is_causal": causal, "scale": None, "dropout_p": 0.3, "rng_site": 1}
    node, graph = one_node("sdpa", operands, q_shape, attrs)
    with SiteKeyedDropout(KEY):
        F.dropout(torch.ones(3), 0.5)  # site 0
        single = F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if mask_shape else None,
                                                dropout_p=0.3, is_causal=causal)  # site 1
    plain = F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if mask_shape else None, is_causal=causal)
    assert float((single - plain).abs().max()) > 1e-3, "attention dropout changes the result"
    rules = op_rules(node, graph)
    names = {r.name for r in rules}
    assert {"replicate", "batch", "heads"} <= names and ("queries" in names) == (not causal)
    for r in rules:
        out = run_sharded(node, graph, inputs, r.inputs, r.output, ratios)
        assert float((out - single).abs().max()) < 1e-12, str(r)


def test_masks_are_keyed_by_seed_step_and_site_and_keep_one_minus_p():
    shape = (200, 300)
    base = keep_mask(0.25, KEY, 0, shape, (0, 0), shape)
    assert abs(float(base.float().mean()) - 0.75) < 0.01
    u = uniform(KEY, 0, shape, (0, 0), shape)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert torch.equal(base, keep_mask(0.25, RngKey(7, 3), 0, shape, (0, 0), shape)), "a pure function of its key"
    for other in (keep_mask(0.25, RngKey(8, 3), 0, shape, (0, 0), shape), keep_mask(0.25, RngKey(7, 4), 0, shape, (0, 0), shape),
                  keep_mask(0.25, KEY, 1, shape, (0, 0), shape)):
        agree = float((other == base).float().mean())
        assert 0.55 < agree < 0.70, f"masks of other keys are independent (agree {agree:.3f}, expect ~0.625)"


def test_a_block_of_the_mask_is_the_block_of_the_global_mask():
    shape = (6, 5, 9)
    whole = keep_mask(0.5, KEY, 2, shape, (0, 0, 0), shape)
    assert torch.equal(keep_mask(0.5, KEY, 2, shape, (0, 1, 0), (6, 3, 9)), whole[:, 1:4])
    assert torch.equal(keep_mask(0.5, KEY, 2, shape, (4, 0, 0), (2, 5, 9)), whole[4:])
    assert keep_mask(0.5, KEY, 2, shape, (6, 0, 0), (0, 5, 9)).shape == (0, 5, 9), "a device may hold no row"


class Dropouts(nn.Module):
    """Three kinds of dropout site, one pruned (its result is unused) and one in eval mode (no site)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.off = nn.Dropout(0.3).eval()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        unused = F.dropout(x, 0.5)  # site 0: pruned, still counted
        del unused
        h = self.off(self.drop(self.fc(x)))  # site 1; eval-mode dropout is no site
        q = h.view(4, 3, 2, 4).transpose(1, 2)  # (B, nh, T, hs)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25)  # site 2
        return F.mse_loss(F.dropout(a, 0.1).transpose(1, 2).reshape(4, 3, 8), y)  # site 3


def dropouts_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)


def dropouts_graph(decompose: bool) -> tuple[Graph, nn.Module]:
    torch.manual_seed(0)
    module = Dropouts()
    ep = export_program(LossOf(module), (), dict(zip("xy", dropouts_inputs())))
    if decompose:  # dropout as native_dropout, as run_decompositions leaves it
        ep = ep.run_decompositions({})
    return _to_graph(ep, name="dropouts", origin={}), module


@pytest.mark.parametrize("decompose", [False, True], ids=["aten.dropout", "aten.native_dropout"])
def test_capture_numbers_sites_in_forward_order_as_the_eager_forward_meets_them(decompose):
    graph, module = dropouts_graph(decompose)
    sites = [(n.op, n.attrs["rng_site"]) for n in graph.nodes if "rng_site" in n.attrs]
    assert sites == [("dropout", 1), ("sdpa", 2), ("dropout", 3)], "site 0 is pruned but keeps its number"
    if not decompose:  # (run_decompositions turns it into a clone)
        assert any(n.op == "dropout" and not n.attrs["train"] for n in graph.nodes), "the eval-mode dropout has no site"
    key = RngKey(5, 1)
    with SiteKeyedDropout(key) as mode:
        eager = module(*dropouts_inputs())
    assert mode.sites == 4
    assert abs(float(interpret(graph, module, dropouts_inputs(), key)) - float(eager)) < 1e-6 * abs(float(eager))
    with SiteKeyedDropout(RngKey(5, 2)):
        assert abs(float(module(*dropouts_inputs())) - float(eager)) > 1e-4, "another step draws other masks"


class FeatureDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout1d(self.fc(x), 0.5).sum()


@pytest.mark.parametrize("fallback", [None, "replicate"])
def test_random_operators_without_exact_masks_are_refused_even_with_the_fallback(fallback):
    with pytest.raises(UnsupportedOpError, match="feature_dropout.*random operator"):
        engine.load_model(FeatureDropout(), (torch.randn(4, 6, 6),), fallback=fallback)


def test_attention_dropout_keeps_its_probabilities_in_the_memory_estimate():
    plain, graph0 = one_node("sdpa", [(4, 2, 8, 4)] * 3, (4, 2, 8, 4), {"is_causal": False, "scale": None})
    drop, graph1 = one_node("sdpa", [(4, 2, 8, 4)] * 3, (4, 2, 8, 4),
                            {"is_causal": False, "scale": None, "dropout_p": 0.1, "rng_site": 0})
    cluster = Cluster.from_dict(cluster_dict([1e10, 1e10]))
    leaf_params = [Node(id=i, name=f"w{i}", op="parameter", inputs=(), shape=(4, 2, 8, 4), dtype="float64") for i in range(3)]
    mems = []
    for node in (plain, drop):
        g = Graph(nodes=tuple(leaf_params) + (node,), loss=3)
        mems.append(CostModel(g, cluster, [0.5, 0.5], PlanOptions(optimizer="sgd")).compute_delta(3, True)[2][2])
    probs = 4 * 2 * 8 * 8
    assert mems[1] - mems[0] == probs * (2 * 8 + 1), "float64 probabilities before and after dropout, a boolean mask"


def test_the_reference_mode_refuses_dropout_variants_that_would_draw_without_a_site_mask():
    x = torch.randn(2, 3, 4)
    with SiteKeyedDropout(KEY) as mode:
        assert torch.equal(F.dropout1d(x, 0.5, training=False), x) and torch.equal(F.alpha_dropout(x, 0.5), x)
        with pytest.raises(NotImplementedError, match="dropout1d has no site-keyed mask"):
            F.dropout1d(x, 0.5)
        assert torch.equal(F.dropout(x, 0.5, training=False), x) and torch.equal(F.dropout(x, 0.0), x)
    assert mode.sites == 0, "eval-mode and p = 0 dropout are no sites"


def test_a_dropout_site_counts_the_hashing_of_its_mask_in_its_flops():
    from engine.model.dropout import MASK_OPS_PER_ELEMENT

    graph, _ = dropouts_graph(decompose=False)
    site = next(n for n in graph.nodes if n.op == "dropout" and "rng_site" in n.attrs)
    off = next(n for n in graph.nodes if n.op == "dropout" and "rng_site" not in n.attrs)
    assert site.flops == site.numel * (1 + MASK_OPS_PER_ELEMENT) and off.flops == off.numel
    sdpa = next(n for n in graph.nodes if n.op == "sdpa")
    weights = 4 * 2 * 3 * 3  # (B, nh, T, T)
    assert sdpa.flops == 4 * 2 * (4.0 * 3 * 3 * 4 + 5.0 * 3 * 3) + weights * (1 + MASK_OPS_PER_ELEMENT)


def test_attention_dropout_gives_a_query_with_no_visible_key_zeros_as_torch_does():
    from engine.model.dropout import attention_dropout

    q = torch.randn(2, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    visible = torch.ones(4, 4, dtype=torch.bool)
    visible[1] = False  # query 1 sees no key (a padded position)
    want = F.scaled_dot_product_attention(q, q, q, attn_mask=visible)
    same = attention_dropout(q, q, q, visible, False, None, 0.0, KEY, 0, (2, 2, 4, 4), (0, 0, 0, 0))
    assert float((same - want).abs().max()) < 1e-12
    dropped = attention_dropout(q, q, q, visible, False, None, 0.5, KEY, 0, (2, 2, 4, 4), (0, 0, 0, 0))
    assert torch.equal(dropped[:, :, 1], torch.zeros(2, 2, 8, dtype=torch.float64))
    dropped.sum().backward()
    assert bool(torch.isfinite(q.grad).all()), "no NaN reaches the gradients"


@pytest.mark.parametrize("ratios", WORLDS, ids=["2-devices", "3-devices"])
def test_grouped_query_attention_dropout_draws_the_single_device_mask(ratios):
    """With `enable_gqa` the probabilities have the query heads (key heads repeated): full and batch-split runs."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, dtype=torch.float64, generator=gen) for s in [(5, 4, 6, 8), (5, 2, 7, 8), (5, 2, 7, 8)])
    node, graph = one_node("sdpa", [q.shape, k.shape, v.shape], tuple(q.shape),
                           {"is_causal": False, "scale": None, "dropout_p": 0.3, "rng_site": 0, "enable_gqa": True})
    with SiteKeyedDropout(KEY):
        single = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)
    for forms in [(FULL, FULL, FULL), (0, 0, 0)]:
        out = run_sharded(node, graph, [q, k, v], forms, forms[0], ratios)
        assert float((out - single).abs().max()) < 1e-12, forms


@pytest.mark.parametrize("name, dropout", [("GPT2LMHeadModel", {}), ("LlamaForCausalLM", {"attention_dropout": 0.2})])
def test_a_transformers_decoder_with_dropout_on_computes_its_loss_with_the_same_masks(name, dropout):
    """GPT-2 at its default dropout (embeddings, residuals, attention inside sdpa with its padding
    mask), Llama with attention dropout and GQA: the captured graph, node by node, gives the model's
    own loss when the eager forward draws the site-keyed masks of the same step."""
    pytest.importorskip("transformers")
    from test_capture_decoders import batch, build

    torch.manual_seed(0)
    model, inputs = build(name, "cpu", **dropout), batch("cpu")
    g = engine.load_model(model, inputs)
    assert any(n.op == "sdpa" and "rng_site" in n.attrs for n in g.nodes)
    by_index = {n.attrs["index"]: inputs[n.attrs["name"]] for n in g.placeholders}
    got = interpret(g, model, tuple(by_index.get(i) for i in range(max(by_index) + 1)))  # run_node's key: RngKey(0, 0)
    with SiteKeyedDropout(RngKey(0, 0)):
        want = model(**inputs).loss
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    without = model.eval()(**inputs).loss  # eval mode: no dropout
    assert abs(float(want) - float(without)) > 1e-4, "the masks change the loss"


def test_the_reference_keys_the_attention_dropout_inside_nn_multihead_attention():
    """nn.TransformerEncoderLayer's attention runs in `F.multi_head_attention_forward`, a Python
    composite that reaches the mode as one call (torch turns the mode off inside it): its attention
    dropout must still draw the site-keyed mask and take its site number, else the reference draws
    torch's own mask there and every later site is shifted by one (hap run --verify failed on the
    transformer_classifier of the coverage bench)."""
    from engine.model.zoo import ecosystem

    model, inputs = ecosystem.build("transformer_classifier", "cpu")
    g = engine.load_model(model, inputs)
    sites = sorted(n.attrs["rng_site"] for n in g.nodes if "rng_site" in n.attrs)
    assert any(n.op == "sdpa" and "rng_site" in n.attrs for n in g.nodes)
    by_index = {n.attrs["index"]: inputs[n.attrs["name"]] for n in g.placeholders}
    got = interpret(g, model, tuple(by_index[i] for i in range(max(by_index) + 1)), KEY)
    losses = []
    for seed in (0, 1):  # torch's global RNG must not matter: every mask is keyed
        torch.manual_seed(seed)
        with SiteKeyedDropout(KEY) as mode:
            losses.append(model(**inputs).detach())
        assert mode.sites == sites[-1] + 1 == len(sites)
    assert float(losses[0]) == float(losses[1])
    assert torch.allclose(got, losses[0], rtol=1e-5, atol=1e-6)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention, "the functional module is restored"


class Jitter(nn.Module):
    """A mixture-of-experts router's jitter: input noise on [0.9, 1.1) and a rand_like refilled by uniform_ (PhiMoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.empty_like(x).uniform_(0.9, 1.1)  # site 0
        coin = torch.rand_like(x).uniform_() > 0.75  # sites 1 (pruned: uniform_ overwrites it) and 2
        return (self.fc(x) * coin).sum()


def assert_eager_draws_like_the_graph(build, graph, x: torch.Tensor, sites: int) -> None:
    """The eager forward under SiteKeyedDropout draws `sites` sites and gives the captured graph's loss."""
    torch.manual_seed(0)
    module = build()
    with SiteKeyedDropout(KEY) as mode:
        eager = module(x)
    assert mode.sites == sites
    assert abs(float(interpret(graph, module, (x,), KEY)) - float(eager)) < 1e-5 * abs(float(eager))


def test_uniform_draws_are_sites_whose_range_the_graph_keeps_and_the_eager_forward_draws_alike():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    graph = engine.load_model(Jitter(), (x,))
    draws = sorted((n.attrs["rng_site"], n.attrs.get("low"), n.attrs.get("high")) for n in graph.nodes if n.op == "rand")
    assert draws == [(0, 0.9, 1.1), (2, None, None)], draws
    assert_eager_draws_like_the_graph(Jitter, graph, x, sites=3)


@pytest.mark.parametrize("ratios", WORLDS, ids=["2-devices", "3-devices"])
def test_every_rule_of_a_ranged_draw_gives_the_single_device_numbers(ratios):
    node, graph = one_node("rand", [], (7, 5), {"rng_site": 4, "low": -2.0, "high": 3.0})
    with SiteKeyedDropout(KEY):
        single = torch.empty(7, 5, dtype=torch.float64)
        for _ in range(4):  # sites 0-3
            torch.rand(1)
        single.uniform_(-2.0, 3.0)  # site 4
    assert single.min() >= -2.0 and single.max() < 3.0 and single.min() < 0.0 < single.max()
    rules = op_rules(node, graph)
    assert {r.output for r in rules} == {FULL, 0, 1}
    for r in rules:
        assert torch.equal(run_sharded(node, graph, [], r.inputs, r.output, ratios), single), str(r)


class Rotations(nn.Module):
    """LSH attention's hashing in small: random rotations (randn) contracted with the vectors, an argmax bucket,
    plus a randn_like, a normal_ and a torch.normal that feed the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotations = torch.randn((6, 2), dtype=x.dtype)  # site 0
        buckets = torch.argmax(torch.einsum("bd,dr->br", x.detach(), rotations), dim=-1)
        h = self.fc(x) + torch.randn_like(x) + torch.empty_like(x).normal_(2.0, 0.5)  # sites 1, 2
        return (h * buckets[:, None]).sum() + torch.normal(1.0, 3.0, size=(2, 3)).sum()  # site 3


def test_normal_draws_are_sites_whose_mean_and_std_the_graph_keeps_and_the_eager_forward_draws_alike():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    graph = engine.load_model(Rotations(), (x,))
    draws = sorted((n.attrs["rng_site"], n.attrs.get("normal"), n.attrs.get("mean"), n.attrs.get("std"))
                   for n in graph.nodes if n.op == "rand")
    assert draws == [(0, True, None, None), (1, True, None, None), (2, True, 2.0, 0.5), (3, True, 1.0, 3.0)], draws
    assert_eager_draws_like_the_graph(Rotations, graph, x, sites=4)


def test_site_keyed_normal_numbers_look_normal():
    with SiteKeyedDropout(KEY):
        z = torch.randn(200_000, dtype=torch.float64)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1.0) < 0.01, (z.mean(), z.std())
    assert abs(float((z > 1.0).double().mean()) - 0.1587) < 0.005, "the tail of a standard normal"
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("ratios", WORLDS, ids=["2-devices", "3-devices"])
def test_every_rule_of_a_normal_draw_gives_the_single_device_numbers(ratios):
    node, graph = one_node("rand", [], (7, 5), {"rng_site": 2, "normal": True, "mean": -1.0, "std": 2.0})
    with SiteKeyedDropout(KEY):
        torch.rand(1), torch.rand(1)  # sites 0 and 1
        single = torch.empty(7, 5, dtype=torch.float64).normal_(-1.0, 2.0)  # site 2
    rules = op_rules(node, graph)
    assert {r.output for r in rules} == {FULL, 0, 1}
    for r in rules:
        assert torch.equal(run_sharded(node, graph, [], r.inputs, r.output, ratios), single), str(r)


def test_a_draw_with_its_own_generator_is_refused_naming_the_operator():
    class Seeded(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).sum()

    with pytest.raises(UnsupportedOpError, match="randn with its own generator"):
        engine.load_model(Seeded(), (torch.ones(2, 3),))


class LmLoss(nn.Module):
    """A causal language model's loss on its own ids (the labels), as one positional input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids).loss


def test_reformer_lsh_attention_captures_and_computes_the_eager_loss_with_the_sites_rotations():
    """LSH attention hashes by random rotations (`torch.randn` in forward): one normal site, whose numbers the
    graph and the eager forward under SiteKeyedDropout draw alike, so buckets, sorting and loss agree."""
    from transformers import ReformerConfig, ReformerModelWithLMHead

    config = ReformerConfig(attn_layers=["lsh"], hidden_size=16, num_attention_heads=2, attention_head_size=8,
                            feed_forward_size=16, axial_pos_embds=False, max_position_embeddings=16, vocab_size=20,
                            lsh_attn_chunk_length=4, num_buckets=4, num_hashes=2, is_decoder=True,
                            hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    module = LmLoss(ReformerModelWithLMHead(config).double().train())
    ids = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(1))
    graph = engine.load_model(module, (ids,), fallback="strict")
    assert [n.attrs for n in graph.nodes if n.op == "rand"] == [{"rng_site": 0, "normal": True}]
    with SiteKeyedDropout(KEY) as mode:
        want = module(ids)
    assert mode.sites == 1
    got = interpret(graph, module, (ids,), KEY)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got, want)
    with SiteKeyedDropout(RngKey(seed=7, step=4)):
        assert not torch.allclose(module(ids), want, rtol=1e-6), "another step hashes by other rotations"
