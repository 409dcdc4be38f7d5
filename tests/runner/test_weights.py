"""Weights in and out (runner.weights): safetensors and save_pretrained directories into the plan's
model with every check, and the trained model out in a form transformers loads.

A tiny LlamaForCausalLM (hidden 32, vocab 256) stands for a pretrained model; `examples/llama_tiny.py`
built through the plan's path (its forward replaced by the flat-batch one) for the trained model.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

import engine  # noqa: E402
from engine.model import source  # noqa: E402
from runner import weights  # noqa: E402
from runner.weights import WeightsError, load_pretrained, module_with_state, read_state, save_model  # noqa: E402
from runner_plans import cluster  # noqa: E402

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[LlamaForCausalLM, str]:
    """A tiny Llama saved with save_pretrained (the model and its directory)."""
    model, out = llama(0), tmp_path_factory.mktemp("pretrained") / "llama"
    model.save_pretrained(out)
    return model, str(out)


@pytest.fixture(scope="module")
def example_origin() -> dict:
    return source.capture_file("examples/llama_tiny.py").origin


def test_load_pretrained_restores_a_save_pretrained_llama(pretrained):
    model, path = pretrained
    fresh = llama(1)
    assert not same_state(fresh, model)
    report = load_pretrained(fresh, path)
    assert same_state(fresh, model)
    assert len(report.loaded) == len(model.state_dict()) and not (report.cast or report.tied or report.ignored)
    assert report.summary().startswith(f"loaded {len(report.loaded)} tensors")


def count_reads(monkeypatch) -> list[str]:
    """The names `safe_open(...).get_tensor` is asked for from now on."""
    reads, real = [], weights.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(weights, "safe_open", Counting)
    return reads


def test_tensors_are_read_one_at_a_time_each_once(pretrained, monkeypatch):
    reads = count_reads(monkeypatch)
    load_pretrained(llama(1), pretrained[1])
    assert sorted(reads) == sorted(llama(1).state_dict())


def test_tied_alias_missing_from_the_file_is_filled_through_the_tie(tmp_path):
    model = llama(0, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in read_state(tmp_path)
    fresh = llama(1, tie_word_embeddings=True)
    report = load_pretrained(fresh, tmp_path)
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and same_state(fresh, model)


def test_tied_aliases_both_in_the_file_must_be_equal(tmp_path):
    model = llama(0, tie_word_embeddings=True)
    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp_path / "same.safetensors"))
    assert load_pretrained(llama(1, tie_word_embeddings=True), tmp_path / "same.safetensors").tied == {}
    tensors["lm_head.weight"] += 1
    save_file(tensors, str(tmp_path / "untied.safetensors"))
    with pytest.raises(WeightsError, match="holds different model.embed_tokens.weight and lm_head.weight, which the "
                                           "model ties"):
        load_pretrained(llama(1, tie_word_embeddings=True), tmp_path / "untied.safetensors")


def test_sharded_directory_loads(pretrained, tmp_path):
    model, _ = pretrained
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / weights.INDEX).exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    fresh = llama(2)
    load_pretrained(fresh, tmp_path)
    assert same_state(fresh, model)


def test_planned_example_saved_loads_with_from_pretrained_and_gives_the_same_loss(example_origin, tmp_path):
    model = source.build_module(example_origin, 3)
    assert "forward" in vars(model)  # the plan's flat-batch forward, an instance attribute
    written = save_model(tmp_path / "out", model)
    assert {p.name for p in written} >= {"config.json", "model.safetensors"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    input_ids, attention_mask, labels = source.make_batch(example_origin, 0, 0)
    with torch.no_grad():
        ours = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        theirs = loaded(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)
        assert torch.equal(model(input_ids, attention_mask, labels), theirs.loss)
    again = source.build_module(example_origin, 4)
    load_pretrained(again, tmp_path / "out")
    assert same_state(again, model)


def test_module_with_state_builds_the_plans_model_from_gathered_parameters(example_origin, tmp_path):
    plan = engine.evaluate(engine.load_model("examples/llama_tiny.py"), cluster(2), "dp-even", optimizer="sgd")
    trained = source.build_module(example_origin, 7)
    params = dict(trained.named_parameters(remove_duplicate=False))
    state = {plan.graph[n.id].attrs["target"]: params[plan.graph[n.id].attrs["target"]].detach()
             for n in plan.graph.parameters}
    rng = torch.get_rng_state()
    module = module_with_state(plan, state)
    assert torch.equal(torch.get_rng_state(), rng)
    assert same_state(module, trained)
    with pytest.raises(WeightsError, match="has no tensor model.norm.weight"):
        module_with_state(plan, {k: v for k, v in state.items() if k != "model.norm.weight"})


class Tied(torch.nn.Module):
    """A non-transformers model with a tied head and a persistent buffer."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.norm = torch.nn.BatchNorm1d(4)


