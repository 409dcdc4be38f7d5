"""Model zoo: models built from code and a config, so no weights ever come from the internet.

`ZOO[name]` holds the config class, the module builder and an example-batch maker. `make_config`
turns user knobs (strings from the CLI or numbers from scripts) into a validated config.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine import limits
from engine.errors import ModelError
from engine.model.zoo import bert, bert_moe, gpt, hf, mlp, vgg19, vit


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its config dataclass, how to build it, how to make a batch for it."""

    config_cls: type
    build: Callable[[Any], torch.nn.Module]
    example_inputs: Callable[..., tuple[torch.Tensor, ...]]


ZOO: dict[str, ZooEntry] = {
    "mlp": ZooEntry(mlp.MLPConfig, mlp.build, mlp.example_inputs),
    "gpt": ZooEntry(gpt.GPTConfig, gpt.build, gpt.example_inputs),
    "vgg19": ZooEntry(vgg19.VGG19Config, vgg19.build, vgg19.example_inputs),
    "vit": ZooEntry(vit.ViTConfig, vit.build, vit.example_inputs),
    "bert": ZooEntry(bert.BertConfig, bert.build, bert.example_inputs),
    "bert_moe": ZooEntry(bert_moe.BertMoEConfig, bert_moe.build, bert_moe.example_inputs),
    "hf_bert": ZooEntry(hf.HFConfig, hf.build_bert, hf.example_inputs),
    "hf_gpt2": ZooEntry(hf.HFConfig, hf.build_gpt2, hf.example_inputs),
    "hf_llama": ZooEntry(hf.HFConfig, hf.build_llama, hf.example_inputs),
}


def entry(name: str) -> ZooEntry:
    if name not in ZOO:
        near = difflib.get_close_matches(name, ZOO, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ModelError(f"unknown zoo model '{name}' (available: {', '.join(sorted(ZOO))}){hint}")
    return ZOO[name]


def _coerce(name: str, field: dataclasses.Field, value: Any) -> Any:
    kind = field.type if isinstance(field.type, type) else {"int": int, "bool": bool, "float": float, "str": str}.get(str(field.type), str)
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ModelError(f"knob '{name}': expected {kind.__name__}, got {value!r}") from None


def make_config(name: str, **knobs: Any) -> Any:
    """A validated config for zoo model `name`; unknown or bad knobs raise ModelError naming them."""
    cls = entry(name).config_cls
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in knobs.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ModelError(f"unknown knob '{key}' for zoo model '{name}' (knobs: {', '.join(fields)}){hint}")
        problem = limits.knob_problem(key, value)  # before coercion: int('1e999') must never be attempted
        if problem:
            raise ModelError(problem)
        values[key] = _coerce(key, fields[key], value)
        if fields[key].type in ("int", int) and values[key] <= 0:
            raise ModelError(f"knob '{key}' must be a positive integer, got {values[key]}")
        problem = limits.knob_problem(key, values[key])
        if problem:
            raise ModelError(problem)
    try:
        return cls(**values)
    except ValueError as e:
        raise ModelError(f"zoo model '{name}': {e}") from None
