"""Coverage of the theory: every captured op has rules, every registered op runs, every zoo rule holds."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import engine
from engine.model import capture as capture_mod
from engine.model.graph import Graph
from engine.model.ops import run_node
from engine.theory import missing_rules, op_rules
from engine.theory.check import DOMAINS, check_node, describe
from engine.theory.core import registered_ops

from ._helpers import UNEVEN, one_op

GPT_SMALL = dict(layers=2, hidden=32, heads=4, ffn=64, vocab=50, seq_len=8, batch=4)
MLP_SMALL = dict(layers=2, in_features=8, hidden=16, classes=5, batch=6)


@functools.cache
def gpt_small() -> Graph:
    return engine.load_model("zoo:gpt", **GPT_SMALL)


@functools.cache
def mlp_small() -> Graph:
    return engine.load_model("zoo:mlp", **MLP_SMALL)


class Kitchen(nn.Module):
    """Many canonical ops in one small model: scalar ops, rsub, batched matmul, softmaxes, reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6))
        self.ln = nn.LayerNorm(6, elementwise_affine=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) * torch.sigmoid(x) - nn.functional.silu(x) / 2.0
        h = 1.0 - h
        a = torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h
        a = torch.log_softmax(a, dim=1) + torch.exp(-a)
        a = self.ln(a @ self.w).permute(1, 0, 2).reshape(5, 24)
        s = a.sum(dim=-1, keepdim=True) + a.mean(dim=0)
        return ((s - y) * (s - y)).mean()


@functools.cache
def kitchen() -> Graph:
    return engine.load_model(Kitchen(), (torch.randn(4, 5, 6), torch.randn(5, 24)))


@functools.cache
def vgg19_small() -> Graph:
    return engine.load_model("zoo:vgg19", batch=4, image_size=32, width=0.125, hidden=16, classes=5, pool_size=2, batch_norm=True)


@functools.cache
def vit_small() -> Graph:
    return engine.load_model("zoo:vit", batch=3, image_size=8, patch=4, hidden=8, layers=1, heads=2, mlp=16, classes=5,
                             qkv_fused=True)


@functools.cache
def bert_small() -> Graph:
    return engine.load_model("zoo:bert", **BERT_SMALL)


@functools.cache
def bert_moe_small() -> Graph:
    return engine.load_model("zoo:bert_moe", **BERT_SMALL, experts=5)


@functools.cache
def decoder_small(name: str) -> Graph:
    """A transformers causal LM (default config, tiny): RoPE, GQA, mask code, MoE routing, exact loss."""
    transformers = pytest.importorskip("transformers")
    extra = {"num_local_experts": 3, "experts_implementation": "batched_mm"} if name == "Mixtral" else {}
    cfg = getattr(transformers, f"{name}Config")(hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                                 num_key_value_heads=2, vocab_size=24, intermediate_size=8,
                                                 max_position_embeddings=16, **extra)
    with torch.device("meta"):
        model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    ids = torch.zeros(3, 6, dtype=torch.long, device="meta")
    return engine.load_model(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})


BERT_SMALL = dict(layers=2, hidden=16, heads=2, ffn=32, vocab=30, seq_len=6, predictions=2, batch=4)
MODELS = {"gpt": gpt_small, "mlp": mlp_small, "kitchen": kitchen, "vgg19": vgg19_small, "vit": vit_small,
          "bert": bert_small, "bert_moe": bert_moe_small, "llama": functools.partial(decoder_small, "Llama"),
          "mixtral": functools.partial(decoder_small, "Mixtral")}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_captured_op_has_rules(model: str) -> None:
    g = MODELS[model]()
    assert missing_rules(g) == []
    ops = {n.op for n in g.nodes if not n.is_leaf}
    assert ops <= set(registered_ops())


