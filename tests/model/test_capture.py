"""Tests of engine.model.capture / engine.model.graph: zoo capture, the graph IR, JSON round trips, error messages."""
from __future__ import annotations

import functools
import json
import math
import re
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
from engine.errors import ModelError, UnsupportedOpError
from engine.model.graph import Graph, Node
from engine.model.zoo import ZOO, entry, make_config

GPT_SMALL = dict(layers=3, hidden=32, heads=4, ffn=64, vocab=50, seq_len=8, batch=4)
MLP_SMALL = dict(layers=3, in_features=8, hidden=16, classes=5, batch=6)


@functools.cache
def gpt() -> Graph:
    return engine.load_model("zoo:gpt", **GPT_SMALL)


@functools.cache
def mlp() -> Graph:
    return engine.load_model("zoo:mlp", **MLP_SMALL)


def meta_param_count(name: str, **knobs) -> int:
    cfg = make_config(name, **knobs)
    with torch.device("meta"):
        module = entry(name).build(cfg)
    return sum(p.numel() for p in module.parameters())


def _module_path(n: Node) -> str:
    return n.source.split(" ", 1)[0]


# --- zoo capture ------------------------------------------------------------------------------


def test_gpt_histogram() -> None:
    g, L = gpt(), GPT_SMALL["layers"]
    hist = g.op_histogram()
    assert hist["sdpa"] == L
    assert hist["layer_norm"] == 2 * L + 1
    assert hist["linear"] == 6 * L + 1  # q, k, v, proj, fc, fc_proj per block + the LM head
    assert hist["gelu"] == L and hist["embedding"] == 1 and hist["cross_entropy"] == 1
    assert hist["placeholder"] == 2
    loss = g[g.loss]
    assert loss.op == "cross_entropy" and loss.shape == () and g.loss == len(g) - 1
    count = g[loss.inputs[2]]  # the number of targets that are not ignore_index: the mean's divisor
    assert count.op == "sum" and count.shape == () and g[count.inputs[0]].op == "ne"
    assert g[count.inputs[0]].attrs["scalar"] == -100 and g[count.inputs[0]].inputs == (loss.inputs[1],)
    assert [p.dtype for p in g.placeholders] == ["int64", "int64"]
    assert [p.shape for p in g.placeholders] == [(4, 8), (4, 8)]
    assert g.origin == {"zoo": "gpt", "config": {**dataclass_defaults("gpt"), **GPT_SMALL}}


def dataclass_defaults(name: str) -> dict:
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(ZOO[name].config_cls)}


def test_mlp_histogram() -> None:
    g, L = mlp(), MLP_SMALL["layers"]
    hist = g.op_histogram()
    assert hist["linear"] == L + 1 and hist["relu"] == L and hist["add"] == L + 1  # biases are separate adds
    assert hist["cross_entropy"] == 1 and g[g.loss].op == "cross_entropy" and g[g.loss].shape == ()
    assert hist["parameter"] == 2 * (L + 1)


@pytest.mark.parametrize("name,knobs", [("gpt", GPT_SMALL), ("gpt", {**GPT_SMALL, "tie_weights": True}), ("mlp", MLP_SMALL)])
def test_parameter_count_matches_the_module(name: str, knobs: dict) -> None:
    g = engine.load_model(f"zoo:{name}", **knobs)
    assert g.num_parameters == meta_param_count(name, **knobs)
    assert all(p.dtype == "float32" for p in g.parameters)
    assert len({p.attrs["target"] for p in g.parameters}) == len(g.parameters)


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_linear_flops(model: str) -> None:
    g = gpt() if model == "gpt" else mlp()
    linears = [n for n in g.nodes if n.op == "linear"]
    assert linears
    for n in linears:
        x, w = g[n.inputs[0]], g[n.inputs[1]]
        tokens = math.prod(x.shape[:-1])
        out_f, in_f = w.shape
        assert x.shape[-1] == in_f and n.shape == x.shape[:-1] + (out_f,)
        assert n.flops == 2 * tokens * in_f * out_f, n.name
    assert g.flops == sum(n.flops for n in g.nodes) > 0


