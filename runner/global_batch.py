"""A global batch as the library API takes it (runner.api, runner.pipeline_api), and the API's error.

Every rank is given the same global batch, a tuple in the model's input order or a dict by input name;
`flat_batch` puts it in the plan's input order and checks each tensor's shape against the plan's, so a
local batch passed by mistake is named, not silently mis-sliced.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from engine.errors import HapError
from engine.model.graph import Graph


class ApiError(HapError):
    """The library API was used in a way the plan cannot honour (no process group, a wrong batch, ...)."""


def flat_batch(graph: Graph, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The global batch in the plan's input order, each tensor checked against the plan's shape."""
    inputs = sorted((n for n in graph.nodes if n.op == "placeholder"), key=lambda n: n.attrs["index"])
    if isinstance(batch, Mapping):
        missing = [str(n.attrs.get("name", n.name)) for n in inputs if n.attrs.get("name", n.name) not in batch]
        if missing:
            raise ApiError(f"the global batch has no {', '.join(missing)}; the plan's model takes "
                           f"{', '.join(str(n.attrs.get('name', n.name)) for n in inputs)}")
        batch = [batch[n.attrs.get("name", n.name)] for n in inputs]
    flat = tuple(batch)
    if len(flat) != len(inputs):
        raise ApiError(f"the global batch has {len(flat)} tensors; the plan's model takes {len(inputs)} "
                       f"({', '.join(str(n.attrs.get('name', n.name)) for n in inputs)})")
    ones = set(graph.origin.get("assumes_all_ones", ()))
    for t, n in zip(flat, inputs):
        name = n.attrs.get("name", n.name)
        if tuple(t.shape) != tuple(n.shape):
            raise ApiError(f"input {name} has shape {list(t.shape)} but the plan was made "
                           f"for {list(n.shape)}: give the global batch (every rank the same), not a local one")
        if name in ones and not bool((t == 1).all()):
            raise ApiError(f"input {name} has entries other than 1, but the model's forward branches on {name} and "
                           f"the plan was captured for it all ones (no padding): give batches without padding")
    return flat