def test_every_op_capture_can_emit_is_registered() -> None:
    emitted = set(capture_mod._UNARY.values()) | set(capture_mod._BINARY) | {
        "view", "identity", "permute", "linear", "matmul", "softmax", "log_softmax", "sum", "mean", "layer_norm",
        "embedding", "sdpa", "cross_entropy", "mse_loss", "cat", "narrow", "select", "expand",
        "conv", "max_pool", "avg_pool", "adaptive_avg_pool", "batch_norm", "einsum", "topk_values", "topk_indices",
        "one_hot", "cumsum", "gather", "arange", "opaque", "constant", "full", "pad", "index", "where",
        "index_add", "scatter_add", "histc", "roll", "clamp", "softplus", "rand", "round", "elu", "leaky_relu",
        "div_floor", "div_trunc", "bitwise_and", "bitwise_or", "bitwise_xor", "amax", "amin", "any", "all", "prod", "var",
        "argmax", "argmin", "flip", "slice_scatter", "select_scatter", "sort_values", "sort_indices", "group_norm", "upsample",
        "tril", "triu", "scatter", "im2col", "unfold", "col2im", "fft"}
    assert emitted - set(registered_ops()) == set()


def _positive(shape):
    return torch.rand(shape, dtype=torch.float64) + 0.5