def test_save_model_of_a_plain_module_writes_each_shared_tensor_once(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    model.norm.running_mean.fill_(0.5)
    save_model(tmp_path / "out", model)
    state = read_state(tmp_path / "out")
    assert "head.weight" not in state.specs and state.aliases == {"head.weight": "embed.weight"}
    for fresh in (Tied(), Tied(tie=False)):  # an untied model reads the alias from the header
        load_pretrained(fresh, tmp_path / "out")
        assert same_state(fresh, model)


def test_missing_persistent_buffer_keeps_its_built_value(tmp_path):
    model = Tied()
    tensors, _ = weights.state_dict_for_save(model)
    del tensors["norm.running_mean"]
    save_file(tensors, str(tmp_path / "w.safetensors"))
    fresh = Tied()
    fresh.norm.running_mean.fill_(3.0)
    report = load_pretrained(fresh, tmp_path / "w.safetensors")
    assert report.kept == ["norm.running_mean"] and torch.equal(fresh.norm.running_mean, torch.full((4,), 3.0))
    assert "kept as built: norm.running_mean" in report.summary()


def test_save_model_replaces_a_previous_save_only_once_complete(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_model(out, Tied())
    before = (out / "model.safetensors").read_bytes()

    def crash(directory, module):
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(weights, "write_model", crash)
    with pytest.raises(KeyboardInterrupt):
        save_model(out, Tied())
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_model_refuses_to_replace_a_directory_that_is_no_save(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(WeightsError, match="holds other files and no saved model"):
        save_model(tmp_path, Tied())
    assert (tmp_path / "notes.txt").exists()


def test_save_model_copies_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>")))
    tok.save_pretrained(tmp_path / "tok")
    save_model(tmp_path / "out", llama(0), tokenizer_dir=tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("a b")["input_ids"] == tok("a b")["input_ids"]
    with pytest.raises(WeightsError, match="no tokenizer files there"):
        save_model(tmp_path / "out2", llama(0), tokenizer_dir=tmp_path)


# ----------------------------------------------------------------------------- bad input


def test_missing_path_is_named(tmp_path):
    with pytest.raises(WeightsError, match=f"weights {tmp_path}/nope: no such file or directory"):
        read_state(tmp_path / "nope")


def test_directory_without_weights_says_what_it_looked_for(tmp_path):
    with pytest.raises(WeightsError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        read_state(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pytorch_model.bin, a pickle, which is never loaded"):
        load_pretrained(Tied(), tmp_path)


def test_truncated_file_is_named_with_its_sizes(pretrained, tmp_path):
    data = open(os.path.join(pretrained[1], "model.safetensors"), "rb").read()
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    header = 8 + int.from_bytes(data[:8], "little")
    want = f"{cut} is truncated or not a safetensors file (header says {len(data) - header} bytes of data, " \
           f"the file has {len(data) // 2 - header})"
    with pytest.raises(WeightsError) as e:
        load_pretrained(llama(1), tmp_path)
    assert str(e.value) == want


def test_non_safetensors_file_is_refused(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    (tmp_path / "w.txt").write_text("hello, not weights at all")
    for name in ("w.pt", "w.txt"):
        with pytest.raises(WeightsError, match=f"{name} is truncated or not a safetensors file"):
            read_state(tmp_path / name)
    (tmp_path / "j.safetensors").write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(WeightsError, match="not a safetensors file .its 2-byte header is not a JSON object"):
        read_state(tmp_path / "j.safetensors")


def test_weights_of_another_model_name_the_first_mismatching_tensor(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=256)).save_pretrained(tmp_path)
    model = llama(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError, match=r"has no tensor model.embed_tokens.weight \(12 of the model's 12 missing, "
                                           r"and it holds \d+ tensors the model lacks, e.g. transformer\.") as e:
        load_pretrained(model, tmp_path)
    assert "plan the model the weights belong to" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unexpected_tensor_is_refused_but_a_stale_rotary_buffer_ignored(pretrained, tmp_path):
    model, _ = pretrained
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    stale = "model.layers.0.self_attn.rotary_emb.inv_freq"  # what transformers < 4.31 wrote for Llama
    save_file({**tensors, stale: torch.ones(4)}, str(tmp_path / "a.safetensors"))
    report = load_pretrained(llama(1), tmp_path / "a.safetensors")
    assert report.ignored == [stale]
    save_file({**tensors, "score.weight": torch.ones(2, 32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(WeightsError, match="holds score.weight, which the model has no tensor for"):
        load_pretrained(llama(1), tmp_path / "b.safetensors")


def test_shape_mismatch_names_the_tensor_and_both_shapes(pretrained, monkeypatch):
    reads = count_reads(monkeypatch)
    with pytest.raises(WeightsError, match=r"tensor model.layers.0.mlp.gate_proj.weight is \[64, 32\] float32 in "
                                           r"the file, \[48, 32\] float32 in the model: the weights are for another"):
        load_pretrained(llama(1, intermediate_size=48), pretrained[1])
    assert reads == []  # refused from the header alone: no tensor was read


def test_narrowing_dtype_is_refused(pretrained):
    model = llama(1).to(torch.bfloat16)
    with pytest.raises(WeightsError, match=r"tensor model.embed_tokens.weight is \[256, 32\] float32 in the file, "
                                           r"\[256, 32\] bfloat16 in the model: casting float32 to bfloat16 "
                                           r"would lose values"):
        load_pretrained(model, pretrained[1])


def test_int_float_change_and_bf16_fp16_are_refused(tmp_path):
    save_file({"weight": torch.ones(2, dtype=torch.int64)}, str(tmp_path / "i.safetensors"))
    save_file({"weight": torch.ones(2, dtype=torch.float16)}, str(tmp_path / "h.safetensors"))

    class One(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, dtype=dtype))

    for file, dtype in (("i", torch.float64), ("h", torch.bfloat16)):
        with pytest.raises(WeightsError, match="would lose values"):
            load_pretrained(One(dtype), tmp_path / f"{file}.safetensors")
    assert weights.widens(torch.int32, torch.int64) and not weights.widens(torch.int64, torch.int32)


def test_bf16_file_into_an_fp32_model_is_cast_up(pretrained, tmp_path):
    model, _ = pretrained
    model16 = llama(0).to(torch.bfloat16)
    model16.save_pretrained(tmp_path)
    assert read_state(tmp_path).spec("model.norm.weight").dtype == torch.bfloat16
    fresh = llama(1)
    report = load_pretrained(fresh, tmp_path)
    assert set(report.cast.values()) == {"bfloat16->float32"} and len(report.cast) == len(fresh.state_dict())
    assert fresh.model.norm.weight.dtype == torch.float32
    assert all(torch.equal(v, model16.state_dict()[k].float()) for k, v in fresh.state_dict().items())
    assert "cast 12 (bfloat16->float32)" in report.summary()


def test_index_naming_a_missing_shard_is_refused(pretrained, tmp_path):
    pretrained[0].save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / weights.INDEX).read_text())
    shard = next(iter(index["weight_map"].values()))
    (tmp_path / shard).unlink()
    with pytest.raises(WeightsError, match=f"names shard '{shard}', which is not a file beside it"):
        read_state(tmp_path)
