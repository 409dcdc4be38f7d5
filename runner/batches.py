"""Where a run's global batches come from: a token dataset, the model file's `batches(step)`, or drawn.

Every source is a pure function of the global batch number (microstep k of a run: optimiser step s with
accumulation K draws batches s*K .. s*K+K-1), so every rank, the single-device reference and a resumed
run see the same data in the same order:

- `--data PATH` (runner.data): token ids of a Parquet/Arrow dataset in a seeded order, given to the
  plan's inputs by name: `input_ids` and `labels` get the tokens (transformers' causal LMs shift the
  labels themselves), `attention_mask` ones, `token_type_ids` zeros;
- a model file that defines `batches(step)`: its global batch for that number (images, custom inputs);
- otherwise the random batch of the model's `example_inputs` seeded per number (`runner.train.make_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.errors import HapError
from engine.model import source, zoo
from engine.model.graph import Graph

TOKEN_INPUTS = ("input_ids", "labels")
"""Inputs filled with the dataset's token ids."""
FILLED = {"attention_mask": 1, "token_type_ids": 0}
"""Inputs a token dataset fills with a constant."""


@dataclass(frozen=True)
class PlanInput:
    """One input of the plan's model, in capture order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_inputs(graph: Graph) -> list[PlanInput]:
    nodes = sorted((n for n in graph.nodes if n.op == "placeholder"), key=lambda n: n.attrs["index"])
    return [PlanInput(str(n.attrs.get("name", n.name)), tuple(n.shape), getattr(torch, n.dtype)) for n in nodes]


def vocab_size(graph: Graph) -> int | None:
    """Rows of the embedding table that reads `input_ids` (None when no embedding reads it)."""
    ids = [n.id for n in graph.nodes if n.op == "placeholder" and n.attrs.get("name") == "input_ids"]
    for n in graph.nodes:
        if n.op == "embedding" and ids and ids[0] in n.inputs:
            table = [graph[i] for i in n.inputs if graph[i].op == "parameter"]
            if table:
                return int(table[0].shape[0])
    return None


@dataclass
class Batches:
    """The global batch of number k (`batches(k)`), and what one batch holds."""

    draw: Callable[[int], tuple[torch.Tensor, ...]]
    tokens: int | None = None
    """Tokens in one batch (None when the inputs are not tokens)."""
    describe: str = "random batches of the model's example inputs"
    tokenizer: str | None = None
    """The transformers tokenizer folder the dataset was prepared with (its files go beside a saved model)."""
    count: int | None = None
    """How many distinct batches there are in order (evaluation data: the held-out batches)."""

    def __call__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.draw(index)


def token_batches(graph: Graph, path: str, seed: int, evaluation: bool = False) -> Batches:
    """Batches of a token dataset for the plan's inputs (in the seeded order; `evaluation`: in file order,
    the held-out samples one after another); DataError when the model cannot take tokens."""
    from .data import DataError, TokenDataset, eval_batch, global_batch  # pyarrow, only for runs with --data

    inputs = plan_inputs(graph)
    names = [i.name for i in inputs]
    if "input_ids" not in names:
        raise DataError(f"--data gives token ids, but the plan's model takes no input_ids (its inputs: "
                        f"{', '.join(names)}); define batches(step) in the model file instead")
    unknown = [n for n in names if n not in TOKEN_INPUTS and n not in FILLED]
    if unknown:
        raise DataError(f"--data gives input_ids, labels and attention_mask, but the plan's model also takes "
                        f"{', '.join(unknown)}; define batches(step) in the model file instead")
    shape = inputs[names.index("input_ids")].shape
    if len(shape) != 2:
        raise DataError(f"input_ids of the plan's model has shape {list(shape)}; a token dataset gives (batch, sequence)")
    batch, seq_len = shape
    ds = TokenDataset.open(path, seq_len)
    vocab = vocab_size(graph)
    if vocab is not None:
        ds.check_vocab(vocab)

    def draw(index: int) -> tuple[torch.Tensor, ...]:
        tokens = eval_batch(ds, index, batch) if evaluation else global_batch(ds, index, seed, batch)
        return tuple(tokens.to(i.dtype) if i.name in TOKEN_INPUTS else torch.full(i.shape, FILLED[i.name], dtype=i.dtype)
                     for i in inputs)

    return Batches(draw, batch * seq_len, ds.describe(), None if ds.tokenizer in (None, "bytes") else ds.tokenizer,
                   len(ds) // batch)


def file_batches(origin: dict[str, Any]) -> Batches | None:
    """The model file's `batches(step)`, checked against the plan's inputs; None when it has none."""
    if "file" not in origin:
        return None
    module, filename = source.checked_module(origin["file"], origin.get("sha256"))
    fn = getattr(module, "batches", None)
    if fn is None:
        return None

    def draw(index: int) -> tuple[torch.Tensor, ...]:
        with torch.device("cpu"):
            tensors = source.flat_tensors(source.call_file_function(filename, "batches", lambda: fn(index)))
        source.check_batch(origin, tensors, what="batches(step)")
        return tensors

    return Batches(draw, None, f"{filename}: batches(step)")


def batch_source(graph: Graph, seed: int, data: str | None = None, evaluation: bool = False) -> Batches:
    """The run's batches (see the module docstring); `evaluation`: a dataset's batches in file order."""
    if data:
        return token_batches(graph, data, seed, evaluation)
    found = file_batches(graph.origin)
    if found is not None:
        return found
    return Batches(lambda index: drawn_batch(graph.origin, index, seed))


def drawn_batch(origin: dict[str, Any], index: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Batch `index` drawn from the model's example inputs, seeded by (seed, index), on the CPU."""
    if "zoo" not in origin:
        return source.make_batch(origin, seed, index)
    entry = zoo.entry(origin["zoo"])
    return tuple(entry.example_inputs(source.zoo_config(origin), "cpu", seed=seed * source.BATCH_SEED + index))


def check_source(batches: Batches) -> None:
    """Draw batch 0 once before training, so a bad source fails with one line before any step."""
    try:
        batches(0)
    except HapError:
        raise
    except Exception as e:  # a model file's batches(step) that raises
        raise HapError(f"{batches.describe}: drawing batch 0 failed: {type(e).__name__}: {e}") from None