# a small example for every registered op: operands (shape or (shape, dtype)) and attrs
EXAMPLES: dict[str, tuple[list, dict]] = {
    **{op: ([(3, 4)], {}) for op in ("relu", "tanh", "sigmoid", "silu", "exp", "rsqrt", "sqrt", "neg", "identity",
                                     "cos", "sin", "logical_not")},
    "gelu": ([(3, 4)], {"approximate": "none"}),
    **{op: ([(3, 4)], {}) for op in ("abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cosh", "erf",
                                     "expm1", "floor", "log", "log10", "log1p", "log2", "reciprocal", "sign", "sinh", "tan",
                                     "trunc", "isinf", "isnan")},
    "bitwise_not": ([((3, 4), "int64")], {}),
    "round": ([(3, 4)], {"decimals": 1}),
    "elu": ([(3, 4)], {"alpha": 0.5, "scale": 1.5, "input_scale": 2.0}),
    "leaky_relu": ([(3, 4)], {"negative_slope": 0.1}),
    "rand": ([], {"rng_site": 3}),
    **{op: ([(3, 4), (4,)], {}) for op in ("maximum", "minimum", "atan2", "remainder", "fmod", "logical_xor", "div_floor",
                                          "div_trunc")},
    **{op: ([((3, 4), "int64"), ((4,), "int64")], {}) for op in ("bitwise_and", "bitwise_or", "bitwise_xor")},
    **{op: ([(2, 3, 4)], {"dims": [1], "keepdim": False}) for op in ("amax", "any", "all", "prod", "argmax")},
    **{op: ([(2, 3, 4)], {"dims": [0, 2], "keepdim": True}) for op in ("amin", "argmin")},
    "var": ([(2, 3, 4)], {"dims": [2], "keepdim": False, "correction": 1}),
    "group_norm": ([(4, 6, 3), (6,), (6,)], {"groups": 3, "eps": 1e-5, "has_weight": True, "has_bias": True}),
    "upsample": ([(2, 3, 4, 5)], {"target": "aten::upsample_bilinear2d.vec", "args": [None, False, [1.5, 2.0]], "spatial": 2}),
    **{op: ([(3, 4)], {"dim": 1, "descending": True, "stable": True}) for op in ("sort_values", "sort_indices")},
    "flip": ([(3, 4, 2)], {"dims": [1]}),
    "unfold": ([(3, 7, 4)], {"dim": 1, "size": 3, "step": 2}),
    "slice_scatter": ([(4, 6), (4, 2)], {"dim": 1, "start": 1, "end": 5, "step": 2}),
    "select_scatter": ([(4, 6, 3), (4, 3)], {"dim": 1, "index": 2}),
    "clamp": ([(3, 4)], {"min": -0.25, "max": 0.5}),
    "softplus": ([(3, 4)], {"beta": 2.0, "threshold": 1.0}),
    "dropout": ([(3, 4)], {"p": 0.1, "train": False}),
    **{op: ([(3, 4), (4,)], {}) for op in ("add", "sub", "mul", "div")},
    "linear": ([(2, 3, 4), (5, 4)], {}),
    "stage_output": ([(4, 3), (4,)], {"forms": [0, -1]}),
    "matmul": ([(2, 3, 4), (4, 5)], {}),
    "view": ([(2, 6)], {"shape": [3, 4]}),
    "permute": ([(2, 3, 4)], {"dims": [2, 0, 1]}),
    "softmax": ([(3, 4)], {"dim": 1}),
    "log_softmax": ([(3, 4)], {"dim": 0}),
    "sum": ([(2, 3, 4)], {"dims": [1], "keepdim": False}),
    "mean": ([(2, 3, 4)], {"dims": [0, 2], "keepdim": True}),
    "layer_norm": ([(2, 3, 4), (4,), (4,)], {"normalized_shape": [4], "eps": 1e-5, "has_weight": True, "has_bias": True}),
    "embedding": ([((6, 4), "float64"), ((2, 3), "int64")], {}),
    "sdpa": ([(2, 3, 4), (2, 5, 4), (2, 5, 4)], {"is_causal": False, "scale": None}),
    "cross_entropy": ([((4, 5), "float64"), ((4,), "int64")], {"count": 4}),
    "mse_loss": ([(4, 5), (4, 5)], {"count": 20}),
    "cat": ([(2, 3), (2, 4)], {"dim": 1}),
    "narrow": ([(4, 5)], {"dim": 1, "start": 1, "end": 5, "step": 2}),
    "select": ([(4, 5)], {"dim": 0, "index": 3}),
    "expand": ([(1, 5)], {"shape": [4, 5]}),
    "conv": ([(2, 3, 6, 6), (4, 3, 3, 3)], {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}),
    "max_pool": ([(2, 3, 6, 6)], {"spatial": 2, "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0],
                                  "dilation": [1, 1], "ceil_mode": False}),
    "avg_pool": ([(2, 3, 6, 6)], {"spatial": 2, "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "ceil_mode": True,
                                  "count_include_pad": False, "divisor_override": None}),
    "adaptive_avg_pool": ([(2, 3, 6, 6)], {"spatial": 2, "output_size": [4, 4]}),
    "batch_norm": ([(4, 3, 2, 2), (3,), (3,)], {"eps": 1e-5, "has_weight": True, "has_bias": True}),
    **{op: ([(3, 4), (4,)], {}) for op in ("lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "pow")},
    "einsum": ([(2, 3, 4), (4, 5)], {"equation": "bik,kj->bij"}),
    **{op: ([(3, 4)], {"k": 2, "dim": 1, "largest": True, "sorted": True}) for op in ("topk_values", "topk_indices")},
    "one_hot": ([((3, 2), "int64")], {"num_classes": 4}),
    "cumsum": ([(3, 4)], {"dim": 1}),
    "gather": ([((3, 4), "float64"), ((3, 2), "int64")], {"dim": 1}),
    "arange": ([], {"start": 0, "end": 5, "step": 1}),
    "constant": ([], {"value": [[1.0, 2.0], [3.0, 4.0]], "shape": [2, 2], "target": "c"}),
    "full": ([], {"value": 1.5, "shape": [2, 3]}),
    "pad": ([(3, 4)], {"pad": [0, 1], "value": -100}),
    "index": ([((5, 4), "float64"), ((3, 1), "int64"), ((1, 2), "int64")], {"slots": [True, True]}),
    "where": ([((3, 4), "int64"), (3, 4)], {"x": -1e9, "y": None}),
    "index_add": ([(3, 4), ((2,), "int64"), (2, 4)], {"dim": 0}),
    "scatter_add": ([(3, 4), ((3, 2), "int64"), (3, 2)], {"dim": 1}),
    "histc": ([(3, 4)], {"bins": 5, "min": 0.0, "max": 2.0}),
    "opaque": ([(3, 4)], {"target": "aten::flip.default", "args": [{"tensor": 0}, [0]], "kwargs": {}, "output_index": None}),
    "roll": ([(3, 4)], {"shifts": [1], "dims": [1]}),
    **{op: ([(3, 4)], {}) for op in ("hardswish", "hardsigmoid", "log_sigmoid", "mish")},
    "tril": ([(3, 4, 5)], {"diagonal": -1}),
    "triu": ([(2, 3, 4, 5)], {"diagonal": 2}),
    "scatter": ([(4, 5, 3), ((4, 2, 3), "int64"), (4, 2, 3)], {"dim": 1}),
    "im2col": ([(2, 3, 5, 6)], {"kernel_size": [2, 3], "dilation": [1, 2], "padding": [1, 0], "stride": [2, 1]}),
    "fft": ([(3, 4, 5, 2)], {"dims": [1], "norm": "ortho", "inverse": False, "pair": True}),
    "col2im": ([(2, 18, 6)], {"output_size": [4, 5], "kernel_size": [2, 3], "dilation": [1, 1], "padding": [0, 1],
                              "stride": [2, 2]}),
}
MORE_EXAMPLES: list[tuple[str, list, dict]] = [
    ("scatter", [(4, 5, 3), ((4, 2, 3), "int64")], {"dim": 1, "value": 0}),
    ("scatter", [(4, 5), ((3, 2), "int64")], {"dim": 1, "value": 1.5}),
    ("im2col", [(6, 5, 5)], {"kernel_size": [2, 2], "dilation": [1, 1], "padding": [0, 0], "stride": [1, 1]}),
    ("fft", [(3, 4, 5)], {"dims": [0, 2], "norm": "backward", "inverse": True, "pair": False}),
    ("col2im", [(12, 16)], {"output_size": [5, 5], "kernel_size": [2, 2], "dilation": [1, 1], "padding": [0, 0],
                            "stride": [1, 1]}),
]
"""Further examples of operators whose rules depend on their attrs or operand shapes (a value to scatter, an
unbatched input)."""
VIEW_SHAPES = {"view": (3, 4), "expand": (4, 5), "topk_values": (3, 2), "topk_indices": (3, 2), "arange": (5,),
               "constant": (2, 2), "full": (2, 3), "histc": (5,), "rand": (3, 4)}


@pytest.mark.parametrize("op", registered_ops())
def test_every_registered_op_has_an_executor(op: str) -> None:
    assert op in EXAMPLES, f"add a small example for the newly registered op '{op}' to EXAMPLES"
    operands, attrs = EXAMPLES[op]
    node, g = one_op(op, operands, attrs, out_shape=VIEW_SHAPES.get(op))
    data = [torch.randint(0, 2, g[i].shape) if g[i].dtype.startswith("int") else _positive(g[i].shape) for i in node.inputs]
    data = [DOMAINS[op](t) for t in data] if op in DOMAINS else data
    out = run_node(node, g, data, node.shape)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == node.shape
    assert torch.isfinite(out).all()
    assert op_rules(node, g), f"{op} has no rule on its example"


@pytest.mark.parametrize("op", registered_ops())
def test_every_rule_of_every_registered_op_holds_on_its_example(op: str) -> None:
    """The theory's checker on each operator's example: every rule it offers, on 3 uneven devices."""
    operands, attrs = EXAMPLES[op]
    node, g = one_op(op, operands, attrs, out_shape=VIEW_SHAPES.get(op))
    results = check_node(node, g, UNEVEN)
    assert results and all(r.ok for r in results), describe(results)


@pytest.mark.parametrize("op, operands, attrs", MORE_EXAMPLES)
def test_every_rule_holds_on_the_further_examples(op: str, operands: list, attrs: dict) -> None:
    node, g = one_op(op, operands, attrs)
    results = check_node(node, g, UNEVEN)
    assert results and all(r.ok for r in results), describe(results)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_rule_of_every_node_holds(model: str) -> None:
    g = MODELS[model]()
    failures, checked = [], 0
    for n in g.nodes:
        if n.is_leaf:
            continue
        results = check_node(n, g, UNEVEN)
        checked += len(results)
        if not all(r.ok for r in results):
            failures.append(f"{n.name} ({n.op}, {n.source}): {describe(results)}")
    assert checked > 0
    assert not failures, "\n".join(failures)


def test_gpt_rules_offer_the_classic_strategies() -> None:
    """Data, tensor (Megatron column/row) and head parallelism are all expressible on the small gpt."""
    g = gpt_small()
    names = {n.op: set() for n in g.nodes}
    for n in g.nodes:
        names[n.op] |= {r.name for r in op_rules(n, g)}
    assert {"batch", "column", "row", "partial", "replicate"} <= names["linear"]
    assert {"batch", "heads", "replicate"} == names["sdpa"]
    assert {"samples", "replicate"} == names["cross_entropy"]
