"""Models as people bring them (issue 13): transformers architectures built from their *default*
configs with only the sizes shrunk (dropout left as the config has it), and two plain-torch models.

`MODELS[name](device, small=True)` returns `(module, example_inputs)`: the module in training mode,
its inputs a keyword dict with `labels` (and an attention mask where the model takes one), both on
`device` (`"meta"` to capture without allocating a weight). `small=False` keeps the default
widths and depths (the architecture as published) and only shrinks batch and sequence.
Used by `tests/test_capture_encoders.py` and `bench/coverage.py`; nothing is ever downloaded.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.errors import ModelError
from engine.model.zoo.hf import _transformers

Built = tuple[nn.Module, dict[str, torch.Tensor]]
BATCH, SEQ, VOCAB = 8, 16, 512
"""Global batch, sequence length and vocabulary of the small text models."""
IMAGE = 32
"""Side of the small vision models' images."""


def _build(cls_name: str, config: Any, device: str | torch.device) -> nn.Module:
    """A transformers model from `config` on `device`, in training mode, with seed 0."""
    t = _transformers()
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(t, cls_name)(config)
    return model.train()


def _tokens(device: str | torch.device, *, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB, seed: int = 0,
            low: int = 3) -> torch.Tensor:
    """Random token ids in [low, vocab): above the special ids (pad, bos, eos) of every config."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, seq), generator=g).to(device)


def _text_inputs(device: str | torch.device, *, mask: bool = True) -> dict[str, torch.Tensor]:
    """Token ids, labels (the tokens: masked-/causal-LM) and, where the model takes one, an all-ones mask."""
    ids = _tokens(device)
    out = {"input_ids": ids, "labels": _tokens(device, seed=1)}
    if mask:
        out["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long).to(device)
    return out


def _sizes(small: bool, **sizes: Any) -> dict[str, Any]:
    """The shrunk sizes, or none at all (the default config) when not small."""
    return sizes if small else {}


# --- encoders -------------------------------------------------------------------------------
def bert(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.BertConfig(**_sizes(small, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64))
    return _build("BertForMaskedLM", cfg, device), _text_inputs(device)


def roberta(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.RobertaConfig(**_sizes(small, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=64))
    return _build("RobertaForMaskedLM", cfg, device), _text_inputs(device)


def distilbert(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.DistilBertConfig(**_sizes(small, vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                      max_position_embeddings=64))
    return _build("DistilBertForMaskedLM", cfg, device), _text_inputs(device)


# --- encoder-decoder ------------------------------------------------------------------------
def t5(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    # decoder_start_token_id: the published T5 configs start decoding at the pad id (0); the
    # default config has none, and the model needs one to shift the labels right.
    cfg = t.T5Config(decoder_start_token_id=0, **_sizes(small, vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                                                        num_layers=2, num_decoder_layers=2, num_heads=4))
    return _build("T5ForConditionalGeneration", cfg, device), _text_inputs(device)


def bart(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.BartConfig(**_sizes(small, vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                decoder_ffn_dim=128, max_position_embeddings=64))
    return _build("BartForConditionalGeneration", cfg, device), _text_inputs(device)


# --- decoders -------------------------------------------------------------------------------
_DECODER_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)


def _decoder(cls_name: str, config_name: str, **extra: Any) -> Callable[..., Built]:
    """A causal-LM builder from the config class `config_name` (sizes shrunk, `extra` on top)."""

    def build(device: str | torch.device = "meta", small: bool = True) -> Built:
        t = _transformers()
        cfg = getattr(t, config_name)(**_sizes(small, **_DECODER_SIZES, **extra))
        return _build(cls_name, cfg, device), _text_inputs(device)

    build.__doc__ = f"{cls_name} from a default {config_name} (sizes shrunk)."
    return build


llama = _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
mistral = _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, head_dim=16, sliding_window=8)
qwen2 = _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2)
mixtral = _decoder("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                   experts_implementation="batched_mm")
"""Mixtral's experts as batched matmuls: the default (`grouped_mm`) sizes its groups with `histc` and
`eager` loops over the `nonzero()` experts, both data-dependent shapes (see tests/test_capture_decoders.py)."""
gpt_neox = _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig")
phi = _decoder("PhiForCausalLM", "PhiConfig")
gemma = _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=16)


def gpt2(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.GPT2Config(**_sizes(small, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                bos_token_id=0, eos_token_id=0))  # the default 50256 is past the small vocabulary
    return _build("GPT2LMHeadModel", cfg, device), _text_inputs(device)


def opt(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.OPTConfig(**_sizes(small, vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128,
                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64))
    return _build("OPTForCausalLM", cfg, device), _text_inputs(device)


# --- vision ---------------------------------------------------------------------------------
def _images(device: str | torch.device, side: int, classes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(BATCH, 3, side, side, generator=g)
    labels = torch.randint(0, classes, (BATCH,), generator=g)
    return {"pixel_values": pixels.to(device), "labels": labels.to(device)}


NUM_LABELS = 10
"""Classes of the vision models' heads."""