def test_gpt_segments_follow_blocks() -> None:
    g, L = gpt(), GPT_SMALL["layers"]
    assert g.num_segments == L
    seen = set()
    for n in g.nodes:
        where = n.attrs.get("target", "") if n.op == "parameter" else _module_path(n)
        m = re.match(r"blocks\.(\d+)\.", where + ".")
        if m:
            assert n.segment == int(m.group(1)), f"{n.name} ({where}) has segment {n.segment}"
            seen.add(int(m.group(1)))
    assert seen == set(range(L))
    # sdpa i belongs to block i
    assert [n.segment for n in g.nodes if n.op == "sdpa"] == list(range(L))


def test_mlp_segments_follow_layers() -> None:
    g = mlp()
    for n in g.nodes:
        if n.op == "parameter" and n.attrs["target"].startswith("layers."):
            assert n.segment == int(n.attrs["target"].split(".")[1])
        elif n.op == "linear" and _module_path(n).startswith("layers."):
            assert n.segment == int(_module_path(n).split(".")[1])


def test_sources_name_the_module_and_file() -> None:
    g = gpt()
    q = next(n for n in g.nodes if n.op == "linear")
    assert q.source.startswith("blocks.0.attn.q ") and "gpt.py" in q.source and "line" in q.source


# --- graph JSON -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_graph_json_round_trip(model: str, tmp_path: Path) -> None:
    g = gpt() if model == "gpt" else mlp()
    path = tmp_path / "g.json"
    g.save(path)
    back = Graph.load(path)
    assert back.to_dict() == g.to_dict()
    assert back == g
    assert back.fingerprint() == g.fingerprint()
    assert engine.load_model(str(path)).to_dict() == g.to_dict()
    assert Graph.from_dict(json.loads(g.to_json())).to_dict() == g.to_dict()


def test_fingerprint_is_stable_and_ignores_names() -> None:
    again = engine.load_model("zoo:gpt", **GPT_SMALL)
    assert again.fingerprint() == gpt().fingerprint()
    renamed = Graph(nodes=tuple(Node(**{**n.__dict__, "name": n.name + "_x", "source": ""}) for n in again.nodes),
                    loss=again.loss, name="other", origin={})
    assert renamed.fingerprint() == gpt().fingerprint()
    assert engine.load_model("zoo:gpt", **{**GPT_SMALL, "ffn": 96}).fingerprint() != gpt().fingerprint()


