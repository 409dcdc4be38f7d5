"""Tests of engine.model.values: Python branches on tensor values that a meta capture decides by a general rule
(inputs of known value and what is computed from them, assertions), and the ones it still refuses, by line."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.errors import ModelError
from engine.model import source
from engine.model.capture import capture


class GlobalAttention(nn.Module):
    """Longformer's pattern: a mask value above 1 asks for global attention, read back with `.item()`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        is_global = (attention_mask > 1).flatten().any().item()
        if is_global:
            x = x.exp()
        extended = (1.0 - attention_mask[:, :, None].to(x.device)) * torch.finfo(x.dtype).min
        if not (extended == 0).all():  # a padded batch
            x = x.flip(1)
        return (self.proj(x) + extended).sum()


class MaskedLoss(nn.Module):
    """Qwen2-Audio's loss: the logits and labels at the positions the attention mask keeps (a boolean index)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)
        keep = attention_mask.to(logits.device) != 0
        return nn.functional.cross_entropy(logits[keep], labels[keep])


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype, device="meta") if dtype == torch.long else torch.randn(*shape, device="meta")


def test_a_branch_on_an_input_of_known_value_is_decided_by_that_value():
    with torch.device("meta"):
        model = GlobalAttention()
    inputs = {"x": meta(2, 3, 4), "attention_mask": meta(2, 3, dtype=torch.long)}
    graph = capture(model, inputs, known={"attention_mask": torch.ones(2, 3, dtype=torch.long)})
    ops = {n.op for n in graph.nodes}
    assert "exp" not in ops and "flip" not in ops  # neither global attention nor padding: an all-ones mask
    with pytest.raises(ModelError, match=r"data-dependent.* at test_values\.py:\d+ `if is_global:`"):
        capture(model, inputs)  # unknown: refused at the model's line


def test_a_mask_twice_the_value_decides_the_other_branch():
    with torch.device("meta"):
        model = GlobalAttention()
    inputs = {"x": meta(2, 3, 4), "attention_mask": meta(2, 3, dtype=torch.long)}
    graph = capture(model, inputs, known={"attention_mask": torch.full((2, 3), 2, dtype=torch.long)})
    assert {"exp", "flip"} <= {n.op for n in graph.nodes}


def test_a_boolean_index_by_a_known_all_true_mask_keeps_every_position():
    with torch.device("meta"):
        model = MaskedLoss()
    inputs = {"x": meta(2, 3, 4), "attention_mask": meta(2, 3, dtype=torch.long),
              "labels": torch.zeros(2, 3, dtype=torch.long, device="meta")}
    graph = capture(model, inputs, known={"attention_mask": torch.ones(2, 3, dtype=torch.long)})
    logits = [n for n in graph.nodes if n.shape == (6, 6)]
    assert logits, "the kept logits are all 2 x 3 positions"
    with pytest.raises(ModelError, match="data-dependent"):
        capture(model, inputs)


class LanguageAdapters(nn.Module):
    """X-MOD's adapters: a language id per sample (the default language's, made by `ones`), each language's adapter
    run on its samples (a boolean index) and written back by the same mask (a boolean-mask write)."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lang_ids = 0 * torch.ones(x.shape[0], device=x.device)
        out = torch.zeros_like(x)
        for i, adapter in enumerate(self.adapters):
            mask = lang_ids == i  # all True for language 0, all False for language 1
            out[mask] = adapter(x[mask])
        return (out * x).sum()


def test_a_write_by_a_known_mask_all_true_is_a_whole_copy_and_all_false_writes_nothing():
    from test_ecosystem import interpret

    torch.manual_seed(0)
    model, x = LanguageAdapters(), torch.randn(2, 3, 4)
    graph = capture(model, (x,))
    ops = [n.op for n in graph.nodes]
    assert "index_put" not in ops and "opaque" not in ops and ops.count("linear") == 1, ops
    assert torch.allclose(interpret(graph, model, (x,)), model(x))


def test_a_write_of_unknown_values_forgets_what_was_known():
    class Overwritten(nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            mask = attention_mask.clone()
            mask.masked_fill_(x[..., 0] > 0, 2)  # activations decide: unknown again
            return x.sum() * 2 if (mask > 1).any() else x.sum()

    inputs = {"x": meta(2, 3, 4), "attention_mask": meta(2, 3, dtype=torch.long)}
    with pytest.raises(ModelError, match=r"data-dependent.* `return x.sum\(\) \* 2 if"):
        capture(Overwritten(), inputs, known={"attention_mask": torch.ones(2, 3, dtype=torch.long)})


ASSERTING_MODEL = """
import torch

class Asserts(torch.nn.Module):
    def forward(self, x):
        assert x.isnan().sum() == 0 and not x.isinf().any(), "NaN in the activations"
        return x.sum()
"""
"""Compiled apart from this file: pytest rewrites the assertions of test modules into other bytecode."""


def test_an_assertion_on_tensor_values_is_taken_as_true_and_other_branches_still_refused():
    scope: dict = {}
    exec(compile(ASSERTING_MODEL, "asserting_model.py", "exec"), scope)  # noqa: S102 (the test's own text)
    Asserts = scope["Asserts"]

    class Branches(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return x.sum()
            return -x.sum()

    assert [n.op for n in capture(Asserts(), (meta(2, 3),)).nodes][-1] == "sum"
    with pytest.raises(ModelError, match=r"at test_values\.py:\d+ `if x.sum\(\) > 0:`"):
        capture(Branches(), (meta(2, 3),))


def test_hf_masks_are_known_all_ones_and_a_seq2seq_batch_has_its_decoder_mask():
    """FSMT infers the decoder's padding from its ids' values (a random pad id) unless given the decoder mask."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:FSMTForConditionalGeneration", None,
                          {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                           "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
                           "src_vocab_size": 40, "tgt_vocab_size": 40, "batch": 2, "seq_len": 8})
    batch = source.hf_inputs(spec, torch.Generator().manual_seed(0))
    assert torch.equal(batch["decoder_attention_mask"], torch.ones(2, 8, dtype=torch.long))
    assert {"attention_mask", "decoder_attention_mask"} <= set(batch)  # every all-ones mask of a text batch
    graph = source.capture_hf(spec)
    assert [n.attrs["name"] for n in graph.nodes if n.op == "placeholder"] == list(batch)


class MaskArithmetic(nn.Module):
    """A mask used as data only (multiplied in): nothing is decided by its value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * attention_mask[:, :, None]).sum()


def test_a_capture_decided_by_a_mask_records_it_and_a_padded_batch_is_refused():
    """The program of a capture that decided a branch by the all-ones mask is that of an unpadded batch: the graph
    says so, and a global batch with padding is refused by name rather than trained by the wrong program."""
    from runner.global_batch import ApiError, flat_batch

    known = {"attention_mask": torch.ones(2, 3, dtype=torch.long)}
    with torch.device("meta"):
        decided, plain = GlobalAttention(), MaskArithmetic()
    inputs = {"x": meta(2, 3, 4), "attention_mask": meta(2, 3, dtype=torch.long)}
    graph = capture(decided, inputs, known=known)
    assert graph.origin["assumes_all_ones"] == ["attention_mask"]
    assert "assumes_all_ones" not in capture(plain, inputs, known=known).origin
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.long)
    assert len(flat_batch(graph, {"x": x, "attention_mask": mask})) == 2
    mask[0, 2] = 0
    with pytest.raises(ApiError, match="attention_mask has entries other than 1"):
        flat_batch(graph, {"x": x, "attention_mask": mask})