def vit(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.ViTConfig(num_labels=NUM_LABELS, **_sizes(small, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=128, image_size=IMAGE, patch_size=8))
    return _build("ViTForImageClassification", cfg, device), _images(device, cfg.image_size, NUM_LABELS)


def resnet(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.ResNetConfig(num_labels=NUM_LABELS, **_sizes(small, embedding_size=16, hidden_sizes=[32, 64],
                                                         depths=[1, 1]))
    return _build("ResNetForImageClassification", cfg, device), _images(device, IMAGE if small else 224, NUM_LABELS)


def convnext(device: str | torch.device = "meta", small: bool = True) -> Built:
    t = _transformers()
    cfg = t.ConvNextConfig(num_labels=NUM_LABELS, **_sizes(small, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                                           image_size=IMAGE))
    return _build("ConvNextForImageClassification", cfg, device), _images(device, cfg.image_size, NUM_LABELS)


def swin(device: str | torch.device = "meta", small: bool = True) -> Built:
    """Swin with its default stochastic depth (`drop_path_rate` 0.1): drop path draws `torch.rand` in
    forward, a site-keyed draw like dropout's masks (engine/model/dropout.py). Its hidden and
    attention dropout stay as the default config has them."""
    t = _transformers()
    cfg = t.SwinConfig(num_labels=NUM_LABELS, **_sizes(small, image_size=IMAGE, embed_dim=16, depths=[2, 1],
                                                       num_heads=[2, 4], window_size=4))
    return _build("SwinForImageClassification", cfg, device), _images(device, cfg.image_size, NUM_LABELS)


# --- plain torch ----------------------------------------------------------------------------
class TransformerClassifier(nn.Module):
    """Token embedding + learned positions -> nn.TransformerEncoder -> mean pool -> class logits."""

    def __init__(self, vocab: int = VOCAB, width: int = 64, heads: int = 4, layers: int = 2, seq: int = SEQ,
                 classes: int = NUM_LABELS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, seq, width))
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids) + self.pos)  # (B, T, width)
        return F.cross_entropy(self.head(h.mean(dim=1)), labels)


class ResidualCNN(nn.Module):
    """Conv-BN-ReLU stem, two residual blocks (BatchNorm, identity and 1x1-projection skips),
    adaptive average pooling and a linear head."""

    def __init__(self, width: int = 16, classes: int = NUM_LABELS) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = self._block(width, width, 1)
        self.block2 = self._block(width, 2 * width, 2)
        self.project = nn.Sequential(nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, classes)

    @staticmethod
    def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.stem(pixel_values)
        h = F.relu(h + self.block1(h))
        h = F.relu(self.project(h) + self.block2(h))
        return F.cross_entropy(self.head(self.pool(h).flatten(1)), labels)


def transformer_classifier(device: str | torch.device = "meta", small: bool = True) -> Built:
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerClassifier() if small else TransformerClassifier(vocab=30522, width=768, heads=12, layers=12)
    inputs = {"input_ids": _tokens(device, vocab=model.embed.num_embeddings),
              "labels": torch.randint(0, NUM_LABELS, (BATCH,), generator=torch.Generator().manual_seed(1)).to(device)}
    return model.train(), inputs


def residual_cnn(device: str | torch.device = "meta", small: bool = True) -> Built:
    torch.manual_seed(0)
    with torch.device(device):
        model = ResidualCNN() if small else ResidualCNN(width=64)
    return model.train(), _images(device, IMAGE if small else 224, NUM_LABELS)


ENCODERS = {"bert": bert, "roberta": roberta, "distilbert": distilbert}
ENCODER_DECODERS = {"t5": t5, "bart": bart}
DECODERS = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "mixtral": mixtral, "gpt2": gpt2,
            "gpt_neox": gpt_neox, "opt": opt, "phi": phi, "gemma": gemma}
VISION = {"vit": vit, "resnet": resnet, "convnext": convnext, "swin": swin}
PLAIN = {"transformer_classifier": transformer_classifier, "residual_cnn": residual_cnn}
MODELS: dict[str, Callable[..., Built]] = {**DECODERS, **ENCODERS, **ENCODER_DECODERS, **VISION, **PLAIN}
"""Every model of the coverage bench: name -> builder(device, small=True) -> (module, example inputs)."""


def build(name: str, device: str | torch.device = "meta", small: bool = True) -> Built:
    """`(module, example_inputs)` of the model `name` on `device`; ModelError names the known ones."""
    if name not in MODELS:
        raise ModelError(f"unknown ecosystem model '{name}' (available: {', '.join(MODELS)})")
    return MODELS[name](device, small)


def draw_inputs(name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A fresh batch for model `name` drawn from torch's global RNG (the model-file contract of
    engine/model/source.py: the runner seeds that RNG per step): token ids and text labels in
    [3, vocab), class labels in [0, NUM_LABELS), all-ones masks, normal pixels; shapes as `build`'s."""
    _, example = build(name, "meta")
    classes = name in VISION or name in PLAIN
    out = {}
    for key, t in example.items():
        shape = tuple(t.shape)
        if key == "attention_mask":
            out[key] = torch.ones(shape, dtype=t.dtype)
        elif t.dtype.is_floating_point:
            out[key] = torch.randn(shape, dtype=t.dtype)
        elif key == "labels" and classes:
            out[key] = torch.randint(0, NUM_LABELS, shape)
        else:
            out[key] = torch.randint(3, VOCAB, shape)
    return {k: v.to(device) for k, v in out.items()}


MODEL_FILE = '''"""{name} from engine.model.zoo.ecosystem, in the model-file contract of engine/model/source.py."""
import torch

from engine.model.zoo import ecosystem


def build_model() -> torch.nn.Module:
    return ecosystem.build({name!r}, torch.get_default_device())[0]


def example_inputs() -> dict:
    return ecosystem.draw_inputs({name!r}, torch.get_default_device())
'''
"""A model file (`hap plan --model FILE`) for an ecosystem model: the runner rebuilds it from this."""


def model_file(name: str) -> str:
    """The text of a model file for `name` (see MODEL_FILE)."""
    build(name, "meta")  # an unknown name fails here, not on every rank
    return MODEL_FILE.format(name=name)
