"""Model sources (engine/model/source.py): model files and `hf:` classes plan with their origin recorded, and the
runner's side rebuilds the same module and the same batch of every step from it (issue 13, item 4)."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from conftest import ROOT, load_bench
from hap_inprocess import run_hap
from test_cli import assert_one_line_error

import engine
from engine.bundle.archive import check_bundle, export_bundle, model_file_of, open_bundle
from engine.errors import ModelError
from engine.model import source

MODEL_FILES = ROOT / "tests" / "fixtures" / "model_files"
CUMPROD = MODEL_FILES / "cumprod_mlp.py"
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 64, "max_position_embeddings": 32}
TINY_GIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 64,
            "max_position_embeddings": 32, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "intermediate_size": 64, "image_size": 16, "patch_size": 8}}
TINY_VOXTRAL_RT = {"audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "head_dim": 16, "num_mel_bins": 8},
                   "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64}}
TINY_SIGLIP2 = {"num_labels": 3, "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "num_patches": 16, "patch_size": 4}}
TINY_MUSICGEN = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "ffn_dim": 64, "vocab_size": 64,
                 "num_codebooks": 3, "max_position_embeddings": 32, "dropout": 0.0}


@pytest.fixture(scope="module")
def cumprod_graph():
    return engine.load_model(str(CUMPROD), fallback="replicate")


# ----------------------------------------------------------------------------- model files


def test_a_model_file_plans_with_its_path_sha256_and_input_spec_recorded(cumprod_graph):
    origin = cumprod_graph.origin
    assert origin["file"] == str(CUMPROD.resolve())
    assert origin["sha256"] == source.sha256_of(CUMPROD.read_bytes())
    assert [(i["shape"], i["dtype"]) for i in origin["inputs"]] == [([12, 8], "float32"), ([12, 4], "float32")]
    assert any(n.op == "opaque" for n in cumprod_graph.nodes)  # cumprod has no rule: replicated
    source.check_rebuildable(origin)


def test_the_batch_is_a_function_of_seed_and_step_and_leaves_the_global_rng_alone(cumprod_graph):
    origin = cumprod_graph.origin
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a0, a1 = source.make_batch(origin, 0, 0), source.make_batch(origin, 0, 1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a0, source.make_batch(origin, 0, 0)))
    assert not torch.equal(a0[0], a1[0]) and not torch.equal(a0[0], source.make_batch(origin, 1, 0)[0])
    assert [t.shape for t in a0] == [(12, 8), (12, 4)] and not a0[0].is_meta


def test_the_rebuilt_module_takes_the_flat_batch_and_is_the_same_for_the_same_seed(cumprod_graph):
    origin = cumprod_graph.origin
    m, again, other = source.build_module(origin, 7), source.build_module(origin, 7), source.build_module(origin, 8)
    names = [n.attrs["target"] for n in cumprod_graph.parameters]
    params = dict(m.named_parameters())
    assert sorted(names) == sorted(params) and all(not p.is_meta for p in params.values())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), again.parameters()))
    assert not torch.equal(params["fc1.weight"], dict(other.named_parameters())["fc1.weight"])
    x, y = source.make_batch(origin, 0, 0)
    loss = m(x, y)
    expected = torch.nn.functional.mse_loss(m.fc2(torch.cumprod(torch.sigmoid(m.fc1(x)), dim=-1)), y)
    assert loss.shape == () and torch.equal(loss, expected)


def test_a_changed_model_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "model.py"
    shutil.copy(CUMPROD, path)
    origin = engine.load_model(str(path), fallback="replicate").origin
    path.write_text(path.read_text() + "\n# edited\n")
    with pytest.raises(ModelError, match=r"model file '.*model.py' changed since the plan was made \(sha256"):
        source.check_rebuildable(origin)
    with pytest.raises(ModelError, match="changed since the plan was made"):
        source.make_batch(origin, 0, 0)
    path.unlink()
    with pytest.raises(ModelError, match="not found"):
        source.build_module(origin, 0)


def test_hap_run_refuses_a_changed_model_file_before_any_rank_starts(tmp_path):
    path = tmp_path / "model.py"
    shutil.copy(CUMPROD, path)
    plan = engine.plan(engine.load_model(str(path), fallback="replicate"), engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json"))
    plan.save(tmp_path / "p.json")
    path.write_text(path.read_text() + "\n# edited\n")
    r = run_hap("run", str(tmp_path / "p.json"), "--steps", "1")
    assert r.returncode == 2 and "changed since the plan was made" in r.stderr and "torchrun" not in r.stderr


def test_model_file_errors_are_one_line_model_errors(tmp_path):
    cases = {"nofns.py": ("x = 1\n", "no function build_model()"),
             "syntax.py": ("def build_model(:\n", "SyntaxError"),
             "meta.py": ("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n"
                         "def example_inputs():\n    return (torch.randn(4, 2, device='meta'),)\n", None)}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        if message:
            with pytest.raises(ModelError, match=message):
                engine.load_model(str(tmp_path / name))
    r = run_hap("plan", "--model", str(tmp_path / "missing.py"), "--cluster", "sample_clusters/cpu_2.json")
    assert "model file" in assert_one_line_error(r.returncode, r.stdout, r.stderr)
    module = source.exec_model_file((tmp_path / "meta.py").read_bytes(), "meta.py")
    with pytest.raises(ModelError, match="returned meta tensors"):
        source.file_inputs(module, "meta.py", 0)


# ----------------------------------------------------------------------------- hf:


@pytest.mark.parametrize("spec, config, knobs, message", [
    ("hf:", None, {}, "needs a class name"),
    ("hf:LlamaForCausalLm", None, {}, "no model class 'LlamaForCausalLm'; did you mean 'LlamaForCausalLM'"),
    ("hf:LlamaModel", None, {}, "no inputs known for this class"),
    ("hf:LlamaForCausalLM", None, {"hiden_size": "64"}, "'hiden_size' is not a key of LlamaConfig .*did you mean 'hidden_size'"),
    ("hf:LlamaForCausalLM", None, {"seq_len": "99999999"}, "seq_len 99999999 exceeds the model's"),
    ("hf:LlamaForCausalLM", None, {"batch": "0"}, "batch must be a positive integer"),
    ("hf:LlamaForCausalLM", None, {"image_size": "32"}, "image_size applies to models whose batch has pixels"),
    ("hf:LlamaForCausalLM", "missing.json", {}, "--config missing.json: file not found"),
    ("hf:MixtralForCausalLM", None, {"experts_implementation": "fast"}, "experts_implementation must be one of hap_dense"),
    ("hf:Gemma4AssistantForCausalLM", None, {}, "default config does not validate: ValueError: hidden_size_per_layer_"),
    ("hf:OlmoHybridForCausalLM", None, {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 4},
     "bad config: ValueError: OLMoHybrid expects at least one attention layer"),
])
def test_hf_spec_errors_are_one_line_model_errors(spec, config, knobs, message):
    pytest.importorskip("transformers")
    with pytest.raises(ModelError, match=message) as e:
        source.hf_spec(spec, config, knobs)
    assert "\n" not in str(e.value)


def test_hap_plan_reports_a_bad_hf_config_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "cfg.json").write_text("[1, 2]")
    r = run_hap("plan", "--model", "hf:BertForMaskedLM", "--config", str(tmp_path / "cfg.json"), "--cluster",
            "sample_clusters/cpu_2.json")
    assert "expected a JSON object of config keys" in assert_one_line_error(r.returncode, r.stdout, r.stderr)
    r = run_hap("plan", "--model", "zoo:mlp", "--config", str(tmp_path / "cfg.json"), "--cluster", "sample_clusters/cpu_2.json")
    assert "applies to Hugging Face models only" in assert_one_line_error(r.returncode, r.stdout, r.stderr)


def test_hf_config_file_then_knobs_give_the_full_config_the_plan_records(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "cfg.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 3}))
    spec = source.hf_spec("hf:LlamaForCausalLM", tmp_path / "cfg.json", {"hidden_size": "64", "batch": "4", "seq_len": "16"})
    assert spec.config["hidden_size"] == 64 and spec.config["num_hidden_layers"] == 3
    assert spec.config["num_attention_heads"] == 32  # the default, recorded in full
    assert spec.inputs == {"batch": 4, "seq_len": 16} and spec.task == "causal_lm"
    rebuilt = source.hf_config(source.spec_of(json.loads(json.dumps(spec.origin()))))
    assert json.loads(rebuilt.to_json_string(use_diff=False)) == spec.config


TINY_MIXTRAL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "vocab_size": 64, "max_position_embeddings": 32,
                "batch": 6, "seq_len": 8}


def test_a_mixture_of_experts_class_captures_without_a_hand_set_option():
    """transformers' default experts kernel has data-dependent shapes; hf: picks batched matmuls by itself,
    records the pick in the origin (it is not in the config's dict), and the runner rebuilds the same."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:MixtralForCausalLM", None, TINY_MIXTRAL)
    assert spec.implementation == {"experts": "hap_dense"}
    assert source.hf_spec("hf:LlamaForCausalLM", None, {"num_hidden_layers": 1}).origin().get("implementation") is None
    chosen = source.hf_spec("hf:MixtralForCausalLM", None, {**TINY_MIXTRAL, "experts_implementation": "eager"})
    assert chosen.implementation == {"experts": "eager"}
    origin = json.loads(json.dumps(engine.load_model("hf:MixtralForCausalLM", **TINY_MIXTRAL).origin))
    assert origin["implementation"] == {"experts": "hap_dense"}
    assert source.hf_config(source.spec_of(origin))._experts_implementation == "hap_dense"
    with pytest.raises(ModelError, match="origin.implementation.experts = 'histc' is not one of"):
        source.hf_config(source.spec_of({**origin, "implementation": {"experts": "histc"}}))


def test_layerdrop_is_turned_off_unless_the_user_sets_it_and_the_origin_says_so():
    """M2M-100 defaults to LayerDrop 0.05 (`if torch.rand([]) < p` skips a layer): no captured program holds
    that branch, so the spec sets it to 0, records the default it changed, and keeps a value the user set."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:M2M100ForConditionalGeneration", None, {"d_model": 32})
    assert spec.config["encoder_layerdrop"] == spec.config["decoder_layerdrop"] == 0.0
    assert spec.origin()["adjusted"] == {"encoder_layerdrop": 0.05, "decoder_layerdrop": 0.05}
    mine = source.hf_spec("hf:M2M100ForConditionalGeneration", None, {"encoder_layerdrop": "0.1"})
    assert mine.config["encoder_layerdrop"] == 0.1 and mine.adjusted == {"decoder_layerdrop": 0.05}
    assert "adjusted" not in source.hf_spec("hf:BertForMaskedLM", None, TINY_BERT).origin()


def test_a_causal_lm_reading_is_decoder_is_built_as_a_decoder_and_the_origin_says_so():
    """BertGenerationDecoder (no TASKS suffix: its forward's labels and input_ids make it a causal LM) defaults to
    is_decoder=False, which lets its layers see later tokens; Reformer's LM head refuses to build with it."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:BertGenerationDecoder", None, TINY_BERT)
    assert spec.task == "causal_lm" and spec.config["is_decoder"] is True and spec.adjusted == {"is_decoder": False}
    assert "is_decoder set to true" in source.adjusted_note("is_decoder", False)
    assert source.hf_spec("hf:BertGenerationDecoder", None, {**TINY_BERT, "is_decoder": "false"}).adjusted == {}
    assert "adjusted" not in source.hf_spec("hf:LlamaForCausalLM", None, {"num_hidden_layers": 1}).origin()


def test_a_size_the_default_config_leaves_none_is_named_with_the_set_to_pass():
    """Ministral's default config has head_dim None and its attention raises on it: the error names the key and
    the --set of its standard relation."""
    pytest.importorskip("transformers")
    knobs = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 64, "vocab_size": 64}
    spec = source.hf_spec("hf:MinistralForCausalLM", None, knobs)
    with torch.device("meta"), pytest.raises(ModelError, match=r"leaves head_dim None .*: pass --set head_dim=8 "
                                                                r"\(hidden_size // num_attention_heads\)$"):
        source.hf_build(spec)
    unset = source.unset_sizes({"n_routed_experts": None, "indexer_head_dim": None, "sliding_window": None})
    assert unset == {"indexer_head_dim": ("", None), "n_routed_experts": ("", None)}
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    assert source.unset_sizes({"rope_parameters": {}, "layer_types": ["sliding", "full", "sliding"]})["rope_parameters"][1] \
        == {"sliding": rope, "full": rope}, "empty rotary parameters: plain RoPE for each kind of layer"
    assert source.unset_sizes({"rope_parameters": {}})["rope_parameters"][1] == rope
    assert source.unset_sizes({"rope_parameters": {"rope_theta": 5e5}}) == {}
    assert "leaves rope_parameters empty" in source.unset_size_hint({"rope_parameters": {}})


def test_a_default_language_left_none_is_named_with_the_first_of_the_languages():
    """X-MOD refuses a batch without language ids unless its config names a default language (None by default):
    the relation gives the first of its languages, which the sweep fills and a capture error names."""
    unset = source.unset_sizes({"default_language": None, "languages": ["en_XX", "de_DE"]})
    assert unset == {"default_language": ("the first of languages", "en_XX")}
    assert source.unset_sizes({"default_language": "de_DE", "languages": ["en_XX", "de_DE"]}) == {}
    assert 'pass --set default_language="en_XX" (the first of languages)' in source.unset_size_hint(
        {"default_language": None, "languages": ("en_XX",)})


def test_a_classifier_whose_forward_takes_no_labels_trains_on_the_cross_entropy_of_its_scores():
    """PPLCNet's forward takes pixels only and returns its class scores as `last_hidden_state`."""
    pytest.importorskip("transformers")
    origin = source.hf_spec("hf:PPLCNetForImageClassification", None,
                            {"image_size": 32, "batch": 2, "num_labels": 3, "hidden_dropout_prob": 0.0}).origin()
    model = source.build_module(origin, 0)
    pixels, labels = source.make_batch(origin, 0, 0)
    with torch.no_grad():
        scores = type(model).forward(model, pixels).last_hidden_state
        assert torch.allclose(model(pixels, labels), torch.nn.functional.cross_entropy(scores, labels))


@pytest.mark.parametrize("cls", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_the_dense_experts_forward_computes_what_transformers_batched_experts_compute(cls):
    """`hap_dense` (every expert on every token, weighted by its routing weight) against transformers' own
    `batched_mm`, values and gradients, on a tiny model of two MoE families."""
    pytest.importorskip("transformers")
    knobs = TINY_MIXTRAL if cls == "MixtralForCausalLM" else {
        "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": 64, "batch": 3, "seq_len": 8}
    origin = source.hf_spec(f"hf:{cls}", None, knobs).origin()
    batch = source.make_batch(origin, 0, 0)
    results = []
    for kernel in ("hap_dense", "batched_mm"):
        model = source.build_module({**origin, "implementation": {"experts": kernel}}, 7)
        assert {m.config._experts_implementation for m in model.modules() if hasattr(m, "has_gate")} == {kernel}
        loss = model(*batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (dense, dense_grads), (batched, batched_grads) = results
    assert torch.allclose(dense, batched, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(dense_grads, batched_grads))


def test_a_recorded_config_with_an_infinite_float_builds_again_and_training_keeps_no_kv_cache():
    """transformers writes Mamba2's `time_step_limit` (0, inf) as JSON with `{"__float__": "Infinity"}`, which its
    strict config then refused when the runner rebuilt it; and `use_cache` defaults off (hybrid models' caches stop
    the capture; training keeps none) unless the user sets it."""
    pytest.importorskip("transformers")
    origin = json.loads(json.dumps(source.hf_spec("hf:Mamba2ForCausalLM", None, {"num_hidden_layers": 2}).origin()))
    assert source.hf_config(source.spec_of(origin)).time_step_limit[1] == float("inf")
    assert origin["config"]["use_cache"] is False
    assert source.hf_spec("hf:LlamaForCausalLM", None, {"use_cache": "true"}).config["use_cache"] is True


@pytest.mark.parametrize("cls, knobs, expected, labels_below", [
    ("BertForMaskedLM", {**TINY_BERT, "batch": 3, "seq_len": 8},
     {"input_ids": (3, 8), "attention_mask": (3, 8), "labels": (3, 8)}, 64),
    ("T5ForConditionalGeneration", {"d_model": 32, "vocab_size": 64, "batch": 2, "seq_len": 8},
     {"input_ids": (2, 8), "attention_mask": (2, 8), "decoder_input_ids": (2, 8), "decoder_attention_mask": (2, 8),
      "labels": (2, 8)}, 64),
    ("ViTForImageClassification", {"image_size": 16, "patch_size": 8, "num_labels": 5, "batch": 64},
     {"pixel_values": (64, 3, 16, 16), "labels": (64,)}, 5),
    ("BertForSequenceClassification", {**TINY_BERT, "num_labels": 3, "batch": 64, "seq_len": 8},
     {"input_ids": (64, 8), "attention_mask": (64, 8), "labels": (64,)}, 3),
    # no TASKS suffix: the task and the inputs follow what the forward takes
    ("BertGenerationDecoder", {**TINY_BERT, "batch": 2, "seq_len": 8},
     {"input_ids": (2, 8), "attention_mask": (2, 8), "labels": (2, 8)}, 64),
    ("SeamlessM4TForTextToText", {"vocab_size": 64, "batch": 2, "seq_len": 8},
     {"input_ids": (2, 8), "attention_mask": (2, 8), "decoder_input_ids": (2, 8), "decoder_attention_mask": (2, 8),
      "labels": (2, 8)}, 64),
    ("ImageGPTForImageClassification", {"vocab_size": 64, "num_labels": 3, "batch": 2, "seq_len": 8},
     {"input_ids": (2, 8), "attention_mask": (2, 8), "labels": (2,)}, 3),
    ("FNetForMaskedLM", {"vocab_size": 64, "batch": 2, "seq_len": 8}, {"input_ids": (2, 8), "labels": (2, 8)}, 64),
    # the forward documents its ids and labels with the config's codebook count: a row of ids per codebook, a
    # label per codebook (the plain (batch, seq_len) labels failed the loss: "Expected input batch_size (256)")
    ("MusicgenForCausalLM", {**TINY_MUSICGEN, "batch": 2, "seq_len": 8},
     {"input_ids": (6, 8), "attention_mask": (2, 8), "labels": (2, 8, 3)}, 64),
    # a modality merged by position, with no placeholder token: GIT's image before the text (its loss starts after
    # the image's 5 patch tokens: without pixels it had no logits left), Voxtral Realtime's audio added to every
    # token (8 frames per token, its config's audio_length_per_tok), as (batch, mel bins, frames)
    ("GitForCausalLM", {**TINY_GIT, "batch": 2, "seq_len": 8},
     {"pixel_values": (2, 3, 16, 16), "input_ids": (2, 8), "attention_mask": (2, 8), "labels": (2, 8)}, 64),
    ("VoxtralRealtimeForConditionalGeneration", {**TINY_VOXTRAL_RT, "batch": 2, "seq_len": 8},
     {"input_features": (2, 8, 64), "input_ids": (2, 8), "attention_mask": (2, 8), "labels": (2, 8)}, 64),
    # an image already cut into patches (its vision config has num_patches, no image_size), all of them the image's,
    # on a 4 x 4 grid: (batch, patches, channels * patch * patch), not (batch, channels, 224, 224)
    ("Siglip2ForImageClassification", {**TINY_SIGLIP2, "batch": 2},
     {"pixel_values": (2, 16, 48), "pixel_attention_mask": (2, 16), "spatial_shapes": (2, 2), "labels": (2,)}, 3),
])
def test_hf_inputs_follow_the_task_and_stay_in_range(cls, knobs, expected, labels_below):
    pytest.importorskip("transformers")
    spec = source.hf_spec(f"hf:{cls}", None, knobs)
    batch = source.hf_inputs(spec, torch.Generator().manual_seed(0))
    assert {k: tuple(v.shape) for k, v in batch.items()} == expected
    if "input_ids" in batch:
        assert int(batch["input_ids"].max()) < source._text(source.hf_config(spec)).vocab_size
    assert all(bool((batch[k] == 1).all()) for k in source.ALL_ONES_INPUTS if k in batch)
    assert int(batch["labels"].min()) >= 0 and int(batch["labels"].max()) < labels_below


def test_a_documented_shape_is_used_only_where_the_config_sizes_its_every_dim():
    """DistilBERT's forward documents input_ids as (batch_size, num_choices), copied from a multiple-choice head:
    a dim no config key sizes is not trusted, and the plain layouts keep the default batch."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:MusicgenForCausalLM", None, {**TINY_MUSICGEN, "batch": 2, "seq_len": 8})
    cfg = source.hf_config(spec)
    assert source.documented_shape("MusicgenForCausalLM", "input_ids") == ("batch_size * num_codebooks", "sequence_length")
    assert source.config_layout("MusicgenForCausalLM", "labels", cfg, 5, 7) == (5, 7, 3)
    assert source.documented_shape("DistilBertForMaskedLM", "input_ids") == ("batch_size", "num_choices")
    assert source.config_layout("DistilBertForMaskedLM", "input_ids", cfg, 5, 7) is None
    assert source.config_layout("GPT2LMHeadModel", "labels", cfg, 5, 7) is None  # (batch_size, input_ids_length)


def test_a_modality_is_in_the_batch_only_where_the_model_merges_it_by_position():
    """A vision-language model with an image placeholder token (LLaVA) splices image features in at those ids,
    which random ids never are: its batch stays text only. GIT names none: it puts the image before the text."""
    pytest.importorskip("transformers")
    llava, git = source.default_config("LlavaForConditionalGeneration"), source.default_config("GitForCausalLM")
    assert not source.merged_by_position("LlavaForConditionalGeneration", llava, "pixel_values")
    assert source.merged_by_position("GitForCausalLM", git, "pixel_values")
    assert not source.merged_by_position("GitForCausalLM", git, "input_features")  # its forward takes no audio
    assert "image_size" not in source.hf_spec("hf:LlavaForConditionalGeneration", None, {}).inputs


def test_patches_lie_on_a_grid_as_square_as_they_divide_and_the_grid_is_in_every_batch():
    pytest.importorskip("transformers")
    assert [source.patch_grid(n) for n in (256, 12, 7, 1)] == [(16, 16), (3, 4), (1, 7), (1, 1)]
    spec = source.hf_spec("hf:Siglip2ForImageClassification", None, {**TINY_SIGLIP2, "batch": 3})
    assert spec.inputs == {"batch": 3, "patches": 16}
    assert source.hf_inputs(spec)["spatial_shapes"].tolist() == [[4, 4]] * 3
    with pytest.raises(ModelError, match="cut into 16 patches, not an image_size"):
        source.hf_spec("hf:Siglip2ForImageClassification", None, {**TINY_SIGLIP2, "image_size": 32})


def test_a_masked_lm_whose_head_predicts_fixed_positions_gets_that_many_tokens():
    """Perceiver's decoder queries max_position_embeddings positions whatever the input's length: labels for the
    default 128 tokens failed its loss ("Expected input batch_size (16384) to match target batch_size (1024)")."""
    pytest.importorskip("transformers")
    knobs = {"num_latents": 4, "d_latents": 16, "d_model": 16, "num_blocks": 1, "num_self_attends_per_block": 1,
             "num_self_attention_heads": 2, "num_cross_attention_heads": 1, "vocab_size": 64,
             "max_position_embeddings": 24, "batch": 2}
    spec = source.hf_spec("hf:PerceiverForMaskedLM", None, knobs)
    assert spec.inputs == {"batch": 2, "seq_len": 24}
    assert {k: tuple(v.shape) for k, v in source.hf_inputs(spec).items()} == {
        "input_ids": (2, 24), "attention_mask": (2, 24), "labels": (2, 24)}
    with pytest.raises(ModelError, match=r"predicts 24 positions .*max_position_embeddings.*seq_len must be 24, not 8"):
        source.hf_spec("hf:PerceiverForMaskedLM", None, {**knobs, "seq_len": 8})
    assert source.hf_spec("hf:BertForMaskedLM", None, {**TINY_BERT, "seq_len": 8}).inputs["seq_len"] == 8


def test_an_hf_model_is_rebuilt_identically_and_its_flat_batch_gives_the_model_loss():
    pytest.importorskip("transformers")
    knobs = {**TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "batch": 2, "seq_len": 8}
    origin = source.hf_spec("hf:BertForMaskedLM", None, knobs).origin()
    m, again = source.build_module(origin, 3), source.build_module(origin, 3)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), again.parameters()))
    flat = source.make_batch(origin, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(flat, source.make_batch(origin, 0, 2)))
    ids, mask, labels = flat
    direct = again.model if hasattr(again, "model") else again
    expected = type(direct).forward(direct, input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.allclose(m(*flat), expected)


# ----------------------------------------------------------------------------- bundles


def test_export_carries_the_plans_model_file_and_check_ties_it_to_the_plan(tmp_path):
    path = tmp_path / "net.py"
    shutil.copy(CUMPROD, path)
    plan = engine.plan(engine.load_model(str(path), fallback="replicate"), engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json"))
    out = export_bundle(plan, None, tmp_path / "b")
    assert (out / "model" / "net.py").read_bytes() == path.read_bytes()
    assert json.loads((out / "model.json").read_text())["file"] == "model/net.py"
    assert check_bundle(out).ok and model_file_of(open_bundle(out)) == out / "model" / "net.py"
    # a bundle whose model file (and manifest entry) were swapped is not the plan's model
    (out / "model" / "net.py").write_text(path.read_text() + "\n# swapped\n")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["model/net.py"]["sha256"] = source.sha256_of((out / "model" / "net.py").read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert any("model/net.py: sha256 differs from the model file the plan was made for" in p
               for p in check_bundle(out).problems)
    path.write_text("# changed\n")
    with pytest.raises(Exception, match="changed since the plan was made"):
        export_bundle(plan, None, tmp_path / "c")


@pytest.mark.parametrize("spec, knobs", [
    (str(CUMPROD), {"fallback": "replicate"}),
    ("hf:LlamaForCausalLM", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "vocab_size": 64, "batch": 3, "seq_len": 8}),
    ("hf:MusicgenForCausalLM", {**TINY_MUSICGEN, "batch": 2, "seq_len": 8}),
    ("hf:GitForCausalLM", {**TINY_GIT, "batch": 2, "seq_len": 8}),
    ("hf:VoxtralRealtimeForConditionalGeneration", {**TINY_VOXTRAL_RT, "batch": 2, "seq_len": 8}),
    ("hf:Siglip2ForImageClassification", {**TINY_SIGLIP2, "batch": 2}),
])
def test_the_graph_run_on_the_runners_batch_gives_the_rebuilt_modules_loss(spec, knobs):
    """Capture (meta) and the runner's rebuild agree: placeholders index the flat batch, parameters match by name."""
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    from test_ecosystem import interpret

    graph = engine.load_model(spec, **knobs)
    module = source.build_module(graph.origin, 0)
    batch = source.make_batch(graph.origin, 0, 1)
    for p in graph.placeholders:
        x = batch[p.attrs["index"]]
        assert tuple(x.shape) == p.shape and str(x.dtype).removeprefix("torch.") == p.dtype
    with torch.no_grad():
        assert torch.allclose(interpret(graph, module, batch), module(*batch), rtol=1e-5)


# ----------------------------------------------------------------------------- the coverage sweep's shrinking


@pytest.fixture(scope="module")
def sweep():
    module = load_bench("sweep")
    yield module
    del sys.modules[module.__name__]


def test_a_per_layer_list_is_cut_keeping_a_layer_of_each_kind(sweep):
    assert sweep.cut(["s", "s", "s", "f"] * 3, 2) == ["s", "f"]
    assert sweep.cut(["a", "a", "b", "c"], 2) == ["a", "b", "c"]  # three kinds: three layers
    assert sweep.cut([[1, 2], [1, 2], [3]], 2) == [[1, 2], [3]]


@pytest.mark.parametrize("cls, expected", [
    ("NeoMMEForMaskedLM", {"num_hidden_layers": 2}),  # keeps its one full_attention layer (the config checks)
    ("AXK1ForCausalLM", {"n_routed_experts": 4, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4}),
    ("Ernie4_5_MoeForCausalLM", {"moe_num_experts": 4, "moe_k": 4}),  # top-k within the shrunk experts
    # layers of each attention kind and each activation sparsity (3), and 15 of 35 KV-sharing layers scaled to 1
    ("Gemma3nForCausalLM", {"num_hidden_layers": 3, "num_kv_shared_layers": 1}),
    ("MinistralForCausalLM", {"head_dim": 128}),  # None in the default: hidden_size // num_attention_heads
    ("Dots1ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}),  # None: filled
    ("EsmForMaskedLM", {"vocab_size": 32000, "pad_token_id": 0}),  # no vocabulary, so no padding id: both filled
    ("CohereCompassForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    ("Qwen4ExpForCausalLM", {"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 256,  # all None: the
                             "indexer_budget": 64, "indexer_compress_ratio": 4}),  # indexer is built on every layer
    ("PerceiverForMaskedLM", {"num_self_attends_per_block": 2}),  # a block's 26 layers: 1398 nodes, 240 s to plan
])
def test_the_sweep_shrinks_a_default_config_into_one_that_validates(sweep, cls, expected):
    pytest.importorskip("transformers")
    knobs = sweep.shrunk(cls)
    assert {k: knobs.get(k) for k in expected} == expected
    layer_types = knobs.get("layer_types")
    if layer_types and cls == "NeoMMEForMaskedLM":
        assert "full_attention" in layer_types and len(layer_types) == 2
    source.hf_spec(f"hf:{cls}", None, knobs)  # the shrunk config validates


def test_the_sweep_shrinks_each_sub_config_of_a_composite_config_keeping_its_other_defaults(sweep):
    """AudioFlamingo3's audio encoder and text decoder have 32 layers each in their own sub-configs: shrinking
    only the top level left a 2-layer model of 180 GiB."""
    pytest.importorskip("transformers")
    default = source.default_config("AudioFlamingo3ForConditionalGeneration").to_dict()
    knobs = sweep.shrunk("AudioFlamingo3ForConditionalGeneration")
    for sub in ("audio_config", "text_config"):
        assert knobs[sub]["num_hidden_layers"] == 2
        shrunk = {"num_hidden_layers", "layer_types"}  # layer_types is cut with the layers
        assert {k: v for k, v in knobs[sub].items() if k not in shrunk} == \
            {k: v for k, v in default[sub].items() if k not in shrunk}
    assert "id2label" not in knobs  # a dict of labels is not a config
    spec = source.hf_spec("hf:AudioFlamingo3ForConditionalGeneration", None, knobs)  # validates
    assert spec.config["text_config"]["num_hidden_layers"] == spec.config["audio_config"]["num_hidden_layers"] == 2


def test_a_list_of_every_layers_index_is_shrunk_to_the_kept_layers(sweep):
    """Llama 4's `moe_layers` lists all 48 layer indices: taken as 48 kinds of layer, it kept 48 layers (526 GiB)."""
    pytest.importorskip("transformers")
    knobs = sweep.shrunk("Llama4ForCausalLM")
    assert knobs["num_hidden_layers"] == 2 and knobs["moe_layers"] == [0, 1] and len(knobs["no_rope_layers"]) == 2
    assert sweep.every_layer([0, 1, 2]) and not sweep.every_layer([1, 3]) and not sweep.every_layer([0])
    source.hf_spec("hf:Llama4ForCausalLM", None, knobs)


def test_the_sweep_keeps_a_per_layer_dict_for_the_layers_it_keeps_renumbered(sweep):
    """Gemma 4 gives its full-attention layers (5, 11, ..., 29 of 30) a wider head in `per_layer_config`, keyed by
    layer index: the two layers kept are a sliding and a full one, so the full one's entry becomes layer 1's."""
    pytest.importorskip("transformers")
    assert sweep.renumbered({"05": {"h": 1}, "11": {"h": 2}}, [0, 5]) == {"01": {"h": 1}}
    assert not sweep.by_layer({"hidden_size": 4}, 30) and not sweep.by_layer({"31": 1}, 30)
    text = sweep.shrunk("Gemma4ForConditionalGeneration")["text_config"]
    assert text["layer_types"] == ["sliding_attention", "full_attention"]
    assert text["per_layer_config"] == {"01": {"head_dim": 512}}
    source.hf_spec("hf:Gemma4ForConditionalGeneration", None, sweep.shrunk("Gemma4ForConditionalGeneration"))
    small = sweep.shrunk("Gemma4UnifiedForConditionalGeneration", small=True)  # verify's widths: entries shrunk too
    assert small["text_config"]["per_layer_config"] == {"01": {"head_dim": 16}}
    source.hf_spec("hf:Gemma4UnifiedForConditionalGeneration", None, small)


def test_per_layer_lists_of_the_same_layers_are_cut_to_the_same_layers(sweep):
    """Dots3 Note has `mlp_layer_types` (dense first) and `layer_types` (sliding from layer 2) and gives each sliding
    layer its sizes in `per_layer_config`: the kept layers must be one set for all three."""
    pytest.importorskip("transformers")
    assert sweep.kept_jointly([["d", "s", "s", "s"], ["i", "i", "w", "w"]], 2) == [0, 1, 2]
    assert sweep.kept_jointly([["d", "s", "s"], ["i", "w", "w"]], 2) == [0, 1]  # one layer serves both lists
    knobs = sweep.shrunk("Dots3NoteForCausalLM")
    kept = len(knobs["layer_types"])
    assert len(knobs["mlp_layer_types"]) == kept == knobs["num_hidden_layers"]
    sliding = [i for i, t in enumerate(knobs["layer_types"]) if t == "sliding_attention"]
    assert sliding and sorted(int(k) for k in knobs["per_layer_config"]) == sliding
    source.hf_spec("hf:Dots3NoteForCausalLM", None, knobs)  # validates


def test_a_parameter_a_legacy_constructor_makes_on_the_cpu_is_moved_to_meta_for_the_capture():
    """ImageGPT's layer norm makes its weight with `torch.Tensor(n)`, which ignores `torch.device("meta")`: the
    capture then mixed a CPU weight with meta activations and failed."""
    pytest.importorskip("transformers")
    g = engine.load_model("hf:ImageGPTForImageClassification", n_layer=1, n_embd=16, n_head=2, vocab_size=20,
                          n_positions=16, seq_len=8, batch=2)
    assert any(n.op == "parameter" and "ln_1" in n.name for n in g.nodes)
    model = torch.nn.Linear(2, 2, device="meta")
    model.extra = torch.nn.Parameter(torch.ones(2))  # on the CPU
    assert {t.device.type for t in source.all_on_meta(model).parameters()} == {"meta"}


def test_a_composite_model_whose_decoder_has_switchable_experts_gets_the_capturable_kernel():
    """A speech model around a mixture-of-experts decoder (NeMo's speech LM): the top class has no experts of its
    own, the text sub-config's model does, and transformers sets the kernel on every sub-config."""
    pytest.importorskip("transformers")
    assert source._switchable_experts("Nemotron3_5TranscribeForConditionalGeneration")
    assert not source._switchable_experts("LlamaForCausalLM")
    assert not source._switchable_experts("WhisperForConditionalGeneration")
    cfg = source.hf_class("Nemotron3_5TranscribeForConditionalGeneration").config_class()
    cfg._experts_implementation = "hap_dense"
    assert cfg.text_config._experts_implementation == "hap_dense"


def test_a_model_without_a_vocabulary_gets_byte_ids():
    """CANINE reads Unicode code points through hash embeddings: its config has no vocab_size, and the batch drew
    ids below None (a raw TypeError from randint)."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:CanineForSequenceClassification", None, {
        "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "num_hash_buckets": 64, "batch": 2, "seq_len": 16})
    ids = source.hf_inputs(spec)["input_ids"]
    assert ids.shape == (2, 16) and 0 <= int(ids.min()) and int(ids.max()) < source.BYTE_IDS


def test_the_sweep_shrinks_the_sub_configs_of_a_composite_model(sweep):
    """Qwen2-Audio's layers are in its text and audio sub-configs (32 each by default: 180 GiB to train, more
    than the sweep's cluster holds); each is passed whole with its own counts shrunk."""
    pytest.importorskip("transformers")
    knobs = sweep.shrunk("Qwen2AudioForConditionalGeneration")
    assert knobs["text_config"]["num_hidden_layers"] == 2 and knobs["audio_config"]["encoder_layers"] == 2
    assert knobs["text_config"]["vocab_size"] == 151936  # the rest of the default sub-config kept
    cfg = source.hf_spec("hf:Qwen2AudioForConditionalGeneration", None, knobs).config
    assert cfg["text_config"]["num_hidden_layers"] == 2 and cfg["audio_config"]["encoder_layers"] == 2


def test_a_sub_config_read_for_the_legacy_rope_theta_gets_the_configs_rotary_base():
    """DBRX's attention reads `attn_config.rope_theta`, which transformers 5 no longer declares (the base moved into
    `rope_parameters`): the build raised AttributeError for every DBRX config."""
    pytest.importorskip("transformers")
    spec = source.hf_spec("hf:DbrxForCausalLM", None, {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 64,
                                                       "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    with torch.device("meta"):
        model = source.hf_build(spec)
    assert model.config.attn_config.rope_theta == 5e5
    assert "rope_theta" not in spec.config["attn_config"], "set at build, not recorded"


def test_the_sweep_shrinks_the_layer_counts_a_config_holds_as_a_partition_of_the_layers(sweep):
    """Dory stores each layer as an attention and an MLP block (its counts doubled in `to_dict()`, halved when built
    from that form), and its input, recurrent and output layers must sum to all of them: shrunk from the stored form
    each on its own, the counts no longer added up."""
    pytest.importorskip("transformers")
    knobs = sweep.shrunk("DoryForCausalLM")
    assert {k: knobs[k] for k in ("num_hidden_layers", "n_input_layers", "n_recurrent_layers", "n_output_layers")} \
        == {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1}
    assert "mlp" not in knobs["layer_types"] and len(knobs["layer_types"]) == 3
    cfg = source.hf_config(source.hf_spec("hf:DoryForCausalLM", None, knobs))  # validates, and builds again as recorded
    assert (cfg.num_hidden_layers, cfg.n_recurrent_layers) == (3, 1)
    assert sweep.apportioned({"a": 8, "b": 20, "c": 8}, 5) == {"a": 1, "b": 3, "c": 1}
    assert sweep.partition({"n_a_layers": 2, "n_b_layers": 3}, 5) and not sweep.partition({"n_a_layers": 2}, 2)


def test_a_sequence_length_the_config_dictates_is_the_default_and_the_sweep_shrinks_it_with_the_shape(sweep):
    """Reformer's axial position embeddings train on exactly prod(axial_pos_shape) positions (4096 by default): the
    input's default 128 tokens failed at capture; the sweep refactors the shape to its sequence."""
    pytest.importorskip("transformers")
    knobs = sweep.shrunk("ReformerModelWithLMHead")
    assert knobs["axial_pos_shape"] == [8, 16]
    assert source.hf_spec("hf:ReformerModelWithLMHead", None, knobs).inputs["seq_len"] == 128
    assert source.hf_spec("hf:ReformerModelWithLMHead", None, {"num_hidden_layers": 2}).inputs["seq_len"] == 4096
    with pytest.raises(ModelError, match=r"seq_len 64 does not fit the config: the product of axial_pos_shape .* is "
                                         r"128, .*pass seq_len=128, or set axial_pos_shape"):
        source.hf_spec("hf:ReformerModelWithLMHead", None, {**knobs, "seq_len": 64})
    small = sweep.shrunk("ReformerModelWithLMHead", small=True)
    assert small["axial_pos_shape"] == [4, 4] and small["lsh_attn_chunk_length"] == small["seq_len"] == 16
    assert small["axial_pos_embds_dim"] == [16, 48], "the widths splitting the hidden size shrink with it"
    source.hf_spec("hf:ReformerModelWithLMHead", None, small)
    assert sweep.factored(128, 2) == [8, 16] and sweep.factored(12, 3) == [2, 2, 3] and sweep.factored(7, 2) == [1, 7]


def test_a_model_refusing_the_batch_for_an_input_it_lacks_is_refused_naming_the_input(sweep):
    """Gemma 4's unified assistant (a draft model) raises in forward without its main model's `inputs_embeds` and
    `shared_kv_states`, which no `hf:` batch makes: a one-line typed error names them and the model's line."""
    pytest.importorskip("transformers")
    from engine.errors import MissingInputError

    cls = "Gemma4UnifiedAssistantForCausalLM"
    spec = source.hf_spec(f"hf:{cls}", None, {**sweep.shrunk(cls), "batch": 2, "seq_len": 8})
    with pytest.raises(MissingInputError, match=r"its forward needs inputs_embeds and shared_kv_states, which the "
                                                r"causal_lm batch does not make; the model raised: .* at modeling_"):
        source.capture_hf(spec)


def test_layers_that_share_weights_keep_a_second_of_their_kind_when_one_does_not_build(sweep):
    """Zamba ties every hybrid layer's shared transformer to the first one's: cut to one hybrid layer, the tie had
    no layer to share with and the build failed; `one` then shrinks with two layers of each kind."""
    pytest.importorskip("transformers")
    from engine.errors import BuildError

    assert sweep.cut(["a", "a", "b", "c", "b"], 2, per_kind=2) == ["a", "a", "b", "c", "b"]
    assert sweep.cut(["a", "a", "a", "b", "b"], 2, per_kind=2) == ["a", "a", "b", "b"]
    once, twice = sweep.shrunk("ZambaForCausalLM", small=True), sweep.shrunk("ZambaForCausalLM", small=True, per_kind=2)
    assert twice["layers_block_type"] == ["linear_attention", "linear_attention", "hybrid", "hybrid"]
    with torch.device("meta"):
        with pytest.raises(BuildError, match="tie_weights_keys"):
            source.hf_build(source.hf_spec("hf:ZambaForCausalLM", None, once))
        assert sum(1 for _ in source.hf_build(source.hf_spec("hf:ZambaForCausalLM", None, twice)).model.layers) == 4
