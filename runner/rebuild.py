"""The single-device model a plan was made for, rebuilt from the plan's recorded origin (zoo, file, hf).

Every rank builds it (then keeps its slices, runner.train), and so do the single-device reference,
the weights writer (runner.weights) and the profiler.
"""
from __future__ import annotations

import torch

from engine.model import source, zoo
from engine.spmd.plan import Plan


def build_module(plan: Plan, seed: int, device: str = "cpu") -> torch.nn.Module:
    """The single-device model the plan was made for, initialised from `seed` on the CPU (`device="meta"`:
    its structure only, for checks before a run).

    Zoo models are called with the positional batch; file and Hugging Face models (engine.model.source)
    come back with a forward that takes the flat batch of `make_batch` and returns the loss. Every
    rank builds the whole model once (its memory cost) and then keeps only its slices."""
    origin = plan.graph.origin
    if "zoo" not in origin:
        return source.build_module(origin, seed, device)
    entry = zoo.entry(origin["zoo"])
    torch.manual_seed(seed)
    with torch.device(device):
        return entry.build(source.zoo_config(origin))
