"""Hugging Face `transformers` architectures built from a config (never a weight download).

`transformers` is an optional extra (`pip install -e ".[hf]"`): it is imported only when one of
these models is built. Each entry wraps a transformers model in a module whose forward takes the
zoo's positional batch and returns the loss, so the runner can rebuild and train it like any zoo
model. Dropout is a knob (`dropout`: the hidden and the attention dropout), off by default; with it
on, the runner draws the same masks as single-device training (engine/model/dropout.py).

- `hf_bert`: `BertForMaskedLM`; the loss is the model's own `.loss` (labels = the tokens, every
  position predicted, so no label is the ignored -100).
- `hf_gpt2`: `GPT2LMHeadModel` body; the loss is a cross-entropy of its logits against the next
  tokens, computed here. GPT-2 builds its attention mask with index arithmetic (`diff`, `index`,
  `new_ones`), which capture lowers to ops with rules.
- `hf_llama`: `LlamaForCausalLM` with grouped-query attention (half as many kv heads as heads when
  `heads` is even) and rotary embeddings; the loss is the model's own (labels shifted and padded
  with -100: the mean over the kept targets, which capture keeps exact under sharding).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.errors import ModelError


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is ever fetched
    try:
        import transformers
    except ImportError:
        raise ModelError("this zoo model needs the optional 'transformers' package: pip install -e \".[hf]\"") from None
    from engine.model.zoo.experts import register

    register(transformers)  # the experts forward a capture can take at real sizes (`hap_dense`)
    return transformers


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """Size knobs shared by the transformers zoo entries (defaults: BERT-Base / GPT-2 small widths)."""

    layers: int = 12
    """Transformer blocks."""
    hidden: int = 768
    """Model width."""
    heads: int = 12
    """Attention heads; must divide `hidden`."""
    ffn: int = 3072
    """Feed-forward width."""
    vocab: int = 30522
    """Vocabulary size."""
    seq_len: int = 128
    """Sequence length (also the model's maximum positions)."""
    batch: int = 64
    """Global batch size."""
    dropout: float = 0.0
    """Dropout probability of the hidden states and of the attention probabilities (0.1 in BERT and GPT-2)."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")


class HFBert(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        t = _transformers()
        config = t.BertConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                              num_attention_heads=cfg.heads, intermediate_size=cfg.ffn,
                              max_position_embeddings=cfg.seq_len, hidden_dropout_prob=cfg.dropout,
                              attention_probs_dropout_prob=cfg.dropout)
        self.model = t.BertForMaskedLM(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class HFGPT2(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        t = _transformers()
        config = t.GPT2Config(vocab_size=cfg.vocab, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads,
                              n_inner=cfg.ffn, n_positions=cfg.seq_len, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                              attn_pdrop=cfg.dropout, use_cache=False, bos_token_id=0, eos_token_id=0)
        self.model = t.GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class HFLlama(nn.Module):
    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        t = _transformers()
        config = t.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                               num_attention_heads=cfg.heads, intermediate_size=cfg.ffn,
                               num_key_value_heads=cfg.heads // 2 if cfg.heads % 2 == 0 else cfg.heads,
                               max_position_embeddings=cfg.seq_len, attention_dropout=cfg.dropout, use_cache=False,
                               bos_token_id=0, eos_token_id=0)
        self.model = t.LlamaForCausalLM(config)  # Llama's only dropout is its attention dropout

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build_llama(cfg: HFConfig) -> nn.Module:
    return HFLlama(cfg)


def build_bert(cfg: HFConfig) -> nn.Module:
    return HFBert(cfg)


def build_gpt2(cfg: HFConfig) -> nn.Module:
    return HFGPT2(cfg)


def example_inputs(cfg: HFConfig, device: str | torch.device = "meta", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Token ids and targets: the tokens themselves for hf_bert (MLM labels), the next tokens for hf_gpt2."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