def test_graph_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as e:
        Graph.load(tmp_path / "nope.json")
    assert "not found" in str(e.value) and "nope.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ['{"kind": "hap.graph",\n oops}', "", "[1, 2", "not json at all"])
def test_graph_load_malformed_json(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ModelError) as e:
        Graph.load(path)
    msg = str(e.value)
    assert "bad.json" in msg and "not valid JSON" in msg and "\n" not in msg


def test_graph_load_non_utf8_file(tmp_path: Path) -> None:
    """A binary file given as a graph is malformed JSON too: a one-line ModelError, not UnicodeDecodeError."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\xff\xfe\x00\x80 not text")
    with pytest.raises(ModelError) as e:
        Graph.load(path)
    assert "weights.bin" in str(e.value) and "\n" not in str(e.value)


def test_graph_load_directory(tmp_path: Path) -> None:
    """A directory where a graph file is expected: a one-line ModelError, not IsADirectoryError."""
    with pytest.raises(ModelError) as e:
        Graph.load(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("doc,needle", [
    ([1, 2], "kind"),
    ({"kind": "hap.graph", "schema_version": 99, "nodes": [], "loss": 0}, "schema_version"),
    ({"kind": "hap.graph", "schema_version": 1, "nodes": [{"id": 0}], "loss": 0}, "nodes[0].name is missing"),
    ({"kind": "hap.graph", "schema_version": 1, "nodes": None, "loss": 0}, "nodes must be a list"),
    ({"kind": "hap.graph", "schema_version": 1, "nodes": [], "loss": 0}, "loss"),
    ({"kind": "hap.graph", "schema_version": 1, "loss": 0,
      "nodes": [{"id": 0, "name": "x", "op": "placeholder", "inputs": [], "shape": [2]}]}, "scalar"),
    ({"kind": "hap.graph", "schema_version": 1, "loss": 0,
      "nodes": [{"id": 0, "name": "x", "op": "relu", "inputs": [0], "shape": []}]}, "nodes[0].inputs[0] = 0 is not an earlier node"),
])
def test_graph_from_dict_rejects_bad_documents(tmp_path: Path, doc, needle: str) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ModelError) as e:
        Graph.load(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- custom modules ---------------------------------------------------------------------------


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def _check_two_layer(g: Graph) -> None:
    assert g.num_parameters == sum(p.numel() for p in TwoLayer().parameters())
    assert {p.name for p in g.placeholders} == {"x", "y"}
    hist = g.op_histogram()
    assert hist["linear"] == 2 and hist["add"] == 1 and hist["tanh"] == 1 and hist["cross_entropy"] == 1
    assert g[g.loss].op == "cross_entropy" and g[g.loss].attrs["ignore_index"] == -100 and len(g[g.loss].inputs) == 3
    assert g.name == "TwoLayer" and g.origin == {"module": "TwoLayer"}
    assert engine.theory.missing_rules(g) == []


def test_load_module_with_positional_inputs() -> None:
    g = engine.load_model(TwoLayer(), (torch.randn(5, 6), torch.randint(0, 3, (5,))))
    _check_two_layer(g)
    x, y = sorted(g.placeholders, key=lambda n: n.attrs["index"])
    assert (x.name, x.shape, x.dtype) == ("x", (5, 6), "float32") and (y.name, y.shape, y.dtype) == ("y", (5,), "int64")


def test_load_module_with_keyword_inputs() -> None:
    g = engine.load_model(TwoLayer(), {"y": torch.randint(0, 3, (5,)), "x": torch.randn(5, 6)})
    _check_two_layer(g)
    shapes = {p.name: p.shape for p in g.placeholders}
    assert shapes == {"x": (5, 6), "y": (5,)}


def test_load_module_on_meta_inputs() -> None:
    with torch.device("meta"):
        module = TwoLayer()
    g = engine.load_model(module, (torch.randn(5, 6, device="meta"), torch.zeros(5, dtype=torch.long, device="meta")))
    _check_two_layer(g)


class MSEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc(x), y)


def test_load_module_with_mse_loss() -> None:
    """F.mse_loss (and nn.MSELoss) is the canonical regression loss and has rules (`mse_loss`)."""
    g = engine.load_model(MSEModel(), (torch.randn(5, 4), torch.randn(5, 3)))
    loss = g[g.loss]
    assert loss.op == "mse_loss" and loss.shape == () and loss.attrs["count"] == 15


class CumsumInner(nn.Module):
    """A scan whose operator (cummax) has no rule (cumsum has one since the MoE gating needs it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(x, dim=1).values


class CumsumModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scan = CumsumInner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scan(self.fc(x)).sum()


def test_unsupported_op_names_op_node_and_location() -> None:
    with pytest.raises(UnsupportedOpError) as e:
        engine.load_model(CumsumModel(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert isinstance(e.value, ModelError)
    assert "aten.cummax" in msg
    assert "'cummax'" in msg  # the node
    assert "scan" in msg  # the module path
    assert "test_capture.py" in msg and "line" in msg  # the source location
    assert "\n" not in msg


class DataSplit(nn.Module):
    """JetMoE's expert split: pieces sized by counts read from tensor values (`.tolist()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.split((self.fc(x) > 0).long().sum(0).tolist(), dim=0)
        return parts[0].sum() + parts[1].mean()


def test_a_split_into_data_dependent_sizes_is_refused_at_the_models_line() -> None:
    with pytest.raises(UnsupportedOpError, match=r"aten.split_with_sizes with sizes read from tensor values .* "
                                                 r"at node 'split_with_sizes' .*test_capture.py.?, line \d+") as e:
        engine.load_model(DataSplit(), (torch.randn(6, 4),))
    assert "\n" not in str(e.value)


def test_arguments_a_lowering_cannot_read_refuse_the_operator_instead_of_escaping(monkeypatch) -> None:
    def unreadable(c):
        return int(c.fx)  # what a symbolic size where a number is expected gave (JetMoE before its own refusal)

    monkeypatch.setitem(engine.model.capture._SPLITS, "cummax", lambda c: [unreadable(c), None])
    with pytest.raises(UnsupportedOpError, match=r"aten.cummax with arguments capture cannot read \(TypeError: .*"
                                                 r"at node 'cummax' .*test_capture.py"):
        engine.load_model(CumsumModel(), (torch.randn(2, 4),))


class InPlaceResidual(nn.Module):
    """In-place residual adds and scaling next to a batch norm (whose running statistics update in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = self.bn(h)
        out += h  # aten.add_
        out.mul_(0.5)
        return torch.relu(out).mean()


def test_in_place_operators_are_functionalized() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, x = InPlaceResidual(), torch.randn(5, 6)
    g = engine.load_model(module, (x,))
    ops = [n.op for n in g.nodes if not n.is_leaf]
    assert ops == ["linear", "add", "batch_norm", "add", "mul", "relu", "mean"], ops
    assert g[g.loss].op == "mean", "the loss, not the batch norm's step counter (also a scalar output)"
    assert torch.allclose(interpret(g, module, (x,)), module(x), rtol=1e-6, atol=1e-7)


def test_programs_without_in_place_operators_keep_the_training_ir() -> None:
    """Functionalization re-traces the program (dropout would become native_dropout): only when needed."""
    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    ep = engine.model.capture.export_program(module, (torch.randn(3, 4),), {})
    assert engine.model.capture.functionalize(ep) is ep
    mutating = engine.model.capture.export_program(InPlaceResidual(), (torch.randn(3, 6),), {})
    assert engine.model.capture.functionalize(mutating) is not mutating


class MaskArithmetic(nn.Module):
    """The mask and position code of attention models written by hand: integer and boolean tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.cumsum(pad, dim=1) - 1  # positions of a left-padded batch
        causal = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        keep = causal[None] & (pad[:, None, :] == 1)
        scores = (self.fc(x) @ x.transpose(1, 2)).masked_fill(~keep, -1e9)
        scores = torch.where(pos[:, :, None] >= 0, scores, torch.zeros_like(scores))
        return torch.softmax(scores, dim=-1).pow(2).mean() + x.new_zeros(()).float()


def test_mask_arithmetic_captures_with_rules_and_computes_the_same() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, x = MaskArithmetic(), torch.randn(3, 4, 5)
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    g = engine.load_model(module, (x, pad))
    assert {"where", "full", "cumsum", "arange"} <= {n.op for n in g.nodes} and engine.theory.missing_rules(g) == []
    assert torch.allclose(interpret(g, module, (x, pad)), module(x, pad), rtol=1e-6, atol=1e-7)


class Composites(nn.Module):
    """Composite operators capture decomposes (logsumexp, rms_norm, vector norms, nll_loss, the real part of an FFT)
    and the ones it lowers
    to operators of their own (tril, triu, unfold, scatter, hardswish, log-sigmoid), with aliases among them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.RMSNorm(6)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x)) + F.rms_norm(x, [3, 6], eps=1e-3)
        h = F.hardswish(h) + F.logsigmoid(h.tril(-1)) * h.triu(1).multiply(0.5)
        lse = torch.logsumexp(h.masked_fill(torch.ones_like(h, dtype=torch.bool).tril(-2), float("-inf")), dim=-1)
        norms = sum(torch.linalg.vector_norm(h, ord=p, dim=(1, 2), keepdim=True) for p in (2, 1, 3, float("inf"), 0))
        h = F.normalize(h, dim=-1) + norms.expand_as(h) + h.view_as(lse.unsqueeze(-1).expand_as(h))
        cols = F.unfold(h.unsqueeze(1), kernel_size=2)  # (batch, 4, places)
        windows = h.unfold(2, 3, 2).amax(-1)  # Inkling's sliding windows: Tensor.unfold, a view
        windows = torch.concatenate([windows[..., :1], windows[..., 1:]], dim=-1)  # Zamba2's name for cat
        picked = torch.zeros_like(cols).scatter(2, torch.zeros_like(cols[..., :1], dtype=torch.long), cols[..., :1])
        logp = torch.log_softmax(h.reshape(-1, 6), dim=-1)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real * torch.fft.fftn(h, dim=(0, 1, 2), norm="ortho").real  # FNet's mixing
        return F.nll_loss(logp, target, ignore_index=-100) + picked.mean() + lse.mean() + mixed.mean() + windows.mean()


def test_composites_are_decomposed_into_ruled_operators_and_compute_the_same() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, x = Composites(), torch.randn(2, 3, 6)
    target = torch.tensor([0, 5, -100, 2, 3, -100])
    g = engine.load_model(module, (x, target))
    ops = {n.op for n in g.nodes}
    assert {"tril", "triu", "im2col", "unfold", "scatter", "hardswish", "log_sigmoid", "gather", "amax", "rsqrt",
            "fft"} <= ops
    assert "opaque" not in ops and engine.theory.missing_rules(g) == []
    assert torch.allclose(interpret(g, module, (x, target)), module(x, target), rtol=1e-6, atol=1e-6)


class ReversedPositions(nn.Module):
    """CPM-Ant's relative positions: a list of ints made a tensor in forward, on the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.tensor(list(range(x.shape[1]))[::-1], device=x.device)
        return (self.fc(x) * positions[None, :, None]).mean()


def test_a_list_of_ints_in_progression_made_in_forward_on_meta_keeps_its_values() -> None:
    from test_ecosystem import interpret

    with torch.device("meta"):
        g = engine.load_model(ReversedPositions(), (torch.empty(2, 5, 4),))
    assert "arange" in {n.op for n in g.nodes} and engine.theory.missing_rules(g) == []
    torch.manual_seed(0)
    module, x = ReversedPositions(), torch.randn(2, 5, 4)
    assert torch.allclose(interpret(g, module, (x,)), module(x))


class ComplexRope(nn.Module):
    """Rotary embeddings written with complex numbers, as Llama 4 and DeepSeek-V2 write them: the frequencies by
    `polar` (scaled by a number) and by `view_as_complex` of stacked cos and sin, the rotation a complex product."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 16)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.q(x).view(b, s, 2, 8)
        freqs = torch.arange(s, device=x.device).float()[None, :, None] * self.inv_freq  # (1, s, 4)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * 0.5
        stacked = torch.view_as_complex(torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1))
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        rotated = xq_ * freqs_cis[:, :, None, :] * stacked.unsqueeze(2).expand(b, s, 1, 4)
        out = torch.view_as_real(rotated.transpose(1, 2)[..., 1:]).flatten(3)
        return out.type_as(xq).pow(2).mean() + torch.view_as_real(freqs_cis.real[:, :, None, :] * xq_).sum()


def test_complex_rotary_is_lowered_to_real_pairs_and_computes_the_same() -> None:
    """Complex tensors are held as (re, im) pairs: the graph has no complex node, every node's rules hold on
    uneven shards, and the loss and its gradients are torch's."""
    from test_ecosystem import assert_lowered_like_torch

    torch.manual_seed(0)
    module, x = ComplexRope(), torch.randn(2, 5, 8, requires_grad=True)
    g = engine.load_model(module, (x,))
    assert not any(n.dtype.startswith("complex") for n in g.nodes) and engine.theory.missing_rules(g) == []
    assert {"cos", "sin", "select", "cat", "sub"} <= {n.op for n in g.nodes} and "opaque" not in {n.op for n in g.nodes}
    assert_lowered_like_torch(g, module, (x,), [x, module.q.weight])


class ComplexUnruly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.reshape(2, 2, 2))
        return torch.view_as_real(torch.exp(z)).sum()


class ComplexBuffer(nn.Module):
    """A complex buffer (Llama 4's vision `freqs_ci`): its value reaches the runners as the module holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(x.reshape(4, 2)) * self.freqs).sum()


def test_complex_operators_not_lowered_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedOpError, match=r"aten\.exp of a complex tensor .*write this step in real arithmetic"):
        engine.load_model(ComplexUnruly(), (torch.randn(8),), fallback="strict")
    with pytest.raises(UnsupportedOpError, match=r"^1 unsupported .*complex buffer 'freqs' .*store it as torch\.view_as_real"):
        engine.load_model(ComplexBuffer(), (torch.randn(8),), fallback="strict")


class ForwardConstant(nn.Module):
    """A tensor made in forward from Python numbers (torch.export lifts it as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([1.0, 2.0, 3.0])
        return (self.fc(x) * scale).pow(2).mean()


def test_tensor_constants_made_in_forward_are_stored_in_the_graph() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, x = ForwardConstant(), torch.randn(4, 3)
    g = Graph.from_dict(json.loads(engine.load_model(module, (x,)).to_json()))
    const = next(n for n in g.nodes if n.op == "constant")
    assert const.attrs["value"] == [1.0, 2.0, 3.0] and const.shape == (3,) and not const.inputs
    assert torch.allclose(interpret(g, module, (x,)), module(x), rtol=1e-6)


class MetaConstants(nn.Module):
    """Constants a model makes in forward on its input's device: GPT-Neo's mask value (`torch.tensor` of a
    Python number), Falcon's ALiBi base (`torch.full((), ...)`) and its `qkv[..., [-2], :]` list index."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        low = torch.tensor(-2.0, dtype=y.dtype, device=y.device)
        half = torch.full((), 0.5, device=y.device)
        picked = y[..., [0, 2]]
        return (torch.where(picked > 0, picked, low) * half).pow(2).mean()


def test_constants_made_in_forward_on_meta_keep_their_values() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, x = MetaConstants(), torch.randn(5, 3)
    with torch.device("meta"):
        on_meta = MetaConstants()
    g = Graph.from_dict(json.loads(engine.load_model(on_meta, (torch.empty(5, 3, device="meta"),)).to_json()))
    values = sorted(str(n.attrs["value"]) for n in g.nodes if n.op == "constant")
    assert values == ["-2.0", "[0, 2]"] and any(n.op == "full" for n in g.nodes)
    assert torch.allclose(interpret(g, module, (x,)), module(x), rtol=1e-6)


@pytest.mark.parametrize("equation, shapes", [
    ("...qhd,...khd->...hqk", [(2, 3, 4, 5, 6), (2, 3, 7, 5, 6)]),  # LongT5's local attention
    ("bij,bjk", [(2, 3, 4), (2, 4, 5)]),  # implicit output
    ("...ij,jk->...ik", [(3, 4), (4, 5)]),  # an ellipsis of no dims
    ("...i,...i", [(2, 3), (3,)]),  # broadcast ellipses of different widths
])
def test_einsum_ellipses_and_implicit_outputs_are_written_out_and_compute_the_same(equation, shapes) -> None:
    from engine.model.capture import explicit_equation
    from engine.model.graph import parse_equation

    xs = [torch.randn(*s) for s in shapes]
    written = explicit_equation(equation, [len(s) for s in shapes])
    parse_equation(written)  # the form the rules take
    assert torch.allclose(torch.einsum(written, *xs), torch.einsum(equation, *xs))


class SkipsAtRandom(nn.Module):
    """LayerDrop's pattern: forward branches on a random draw against a config value."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"to_dict": lambda self: {"layer_skip_prob": 0.1, "width": 3}})()
        self.skip_prob = 0.1
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand([]) < self.skip_prob:
            return x.sum()
        return self.fc(x).sum()


def test_a_data_dependent_branch_is_reported_at_the_models_line_with_the_config_key_to_set() -> None:
    with pytest.raises(ModelError) as e:
        engine.load_model(SkipsAtRandom(), (torch.randn(2, 3),))
    message = str(e.value)
    assert "test_capture.py:" in message and "`if torch.rand([]) < self.skip_prob:`" in message
    assert "layer_skip_prob" in message and "width" not in message and "\n" not in message


class NotScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_module_must_return_a_scalar_loss() -> None:
    with pytest.raises(ModelError, match="scalar training loss"):
        engine.load_model(NotScalar(), (torch.randn(3, 4),))


def test_load_model_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="example_inputs"):
        engine.load_model(TwoLayer())
    with pytest.raises(ModelError, match="expected"):
        engine.load_model(42)
    path = tmp_path / "g.json"
    mlp().save(path)
    with pytest.raises(ModelError, match="zoo"):
        engine.load_model(str(path), layers=2)
    assert engine.load_model(mlp()) is mlp()


# --- zoo knobs --------------------------------------------------------------------------------


def test_unknown_zoo_name_hints() -> None:
    with pytest.raises(ModelError) as e:
        engine.load_model("zoo:gtp")
    assert "'gtp'" in str(e.value) and "did you mean 'gpt'" in str(e.value)
    with pytest.raises(ModelError) as e:
        engine.load_model("zoo:resnet")
    assert "available: bert, bert_moe, gpt, hf_bert, hf_gpt2, hf_llama, mlp" in str(e.value)


def test_unknown_knob_hints() -> None:
    with pytest.raises(ModelError) as e:
        engine.load_model("zoo:gpt", layer=2)
    assert "'layer'" in str(e.value) and "did you mean 'layers'" in str(e.value)
    with pytest.raises(ModelError) as e:
        engine.load_model("zoo:mlp", hiden=8)
    assert "did you mean 'hidden'" in str(e.value)


@pytest.mark.parametrize("knobs,needle", [
    ({"layers": "abc"}, "layers"), ({"layers": 0}, "positive"), ({"layers": -2}, "positive"), ({"layers": 2.5}, "layers"),
    ({"hidden": 30, "heads": 4}, "multiple of heads"), ({"tie_weights": "maybe"}, "tie_weights"),
])
def test_bad_knob_values(knobs: dict, needle: str) -> None:
    with pytest.raises(ModelError) as e:
        engine.load_model("zoo:gpt", **knobs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_knobs_from_strings() -> None:
    g = engine.load_model("zoo:mlp", layers="2", in_features="8", hidden="16", classes="5", batch="6")
    assert g.to_dict() == engine.load_model("zoo:mlp", layers=2, in_features=8, hidden=16, classes=5, batch=6).to_dict()


# --- large models capture without allocating ------------------------------------------------------


def test_large_gpt_captures_on_meta() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    g = engine.load_model("zoo:gpt", layers=4, hidden=4096, heads=32, ffn=16384, vocab=50304)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert g.num_parameters > 8e8
    assert g.num_parameters == meta_param_count("gpt", layers=4, hidden=4096, heads=32, ffn=16384, vocab=50304)
    assert grown_gib < 1.0, f"capture grew the process by {grown_gib:.1f} GiB: weights were allocated"
    assert g.op_histogram()["sdpa"] == 4


class _GradRegions(nn.Module):
    """A rotary-like side computation under no_grad (with a nested enable_grad), as transformers' rotary
    embeddings run it; `plain` computes the same without grad-mode regions."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("freq", torch.arange(8.0))
        self.plain = plain

    def side(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * self.freq
        y = y + 1
        return y.cos()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            z = self.side(x)
        else:
            with torch.no_grad():
                y = x.float() * self.freq
                with torch.enable_grad():
                    y = y + 1
                z = y.cos()
        return (x @ self.w * z).sum()


def test_grad_mode_regions_are_inlined_into_the_graph() -> None:
    """Export keeps `no_grad` regions as wrap_with_set_grad_enabled submodules (transformers' Llama
    rotary on torch 2.11 was refused as 'get_attr submod_1'); they lower to the same operators as
    the same code without the region."""
    x = torch.randn(4, 8)
    regions = engine.load_model(_GradRegions(), (x,))
    plain = engine.load_model(_GradRegions(plain=True), (x,))
    shape = lambda g: [(n.op, n.inputs, n.shape) for n in g.nodes]  # noqa: E731
    assert shape(regions) == shape(plain)
    assert "cos" in [n.op for n in regions.nodes]


class ValueSizedOutput(nn.Module):
    """JetMoE's router: a tensor whose length is a count of tensor values (`nonzero`), which export traces with an
    unbacked size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() + torch.nonzero(x > 0).float().sum()


def test_a_tensor_sized_by_tensor_values_is_refused_by_name_not_raised_raw() -> None:
    with pytest.raises(UnsupportedOpError, match="size depends on tensor values"):
        engine.load_model(ValueSizedOutput(), (torch.randn(3, 4),))


class MaskedWrite(nn.Module):
    """T5Gemma 2's end-of-image embedding: `x[ids == k] = v` (index_put by a boolean mask over the leading dims)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.special = nn.Embedding(10, 4), nn.Parameter(torch.randn(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h[ids == 3] = self.special
        return h.pow(2).mean()


def test_a_write_through_a_boolean_mask_is_lowered_as_where_and_computes_the_same() -> None:
    from test_ecosystem import interpret

    torch.manual_seed(0)
    module, ids = MaskedWrite(), torch.tensor([[3, 1, 3], [0, 3, 2]])
    g = engine.load_model(module, (ids,))
    assert "where" in {n.op for n in g.nodes} and "opaque" not in {n.op for n in g.nodes}
    assert engine.theory.missing_rules(g) == []
    assert torch.allclose(interpret(g, module, (ids,)), module(ids))


class _ClipsInForward(nn.Module):
    """Gemma 3n's AltUp clips its coefficients' weights in forward while training (`weight.data.clamp_`)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.lin, self.write = nn.Linear(8, 8), write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.lin.weight.data.clamp_(-1.0, 1.0)
        h = self.lin(x)
        h.add_(1.0)  # an in-place operator on an activation is no parameter write
        return h.sum()


def test_a_forward_that_writes_a_parameter_in_place_is_refused_at_its_line() -> None:
    """torch.export failed late on such a forward ("a fake tensor in the exported program constant's list"), naming
    no line; the refusal names the model's line and the operator."""
    from engine.errors import ParameterWriteError

    with torch.device("meta"):
        clips, plain, x = _ClipsInForward(True), _ClipsInForward(False), torch.randn(4, 8)
    with pytest.raises(ParameterWriteError, match=r"writes a parameter in place at test_capture\.py:\d+ "
                                                  r"`self\.lin\.weight\.data\.clamp_\(-1\.0, 1\.0\)`: Tensor\.clamp_"):
        engine.load_model(clips, (x,))
    assert any(n.op == "linear" for n in engine.load_model(plain, (x,)).nodes)


class _RouterInDtype(nn.Module):
    """Switch Transformers' router moves its classifier to the router dtype in forward (`self.classifier.to(dtype)`)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.classifier, self.dtype = nn.Linear(8, 4), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).softmax(-1).sum()


def test_a_module_moved_to_its_own_dtype_in_forward_is_captured_as_if_untouched() -> None:
    """torch swaps every fake parameter on a module conversion, even one that changes nothing, which export refused
    ("Couldn't swap Linear.weight"); a no-op conversion is identity, a real one is refused at the model's line."""
    with torch.device("meta"):
        same, other, x = _RouterInDtype(torch.float32), _RouterInDtype(torch.float64), torch.randn(3, 8)
    g = engine.load_model(same, (x,))
    assert [n.op for n in g.nodes if n.op == "linear"] == ["linear"] and g.parameters[0].dtype == "float32"
    with pytest.raises(ModelError, match=r"converts the parameters of Linear to another dtype.*at test_capture\.py:\d+ "
                                         r"`self\.classifier = self\.classifier\.to\(self\.dtype\)`"):
        engine.load_model(other, (x,))
    assert torch.nn.Module._apply.__qualname__ == "Module._apply", "torch's own conversion is restored"
