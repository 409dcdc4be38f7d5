"""Activation recomputation in a rank's program (issue 26; the plan's `recompute` layers, chosen and
priced by `engine.spmd.recompute`).

`build_rank_program` tags every fx node with the layer of the instruction that emitted it (a
collective or a load belongs to the layer of the compute that follows it,
`engine.spmd.recompute.instruction_layers`). `checkpoint_layers` then moves each run of nodes of a
recomputed layer into a sub-`GraphModule` (`layer_3`, readable with `print(gm.layer_3.inner.code)`)
called under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: autograd keeps the run's
inputs only and runs the run's forward again when backward reaches it.

Collectives inside a recomputed layer run again in backward, on every rank in the same order: every
rank recomputes the same layers and the whole layer is recomputed (`early_stop=False`, so no rank stops
before a collective its peers run). They run on the process group and observer of the forward
(`runner.collectives.stream`, restored by the checkpoint's recompute context), which a duplex half's
thread sets. Dropout masks are a function of (seed, step, site, global index)
(`engine.model.dropout`): the recomputed mask is the forward's, with no RNG state to restore.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from .collectives import current_group, current_observer, stream

LAYER = "hap_layer"
"""The fx node meta key holding the layer of the instruction that emitted the node."""


def tag_layer(g: fx.Graph, layer: int) -> None:
    """Tag the nodes emitted since the last tagged one with `layer` (called after each instruction)."""
    for node in reversed(g.nodes):
        if LAYER in node.meta:
            return
        node.meta[LAYER] = layer


class Checkpointed(torch.nn.Module):
    """One run of a recomputed layer: `inner` called under non-reentrant activation checkpointing."""

    def __init__(self, inner: fx.GraphModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=_same_stream, early_stop=False)


def _same_stream() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Checkpoint contexts: forward as is; the recomputation on the forward's process group and observer
    (on CUDA the autograd engine runs backward on a thread of its own)."""
    return contextlib.nullcontext(), stream(current_group(), current_observer())


def checkpoint_layers(g: fx.Graph, recompute: frozenset[int], class_name: str) -> fx.GraphModule:
    """The program of `g` with every run of nodes of a recomputed layer called under checkpoint."""
    root = torch.nn.Module()
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    count: dict[int, int] = {}
    for node in g.nodes:  # the arguments first, in call order: a load inside a layer does not cut its run
        if node.op == "placeholder":
            env[node] = out.node_copy(node, lambda x: env[x])
    for layer, run in _runs(g, recompute):
        if layer is None:
            env[run[0]] = out.node_copy(run[0], lambda x: env[x])
            continue
        name = f"layer_{layer}" + (f"_{count[layer]}" if layer in count else "")
        count[layer] = count.get(layer, 0) + 1
        inner, inputs, outputs = _sub_module(run, class_name + name.title().replace("_", ""))
        root.add_module(name, Checkpointed(inner))
        call = out.call_module(name, tuple(env[i] for i in inputs))
        for j, node in enumerate(outputs):
            env[node] = out.call_function(operator.getitem, (call, j))
    return fx.GraphModule(root, out, class_name=class_name)


def _runs(g: fx.Graph, recompute: frozenset[int]) -> Iterator[tuple[int | None, list[fx.Node]]]:
    """Maximal runs of consecutive computed nodes of one recomputed layer, and every other node alone
    (layer None); placeholders are left out (the caller places them), the output stays outside."""
    run: list[fx.Node] = []
    current: int | None = None
    for node in g.nodes:
        if node.op == "placeholder":
            continue
        layer = node.meta.get(LAYER)
        inside = node.op != "output" and layer in recompute
        if run and (not inside or layer != current):
            yield current, run
            run = []
        if inside:
            run.append(node)
            current = layer
        else:
            yield None, [node]
    if run:
        yield current, run


def _sub_module(run: list[fx.Node], class_name: str) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The run as a GraphModule taking the values it uses from outside and returning (as a tuple)
    those used after it."""
    members = set(run)
    inputs = list(dict.fromkeys(i for node in run for i in node.all_input_nodes if i not in members))
    outputs = [node for node in run if any(u not in members for u in node.users)]
    sub = fx.Graph()
    env = {i: sub.placeholder(i.name) for i in inputs}
    for node in run:
        env[node] = sub.node_copy(node, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), sub, class_name=class_name), inputs, outputs
