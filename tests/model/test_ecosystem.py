"""Models people bring (issue 5): transformers models built from a config, and operators with no
rule (one error listing all of them, or the replicate fallback that runs them unsharded)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import cluster_dict, sample_path
from test_cli import assert_one_line_error

import engine
from engine.errors import ModelError, UnsupportedOpError
from engine.model.dropout import RngKey, SiteKeyedDropout
from engine.model.graph import Graph
from engine.model.ops import run_node
from engine.theory import op_rules


class Unruly(nn.Module):
    """A model with three operators the theory has no rule for: cumprod, logcumsumexp and cummax (two outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cumprod(self.fc1(x), dim=1)
        h = torch.logcumsumexp(h, dim=1)
        h = torch.cummax(h, dim=-1).values
        return nn.functional.mse_loss(self.fc2(h), y)


def unruly_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)


@functools.cache
def unruly_graph() -> Graph:
    torch.manual_seed(0)
    return engine.load_model(Unruly(), unruly_inputs(), fallback="replicate")


def interpret(graph: Graph, module: nn.Module, inputs: tuple[torch.Tensor, ...], key: RngKey = RngKey(0, 0)) -> torch.Tensor:
    """Run a graph node by node on full tensors (parameters and buffers taken from `module`; dropout
    masks keyed by `key`)."""
    state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    values: list[torch.Tensor] = []
    for n in graph.nodes:
        if n.op == "placeholder":
            values.append(inputs[n.attrs["index"]])
        elif n.is_leaf:
            values.append(state[n.attrs["target"]])
        else:
            values.append(run_node(n, graph, [values[i] for i in n.inputs], n.shape, rng=key))
    return values[graph.loss]


def assert_lowered_like_torch(graph: Graph, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                              wrt: list[torch.Tensor], *, checked: tuple[str, ...] | None = None,
                              rtol: float = 1e-5, atol: float = 1e-6, grad_rtol: float | None = None) -> None:
    """A lowering's contract: the rules of every compute node (or of the ops in `checked`) hold on uneven
    shards (engine.theory.check), and the graph computes torch's loss and its gradients by `wrt`."""
    from engine.theory.check import check_node

    for n in graph.nodes:
        if not n.is_leaf and (checked is None or n.op in checked):
            bad = [str(r) for r in check_node(n, graph, [0.5, 0.3, 0.2]) if not r.ok]
            assert not bad, (n.name, bad)
    got, want = interpret(graph, module, inputs), module(*inputs)
    assert torch.allclose(got, want, rtol=rtol, atol=atol)
    grads = [torch.autograd.grad(v, wrt) for v in (got, want)]
    assert all(torch.allclose(a, b, rtol=grad_rtol or rtol, atol=atol) for a, b in zip(*grads))


def test_every_unsupported_operator_is_listed_at_once_with_node_and_source() -> None:
    with pytest.raises(UnsupportedOpError) as info:
        engine.load_model(Unruly(), unruly_inputs())
    msg = str(info.value)
    assert msg.startswith("3 unsupported operator(s)") and "fallback='replicate'" in msg
    for op in ("aten.cumprod", "aten.logcumsumexp", "aten.cummax"):
        assert op in msg, msg
    assert "at node 'cumprod'" in msg and "test_ecosystem.py" in msg and "in forward" in msg
    assert "\n" not in msg


def test_replicate_fallback_keeps_unsupported_ops_as_opaque_full_nodes() -> None:
    g = unruly_graph()
    opaque = [n for n in g.nodes if n.op == "opaque"]
    assert sorted(n.attrs["target"].split(".")[0] for n in opaque) == ["aten::cummax", "aten::cumprod", "aten::logcumsumexp"]
    for n in opaque:
        assert [str(r) for r in op_rules(n, g)] == ["{" + ", ".join("F" for _ in n.inputs) + "} replicate {F}"]
        assert n.flops >= n.numel, "an opaque op costs at least a touch per element"
    assert Graph.from_dict(g.to_dict()) == g, "attrs are plain JSON"


def test_opaque_nodes_compute_what_the_module_computes() -> None:
    g = Graph.from_dict(g_dict := unruly_graph().to_dict())
    assert "torch" not in str(g_dict["nodes"]).replace("torch.", "")  # no pickled objects, names only
    torch.manual_seed(0)
    module = Unruly()
    inputs = unruly_inputs()
    assert torch.allclose(interpret(g, module, inputs), module(*inputs), rtol=1e-6, atol=1e-7)


