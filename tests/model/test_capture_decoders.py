"""Decoder language models as people bring them (issue 13, item 1): transformers causal LMs built
from their default configs, only the sizes shrunk, module and inputs on `meta`, dict inputs with
`labels` and `attention_mask`, capture and plan WITHOUT the replicate fallback.

What they contain and the tests below pin: rotary tables (`inv_freq` buffers, cos/sin), the causal
and padding mask code (arange, index, new_ones, comparisons, and/or, expand), GQA (`repeat_kv`:
expand + reshape), KV-cache bookkeeping (dead code: never lowered), tied embeddings (GPT-2), MoE
routing (Mixtral: softmax over experts, topk, per-expert weight gather), and the models' own loss
(labels shifted and padded with -100, mean cross-entropy over the kept targets).

Mixtral runs with `experts_implementation="batched_mm"`: transformers 5.24's default experts
(`grouped_mm`) sort the tokens by expert and call a custom `grouped_mm_fallback` op on offsets
computed with `histc`, and `eager` loops over `nonzero()` experts: both have data-dependent shapes.
`batched_mm` gathers each token's expert weights (static shapes), which plans and runs exactly.
GPT-2 keeps its default dropout (0.1), its attention dropout included: `scaled_dot_product_attention`
with `dropout_p > 0` is one `sdpa` node with a dropout site (engine/model/dropout.py, tests/test_dropout.py).
"""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import sample_path
from test_ecosystem import interpret

import engine
from engine.model.graph import Graph
from engine.theory import missing_rules, op_rules

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 16, 128
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             intermediate_size=128, max_position_embeddings=64)
CONFIGS: dict[str, dict] = {
    "LlamaForCausalLM": SMALL,
    "MistralForCausalLM": SMALL,
    "Qwen2ForCausalLM": SMALL,
    "MixtralForCausalLM": {**SMALL, "num_local_experts": 4, "experts_implementation": "batched_mm"},
    "GPT2LMHeadModel": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
    "GPTNeoXForCausalLM": {k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
    "OPTForCausalLM": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, ffn_dim=128,
                           max_position_embeddings=64, word_embed_proj_dim=64),
    "PhiForCausalLM": SMALL,
    "GemmaForCausalLM": {**SMALL, "head_dim": 16},
}
"""Default configs with the sizes shrunk (kwargs of the model's config class)."""
CLUSTERS = ("a100x2_p100x2", "cpu_4_uneven")
DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
            "activation_dropout")


def config_cls(name: str) -> type:
    return getattr(transformers, "GPT2Config" if name == "GPT2LMHeadModel" else name.replace("ForCausalLM", "Config"))


def build(name: str, device: str, **overrides) -> torch.nn.Module:
    with torch.device(device):
        return getattr(transformers, name)(config_cls(name)(**{**CONFIGS[name], **overrides}))


