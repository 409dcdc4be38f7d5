"""A tiny Llama (GQA, RoPE) from transformers' default LlamaConfig with the sizes shrunk.

    hap plan --model examples/llama_tiny.py --cluster sample_clusters/cpu_4_uneven.json --out p.json
    hap run p.json --steps 3 --verify

The file contract (engine.model.source): build_model() returns the model, example_inputs() its keyword
inputs; both create tensors on the default device (the planner calls them on `meta`, the runner on
the CPU) and the batch is drawn from torch's global RNG, which the runner seeds per step.
"""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config only: nothing is downloaded
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

BATCH, SEQ_LEN = 6, 16
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=SEQ_LEN)


def build_model() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def example_inputs() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ_LEN))
    return {"input_ids": input_ids, "attention_mask": torch.ones(BATCH, SEQ_LEN, dtype=torch.long),
            "labels": torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ_LEN))}