def test_a_model_with_opaque_ops_plans_and_runs_them_unsharded() -> None:
    plan = engine.plan(unruly_graph(), engine.load_cluster(cluster_dict([2e10, 1e10])), optimizer="sgd")
    rules = {plan.graph[i.node].op: i.rule for i in plan.program if i.kind == "compute"}
    assert rules["opaque"] == "replicate"


def test_unknown_fallback_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="fallback 'shard'"):
        engine.load_model(Unruly(), unruly_inputs(), fallback="shard")


# ------------------------------------------------------------------------------------- transformers

def _hf_bert(meta: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=12, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.BertForMaskedLM(cfg)


def test_transformers_model_on_meta_with_keyword_inputs_loss_from_its_loss_field() -> None:
    ids, labels = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    g = engine.load_model(_hf_bert(), {"input_ids": ids.to("meta"), "labels": labels.to("meta")})
    assert g[g.loss].op == "cross_entropy" and g[g.loss].shape == ()
    assert {n.attrs["name"] for n in g.placeholders} == {"input_ids", "labels"}
    assert {n.attrs["target"] for n in g.nodes if n.op == "buffer"} >= {"bert.embeddings.position_ids"}
    assert not any(n.op == "opaque" for n in g.nodes), "BERT needs no fallback"
    assert g.num_parameters > 0 and g.name == "BertForMaskedLM"


def test_transformers_graph_computes_the_models_loss() -> None:
    """Buffers (position ids), slicing, the mask arithmetic and the lookups, run node by node."""
    torch.manual_seed(0)
    model = _hf_bert(meta=False)
    ids, labels = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    g = engine.load_model(model, {"input_ids": ids, "labels": labels})
    expected = model(input_ids=ids, labels=labels).loss
    assert torch.allclose(interpret(g, model, (ids, labels)), expected, rtol=1e-5)


def test_transformers_model_with_positional_inputs_plans() -> None:
    pytest.importorskip("transformers")
    from engine.model.zoo import hf

    cfg = hf.HFConfig(layers=1, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, batch=6)
    with torch.device("meta"):
        module = hf.build_bert(cfg)
    g = engine.load_model(module, hf.example_inputs(cfg, "meta"))
    plan = engine.plan(g, engine.load_cluster(cluster_dict([2e10, 1e10])), optimizer="sgd")
    assert plan.predicted_time_s > 0 and {n.attrs["index"] for n in g.placeholders} == {0, 1}


def test_cli_captures_gpt2_mask_code_without_the_fallback_and_plans_it(capsys, tmp_path) -> None:
    """GPT-2's mask code (diff, index, new_ones, cumsum, comparisons) has rules: no opaque node."""
    pytest.importorskip("transformers")
    from engine.cli import main

    args = ["capture", "--model", "zoo:hf_gpt2", "--set", "layers=1", "--set", "hidden=16", "--set", "heads=2",
            "--set", "ffn=32", "--set", "vocab=40", "--set", "seq_len=8", "--set", "batch=4"]
    assert main([*args, "--out", str(tmp_path / "g.json")]) == 0
    g = Graph.load(tmp_path / "g.json")
    assert not any(n.op == "opaque" for n in g.nodes) and {"index", "full", "cumsum"} <= {n.op for n in g.nodes}
    capsys.readouterr()
    assert main(["plan", "--model", str(tmp_path / "g.json"), "--cluster", sample_path("cpu_2")]) == 0


class StarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fc(xs[0]).pow(2).mean()


def test_positional_inputs_keep_forwards_names_or_stay_positional_for_star_args() -> None:
    g = engine.load_model(StarArgs(), (torch.randn(4, 3),))
    assert [n.attrs["index"] for n in g.placeholders] == [0] and g.name == "StarArgs"


class CoreOps(nn.Module):
    """Operators of issue 29's list that now lower: stack (interleaved rotary), baddbmm (ALiBi scores),
    softplus (Mamba), clamp / hardtanh / ReLU6 (MobileNetV2)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=0.5, alpha=0.25)  # ALiBi-style
        mixed = torch.stack([q, F.softplus(k, beta=2.0, threshold=1.0)], dim=-1).flatten(-2)  # interleaved
        h = F.hardtanh(mixed, -0.5, 0.75) + F.relu6(mixed) + torch.clamp(mixed, min=-0.1) + mixed.clamp(max=0.2)
        return (self.out(h) * scores.softmax(-1).sum(-1, keepdim=True)).square().mean()


def test_stack_baddbmm_softplus_and_clamps_lower_to_ruled_operators_that_compute_the_same() -> None:
    torch.manual_seed(0)
    module = CoreOps().double()
    inputs = (torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 1, 5, dtype=torch.float64))
    graph = engine.load_model(module, inputs, fallback="strict")
    assert {"clamp", "softplus", "cat", "matmul"} <= {n.op for n in graph.nodes}
    assert all(op_rules(n, graph) for n in graph.nodes if not n.is_leaf)
    assert torch.allclose(interpret(graph, module, inputs), module(*inputs), rtol=1e-12, atol=1e-12)


class CoreAten(nn.Module):
    """Core ATen operators of issue 29, item 1, in one forward: pointwise, nonlinear reductions, rounded
    division and bitwise ops on positions, repeat / index_select / flip, in-place writes to slices
    (copy + slice_scatter, select_scatter), reflect padding, group norm, interpolation, and stochastic depth (rand + floor, bernoulli_)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = torch.floor(h) + torch.ceil(h) + torch.round(h) + torch.sign(h) + torch.trunc(h) + torch.abs(h)
        b = torch.log1p(h.abs()) + torch.expm1(h) + torch.special.erf(h) + torch.atan2(h, h + 2) + h.reciprocal()
        c = torch.maximum(h, a) - torch.minimum(h, b) + torch.remainder(h, 1.5) + torch.fmod(h, 1.2) + 2 ** h
        d = F.elu(h) + F.leaky_relu(h, 0.2) + torch.clamp(h, min=torch.zeros_like(h), max=torch.ones_like(h))
        m = h.amax(-1, keepdim=True) + h.amin(-1, keepdim=True) + h.max(-1, keepdim=True).values + h.min(-1).values[..., None]
        v = h.var(-1, keepdim=True) + h.prod(-1, keepdim=True) + (h > 0).any(-1, keepdim=True) + h.argmax(-1, keepdim=True)
        v = v + (h < 3).all(-1, keepdim=True)
        p = (pos // 2) + torch.div(pos, 3, rounding_mode="trunc") + (pos & 1) + (pos ^ 3) + (~pos)
        e = h.repeat(1, 2, 1)[:, :5] + torch.index_select(h, 1, pos[0] % 5) + torch.flip(h, [1])
        e = e + torch.sort(h, dim=-1, descending=True).values
        y = h.clone()
        y[:, :, 2:4] = y[:, :, 2:4] * 2  # DeepSeek-V3's in-place rotary on a slice of the head dim
        y[:, 1] = 0.5
        q = F.pad(h.transpose(1, 2), (1, 1), mode="reflect")[..., 1:-1].transpose(1, 2) + F.group_norm(h, 5)
        q = q + F.interpolate(h[:, None], size=(5, 6), mode="bilinear")[:, 0] + F.interpolate(h, scale_factor=1.0)
        out = a + b + c + d + m + v + p[..., None] + e + y + q
        keep = torch.floor(torch.rand((h.shape[0], 1, 1), dtype=h.dtype) + 0.7)  # Swin's drop path
        mask = torch.empty_like(h).bernoulli_(0.8) * torch.bernoulli(torch.sigmoid(h).detach())
        return (out.div(0.7) * keep * mask).pow(2).mean()


def test_core_aten_operators_lower_to_ruled_operators_that_compute_the_same() -> None:
    """Captured without any fallback, every node has rules, and the graph computes the eager loss with
    the same site-keyed random numbers (three draws: rand, bernoulli_, bernoulli)."""
    torch.manual_seed(0)
    module = CoreAten().double()
    inputs = (torch.randn(3, 5, 6, dtype=torch.float64), torch.randint(0, 9, (3, 5)))
    graph = engine.load_model(module, inputs, fallback="strict")
    ops = {n.op for n in graph.nodes}
    assert {"floor", "erf", "maximum", "amax", "var", "all", "div_floor", "bitwise_xor", "flip", "slice_scatter",
            "select_scatter", "sort_values", "rand", "pad", "topk_values", "index", "group_norm", "upsample"} <= ops, ops
    assert all(op_rules(n, graph) for n in graph.nodes if not n.is_leaf)
    key = RngKey(1, 2)
    with SiteKeyedDropout(key) as mode:
        want = module(*inputs)
    assert mode.sites == 3 == sum(n.op == "rand" for n in graph.nodes)
    assert torch.allclose(interpret(graph, module, inputs, key), want, rtol=1e-12, atol=1e-12)