def batch(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, a padding mask (one sequence padded at the end) and labels with ignored (-100) spans."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    labels[1, SEQ - 4:] = -100
    labels[0, 3:7] = -100
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


@functools.cache
def meta_graph(name: str) -> Graph:
    return engine.load_model(build(name, "meta"), batch("meta"))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def decoder(request) -> tuple[str, Graph]:
    return request.param, meta_graph(request.param)


def test_decoder_captures_without_the_fallback(decoder) -> None:
    name, g = decoder
    assert not any(n.op == "opaque" for n in g.nodes) and missing_rules(g) == []
    loss = g[g.loss]
    assert loss.op == "cross_entropy" and len(loss.inputs) == 3, "mean over the targets that are not -100"
    assert {n.attrs["name"] for n in g.placeholders} == {"input_ids", "attention_mask", "labels"}
    assert Graph.from_dict(g.to_dict()) == g


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_decoder_plans_without_the_fallback(decoder, cluster: str) -> None:
    name, g = decoder
    plan = engine.plan(g, engine.load_cluster(sample_path(cluster)), optimizer="sgd", max_iterations=2)
    computes = [i for i in plan.program if i.kind == "compute"]
    assert plan.predicted_time_s > 0 and sum(i.rule != "replicate" for i in computes) > len(computes) // 3


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decoder_graph_computes_the_models_loss(name: str) -> None:
    """Node by node on CPU (dropout off so both draw nothing): the model's own loss, -100 labels and
    a padded sequence included."""
    torch.manual_seed(0)
    model = build(name, "cpu", **{k: 0.0 for k in DROPOUTS if hasattr(config_cls(name)(), k)})
    inputs = batch("cpu")
    g = engine.load_model(model, inputs)
    by_index = {n.attrs["index"]: inputs[n.attrs["name"]] for n in g.placeholders}
    got = interpret(g, model, tuple(by_index.get(i) for i in range(max(by_index) + 1)))
    assert torch.allclose(got, model(**inputs).loss, rtol=1e-5, atol=1e-6)


def _ops(g: Graph) -> set[str]:
    return {n.op for n in g.nodes}


def test_llama_rope_gqa_and_mask_are_captured_as_rules() -> None:
    g = meta_graph("LlamaForCausalLM")
    assert {"cos", "sin", "neg", "cat", "narrow", "expand", "index", "full", "sdpa"} <= _ops(g)
    assert any(n.op == "buffer" and n.attrs["target"].endswith("inv_freq") for n in g.nodes)
    # repeat_kv: kv heads (2) -> expand (2, 2) -> view to the 4 query heads; the kv head dim shards
    kv = [n for n in g.nodes if n.op == "expand" and n.rank == 5 and n.shape[1:3] == (2, 2)]
    assert len(kv) == 2 * CONFIGS["LlamaForCausalLM"]["num_hidden_layers"]
    assert any(r.inputs == (1,) and r.output == 1 for r in op_rules(kv[0], g))
    sdpa = next(n for n in g.nodes if n.op == "sdpa")
    mask = g[sdpa.inputs[3]]
    assert mask.dtype == "bool" and mask.shape == (BATCH, 1, SEQ, SEQ), "padding + causal mask, broadcast over heads"
    assert {"batch", "heads"} <= {r.name for r in op_rules(sdpa, g)}


def test_gpt2_ties_its_lm_head_to_the_token_embedding() -> None:
    g = meta_graph("GPT2LMHeadModel")
    users = g.users()
    tied = [n for n in g.parameters if {g[u].op for u in users[n.id]} == {"embedding", "linear"}]
    assert len(tied) == 1 and tied[0].shape == (VOCAB, 64), "one parameter, used twice, one gradient"


def test_mixtral_routing_is_captured_as_rules() -> None:
    g = meta_graph("MixtralForCausalLM")
    assert {"softmax", "topk_values", "topk_indices", "index", "matmul"} <= _ops(g)
    experts = [n for n in g.nodes if n.op == "index" and g[n.inputs[0]].op == "parameter"]
    assert experts and all(g[n.inputs[0]].shape[0] == 4 for n in experts), "per-token gather of expert weights"


class GQA(torch.nn.Module):
    """Grouped-query attention through sdpa's own `enable_gqa` (4 query heads, 2 kv heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 4).transpose(1, 2).chunk(2, dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.pow(2).mean()


def test_sdpa_enable_gqa_repeats_the_kv_heads() -> None:
    torch.manual_seed(0)
    module, x = GQA(), torch.randn(3, 5, 8)
    g = engine.load_model(module, (x,))
    sdpa = next(n for n in g.nodes if n.op == "sdpa")
    assert [g[i].shape[1] for i in sdpa.inputs[:3]] == [4, 4, 4]
    assert torch.allclose(interpret(g, module, (x,)), module(x), rtol=1e-6, atol=1e-7)


class TokenChoiceMoE(torch.nn.Module):
    """Top-2 routing written by hand: expert loads by `histc`, per-token expert weights gathered by
    index, and the combine by `index_add` (static shapes: no `nonzero`)."""

    def __init__(self, experts: int = 3, width: int = 6) -> None:
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.w = torch.nn.Parameter(torch.randn(experts, width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, e = x.shape[0], self.w.shape[0]
        probs = torch.softmax(self.router(x), dim=-1)
        weight, expert = torch.topk(probs, 2, dim=-1)
        load = torch.histc(expert.float(), bins=e, min=0, max=e - 1)
        flat = expert.reshape(-1)
        h = torch.bmm(x.repeat_interleave(2, dim=0).unsqueeze(1), self.w[flat]).squeeze(1) * weight.reshape(-1, 1)
        out = torch.zeros_like(x).index_add(0, torch.arange(n).repeat_interleave(2), h)
        return out.pow(2).mean() + (load / (2 * n) * probs.mean(dim=0)).sum() * e


def test_hand_written_moe_routing_captures_with_rules_and_computes_the_same() -> None:
    torch.manual_seed(0)
    module, x = TokenChoiceMoE(), torch.randn(5, 6)
    g = engine.load_model(module, (x,))
    assert {"softmax", "topk_indices", "histc", "index", "index_add"} <= _ops(g) and missing_rules(g) == []
    assert torch.allclose(interpret(g, module, (x,)), module(x), rtol=1e-6, atol=1e-7)
