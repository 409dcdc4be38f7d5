"""Model capture: a `torch.nn.Module` plus example inputs -> the graph IR (HAP §3: the graph (V, E)).

We trace with `torch.export` (non-strict) so fake tensors stand in for the data: on the `meta`
device no weight is ever allocated, so a 10B-parameter model captures on a laptop. The ATen
training IR is then mapped onto a small set of canonical operators that the theory has rules for
(`_HANDLERS` below); `linear` with a bias is split into `linear` + `add` so that row-parallel
linear (which yields `Partial`) stays expressible.

What real models bring, and what capture does with it:

- In-place operators (`x += y`, `masked_fill_`): the program is functionalized first
  (`functionalize`: `run_decompositions` with an empty table), only when it mutates a tensor.
- Dead code: only the nodes the loss depends on are lowered (`_live_nodes`); a KV cache built in
  forward, or logits nobody returns, are never refused.
- Tensor constants made in forward (lifted by torch.export, e.g. `torch.tensor(4096)` or an empty
  KV cache): a `constant` node with no operand whose value is stored in the graph JSON as a nested
  list (`attrs["value"]`, at most `CONSTANT_LIMIT` bytes; empty ones need no data, so meta ones
  are fine). Every rank rebuilds it from the plan alone, Full (`ops.run_node`); a larger or a
  meta constant with data is refused (register it as a buffer). Buffers computed at init (rotary
  `inv_freq`) stay `buffer` leaves, which the runner takes from the rebuilt module.
- Mask and position arithmetic (`arange`, `new_ones`, `index`, `diff`, `pad`, `where`, ...) and
  grouped-query attention (`enable_gqa`, `repeat_interleave`) become canonical nodes with rules.
- Mean cross-entropy divides by the number of targets that are not `ignore_index`, a node of its
  own, so that the loss stays exact when its targets are sharded (see `_h_cross_entropy`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import operator
import re
import string
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine.errors import HapError, ModelError, ParameterWriteError, UnsupportedOpError
from engine.model.dropout import MASK_OPS_PER_ELEMENT, RANDN_OPS_PER_ELEMENT
from engine.model.graph import Graph, Node, parse_equation
from engine.model.strided import NotAView, as_strided_steps
from engine.model.values import KnownValues

_UNARY = {"relu": "relu", "gelu": "gelu", "tanh": "tanh", "sigmoid": "sigmoid", "silu": "silu",
          "exp": "exp", "neg": "neg", "clone": "identity", "contiguous": "identity",
          "alias": "identity", "_to_copy": "identity", "to": "identity", "rsqrt": "rsqrt", "sqrt": "sqrt",
          "lift_fresh_copy": "identity", "detach": "identity", "type_as": "identity", "cos": "cos", "sin": "sin",
          "logical_not": "logical_not", "bitwise_not": "bitwise_not"}
_UNARY.update({"special_erf": "erf", "special_expm1": "expm1", "special_log1p": "log1p"})
_UNARY.update({name: name for name in ("hardswish", "hardsigmoid", "log_sigmoid", "mish")})
_UNARY.update({name: name for name in ("abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cosh", "erf",
                                       "expm1", "floor", "log", "log10", "log1p", "log2", "reciprocal", "sign", "sinh",
                                       "tan", "trunc", "isinf", "isnan")})
_BINARY = {"add", "sub", "mul", "div", "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "pow",
           "maximum", "minimum", "atan2", "remainder", "fmod", "logical_xor"}
_BINARY_ALIASES = {"__and__": "and", "bitwise_and": "and", "__or__": "or", "bitwise_or": "or", "__xor__": "xor",
                   "bitwise_xor": "xor"}
"""Bitwise and/or/xor: of booleans the logical ones, of integers the bitwise ones."""
_ARITHMETIC_ALIASES = {"multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub"}
"""Other names of binary operators (`torch.multiply`), which some traces record as they were called."""
_SCALAR_FIRST = ("add", "sub", "mul", "div", "div_floor", "div_trunc", "pow", "remainder")
"""Binary operators whose first operand may be a Python number (`2 ** x`, `1 - x`)."""
_NO_OPS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
"""Checks torch.export records for itself: they compute nothing."""
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze"}
_CATS = ("cat", "concat", "concatenate")
"""The names torch records concatenation under (Zamba2 and xLSTM call `torch.concatenate`)."""
_UNARY_FLOPS = {"gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "exp": 1, "rsqrt": 1, "sqrt": 1, "cos": 4, "sin": 4,
                "hardswish": 4, "hardsigmoid": 3, "log_sigmoid": 6, "mish": 10}


class _Builder:
    """Accumulates canonical nodes while walking the exported program."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.ids: dict[str, int] = {}
        self.multi: dict[str, list[int | None]] = {}
        """Multi-output nodes: the node id of each output (None for an output nothing models)."""
        self.buffers: dict[str, str] = {}
        """Buffers (fx name -> module path); they are `buffer` leaves, pruned when the loss does not use them."""
        self.rng_sites = 0
        """Dropout sites numbered in lowering order (only for programs `number_dropout_sites` did not number)."""
        self.pairs: set[str] = set()
        """Complex tensors (fx names), each held as a real node with a trailing dim of 2: (re, im)."""

    def add(self, name: str, op: str, inputs: list[int], shape: tuple[int, ...], dtype: str,
            attrs: dict[str, Any] | None = None, flops: float = 0.0, segment: int = 0, source: str = "") -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(id=nid, name=name, op=op, inputs=tuple(inputs), shape=shape, dtype=dtype,
                               attrs=attrs or {}, flops=float(flops), segment=segment, source=source))
        return nid


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """The static sizes of a traced tensor; refused where a size depends on tensor values (an unbacked symbol
    such as JetMoE's count of routed tokens), which no static graph can hold."""
    if not _static(t):
        raise _Unsupported(f"a tensor whose size depends on tensor values ({', '.join(map(str, t.shape))}): a "
                           "static graph cannot hold it; pick a config or kernel whose shapes are fixed")
    return tuple(int(s) for s in t.shape)


def _static(t: torch.Tensor) -> bool:
    """Whether every size of a traced tensor is a number (not a symbol export left unbacked)."""
    return all(isinstance(s, int) or isinstance(s, torch.SymInt) and s.node.is_constant() for s in t.shape)


def _layer_of(fx_node: torch.fx.Node) -> tuple[int | None, str]:
    """The layer index (first `name.<int>` in the module path) and the module path of a node."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0].removeprefix(_WRAPPED) if stack else ""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return (int(m.group(1)) if m else None), path


def _source(fx_node: torch.fx.Node, path: str) -> str:
    trace = (fx_node.meta.get("stack_trace") or "").strip().splitlines()
    files = [line.strip() for line in trace if line.strip().startswith("File ")]
    user = [f for f in files if "site-packages/torch" not in f]
    where = (user or files or [""])[-1]
    return f"{path or '<top>'} {where}".strip()


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def export_program(module: torch.nn.Module, args: tuple, kwargs: dict,
                   known: dict[str, torch.Tensor] | None = None) -> torch.export.ExportedProgram:
    """torch.export in non-strict mode; a failure becomes a ModelError that says what to try. `known`: keyword
    inputs whose value is the same in every batch (all-ones masks), by name: branches on them are decided
    (engine.model.values)."""
    values = KnownValues(known)
    if isinstance(module, LossOf):
        module.known = values
    try:
        with no_op_conversions(), ParameterWrites(), ValuedScalars(), values:  # KnownValues innermost: its handler reads the model's frame
            ep = torch.export.export(module, args, kwargs, strict=False)
    except ParameterWriteError as e:
        raise ParameterWriteError(f"cannot capture the model: its forward writes a parameter in place{model_line(e)}: "
                                  f"{e}") from None
    except Exception as e:  # torch raises many exception types from tracing
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot capture the model with torch.export: {first}{where_in_model(e, module)}") from e
    return number_dropout_sites(inline_grad_mode_regions(ep))


@contextlib.contextmanager
def no_op_conversions() -> Iterator[None]:
    """While a forward is traced, `module.to(dtype)` (or `.float()`, `.to(device)`) that changes no parameter or
    buffer returns the module untouched: Switch Transformers' router runs `self.classifier.to(float32)` in forward.

    torch converts a module by swapping each fake parameter for a new one even when the tensor is unchanged, which
    fails under export ("Couldn't swap Linear.weight"); an identity conversion changes nothing, so it is skipped. A
    conversion that changes a tensor (weights cast in forward) is still refused, with what to try."""
    original = torch.nn.Module._apply

    def apply(module: torch.nn.Module, fn: Callable, recurse: bool = True) -> torch.nn.Module:
        tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
        with torch.no_grad():
            if all(fn(t) is t for t in tensors):
                return module
        try:
            return original(module, fn, recurse)
        except RuntimeError as e:
            raise RuntimeError(f"its forward converts the parameters of {type(module).__name__} to another dtype or "
                               f"device (Module.to), which a captured program cannot hold; give the model that dtype "
                               f"from the start ({e})") from e

    torch.nn.Module._apply = apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


def model_line(e: BaseException) -> str:
    """" at FILE:LINE `code`" of the model's own line an exception was raised from ("" when none is)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not _library_frame(f.filename)]
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} `{(frames[-1].line or '').strip()}`" if frames else ""


def where_in_model(e: BaseException, module: torch.nn.Module) -> str:
    """The model's own line a capture failed at, and the config keys that line reads (a flag to try), or the
    general advice: a data-dependent branch is only removable in the model's code or by its config."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not _library_frame(f.filename)]
    if not frames:
        return " (make forward() free of data-dependent Python control flow)"
    f = frames[-1]
    text = model_line(e)
    keys = _config_keys_read(f.line or "", getattr(getattr(module, "inner", module), "config", None))
    if keys:
        return text + (f"; the line reads the config's {' or '.join(keys)}: set it so the branch goes away "
                       f"(e.g. --set {keys[0]}=0)")
    return text + " (make this branch independent of tensor values, or capture with other config flags)"


def _library_frame(filename: str) -> bool:
    """Frames of torch and of this package: a capture failure is reported at the model's own line."""
    parts = Path(filename).parts
    return "torch" in parts or "engine" in parts and "model" in parts or filename.startswith("<")


def _config_keys_read(line: str, config: Any) -> list[str]:
    """Config keys that contain a name the line reads (`self.layerdrop` -> encoder_layerdrop, decoder_layerdrop)."""
    if config is None or not hasattr(config, "to_dict"):
        return []
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", line)) - {"self", "config", "torch", "training"}
    return sorted(k for k in config.to_dict() if any(n in k for n in names))


class ValuedScalars(torch.overrides.TorchFunctionMode):
    """Scalars made in forward from Python numbers on the meta device are made on the CPU instead, and lists of
    ints in arithmetic progression by `arange` (`_meta_progression`).

    A model captured on meta has no values, so `torch.tensor(finfo.min, device=x.device)` (GPT-Neo's mask
    value) would become a constant without a value. A 0-dim CPU tensor mixes with meta tensors like a
    Python number, so the constant keeps its value and the graph stores it (`_constant`); nothing else
    changes. (`torch.full` needs nothing: it is captured as an operator with its fill value.)"""

    _MAKERS = {torch.tensor, torch.scalar_tensor, torch.as_tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._MAKERS and _meta_scalar(func, args, kwargs):
            kwargs["device"] = "cpu"
        elif func in self._MAKERS and (steps := _meta_progression(args, kwargs)) is not None:
            return torch.arange(*steps, dtype=kwargs.get("dtype") or torch.int64, device="meta")
        elif func is torch.Tensor.__getitem__ and len(args) == 2 and _on_meta(args[0]):
            args = (args[0], _valued_index(args[1]))  # Falcon's `qkv[..., [-2], :]`: the list becomes a constant
        return func(*args, **kwargs)


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
"""Tensor methods named like in-place operators that change no values."""


class ParameterWrites(torch.overrides.TorchFunctionMode):
    """Refuses, at the model's line, an in-place operator on a parameter or on its `.data` in forward (Gemma 3n's
    `weight.data.clamp_(-clip, clip)` while training): torch.export would fail later with "a fake tensor in the
    exported program constant's list", naming no line."""

    def __init__(self) -> None:
        super().__init__()
        self._aliases: dict[int, weakref.ref] = {}
        """The `.data` of parameters taken in forward, by id."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {})) if not self._writes(func, args) else self._refuse(func)
        if func == torch.Tensor.data.__get__ and args and isinstance(args[0], torch.nn.Parameter):  # a new wrapper each time
            self._aliases[id(out)] = weakref.ref(out)
        return out

    def _writes(self, func: Any, args: tuple) -> bool:
        name, x = getattr(func, "__name__", ""), args[0] if args else None
        if not (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and isinstance(x, torch.Tensor)):
            return False
        alias = self._aliases.get(id(x))
        return isinstance(x, torch.nn.Parameter) or (alias is not None and alias() is x)

    @staticmethod
    def _refuse(func: Any) -> Any:
        raise ParameterWriteError(f"Tensor.{func.__name__} on a parameter or its .data (a weight clip while "
                                  "training) updates the weights outside autograd and the optimizer, which a captured "
                                  "program cannot hold; write a model file whose forward leaves its parameters alone "
                                  "(clip them after the optimizer step)")


def _on_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _valued_index(index: Any) -> Any:
    """An index with its Python lists of ints made CPU tensors (indexing takes them on any device), so the
    index constant keeps its values; anything else unchanged."""
    def one(i: Any) -> Any:
        if isinstance(i, list) and i and all(isinstance(v, int) and not isinstance(v, bool) for v in i):
            return torch.tensor(i, device="cpu")
        return i
    return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


def _meta_progression(args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(start, end, step) where a tensor maker is asked for a list of ints in arithmetic progression on the meta
    device (CPM-Ant's `torch.tensor(list(range(n))[::-1], device=x.device)`): made by `arange`, which the graph
    records with its bounds, the tensor has its values; None for any other request."""
    device, data = kwargs.get("device"), args[0] if args else kwargs.get("data")
    if device is None or torch.device(device).type != "meta" or not isinstance(data, (list, tuple)) or len(data) < 2:
        return None
    if not all(type(v) is int for v in data):
        return None
    step = data[1] - data[0]
    if step == 0 or any(b - a != step for a, b in zip(data, data[1:])):
        return None
    return data[0], data[-1] + step, step


def _meta_scalar(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor maker is asked for a 0-dim tensor of a Python number on the meta device."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "meta":
        return False
    data = args[0] if args else kwargs.get("data", kwargs.get("s"))
    return isinstance(data, (int, float, bool))


_SET_GRAD = getattr(getattr(torch.ops, "higher_order", None), "wrap_with_set_grad_enabled", None)


def inline_grad_mode_regions(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Inline the `torch.no_grad()` / `enable_grad()` regions that export keeps as submodules.

    Non-strict export (torch 2.11 on) records a grad-mode region as
    `wrap_with_set_grad_enabled(enabled, submod, *operands)` read back by `getitem`s; transformers'
    rotary embeddings run under `no_grad`. The planner lowers ATen operators one by one, so the
    region's operators are copied into the program in place of the call (the grad mode itself
    changes no value; like `detach`, it is not modelled). Nested regions are inlined in turn."""
    if _SET_GRAD is None:
        return ep
    gm = ep.graph_module
    graph = gm.graph
    while True:
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target is _SET_GRAD]
        if not calls:
            break
        for call in calls:
            _inline_region(gm, call)
    graph.lint()
    gm.recompile()
    return ep


def _inline_region(gm: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Copy the region's submodule graph before `call`, rewire the `getitem`s of its results, drop the call."""
    graph = gm.graph
    _enabled, holder, *operands = call.args
    sub = getattr(gm, holder.target)
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(operands)
    results: Any = None
    with graph.inserting_before(call):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                results = node.args[0]
            elif node.op == "get_attr":  # a nested region's submodule or a constant: move it up
                name = f"{holder.target}_{node.target}".replace(".", "_")
                setattr(gm, name, getattr(sub, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            else:
                env[node] = graph.node_copy(node, lambda x: env[x])
    outs = torch.fx.map_arg(results, lambda x: env[x])
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(outs, (tuple, list)):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        else:
            user.replace_input_with(call, outs)
    graph.erase_node(call)
    if not holder.users:
        graph.erase_node(holder)


FALLBACKS = (None, "auto", "replicate", "strict")
"""What capture does with an operator it has no rule for (see theory/opaque.py for how an opaque
node runs: unsharded, every operand Full):

- `"auto"` (the default, also `None`): keep it opaque when it is *side arithmetic*, i.e. none of
  its operands carries a gradient (attention-mask and position-id arithmetic on integer or bool
  tensors) or none depends on the input batch (arithmetic on
  parameters and buffers only, e.g. a relative-position bias table). Such an op costs only its
  own compute when replicated, and its result can be sliced to any shard for free. An op on an
  activation (batch-dependent *and* differentiable) is refused with its name: replicating it would
  silently all-gather the activations, the user should know.
- `"replicate"`: keep every such op opaque, activations included.
- `"strict"`: refuse every such op (nothing is replicated without a rule)."""


def loss_of(output: Any) -> Any:
    """The training loss in a model's output: the output itself, its `.loss` field (Hugging Face
    `ModelOutput`), a `"loss"` key, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    return loss


class LossOf(torch.nn.Module):
    """Wraps a model so that its forward returns only the loss (drops caches and logits from the
    outputs torch.export must flatten, e.g. a transformers `DynamicCache`)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.known: KnownValues | None = None
        """Set by export_program: told the traced keyword inputs, so those of known value get it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.known is not None:
            self.known.seed(kwargs)
        return loss_of(self.inner(*args, **kwargs))


_WRAPPED = "inner."


def _by_name(module: torch.nn.Module, args: tuple) -> dict[str, Any] | None:
    """Positional inputs as keywords of `module.forward`, so that inputs keep their names (x, y)
    through the loss-only wrapper; None when they cannot be named (a `*args` forward)."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind_partial(*args)
    except (TypeError, ValueError):
        return None
    if any(sig.parameters[n].kind is inspect.Parameter.VAR_POSITIONAL for n in bound.arguments):
        return None
    return dict(bound.arguments)


def capture(module: torch.nn.Module, example_inputs: tuple | dict, *, name: str = "model",
            origin: dict[str, Any] | None = None, fallback: str | None = None,
            known: dict[str, torch.Tensor] | None = None) -> Graph:
    """Trace `module` on `example_inputs` (positional tuple or keyword dict) into a Graph.

    The loss is the model's output or its `.loss` field. Operators with no rule: by default
    (`fallback=None` or `"auto"`) mask and position arithmetic is kept as opaque all-Full nodes and
    an op on activations is refused; `"replicate"` keeps every one opaque, `"strict"` none (see
    `FALLBACKS`). `known`: inputs (by keyword) whose value is the same in every batch, on the CPU: Python
    branches on them are decided by that value (engine.model.values)."""
    _check_fallback(fallback)
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    else:
        kwargs = _by_name(module, tuple(example_inputs))
        args = () if kwargs is not None else tuple(example_inputs)
    wrapped = LossOf(module)
    ep = functionalize(export_program(wrapped, args, kwargs or {}, known))
    origin = dict(origin or {})
    if wrapped.known is not None and wrapped.known.decided:  # the program holds for these inputs all ones only
        origin["assumes_all_ones"] = sorted(k for k in (known or {}) if k in (kwargs or {}))
    return _to_graph(ep, name=name, origin=origin, fallback=fallback)


_VALUE_PRESERVING = {"detach_"}
"""In-place ops that change no value (`detach_` only cuts autograd history, e.g. in a KV cache)."""


def _mutates(fx: torch.fx.Node, buffers: set[str]) -> bool:
    """Whether a node is an in-place ATen op other than an unused update of a buffer (batch norm's
    `num_batches_tracked += 1`, which `_lower` skips: it is no part of the loss)."""
    target = fx.target
    if fx.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return False
    if target._opname in _VALUE_PRESERVING:
        return False
    return not (fx.args and getattr(fx.args[0], "name", None) in buffers and not fx.users)


def functionalize(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrite in-place operators (`add_`, `masked_fill_`, `copy_` ...) as functional ones.

    `run_decompositions({})` (an empty table: no operator is decomposed) re-traces the program
    through functionalization: `x.add_(y)` becomes `x2 = add(x, y)` with later uses reading `x2`,
    and buffer writes become extra BUFFER_MUTATION outputs (batch norm then appears as
    `_native_batch_norm_legit_functional`). It also turns `dropout` into `native_dropout`, so it
    runs only for programs that really mutate a tensor; the others keep the training IR as is."""
    buffers = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"}
    if not any(_mutates(fx, buffers) for fx in ep.graph_module.graph.nodes):
        return ep
    try:
        return ep.run_decompositions({})
    except Exception as e:  # torch raises many exception types from re-tracing
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot functionalize the model's in-place operators: {first}") from e


def _to_graph(ep: torch.export.ExportedProgram, *, name: str, origin: dict[str, Any], fallback: str | None = None) -> Graph:
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    b = _Builder()
    unsupported: list[str] = []
    segment = 0
    loss: int | None = None
    user_index = 0
    pending_leaves: list[tuple[torch.fx.Node, int]] = []
    live = _live_nodes(ep)
    for fx in ep.graph_module.graph.nodes:
        if fx.op not in ("output", "placeholder") and fx not in live:
            continue  # no part of the loss (a KV cache, logits): never lowered, never refused
        if fx.op == "placeholder":
            spec = specs[fx.name]
            val = fx.meta["val"]
            kind = spec.kind.name
            if _is_complex(val) and fx in live:
                unsupported.append(_complex_leaf(kind, str(spec.target).removeprefix(_WRAPPED)))
                continue
            if kind in ("PARAMETER", "BUFFER"):
                op = "parameter" if kind == "PARAMETER" else "buffer"
                if op == "buffer":
                    b.buffers[fx.name] = str(spec.target)  # for the in-place update check in _lower
                leaf = re.sub(r"^(p|b)_inner_", r"\1_", fx.name)  # the LossOf wrapper is not part of the model
                nid = b.add(leaf, op, [], _shape(val), _dtype(val), {"target": spec.target.removeprefix(_WRAPPED)})
            elif kind == "USER_INPUT":
                if not isinstance(val, torch.Tensor):
                    continue
                nid = b.add(fx.name, "placeholder", [], _shape(val), _dtype(val), {"index": user_index, "name": fx.name})
                user_index += 1
            elif kind == "CONSTANT_TENSOR":
                if fx not in live:
                    continue
                try:
                    nid = _constant(fx, ep.constants.get(spec.target), str(spec.target), b)
                except _Unsupported as u:
                    unsupported.append(f"{u} ('{spec.target}')")
                    continue
            else:
                unsupported.append(f"{kind.lower()} input '{spec.target}'")
                continue
            b.ids[fx.name] = nid
            pending_leaves.append((fx, nid))
            continue
        if fx.op == "output":
            loss = _find_loss(fx, b, _user_outputs(ep))
            continue
        layer, path = _layer_of(fx)
        if layer is not None:
            segment = layer
        try:
            _lower_or_refuse(fx, b, segment, _source(fx, path))
        except _Unsupported as u:
            if _may_replicate(fallback, fx, b) and _opaque(fx, b, segment, _source(fx, path)):
                continue
            if not isinstance(u, _Downstream):
                unsupported.append(f"{u} at node '{fx.name}' ({_source(fx, path)})")
    if unsupported:
        hint = "" if fallback == "replicate" else " (fallback='replicate', or --fallback replicate, runs them unsharded)"
        raise UnsupportedOpError(f"{len(unsupported)} unsupported operator(s){hint}: " + "; ".join(unsupported))
    if loss is None:
        raise ModelError("the model's forward must return the scalar training loss (or a tuple/object whose first output is it)")
    nodes = _place_leaves(b.nodes)
    return _prune(nodes, loss, name, origin)


class _Unsupported(Exception):
    pass


def _live_nodes(ep: torch.export.ExportedProgram) -> set[torch.fx.Node]:
    """The nodes the user outputs (the loss) depend on: the rest (KV-cache bookkeeping, logits) is dead."""
    user = _user_outputs(ep)
    out = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    todo = [a for a in torch.utils._pytree.tree_leaves(out.args[0]) if getattr(a, "name", None) in user]
    live: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    return live


CONSTANT_LIMIT = 1 << 20
"""Largest tensor constant (bytes) kept in the graph JSON."""


def _constant(fx: torch.fx.Node, value: Any, target: str, b: _Builder) -> int:
    """A tensor constant made in forward (`torch.tensor(4096)`, a table built from Python numbers):
    a `constant` node with no operand whose value is stored in the graph as a nested list, so every
    rank rebuilds it from the plan alone (theory/index.py: it is built whole on every device)."""
    if isinstance(value, torch.Tensor) and value.numel() == 0:  # an empty KV cache: no data, meta or not
        value = torch.empty(value.shape, dtype=value.dtype)
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        raise _Unsupported("a tensor constant made in forward on the meta device has no value "
                           "(build it from the inputs, or register it as a buffer)")
    if value.numel() * value.element_size() > CONSTANT_LIMIT:
        raise _Unsupported(f"a tensor constant of {value.numel() * value.element_size()} bytes made in forward "
                           f"(over {CONSTANT_LIMIT}: register it as a buffer)")
    name = re.sub(r"^c_inner_", "c_", fx.name)
    attrs = {"value": value.detach().cpu().tolist(), "shape": list(value.shape), "target": target.removeprefix(_WRAPPED)}
    return b.add(name, "constant", [], _shape(value), _dtype(value), attrs)


class _Downstream(_Unsupported):
    """An operand was itself not captured: not reported (its root cause is)."""


def _user_outputs(ep: torch.export.ExportedProgram) -> set[str]:
    """Names of the program's user outputs (not buffer updates that functionalization appends)."""
    return {s.arg.name for s in ep.graph_signature.output_specs
            if s.kind.name == "USER_OUTPUT" and hasattr(s.arg, "name")}


def _find_loss(fx_out: torch.fx.Node, b: _Builder, user: set[str]) -> int | None:
    flat = [a for a in torch.utils._pytree.tree_leaves(fx_out.args[0]) if getattr(a, "name", None) in user]
    for item in flat:
        if isinstance(item, torch.fx.Node) and item.name in b.ids:
            nid = b.ids[item.name]
            if b.nodes[nid].shape == ():
                return nid
    return None


def _place_leaves(nodes: list[Node]) -> list[Node]:
    """Give each parameter the segment of its first consumer (so per-layer ratios follow layers)."""
    first_use: dict[int, int] = {}
    for n in nodes:
        for i in n.inputs:
            first_use.setdefault(i, n.segment)
    return [Node(**{**n.__dict__, "segment": first_use.get(n.id, 0)}) if n.op in ("parameter", "buffer") else n for n in nodes]


def _prune(nodes: list[Node], loss: int, name: str, origin: dict[str, Any]) -> Graph:
    """Keep only nodes the loss depends on, renumbered in topological order."""
    needed = {loss}
    for n in reversed(nodes[: loss + 1]):
        if n.id in needed:
            needed.update(n.inputs)
    keep = [n for n in nodes if n.id in needed]
    remap = {n.id: i for i, n in enumerate(keep)}
    renum = tuple(Node(**{**n.__dict__, "id": remap[n.id], "inputs": tuple(remap[i] for i in n.inputs)}) for n in keep)
    return Graph(nodes=renum, loss=remap[loss], name=name, origin=origin)


def _arg(fx: torch.fx.Node, i: int, key: str, default: Any = None) -> Any:
    if len(fx.args) > i:
        return fx.args[i]
    return fx.kwargs.get(key, default)


def _lower_or_refuse(fx: torch.fx.Node, b: _Builder, seg: int, src: str) -> None:
    """`_lower`; arguments a lowering cannot read (a symbolic size where it expects a number) refuse the operator,
    so the message names it and the model's line instead of a raw exception escaping capture."""
    try:
        _lower(fx, b, seg, src)
    except HapError:
        raise
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
        name = getattr(fx.target, "_opname", str(fx.target))
        raise _Unsupported(f"aten.{name} with arguments capture cannot read ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]})") from None


def _lower(fx: torch.fx.Node, b: _Builder, seg: int, src: str) -> None:
    """Map one ATen node to canonical node(s); raises _Unsupported for anything unknown."""
    if fx.op != "call_function":
        raise _Unsupported(f"{fx.op} '{fx.target}'")
    if fx.target is operator.getitem:
        parts = b.multi.get(getattr(fx.args[0], "name", ""))
        if parts is None:
            raise _Downstream(f"getitem of {fx.args[0]}")
        if parts[fx.args[1]] is None:  # an output capture does not model (batch norm's new running stats)
            if any(u.op != "output" for u in fx.users):
                raise _Unsupported(f"output {fx.args[1]} of {fx.args[0].target}")
            return
        b.ids[fx.name] = parts[fx.args[1]]
        return
    opname = fx.target._opname if hasattr(fx.target, "_opname") else str(fx.target)
    if opname.endswith("_") and fx.args and getattr(fx.args[0], "name", None) in b.buffers and not fx.users:
        return  # an in-place update of a buffer (batch norm's num_batches_tracked): no part of the loss
    if opname == "broadcast_tensors":
        b.multi[fx.name] = _broadcast_aliases(fx, b)
        return
    if opname in _NO_OPS:
        return
    if _touches_complex(fx, b):
        b.ids[fx.name] = _lower_complex(fx, b, seg, src)
        return
    if opname in _VALUE_PRESERVING:  # in place, values unchanged: an alias of its operand
        b.ids[fx.name] = _Ctx(fx, b, seg, src, (), "").tid(fx.args[0])
        return
    qual = f"{opname}.{getattr(fx.target, '_overloadname', '')}"  # an overload's own lowering comes first
    split = _SPLITS.get(qual, _SPLITS.get(opname))
    if split is not None:
        b.multi[fx.name] = split(_Ctx(fx, b, seg, src, (), ""))
        return
    val = fx.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise _Unsupported(f"aten.{opname} (non-tensor output)")
    handler = _HANDLERS.get(qual, _HANDLERS.get(opname))
    if handler is None:
        raise _Unsupported(f"aten.{opname}")
    ctx = _Ctx(fx, b, seg, src, _shape(val), _dtype(val))
    b.ids[fx.name] = handler(ctx)


def _broadcast_aliases(fx: torch.fx.Node, b: _Builder) -> list[int]:
    """`broadcast_tensors` of equal shapes (as mse_loss emits) is a no-op: its outputs are its inputs."""
    missing = [a.name for a in fx.args[0] if a.name not in b.ids]
    if missing:
        raise _Downstream(f"operand {missing[0]} of {fx.name}")
    ids = [b.ids[a.name] for a in fx.args[0]]
    if len({b.nodes[i].shape for i in ids}) != 1:
        raise _Unsupported("aten.broadcast_tensors of different shapes")
    return ids


class _Ctx:
    """What a lowering handler needs about the node being lowered."""

    def __init__(self, fx: torch.fx.Node, b: _Builder, seg: int, src: str, shape: tuple[int, ...], dtype: str) -> None:
        self.fx, self.b, self.seg, self.src, self.shape, self.dtype = fx, b, seg, src, shape, dtype

    def tid(self, a: Any) -> int:
        if isinstance(a, torch.fx.Node) and a.name not in self.b.ids:
            raise _Downstream(f"operand {a.name} of {self.fx.name}")
        if not isinstance(a, torch.fx.Node):
            raise _Unsupported(f"operand {a!r} of {self.fx.name}")
        return self.b.ids[a.name]

    def node(self, a: Any) -> Node:
        return self.b.nodes[self.tid(a)]

    def emit(self, op: str, inputs: list[int], attrs: dict | None = None, flops: float = 0.0,
             name: str | None = None, shape: tuple[int, ...] | None = None, dtype: str | None = None) -> int:
        return self.b.add(name or self.fx.name, op, inputs, shape if shape is not None else self.shape,
                          dtype or self.dtype, attrs, flops, self.seg, self.src)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _h_linear(c: _Ctx) -> int:
    x, w = c.tid(c.fx.args[0]), c.tid(c.fx.args[1])
    bias = _arg(c.fx, 2, "bias")
    k = c.b.nodes[w].shape[1]
    flops = 2.0 * _numel(c.shape) * k
    if bias is None:
        return c.emit("linear", [x, w], flops=flops)
    mm = c.emit("linear", [x, w], flops=flops, name=c.fx.name + "_mm")
    return c.emit("add", [mm, c.tid(bias)], flops=_numel(c.shape))


def _h_addmm(c: _Ctx) -> int:
    """addmm(bias, x, w) = x @ w + bias (transformers' Conv1D): a matmul then an add, like linear."""
    if _arg(c.fx, 3, "beta", 1) != 1 or _arg(c.fx, 4, "alpha", 1) != 1:
        raise _Unsupported("aten.addmm with beta or alpha != 1")
    bias, x, w = (c.node(a) for a in c.fx.args[:3])
    mm = c.emit("matmul", [x.id, w.id], flops=2.0 * _numel(c.shape) * x.shape[-1], name=c.fx.name + "_mm")
    return c.emit("add", [mm, bias.id], flops=_numel(c.shape))


def _h_matmul(c: _Ctx) -> int:
    a, bb = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    if a.rank < 2 or bb.rank < 2:
        raise _Unsupported("matmul of vectors")
    return c.emit("matmul", [a.id, bb.id], flops=2.0 * _numel(c.shape) * a.shape[-1])


def _scalar(v: Any) -> float | int | bool:
    """A Python scalar operand, kept an int for int tensors (arange + 0 stays int64)."""
    return v if isinstance(v, (bool, int)) else float(v)


def _h_binary(c: _Ctx) -> int:
    op = _ARITHMETIC_ALIASES.get(c.fx.target._opname, c.fx.target._opname)
    if op in _BINARY_ALIASES:
        op = ("logical_" if c.dtype == "bool" else "bitwise_") + _BINARY_ALIASES[op]
    if op == "div" and c.fx.kwargs.get("rounding_mode") is not None:  # torch.div(..., rounding_mode=)
        op = f"div_{c.fx.kwargs['rounding_mode']}"
    op = {"floor_divide": "div_floor", "max": "maximum", "min": "minimum"}.get(op, op)  # `//`; max.other, min.other
    x, y = c.fx.args[0], c.fx.args[1]
    alpha = c.fx.kwargs.get("alpha", 1)
    if alpha != 1:
        raise _Unsupported(f"aten.{op} with alpha={alpha}")
    flops = _numel(c.shape)
    xt, yt = isinstance(x, torch.fx.Node), isinstance(y, torch.fx.Node)
    if xt and yt:
        return c.emit(op, [c.tid(x), c.tid(y)], flops=flops)
    if xt:
        return c.emit(op, [c.tid(x)], {"scalar": _scalar(y), "scalar_first": False}, flops)
    if op not in _SCALAR_FIRST:
        raise _Unsupported(f"aten.{op} with a scalar first operand")
    return c.emit(op, [c.tid(y)], {"scalar": _scalar(x), "scalar_first": True}, flops)


def _h_rsub(c: _Ctx) -> int:
    x, y = c.fx.args[0], c.fx.args[1]
    if isinstance(y, torch.fx.Node):
        raise _Unsupported("aten.rsub of two tensors")
    return c.emit("sub", [c.tid(x)], {"scalar": _scalar(y), "scalar_first": True}, _numel(c.shape))


def _h_unary(c: _Ctx) -> int:
    op = _UNARY[c.fx.target._opname]
    if op == "bitwise_not" and c.dtype == "bool":
        op = "logical_not"
    attrs: dict[str, Any] = {}
    if op == "gelu":
        attrs["approximate"] = c.fx.kwargs.get("approximate", _arg(c.fx, 1, "approximate", "none"))
    if op == "identity" and (c.fx.target._opname == "_to_copy" or c.node(c.fx.args[0]).dtype != c.dtype):
        attrs["dtype"] = c.dtype
    return c.emit(op, [c.tid(c.fx.args[0])], attrs, _UNARY_FLOPS.get(op, 1) * _numel(c.shape))


def _h_clamp(c: _Ctx) -> int:
    """clamp / clamp_min / clamp_max / hardtanh / relu6 with number bounds: one `clamp`."""
    name = c.fx.target._opname
    if name == "relu6":
        low, high = 0, 6
    elif name == "hardtanh":
        low, high = _arg(c.fx, 1, "min_val", -1.0), _arg(c.fx, 2, "max_val", 1.0)
    elif name == "clamp_min":
        low, high = _arg(c.fx, 1, "min"), None
    elif name == "clamp_max":
        low, high = None, _arg(c.fx, 1, "max")
    else:
        low, high = _arg(c.fx, 1, "min"), _arg(c.fx, 2, "max")
    if any(isinstance(v, torch.fx.Node) for v in (low, high)):  # clamp.Tensor: max(x, low), then min(., high)
        out = c.tid(c.fx.args[0])
        for k, (bound, op) in enumerate(((low, "maximum"), (high, "minimum"))):
            if bound is not None:
                last = k == 1 or high is None
                out = c.emit(op, [out, c.tid(bound)], flops=_numel(c.shape), name=c.fx.name if last else f"{c.fx.name}_{op}")
        return out
    bounds = {"min": None if low is None else _scalar(low), "max": None if high is None else _scalar(high)}
    return c.emit("clamp", [c.tid(c.fx.args[0])], bounds, _numel(c.shape))


def _h_square(c: _Ctx) -> int:
    return c.emit("pow", [c.tid(c.fx.args[0])], {"scalar": 2, "scalar_first": False}, _numel(c.shape))


def _h_softplus(c: _Ctx) -> int:
    attrs = {"beta": _scalar(_arg(c.fx, 1, "beta", 1.0)), "threshold": _scalar(_arg(c.fx, 2, "threshold", 20.0))}
    return c.emit("softplus", [c.tid(c.fx.args[0])], attrs, 4 * _numel(c.shape))


def _h_stack(c: _Ctx) -> int:
    """stack = every operand unsqueezed at `dim` (a view), then cat: no rule of its own is needed."""
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), len(c.shape))
    parts = []
    for k, t in enumerate(c.fx.args[0]):
        x = c.node(t)
        shape = x.shape[:dim] + (1,) + x.shape[dim:]
        parts.append(c.emit("view", [x.id], {"shape": list(shape)}, name=f"{c.fx.name}_part{k}", shape=shape,
                            dtype=x.dtype))
    if len(parts) == 1:
        return c.emit("identity", parts)
    return c.emit("cat", parts, {"dim": dim})


def _h_baddbmm(c: _Ctx) -> int:
    """baddbmm(input, b1, b2, beta, alpha) = beta * input + alpha * (b1 @ b2) (ALiBi's attention scores):
    a matmul, its scaling, then an add of the (broadcast) input."""
    bias, b1, b2 = (c.node(a) for a in c.fx.args[:3])
    beta, alpha = _scalar(_arg(c.fx, 3, "beta", 1)), _scalar(_arg(c.fx, 4, "alpha", 1))
    flops = _numel(c.shape)
    out = c.emit("matmul", [b1.id, b2.id], flops=2.0 * flops * b1.shape[-1], name=c.fx.name + "_mm")
    if alpha != 1:
        out = c.emit("mul", [out], {"scalar": alpha, "scalar_first": False}, flops, name=c.fx.name + "_alpha")
    if beta == 0:
        return c.emit("identity", [out])
    term = bias.id
    if beta != 1:
        term = c.emit("mul", [bias.id], {"scalar": beta, "scalar_first": False}, _numel(bias.shape),
                      name=c.fx.name + "_beta", shape=bias.shape, dtype=bias.dtype)
    return c.emit("add", [out, term], flops=flops)


def _h_view(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    if x.shape == c.shape:
        return c.emit("identity", [x.id])
    return c.emit("view", [x.id], {"shape": list(c.shape)})


def _h_transpose(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    if c.fx.target._opname in ("t", "numpy_T"):
        d0, d1 = 0, max(x.rank - 1, 0)
    else:
        d0, d1 = _norm_dim(c.fx.args[1], x.rank), _norm_dim(c.fx.args[2], x.rank)
    dims = list(range(x.rank))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return c.emit("permute", [x.id], {"dims": dims})


def _h_permute(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    return c.emit("permute", [x.id], {"dims": [_norm_dim(d, x.rank) for d in c.fx.args[1]]})


def _h_softmax(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    op = "log_softmax" if "log" in c.fx.target._opname else "softmax"
    return c.emit(op, [x.id], {"dim": _norm_dim(c.fx.args[1], x.rank)}, 5 * _numel(c.shape))


def _h_reduce(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    op = "mean" if c.fx.target._opname == "mean" else "sum"
    dims = _arg(c.fx, 1, "dim", None)
    dims = list(range(x.rank)) if dims is None or dims == [] else [_norm_dim(d, x.rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keepdim = bool(_arg(c.fx, 2, "keepdim", False))
    if c.fx.kwargs.get("dtype") is not None:
        raise _Unsupported(f"aten.{op} with dtype")
    return c.emit(op, [x.id], {"dims": sorted(dims), "keepdim": keepdim}, _numel(x.shape))


def _h_layer_norm(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    shape = list(c.fx.args[1])
    w, bias = _arg(c.fx, 2, "weight"), _arg(c.fx, 3, "bias")
    inputs = [x.id] + [c.tid(t) for t in (w, bias) if t is not None]
    attrs = {"normalized_shape": shape, "eps": float(_arg(c.fx, 4, "eps", 1e-5)),
             "has_weight": w is not None, "has_bias": bias is not None}
    return c.emit("layer_norm", inputs, attrs, 8 * _numel(c.shape))


def _h_embedding(c: _Ctx) -> int:
    w, ids = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    pad = _arg(c.fx, 2, "padding_idx", -1)
    if _arg(c.fx, 4, "sparse", False):
        raise _Unsupported("aten.embedding with sparse gradients")
    attrs = {} if pad in (-1, None) else {"padding_idx": _norm_dim(int(pad), w.shape[0])}  # forward unchanged; no gradient to that row
    return c.emit("embedding", [w.id, ids.id], attrs, flops=_numel(c.shape))


def _repeat_heads(c: _Ctx, kv: Node, heads: int) -> Node:
    """Grouped-query attention: kv heads (.., Hkv, S, D) repeated to `heads` as torch's enable_gqa
    does (query head h reads kv head h // (heads / Hkv)): view, expand, view, as `repeat_kv` is."""
    if kv.shape[-3] == heads:
        return kv
    lead, hkv, rest = kv.shape[:-3], kv.shape[-3], kv.shape[-2:]
    one, many, out = lead + (hkv, 1) + rest, lead + (hkv, heads // hkv) + rest, lead + (heads,) + rest
    v1 = c.emit("view", [kv.id], {"shape": list(one)}, name=f"{c.fx.name}_{kv.name}_groups", shape=one, dtype=kv.dtype)
    e = c.emit("expand", [v1], {"shape": list(many)}, name=f"{c.fx.name}_{kv.name}_expand", shape=many, dtype=kv.dtype)
    return c.b.nodes[c.emit("view", [e], {"shape": list(out)}, name=f"{c.fx.name}_{kv.name}_heads", shape=out, dtype=kv.dtype)]


def _h_sdpa(c: _Ctx) -> int:
    q, k, v = (c.node(a) for a in c.fx.args[:3])
    mask = _arg(c.fx, 3, "attn_mask")
    if c.fx.kwargs.get("enable_gqa", _arg(c.fx, 7, "enable_gqa", False)):
        k, v = _repeat_heads(c, k, q.shape[-3]), _repeat_heads(c, v, q.shape[-3])
    scale = c.fx.kwargs.get("scale", _arg(c.fx, 6, "scale"))
    attrs = {"is_causal": bool(_arg(c.fx, 5, "is_causal", False)), "scale": None if scale is None else float(scale)}
    attrs.update(_sdpa_dropout(c))
    batch = _numel(q.shape[:-2])
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    flops = batch * (4.0 * tq * tk * d + 5.0 * tq * tk)  # QK^T and AV matmuls plus the softmax
    if "rng_site" in attrs:
        flops += batch * tq * tk * (1 + MASK_OPS_PER_ELEMENT)  # the probabilities' dropout and its mask
    inputs = [q.id, k.id, v.id] + ([c.tid(mask)] if mask is not None else [])
    return c.emit("sdpa", inputs, attrs, flops)


def _h_cross_entropy(c: _Ctx) -> int:
    """Mean cross-entropy over the targets that are not `ignore_index`, lowered so that it stays exact
    when targets are sharded: `count = sum(target != ignore_index)` is its own node (an addend per
    device when the targets are split, all-reduced to Full before use), and `cross_entropy` sums the
    per-target losses of its rows and divides by that Full count: an addend of the true mean.
    torch's mean divides by the same count (and gives nan when every target is ignored, as here)."""
    logits, target = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    if _arg(c.fx, 2, "weight") is not None or float(_arg(c.fx, 5, "label_smoothing", 0.0)) != 0.0:
        raise _Unsupported("cross_entropy with class weights or label smoothing")
    reduction = int(_arg(c.fx, 3, "reduction", 1))
    if reduction != 1 or logits.rank != 2:
        raise _Unsupported("cross_entropy other than mean over 2-D logits (flatten the logits first)")
    ignore = int(_arg(c.fx, 4, "ignore_index", -100))
    n, v = logits.shape
    kept = c.emit("ne", [target.id], {"scalar": ignore, "scalar_first": False}, n, name=c.fx.name + "_kept",
                  shape=(n,), dtype="bool")
    count = c.emit("sum", [kept], {"dims": [0], "keepdim": False}, n, name=c.fx.name + "_count", shape=(), dtype="int64")
    return c.emit("cross_entropy", [logits.id, target.id, count], {"ignore_index": ignore}, 6.0 * n * v)


def _h_mse(c: _Ctx) -> int:
    x, y = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    if int(_arg(c.fx, 2, "reduction", 1)) != 1 or x.shape != y.shape:
        raise _Unsupported("mse_loss other than mean over same-shaped tensors")
    return c.emit("mse_loss", [x.id, y.id], {"count": x.numel}, 3 * x.numel)


_HANDLERS: dict[str, Callable[[_Ctx], int]] = {
    "linear": _h_linear, "matmul": _h_matmul, "mm": _h_matmul, "bmm": _h_matmul,
    "rsub": _h_rsub, "transpose": _h_transpose, "t": _h_transpose, "permute": _h_permute,
    "softmax": _h_softmax, "_softmax": _h_softmax, "log_softmax": _h_softmax, "_log_softmax": _h_softmax,
    "sum": _h_reduce, "mean": _h_reduce, "layer_norm": _h_layer_norm, "embedding": _h_embedding,
    "scaled_dot_product_attention": _h_sdpa, "cross_entropy_loss": _h_cross_entropy, "mse_loss": _h_mse,
    **{op: _h_binary for op in _BINARY}, **{op: _h_unary for op in _UNARY}, **{op: _h_view for op in _VIEWS},
}


# --- shape operators (engine/theory/shape.py) ------------------------------------------------
def _h_cat(c: _Ctx) -> int:
    """cat; operands with no element along the cat dim (an empty KV cache, or torch's legacy 1-D
    empty tensor, which cat skips) add nothing and are dropped; one operand left is an identity."""
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), len(c.shape))
    parts = [p for p in (c.node(t) for t in c.fx.args[0])
             if not (p.numel == 0 and (p.shape == (0,) or (p.rank == len(c.shape) and p.shape[dim] == 0)))]
    if len(parts) == 1 and parts[0].shape == c.shape:
        return c.emit("identity", [parts[0].id])
    return c.emit("cat", [p.id for p in parts], {"dim": dim})


def _h_slice(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), x.rank)
    start, end, step = _arg(c.fx, 2, "start"), _arg(c.fx, 3, "end"), _arg(c.fx, 4, "step", 1)
    size = x.shape[dim]
    start, end, _ = slice(start, end, step).indices(size)
    if c.shape == x.shape:
        return c.emit("identity", [x.id])
    return c.emit("narrow", [x.id], {"dim": dim, "start": start, "end": max(start, end), "step": int(step)})


def _h_narrow(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(c.fx.args[1], x.rank)
    start = c.fx.args[2] + (x.shape[dim] if c.fx.args[2] < 0 else 0)
    return c.emit("narrow", [x.id], {"dim": dim, "start": start, "end": start + c.fx.args[3], "step": 1})


def _h_select(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(c.fx.args[1], x.rank)
    index = c.fx.args[2] + (x.shape[dim] if c.fx.args[2] < 0 else 0)
    return c.emit("select", [x.id], {"dim": dim, "index": index})


def _h_expand(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    if x.shape == c.shape:
        return c.emit("identity", [x.id])
    return c.emit("expand", [x.id], {"shape": list(c.shape)})


def _split_pieces(c: _Ctx, dim: int, sizes: list[int]) -> list[int]:
    """One `narrow` node per piece of a split along `dim` (getitem then picks its piece)."""
    x = c.node(c.fx.args[0])
    shape, out, start = list(x.shape), [], 0
    for i, size in enumerate(sizes):
        shape[dim] = size
        attrs = {"dim": dim, "start": start, "end": start + size, "step": 1}
        out.append(c.b.add(f"{c.fx.name}_{i}", "narrow", [x.id], tuple(shape), x.dtype, attrs, 0.0, c.seg, c.src))
        start += size
    return out


def _m_split(c: _Ctx) -> list[int]:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(_arg(c.fx, 2, "dim", 0), x.rank)
    arg = c.fx.args[1]
    if c.fx.target._opname == "chunk":
        step = -(-x.shape[dim] // int(arg))
        sizes = [min(step, x.shape[dim] - s) for s in range(0, x.shape[dim], step)]
    elif isinstance(arg, int):
        sizes = [min(arg, x.shape[dim] - s) for s in range(0, x.shape[dim], arg)]
    elif any(isinstance(s, torch.fx.Node) for s in arg):
        raise _Unsupported(f"aten.{c.fx.target._opname} with sizes read from tensor values (data-dependent pieces, "
                           "e.g. tokens per expert: the plan needs static shapes)")
    else:
        sizes = [int(s) for s in arg]
    return _split_pieces(c, dim, sizes)


def _m_unbind(c: _Ctx) -> list[int]:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), x.rank)
    shape = x.shape[:dim] + x.shape[dim + 1:]
    return [c.b.add(f"{c.fx.name}_{i}", "select", [x.id], shape, x.dtype, {"dim": dim, "index": i}, 0.0, c.seg, c.src)
            for i in range(x.shape[dim])]


# --- convolution, pooling, batch norm (engine/theory/conv.py, pool.py, batchnorm.py) -----------
def _ints(v: Any, n: int, default: int) -> list[int]:
    """An int-or-list argument as a list of n ints (an empty list means `default`)."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return [default] * n
    if isinstance(v, int):
        return [v] * n
    return [int(x) for x in v] * (n if len(v) == 1 else 1)


def _h_conv(c: _Ctx) -> int:
    x, w = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    spatial = w.rank - 2
    if x.rank != w.rank:
        raise _Unsupported(f"aten.{c.fx.target._opname} of an unbatched input (add a batch dim)")
    if c.fx.target._opname == "convolution":
        stride, padding, dilation, transposed, _, groups = c.fx.args[3:9]
        if transposed:
            raise _Unsupported("aten.convolution transposed")
    else:
        stride, padding = _arg(c.fx, 3, "stride", 1), _arg(c.fx, 4, "padding", 0)
        dilation, groups = _arg(c.fx, 5, "dilation", 1), _arg(c.fx, 6, "groups", 1)
    attrs = {"stride": _ints(stride, spatial, 1), "dilation": _ints(dilation, spatial, 1), "groups": int(groups),
             "padding": padding if isinstance(padding, str) else _ints(padding, spatial, 0)}
    flops = 2.0 * _numel(c.shape) * math.prod(w.shape[1:])  # a multiply-add per output and filter tap
    bias = _arg(c.fx, 2, "bias")
    if bias is None:
        return c.emit("conv", [x.id, w.id], attrs, flops)
    conv = c.emit("conv", [x.id, w.id], attrs, flops, name=c.fx.name + "_conv")
    channels = (w.shape[0],) + (1,) * spatial  # (Cout, 1, 1): broadcast over the positions
    b = c.emit("view", [c.tid(bias)], {"shape": list(channels)}, name=c.fx.name + "_bias", shape=channels)
    return c.emit("add", [conv, b], flops=_numel(c.shape))


def _spatial(c: _Ctx) -> int:
    """The spatial rank of a pooling op by its name: `max_pool2d`, `max_pool3d_with_indices` -> 2, 3."""
    return int(re.search(r"(\d)d", c.fx.target._opname).group(1))


def _h_max_pool(c: _Ctx) -> int:
    x, n = c.node(c.fx.args[0]), _spatial(c)
    kernel = _ints(c.fx.args[1], n, 1)
    attrs = {"spatial": n, "kernel": kernel, "stride": _ints(_arg(c.fx, 2, "stride"), n, 0) if _arg(c.fx, 2, "stride") else kernel,
             "padding": _ints(_arg(c.fx, 3, "padding", 0), n, 0), "dilation": _ints(_arg(c.fx, 4, "dilation", 1), n, 1),
             "ceil_mode": bool(_arg(c.fx, 5, "ceil_mode", False))}
    return c.emit("max_pool", [x.id], attrs, _numel(c.shape) * math.prod(kernel))


def _h_avg_pool(c: _Ctx) -> int:
    x, n = c.node(c.fx.args[0]), _spatial(c)
    kernel = _ints(c.fx.args[1], n, 1)
    divisor = _arg(c.fx, 6, "divisor_override")
    attrs = {"spatial": n, "kernel": kernel, "stride": _ints(_arg(c.fx, 2, "stride"), n, 0) if _arg(c.fx, 2, "stride") else kernel,
             "padding": _ints(_arg(c.fx, 3, "padding", 0), n, 0), "ceil_mode": bool(_arg(c.fx, 4, "ceil_mode", False)),
             "count_include_pad": bool(_arg(c.fx, 5, "count_include_pad", True)),
             "divisor_override": None if divisor is None else int(divisor)}
    return c.emit("avg_pool", [x.id], attrs, _numel(c.shape) * math.prod(kernel))


def _h_adaptive_avg_pool(c: _Ctx) -> int:
    x, n = c.node(c.fx.args[0]), _spatial(c)
    size = [int(s) for s in c.shape[-n:]]
    return c.emit("adaptive_avg_pool", [x.id], {"spatial": n, "output_size": size}, x.numel)


def _h_batch_norm(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    w, bias = _arg(c.fx, 1, "weight"), _arg(c.fx, 2, "bias")
    shift = 2 if c.fx.target._overloadname == "no_stats" else 0  # no running_mean / running_var arguments
    if not _arg(c.fx, 5 - shift, "training", False):
        raise _Unsupported("aten.batch_norm in eval mode (plan the model in training mode, model.train())")
    attrs = {"eps": float(_arg(c.fx, 7 - shift, "eps", 1e-5)), "has_weight": w is not None, "has_bias": bias is not None}
    inputs = [x.id] + [c.tid(t) for t in (w, bias) if t is not None]
    return c.emit("batch_norm", inputs, attrs, 8 * _numel(c.shape))  # statistics, normalise, scale and shift


def _m_batch_norm_functional(c: _Ctx) -> list[int | None]:
    """`_native_batch_norm_legit_functional` (batch norm after functionalization): output 0 is the
    normalised tensor, as `batch_norm`; the saved statistics and the new running statistics (outputs
    1-4) only feed buffer updates, which are no part of the loss."""
    val = c.fx.meta["val"][0]
    c.shape, c.dtype = _shape(val), _dtype(val)
    return [_h_batch_norm(c), None, None, None, None]


_HANDLERS.update({
    "conv1d": _h_conv, "conv2d": _h_conv, "conv3d": _h_conv, "convolution": _h_conv,
    **{f"max_pool{k}d": _h_max_pool for k in (1, 2, 3)}, **{f"avg_pool{k}d": _h_avg_pool for k in (1, 2, 3)},
    **{f"adaptive_avg_pool{k}d": _h_adaptive_avg_pool for k in (1, 2, 3)},
    **{f"_adaptive_avg_pool{k}d": _h_adaptive_avg_pool for k in (1, 2, 3)},
    "batch_norm": _h_batch_norm,
})
_HANDLERS.update({
    **{op: _h_cat for op in _CATS}, "slice": _h_slice, "narrow": _h_narrow, "select": _h_select,
    "expand": _h_expand, "broadcast_to": _h_expand, "stack": _h_stack, "baddbmm": _h_baddbmm,
    "clamp": _h_clamp, "clamp_min": _h_clamp, "clamp_max": _h_clamp, "hardtanh": _h_clamp, "relu6": _h_clamp,
    "softplus": _h_softplus, "square": _h_square,
})
_SPLITS: dict[str, Callable[[_Ctx], list[int | None]]] = {
    "split": _m_split, "split_with_sizes": _m_split, "chunk": _m_split, "unbind": _m_unbind,
    "_native_batch_norm_legit_functional": _m_batch_norm_functional,
}
"""Multi-output operators: each output becomes its own node, picked by the `getitem` that follows."""


# --- einsum, MoE gating and index operators (engine/theory/einsum.py, moe.py, index.py) ---------
def explicit_equation(equation: str, ranks: list[int]) -> str:
    """An einsum equation with its `...` written as letters (from the operands' ranks) and its output made
    explicit, the form the rules take: `"...qhd,...khd->...hqk"` of rank-5 operands -> `"ABqhd,ABkhd->ABhqk"`."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    ins = lhs.split(",")
    if len(ins) != len(ranks):
        raise ValueError(f"einsum equation '{equation}' names {len(ins)} operands, the call has {len(ranks)}")
    spare = [ch for ch in string.ascii_uppercase + string.ascii_lowercase if ch not in eq]
    width = max((r - len(x.replace("...", "")) for x, r in zip(ins, ranks) if "..." in x), default=0)
    if width > len(spare) or width < 0:
        raise ValueError(f"einsum equation '{equation}' does not fit operands of ranks {ranks}")
    batch = "".join(spare[:width])

    def fill(x: str, rank: int) -> str:
        return x.replace("...", batch[width - (rank - len(x.replace("...", ""))):]) if "..." in x else x

    ins = [fill(x, r) for x, r in zip(ins, ranks)]
    if arrow:
        out = out.replace("...", batch)
    else:  # implicit output: the broadcast dims, then the letters seen once, in alphabetical order
        seen = "".join(ins)
        out = batch + "".join(sorted(ch for ch in set(seen) if seen.count(ch) == 1 and ch not in batch))
    return ",".join(ins) + "->" + out


def _h_einsum(c: _Ctx) -> int:
    operands = [c.node(t) for t in c.fx.args[1]]
    try:
        equation = explicit_equation(c.fx.args[0], [x.rank for x in operands])
        ins, _ = parse_equation(equation)
    except ValueError as e:
        raise _Unsupported(f"aten.einsum: {e}") from None
    sizes = {letter: s for subs, x in zip(ins, operands) for letter, s in zip(subs, x.shape)}
    flops = (2.0 if len(operands) > 1 else 1.0) * math.prod(sizes.values())  # one multiply-add per index tuple
    return c.emit("einsum", [x.id for x in operands], {"equation": equation.replace(" ", "")}, flops)


def _m_topk(c: _Ctx) -> list[int]:
    x = c.node(c.fx.args[0])
    dim = _norm_dim(_arg(c.fx, 2, "dim", -1), x.rank)
    return _topk_nodes(c, x, int(c.fx.args[1]), dim, bool(_arg(c.fx, 3, "largest", True)), bool(_arg(c.fx, 4, "sorted", True)))


def _topk_nodes(c: _Ctx, x: Node, k: int, dim: int, largest: bool, is_sorted: bool) -> list[int]:
    """The `topk_values` and `topk_indices` nodes of the k largest (smallest) entries of x along dim."""
    attrs = {"k": k, "dim": dim, "largest": largest, "sorted": is_sorted}
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    flops = float(x.numel) * max(1, math.ceil(math.log2(max(k, 2))))  # a selection pass per output rank bit
    return [c.b.add(f"{c.fx.name}_{part}", f"topk_{part}", [x.id], shape, dtype, attrs, flops, c.seg, c.src)
            for part, dtype in (("values", x.dtype), ("indices", "int64"))]


def _h_one_hot(c: _Ctx) -> int:
    ids = c.node(c.fx.args[0])
    return c.emit("one_hot", [ids.id], {"num_classes": int(c.shape[-1])}, _numel(c.shape))


def _h_cumsum(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    if c.fx.kwargs.get("dtype") is not None and c.dtype != x.dtype:
        raise _Unsupported("aten.cumsum with a dtype change")
    return c.emit("cumsum", [x.id], {"dim": _norm_dim(c.fx.args[1], x.rank)}, _numel(c.shape))


def _h_gather(c: _Ctx) -> int:
    x, idx = c.node(c.fx.args[0]), c.node(c.fx.args[2])
    if _arg(c.fx, 3, "sparse_grad", False):
        raise _Unsupported("aten.gather with sparse_grad")
    return c.emit("gather", [x.id, idx.id], {"dim": _norm_dim(c.fx.args[1], x.rank)}, _numel(c.shape))


def _h_arange(c: _Ctx) -> int:
    nums = [a for a in c.fx.args if isinstance(a, (int, float))]
    start, end, step = (0, nums[0], 1) if len(nums) == 1 else (nums[0], nums[1], nums[2] if len(nums) > 2 else 1)
    return c.emit("arange", [], {"start": start, "end": end, "step": step})


_HANDLERS.update({
    "addmm": _h_addmm, "einsum": _h_einsum, "one_hot": _h_one_hot, "cumsum": _h_cumsum, "gather": _h_gather, "arange": _h_arange,
    **{op: _h_binary for op in _BINARY_ALIASES}, **{op: _h_binary for op in _ARITHMETIC_ALIASES},
})
_SPLITS["topk"] = _m_topk


# --- dropout (engine/model/dropout.py: exact, site-keyed masks) ---------------------------------------
def _site_p(fx: torch.fx.Node) -> float:
    """The drop probability of a dropout site (p > 0 in training mode), or 0.0 if `fx` is none."""
    name = getattr(fx.target, "_opname", "") if fx.op == "call_function" else ""
    if name in ("dropout", "native_dropout"):
        train = _arg(fx, 2, "train", True)
        return float(_arg(fx, 1, "p", 0.5)) if train is None or train else 0.0
    if name == "scaled_dot_product_attention":
        return float(_arg(fx, 4, "dropout_p", 0.0))
    return 0.0


_DRAW_OPS = frozenset({"rand", "rand_like", "bernoulli", "bernoulli_", "uniform", "uniform_", "randn", "randn_like",
                       "normal", "normal_", "normal_functional"})
"""Random draws with site-keyed numbers (engine.model.dropout.rand): every call is a site."""


def number_dropout_sites(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Number the dropout sites and random draws (`_DRAW_OPS`) of a freshly exported program in forward order (`rng_site`).

    The number counts every dropout call the single-device forward makes, as
    `engine.model.dropout.SiteKeyedDropout` counts them in eager mode: it is assigned before anything is
    pruned and kept in the nodes' `custom` metadata, which `run_decompositions` carries to the
    nodes it makes (functionalization may drop a dead dropout; the others keep their number)."""
    site = 0
    for fx in ep.graph_module.graph.nodes:
        if _site_p(fx) > 0.0 or (fx.op == "call_function" and getattr(fx.target, "_opname", "") in _DRAW_OPS):
            fx.meta["custom"] = {**(fx.meta.get("custom") or {}), "rng_site": site}
            site += 1
    return ep


def _rng_site(c: _Ctx) -> int:
    """The site number `number_dropout_sites` gave this node (or the node it was decomposed from)."""
    site = (c.fx.meta.get("custom") or {}).get("rng_site")
    if site is None:  # a program that did not come from export_program: number in lowering order
        c.b.rng_sites += 1
        return c.b.rng_sites - 1
    return int(site)


def _dropout_attrs(c: _Ctx, p: float, train: bool) -> dict[str, Any]:
    if not 0.0 <= p <= 1.0:
        raise _Unsupported(f"dropout with p={p} (must be in [0, 1])")
    attrs: dict[str, Any] = {"p": p, "train": train}
    if train and p > 0.0:
        attrs["rng_site"] = _rng_site(c)
    return attrs


def _dropout_flops(attrs: dict[str, Any], numel: int) -> float:
    """A multiply per element, plus the hashing of its mask at a site (engine/model/dropout.py)."""
    return float(numel * (1 + (MASK_OPS_PER_ELEMENT if "rng_site" in attrs else 0)))


def _h_dropout(c: _Ctx) -> int:
    """`aten.dropout(x, p, train)` (what torch.export records for nn.Dropout and F.dropout)."""
    attrs = _dropout_attrs(c, float(_arg(c.fx, 1, "p", 0.5)), bool(_arg(c.fx, 2, "train", True)))
    return c.emit("dropout", [c.tid(c.fx.args[0])], attrs, _dropout_flops(attrs, _numel(c.shape)))


def _m_native_dropout(c: _Ctx) -> list[int]:
    """`aten.native_dropout(x, p, train) -> (out, mask)`, as `run_decompositions` leaves dropout:
    the output is a dropout node; the mask (a second output) is refused if forward uses it."""
    if any(u.target is operator.getitem and u.args[1] != 0 for u in c.fx.users):
        raise _Unsupported("aten.native_dropout whose mask is used in forward")
    x = c.node(c.fx.args[0])
    train = _arg(c.fx, 2, "train", True)
    attrs = _dropout_attrs(c, float(_arg(c.fx, 1, "p", 0.5)), True if train is None else bool(train))
    return [c.b.add(c.fx.name, "dropout", [x.id], x.shape, x.dtype, attrs, _dropout_flops(attrs, x.numel), c.seg, c.src)]


def _sdpa_dropout(c: _Ctx) -> dict[str, Any]:
    """Attention dropout of `scaled_dot_product_attention` as attributes of the one `sdpa` node.

    Kept in the node rather than decomposed into matmul/softmax/dropout/matmul: the attention
    rules (batch, heads, queries; never the contracted key positions; no query split when causal)
    and the flop count stay as they are, and the probabilities' mask (..., Tq, Tk) is split along
    the same dim as the output, so a device derives its block from the output's shard."""
    p = float(_arg(c.fx, 4, "dropout_p", 0.0))
    if p == 0.0:
        return {}
    if not 0.0 < p <= 1.0:
        raise _Unsupported(f"scaled_dot_product_attention with dropout_p={p} (must be in [0, 1])")
    return {"dropout_p": p, "rng_site": _rng_site(c)}


_RANDOM_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                         "bernoulli", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
                         "randperm", "multinomial", "normal", "uniform"})
"""Random operators: never kept opaque (each device would draw its own numbers, so the run would
not be single-device training); dropout, `rand`, `uniform`, `bernoulli`, `randn` and `normal` have exact, site-keyed
numbers."""


def _h_random_refused(c: _Ctx) -> int:
    """Dropout variants with no site-keyed mask: refused with what to use instead."""
    raise _Unsupported(f"aten.{c.fx.target._opname} (a random operator without exact per-shard masks: "
                       "use nn.Dropout / F.dropout, whose masks every device derives exactly)")


def _refuse_own_generator(c: _Ctx) -> None:
    """A draw from a generator the call brings itself cannot be re-derived per block by every device."""
    if c.fx.kwargs.get("generator") is not None or "generator" in c.fx.target._overloadname:
        raise _Unsupported(f"aten.{c.fx.target._opname} with its own generator (its numbers cannot be site-keyed)")


def _h_rand(c: _Ctx) -> int:
    """`rand` / `rand_like`: the site's uniform numbers (engine.model.dropout.rand), a node with no
    operand whose every block a device draws itself (theory/random_ops.py)."""
    _refuse_own_generator(c)
    return c.emit("rand", [], {"rng_site": _rng_site(c)}, float(_numel(c.shape) * MASK_OPS_PER_ELEMENT))


def _h_uniform(c: _Ctx) -> int:
    """`x.uniform_(low, high)` (router and input jitter: `torch.empty_like(x).uniform_(1 - eps, 1 + eps)`): a `rand`
    node of x's shape with its range; x gives only the shape, its values are overwritten."""
    low, high = float(_arg(c.fx, 1, "from", 0.0)), float(_arg(c.fx, 2, "to", 1.0))
    if _arg(c.fx, 3, "generator") is not None:
        raise _Unsupported("aten.uniform with its own generator (its numbers cannot be site-keyed)")
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise _Unsupported(f"aten.uniform on [{low}, {high}) (needs finite bounds, low <= high)")
    attrs: dict[str, Any] = {"rng_site": _rng_site(c)}
    if (low, high) != (0.0, 1.0):
        attrs.update(low=low, high=high)
    return c.emit("rand", [], attrs, float(_numel(c.shape) * (MASK_OPS_PER_ELEMENT + 2)))


def _h_randn(c: _Ctx) -> int:
    """`randn` / `randn_like` (LSH attention's random rotations), `x.normal_(mean, std)` (`normal_functional`) and
    `torch.normal(mean, std, size)` of float mean and std: a `rand` node with `normal` (Box-Muller on the site's
    numbers, engine.model.dropout.randn), elementwise in the global index like `rand`, so the same rules hold."""
    op = c.fx.target._opname
    _refuse_own_generator(c)
    mean, std = 0.0, 1.0
    if op == "normal_functional":
        mean, std = _arg(c.fx, 1, "mean", 0.0), _arg(c.fx, 2, "std", 1.0)
    elif op == "normal":
        mean, std = c.fx.args[0], c.fx.args[1]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (mean, std)) or std < 0:
        raise _Unsupported(f"aten.{op} with a tensor or non-finite mean or std (write torch.randn(...) * std + mean)")
    attrs: dict[str, Any] = {"rng_site": _rng_site(c), "normal": True}
    if (mean, std) != (0.0, 1.0):
        attrs.update(mean=float(mean), std=float(std))
    return c.emit("rand", [], attrs, float(_numel(c.shape) * (2 * MASK_OPS_PER_ELEMENT + RANDN_OPS_PER_ELEMENT)))


def _h_bernoulli(c: _Ctx) -> int:
    """`bernoulli(probs)`, `bernoulli.p(x, p)` and `bernoulli.Tensor(x, probs)` (what `x.bernoulli_(p)`
    becomes): `rand` of the result's shape, `lt` the probability, cast to the result's dtype, as
    `SiteKeyedDropout` draws it in eager mode."""
    x = c.node(c.fx.args[0])
    p = _arg(c.fx, 1, "p", 0.5) if c.fx.target._overloadname != "default" else c.fx.args[0]
    u = c.emit("rand", [], {"rng_site": _rng_site(c)}, float(x.numel * MASK_OPS_PER_ELEMENT), name=c.fx.name + "_u",
               shape=x.shape, dtype="float32")
    if isinstance(p, torch.fx.Node):
        keep = c.emit("lt", [u, c.tid(p)], flops=x.numel, name=c.fx.name + "_keep", shape=x.shape, dtype="bool")
    else:
        keep = c.emit("lt", [u], {"scalar": _scalar(p), "scalar_first": False}, x.numel, name=c.fx.name + "_keep",
                      shape=x.shape, dtype="bool")
    return c.emit("identity", [keep], {"dtype": c.dtype}, x.numel)


_HANDLERS.update({"rand": _h_rand, "rand_like": _h_rand, "bernoulli": _h_bernoulli, "uniform": _h_uniform,
                  **{op: _h_randn for op in ("randn", "randn_like", "normal", "normal_functional")}})
_HANDLERS.update({op: _h_random_refused for op in ("feature_dropout", "alpha_dropout", "feature_alpha_dropout")})
_HANDLERS["dropout"] = _h_dropout
_SPLITS["native_dropout"] = _m_native_dropout


# --- mask and position arithmetic (engine/theory/index.py) -------------------------------------
_FILLS = {"ones": 1, "new_ones": 1, "ones_like": 1, "zeros": 0, "new_zeros": 0, "zeros_like": 0,
          "empty": 0, "new_empty": 0, "empty_like": 0, "full": None, "new_full": None, "full_like": None,
          "scalar_tensor": None}
"""Tensors filled with one value; their operand (for `new_*` and `*_like`) gives only a device and
a shape, so the node has none. `empty*` is filled with 0: its values are never read before written."""


def _h_full(c: _Ctx) -> int:
    op = c.fx.target._opname
    value = _FILLS[op]
    if value is None:
        value = c.fx.args[0] if op == "scalar_tensor" else c.fx.args[1 if op in ("full", "full_like", "fill") else 2]
    if not isinstance(value, (bool, int, float)):
        raise _Unsupported(f"aten.{op} with a fill value that is not a Python number")
    value = bool(value) if c.dtype == "bool" else (float(value) if c.dtype.startswith(("float", "bfloat")) else int(value))
    return c.emit("full", [], {"value": value, "shape": list(c.shape)})


def _h_pad(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    pad = [int(p) for p in c.fx.args[1]]
    opname = c.fx.target._opname
    mode = "constant" if opname == "constant_pad_nd" else _arg(c.fx, 2, "mode", "constant")
    value = _arg(c.fx, 2 if opname == "constant_pad_nd" else 3, "value", None)
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise _Unsupported(f"aten.pad in mode {mode!r}")
    value = 0 if value is None else (int(value) if float(value).is_integer() and not x.dtype.startswith(("float", "bfloat")) else float(value))
    attrs = {"pad": pad, "value": value} if mode == "constant" else {"pad": pad, "value": 0, "mode": mode}
    return c.emit("pad", [x.id], attrs, _numel(c.shape))


def _h_index(c: _Ctx) -> int:
    """Advanced indexing `x[i0, i1, ...]` (some slots None, i.e. `:`): x and the index tensors."""
    x = c.node(c.fx.args[0])
    slots = list(c.fx.args[1])
    idx = [c.node(t) for t in slots if t is not None]
    if any(n.dtype == "bool" for n in idx):
        raise _Unsupported("aten.index with a boolean mask (its result has a data-dependent shape)")
    attrs = {"slots": [t is not None for t in slots]}
    return c.emit("index", [x.id] + [n.id for n in idx], attrs, _numel(c.shape))


def _h_repeat_interleave(c: _Ctx) -> int:
    """`x.repeat_interleave(k, dim)` with an int k is view (.., n, 1, ..) -> expand (.., n, k, ..) ->
    view (.., n*k, ..): each row repeated k times in place (MoE token replication per top-k slot)."""
    x = c.node(c.fx.args[0])
    k, dim = _arg(c.fx, 1, "repeats"), _arg(c.fx, 2, "dim")
    if not isinstance(k, int):
        raise _Unsupported("aten.repeat_interleave with a tensor of repeats")
    if dim is None:  # repeats the flattened tensor
        if x.rank != 1:
            x = c.b.nodes[c.emit("view", [x.id], {"shape": [x.numel]}, name=c.fx.name + "_flat", shape=(x.numel,),
                                 dtype=x.dtype)]
        dim = 0
    dim = _norm_dim(dim, x.rank)
    one = x.shape[:dim + 1] + (1,) + x.shape[dim + 1:]
    many = x.shape[:dim + 1] + (k,) + x.shape[dim + 1:]
    v = c.emit("view", [x.id], {"shape": list(one)}, name=c.fx.name + "_unsqueeze", shape=one)
    e = c.emit("expand", [v], {"shape": list(many)}, name=c.fx.name + "_expand", shape=many)
    return c.emit("view", [e], {"shape": list(c.shape)})


def _h_diff(c: _Ctx) -> int:
    """`diff(x, n, dim, prepend, append)` as existing ops: cat the prepend/append pieces, then n
    times `narrow(1:) - narrow(:-1)` (packed-sequence detection in transformers' mask code)."""
    x = c.node(c.fx.args[0])
    n, dim = int(_arg(c.fx, 1, "n", 1)), _norm_dim(_arg(c.fx, 2, "dim", -1), x.rank)
    parts = [p for p in (_arg(c.fx, 3, "prepend"), x, _arg(c.fx, 4, "append")) if p is not None]
    nodes = [p if isinstance(p, Node) else c.node(p) for p in parts]
    if any(p.rank != x.rank for p in nodes):
        raise _Unsupported("aten.diff with a prepend/append of another rank")
    shape = list(x.shape)
    shape[dim] = sum(p.shape[dim] for p in nodes)
    cur = x.id if len(nodes) == 1 else c.emit("cat", [p.id for p in nodes], {"dim": dim}, name=c.fx.name + "_cat",
                                                shape=tuple(shape))
    for i in range(n):
        size = shape[dim]
        shape[dim] = size - 1
        out = tuple(shape)
        hi = c.emit("narrow", [cur], {"dim": dim, "start": 1, "end": size, "step": 1}, name=f"{c.fx.name}_{i}_hi", shape=out)
        lo = c.emit("narrow", [cur], {"dim": dim, "start": 0, "end": size - 1, "step": 1}, name=f"{c.fx.name}_{i}_lo", shape=out)
        cur = c.emit("sub", [hi, lo], flops=_numel(out), name=c.fx.name if i == n - 1 else f"{c.fx.name}_{i}", shape=out)
    return cur


def _h_where(c: _Ctx) -> int:
    """`where(cond, x, y)` and `masked_fill(x, mask, value)` (= where(mask, value, x)); a Python
    number in place of x or y is kept in attrs, the tensor operands are inputs [cond, x?, y?]."""
    if c.fx.target._opname == "where":
        if len(c.fx.args) < 3:
            raise _Unsupported("aten.where with one operand (its result has a data-dependent shape)")
        cond, x, y = c.fx.args[:3]
    else:
        y, cond, x = c.fx.args[:3]
    if isinstance(x, torch.fx.Node) and x.meta["val"].dim() == 0 and x.op == "call_function" and x.name in c.b.ids \
            and c.b.nodes[c.b.ids[x.name]].op == "full":  # a lifted scalar_tensor: keep it a number
        x = c.b.nodes[c.b.ids[x.name]].attrs["value"]
    attrs = {"x": None if isinstance(x, torch.fx.Node) else _scalar(x), "y": None if isinstance(y, torch.fx.Node) else _scalar(y)}
    inputs = [c.tid(cond)] + [c.tid(t) for t in (x, y) if isinstance(t, torch.fx.Node)]
    return c.emit("where", inputs, attrs, _numel(c.shape))


def _h_index_put(c: _Ctx) -> int:
    """`x[mask] = v` (`index_put(x, [mask], v)`) by one boolean mask over x's leading dims: `where(mask, v, x)`, the
    mask given trailing dims of 1 (T5Gemma 2 writes its end-of-image embedding at the tokens that are one). Integer
    indices and accumulation are not lowered."""
    x, indices, v = c.node(c.fx.args[0]), c.fx.args[1], c.fx.args[2]
    mask = indices[0] if len(indices) == 1 and isinstance(indices[0], torch.fx.Node) else None
    if mask is None or mask.meta["val"].dtype != torch.bool or bool(_arg(c.fx, 3, "accumulate", False)):
        raise _Unsupported("aten.index_put other than by one boolean mask without accumulation")
    m = c.node(mask)
    if tuple(x.shape[:m.rank]) != m.shape or c.node(v).rank > x.rank - m.rank:
        raise _Unsupported("aten.index_put by a boolean mask that is not over the leading dims, or with values per "
                           "masked entry")
    step = _Steps(c)
    cond = m.id
    if m.rank < x.rank:
        shape = m.shape + (1,) * (x.rank - m.rank)
        cond = step("mask", "view", [m.id], {"shape": list(shape)}, shape=shape, dtype="bool", flops=0.0)
    return step("", "where", [cond, c.tid(v), x.id], {"x": None, "y": None}, shape=x.shape, dtype=x.dtype, final=True)


_HANDLERS["index_put"] = _h_index_put


def _h_index_add(c: _Ctx) -> int:
    """`index_add(x, dim, index, source)` and `scatter_add(x, dim, index, src)` (MoE combine: expert
    outputs summed back into their tokens); alpha must be 1."""
    op = c.fx.target._opname
    if op == "index_add" and _arg(c.fx, 4, "alpha", 1) != 1:
        raise _Unsupported("aten.index_add with alpha != 1")
    x, idx, src = c.node(c.fx.args[0]), c.node(c.fx.args[2]), c.node(c.fx.args[3])
    return c.emit(op, [x.id, idx.id, src.id], {"dim": _norm_dim(c.fx.args[1], x.rank)}, src.numel)


def _h_histc(c: _Ctx) -> int:
    """`histc(x, bins, min, max)`: expert loads of a router (counts per bin)."""
    x = c.node(c.fx.args[0])
    attrs = {"bins": int(_arg(c.fx, 1, "bins", 100)), "min": float(_arg(c.fx, 2, "min", 0)), "max": float(_arg(c.fx, 3, "max", 0))}
    return c.emit("histc", [x.id], attrs, x.numel)


_HANDLERS.update({
    "index_add": _h_index_add, "scatter_add": _h_index_add, "histc": _h_histc,
    "where": _h_where, "masked_fill": _h_where,
    "diff": _h_diff,
    **{op: _h_full for op in _FILLS}, "pad": _h_pad, "constant_pad_nd": _h_pad, "index": _h_index,
    "repeat_interleave": _h_repeat_interleave,
})


# --- the replicate fallback (engine/theory/opaque.py) ------------------------------------------
def _encode(value: Any, operands: list[int], b: _Builder) -> Any:
    """A non-tensor argument as JSON (dtypes, devices, layouts by name); a tensor as its operand index."""
    if isinstance(value, torch.fx.Node):
        if value.name not in b.ids:
            raise _Unsupported(f"operand {value.name}")
        operands.append(b.ids[value.name])
        return {"tensor": len(operands) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode(v, operands, b) for v in value]
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return {type(value).__name__: str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _Unsupported(f"argument {value!r}")


def _opaque(fx: torch.fx.Node, b: _Builder, seg: int, src: str) -> bool:
    """Keep an ATen op with no rule as opaque node(s), one per tensor output; False if impossible."""
    target = fx.target
    if fx.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._opname.removesuffix("_") in _RANDOM_OPS:
        return False
    operands: list[int] = []
    try:
        attrs = {"target": f"{target.namespace}::{target._opname}.{target._overloadname}",
                 "args": _encode(list(fx.args), operands, b),
                 "kwargs": {k: _encode(v, operands, b) for k, v in fx.kwargs.items()}}
    except _Unsupported:
        return False
    val = fx.meta.get("val")
    outs = list(enumerate(val)) if isinstance(val, (tuple, list)) else [(None, val)]
    if not all(isinstance(v, torch.Tensor) and _static(v) for _, v in outs):
        return False
    ids = []
    for index, v in outs:
        flops = float(v.numel() + sum(b.nodes[i].numel for i in operands))  # a touch per element: a floor
        name = fx.name if index is None else f"{fx.name}_{index}"
        ids.append(b.add(name, "opaque", operands, _shape(v), _dtype(v), {**attrs, "output_index": index}, flops, seg, src))
    if isinstance(val, (tuple, list)):
        b.multi[fx.name] = ids
    else:
        b.ids[fx.name] = ids[0]
    return True


# --- encoder and vision lowerings (issue 13): unflatten, roll (engine/theory/shift.py) -----------
def _h_roll(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    shifts, dims = _arg(c.fx, 1, "shifts"), _arg(c.fx, 2, "dims", [])
    shifts = [int(v) for v in (shifts if isinstance(shifts, (list, tuple)) else [shifts])]
    dims = [_norm_dim(int(d), x.rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    return c.emit("roll", [x.id], {"shifts": shifts, "dims": dims})


_HANDLERS.update({"unflatten": _h_view, "roll": _h_roll})


# --- the rest of the Core ATen operator set (issue 29; engine/theory/op_table.py lists every operator) ---
def _h_round(c: _Ctx) -> int:
    return c.emit("round", [c.tid(c.fx.args[0])], {"decimals": int(c.fx.kwargs.get("decimals", 0))}, _numel(c.shape))


def _h_elu(c: _Ctx) -> int:
    attrs = {k: _scalar(_arg(c.fx, i, k, 1.0)) for i, k in ((1, "alpha"), (2, "scale"), (3, "input_scale"))}
    return c.emit("elu", [c.tid(c.fx.args[0])], attrs, 4 * _numel(c.shape))


def _h_leaky_relu(c: _Ctx) -> int:
    slope = _scalar(_arg(c.fx, 1, "negative_slope", 0.01))
    return c.emit("leaky_relu", [c.tid(c.fx.args[0])], {"negative_slope": slope}, _numel(c.shape))


def _all_dims(dims: Any, rank: int) -> list[int]:
    """A reduction's dims, normalised and sorted: every dim for None or an empty list."""
    if dims is None or dims == []:
        return list(range(rank))
    return sorted(_norm_dim(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims]))


def _h_reduce_by(c: _Ctx) -> int:
    """amax, amin, any, all, prod, argmax and argmin over `dims` (engine/theory/reduction.py): one node
    each, attrs `dims` and `keepdim`."""
    op, overload = c.fx.target._opname, c.fx.target._overloadname
    x = c.node(c.fx.args[0])
    if c.fx.kwargs.get("dtype") is not None:
        raise _Unsupported(f"aten.{op} with dtype")
    whole = overload == "default" and op in ("any", "all", "prod", "max", "min")
    dims = _all_dims(None if whole else _arg(c.fx, 1, "dim", None), x.rank)
    keep = False if whole else bool(_arg(c.fx, 2, "keepdim", False))
    op = {"max": "amax", "min": "amin"}.get(op, op)  # max.default / min.default: every dim
    return c.emit(op, [x.id], {"dims": dims, "keepdim": keep}, x.numel)


def _h_var(c: _Ctx) -> int:
    """`var.correction(x, dim, correction=, keepdim=)`, `var.dim(x, dim, unbiased, keepdim)` and
    `var.default(x, unbiased)`: a `var` node with the correction as a number."""
    x, overload = c.node(c.fx.args[0]), c.fx.target._overloadname
    if overload == "default":
        dims, correction, keep = list(range(x.rank)), int(bool(_arg(c.fx, 1, "unbiased", True))), False
    elif overload == "dim":
        dims, keep = _all_dims(_arg(c.fx, 1, "dim"), x.rank), bool(_arg(c.fx, 3, "keepdim", False))
        correction = int(bool(_arg(c.fx, 2, "unbiased", True)))
    else:
        dims, keep = _all_dims(_arg(c.fx, 1, "dim"), x.rank), bool(c.fx.kwargs.get("keepdim", False))
        correction = c.fx.kwargs.get("correction")
        correction = 1 if correction is None else _scalar(correction)
    return c.emit("var", [x.id], {"dims": dims, "keepdim": keep, "correction": correction}, 3 * x.numel)


def _m_max_dim(c: _Ctx) -> list[int]:
    """`max.dim` / `min.dim` -> (values, indices): `topk` with k = 1 (the same entry and gradient),
    viewed without the dim unless keepdim."""
    x = c.node(c.fx.args[0])
    dim, keep = _norm_dim(c.fx.args[1], x.rank), bool(_arg(c.fx, 2, "keepdim", False))
    parts = _topk_nodes(c, x, 1, dim, c.fx.target._opname == "max", True)
    if keep:
        return parts
    shape = x.shape[:dim] + x.shape[dim + 1:]
    return [c.b.add(f"{c.fx.name}_{k}", "view", [i], shape, c.b.nodes[i].dtype, {"shape": list(shape)}, 0.0, c.seg, c.src)
            for k, i in enumerate(parts)]


def _m_sort(c: _Ctx) -> list[int]:
    """`sort(x, dim, descending)` / `sort.stable(x, stable=, dim=, descending=)` -> `sort_values`, `sort_indices`
    (MoE routing sorts tokens by expert); `argsort` reads the indices."""
    x = c.node(c.fx.args[0])
    stable = c.fx.target._overloadname == "stable"
    dim = _norm_dim(c.fx.kwargs.get("dim", _arg(c.fx, 1, "dim", -1)) if not stable else c.fx.kwargs.get("dim", -1), x.rank)
    descending = bool(c.fx.kwargs.get("descending", False if stable else _arg(c.fx, 2, "descending", False)))
    attrs = {"dim": dim, "descending": descending, "stable": bool(c.fx.kwargs.get("stable", False)) if stable else False}
    flops = float(x.numel) * max(1, math.ceil(math.log2(max(x.shape[dim] if x.rank else 1, 2))))
    return [c.b.add(f"{c.fx.name}_{part}", f"sort_{part}", [x.id], x.shape, dtype, attrs, flops, c.seg, c.src)
            for part, dtype in (("values", x.dtype), ("indices", "int64"))]


def _h_argsort(c: _Ctx) -> int:
    """`argsort(x, dim, descending)` (and `argsort.stable`): the indices of a sort."""
    x = c.node(c.fx.args[0])
    stable = c.fx.target._overloadname == "stable"
    dim = _norm_dim(c.fx.kwargs.get("dim", -1) if stable else _arg(c.fx, 1, "dim", -1), x.rank)
    descending = bool(c.fx.kwargs.get("descending", False) if stable else _arg(c.fx, 2, "descending", False))
    attrs = {"dim": dim, "descending": descending, "stable": bool(c.fx.kwargs.get("stable", False))}
    flops = float(x.numel) * max(1, math.ceil(math.log2(max(x.shape[dim] if x.rank else 1, 2))))
    return c.emit("sort_indices", [x.id], attrs, flops)


def _h_group_norm(c: _Ctx) -> int:
    """`group_norm(x, groups, weight, bias, eps)` and `native_group_norm(x, weight, bias, N, C, HxW, groups, eps)`."""
    x = c.node(c.fx.args[0])
    if c.fx.target._opname == "native_group_norm":
        w, bias, groups, eps = c.fx.args[1], c.fx.args[2], c.fx.args[6], c.fx.args[7]
    else:
        groups, w, bias, eps = c.fx.args[1], _arg(c.fx, 2, "weight"), _arg(c.fx, 3, "bias"), _arg(c.fx, 4, "eps", 1e-5)
    attrs = {"groups": int(groups), "eps": float(eps), "has_weight": w is not None, "has_bias": bias is not None}
    return c.emit("group_norm", [x.id] + [c.tid(t) for t in (w, bias) if t is not None], attrs, 8 * _numel(c.shape))


def _h_upsample(c: _Ctx) -> int:
    """`upsample_{nearest,linear,bilinear,bicubic,trilinear}Nd` (F.interpolate): an `upsample` node that
    calls the same ATen overload with the same sizes, scales and align_corners on its local block."""
    x, t = c.node(c.fx.args[0]), c.fx.target
    rest = [list(a) if isinstance(a, (list, tuple)) else a for a in c.fx.args[1:]]
    if any(isinstance(v, torch.fx.Node) for v in torch.utils._pytree.tree_leaves(rest)) or c.fx.kwargs:
        raise _Unsupported(f"aten.{t._opname} with tensor sizes or keyword arguments")
    attrs = {"target": f"aten::{t._opname}.{t._overloadname}", "args": rest, "spatial": int(_spatial(c))}
    return c.emit("upsample", [x.id], attrs, 4 * _numel(c.shape))


def _h_repeat(c: _Ctx) -> int:
    """`x.repeat(r0, .., rn)`: x viewed with a unit dim before each of its dims (and the new leading
    ones), expanded to the repeats, viewed to the result: tiles, from ruled view and expand."""
    x, reps = c.node(c.fx.args[0]), [int(r) for r in c.fx.args[1]]
    lead = len(reps) - x.rank
    sizes = (1,) * lead + x.shape
    one = tuple(v for s in sizes for v in (1, s))
    many = tuple(v for r, s in zip(reps, sizes) for v in (r, s))
    v = c.emit("view", [x.id], {"shape": list(one)}, name=c.fx.name + "_units", shape=one)
    e = c.emit("expand", [v], {"shape": list(many)}, name=c.fx.name + "_tiles", shape=many)
    return c.emit("view", [e], {"shape": list(c.shape)})


def _h_index_select(c: _Ctx) -> int:
    """`index_select(x, dim, idx)` is `x[:, .., idx]`: an `index` node with one used slot."""
    x, idx = c.node(c.fx.args[0]), c.node(c.fx.args[2])
    dim = _norm_dim(c.fx.args[1], x.rank)
    return c.emit("index", [x.id, idx.id], {"slots": [False] * dim + [True]}, _numel(c.shape))


def _h_copy(c: _Ctx) -> int:
    """Functional `copy(self, src)` (what `x[...] = y` and `copy_` become) and `fill.Tensor(self, value)`:
    src (value) broadcast to self's shape in self's dtype; self's values are not read."""
    src = c.node(c.fx.args[1])
    out = src.id
    if src.shape != c.shape:
        out = c.emit("expand", [out], {"shape": list(c.shape)}, name=c.fx.name + "_expand", dtype=src.dtype)
    attrs = {"dtype": c.dtype} if src.dtype != c.dtype else {}
    return c.emit("identity", [out], attrs, _numel(c.shape) if attrs else 0.0)


def _h_slice_scatter(c: _Ctx) -> int:
    """`slice_scatter(x, src, dim, start, end, step)`: x with rows start:end:step of dim replaced by src
    (an in-place write to a slice, e.g. DeepSeek-V3's rotary on part of the head dim, functionalized)."""
    x, src = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    dim = _norm_dim(_arg(c.fx, 2, "dim", 0), x.rank)
    start, end, step = slice(_arg(c.fx, 3, "start"), _arg(c.fx, 4, "end"), _arg(c.fx, 5, "step", 1)).indices(x.shape[dim])
    attrs = {"dim": dim, "start": start, "end": max(start, end), "step": step}
    return c.emit("slice_scatter", [x.id, src.id], attrs, src.numel)


def _h_select_scatter(c: _Ctx) -> int:
    """`select_scatter(x, src, dim, index)`: x with entry `index` of dim replaced by src (`x[:, i] = y`)."""
    x, src = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    dim = _norm_dim(c.fx.args[2], x.rank)
    index = c.fx.args[3] + (x.shape[dim] if c.fx.args[3] < 0 else 0)
    return c.emit("select_scatter", [x.id, src.id], {"dim": dim, "index": index}, src.numel)


def _h_flip(c: _Ctx) -> int:
    x = c.node(c.fx.args[0])
    return c.emit("flip", [x.id], {"dims": sorted(_norm_dim(d, x.rank) for d in c.fx.args[1])})


def _h_unfold(c: _Ctx) -> int:
    """`x.unfold(dim, size, step)`: the windows of `size` entries every `step` along dim, as a new last dim (a view)."""
    x = c.node(c.fx.args[0])
    return c.emit("unfold", [x.id], {"dim": _norm_dim(c.fx.args[1], x.rank), "size": int(c.fx.args[2]),
                                     "step": int(c.fx.args[3])})


def _h_as_strided(c: _Ctx) -> int:
    """`x.as_strided(size, stride, offset)` that reads x's own elements in a pattern of windows (Longformer's
    overlapping chunks): the chain of views, narrows and unfolds of engine.model.strided; any other is refused."""
    x, val = c.node(c.fx.args[0]), c.fx.args[0].meta["val"]
    size, stride = [int(s) for s in c.fx.args[1]], [int(s) for s in c.fx.args[2]]
    offset = _arg(c.fx, 3, "storage_offset")
    try:
        steps = as_strided_steps(x.shape, tuple(int(s) for s in val.stride()), int(val.storage_offset()),
                                 tuple(size), tuple(stride), int(val.storage_offset() if offset is None else offset))
    except NotAView as e:
        raise _Unsupported(f"aten.as_strided (size {size}, stride {stride}) that is no window view of its operand: {e} "
                           "(write it with Tensor.unfold, which capture lowers)") from None
    step, out = _Steps(c), x.id
    for k, (op, attrs, shape) in enumerate(steps):
        out = step(f"{op}{k}", op, [out], attrs, shape=shape, dtype=x.dtype, flops=0.0, final=k == len(steps) - 1)
    return out if steps else c.emit("identity", [x.id])


def _h_pad_mode(c: _Ctx) -> int:
    """reflection_pad{1,2,3}d / replication_pad{1,2,3}d: a `pad` node with its mode."""
    x = c.node(c.fx.args[0])
    mode = "reflect" if c.fx.target._opname.startswith("reflection") else "replicate"
    return c.emit("pad", [x.id], {"pad": [int(v) for v in c.fx.args[1]], "value": 0, "mode": mode}, _numel(c.shape))


def _m_first_output(op: str, lower: Callable[[_Ctx], int]) -> Callable[[_Ctx], list[int | None]]:
    """A multi-output op whose first output is `lower`'s node and whose others (statistics saved for
    backward, pooling indices) no forward reads: they stay unmodelled (refused if used)."""

    def split(c: _Ctx) -> list[int | None]:
        val = c.fx.meta["val"]
        if any(u.target is operator.getitem and u.args[1] != 0 for u in c.fx.users):
            raise _Unsupported(f"aten.{op} whose outputs after the first are used in forward")
        c.shape, c.dtype = _shape(val[0]), _dtype(val[0])
        return [lower(c)] + [None] * (len(val) - 1)
    return split


_HANDLERS.update({
    "round": _h_round, "elu": _h_elu, "leaky_relu": _h_leaky_relu,
    **{op: _h_reduce_by for op in ("amax", "amin", "any", "all", "prod", "argmax", "argmin", "max.default", "min.default")},
    "var": _h_var,
    "max.other": _h_binary, "min.other": _h_binary,
    "repeat": _h_repeat, "index_select": _h_index_select, "copy": _h_copy, "slice_scatter": _h_slice_scatter,
    "select_scatter": _h_select_scatter, "flip": _h_flip, "unfold": _h_unfold, "argsort": _h_argsort, "group_norm": _h_group_norm,
    "as_strided": _h_as_strided,
    **{f"{kind}_pad{k}d": _h_pad_mode for kind in ("reflection", "replication") for k in (1, 2, 3)},
    **{f"upsample_{mode}{k}d": _h_upsample for mode, k in (("nearest", 1), ("nearest", 2), ("nearest", 3), ("linear", 1),
                                                          ("bilinear", 2), ("bicubic", 2), ("trilinear", 3))},
    "empty_strided": _h_full, "fill": _h_full, "fill.Tensor": _h_copy, "floor_divide": _h_binary,
})
_FILLS.update({"empty_strided": 0, "fill": None})
_SPLITS.update({
    "max.dim": _m_max_dim, "min.dim": _m_max_dim, "sort": _m_sort,
    "native_layer_norm": _m_first_output("native_layer_norm", _h_layer_norm),  # layer_norm's arguments
    "native_group_norm": _m_first_output("native_group_norm", _h_group_norm),
    "max_pool2d_with_indices": _m_first_output("max_pool2d_with_indices", _h_max_pool),
    "max_pool3d_with_indices": _m_first_output("max_pool3d_with_indices", _h_max_pool),
    "_native_batch_norm_legit": _m_first_output("_native_batch_norm_legit", _h_batch_norm),
    "_native_batch_norm_legit.no_stats": _m_first_output("_native_batch_norm_legit", _h_batch_norm),
})


# --- composites decomposed into ruled operators, and aliases (issue 29) --------------------------
class _Steps:
    """Emits a chain of canonical nodes for one ATen node: each step is named after it with a suffix, the last one
    (`final=True`) with its own name, so users of the ATen node read the chain's result."""

    def __init__(self, c: _Ctx) -> None:
        self.c = c

    def __call__(self, suffix: str, op: str, inputs: list[int], attrs: dict | None = None, *, shape: tuple[int, ...],
                 dtype: str, flops: float | None = None, final: bool = False) -> int:
        name = self.c.fx.name if final else f"{self.c.fx.name}_{suffix}"
        return self.c.emit(op, inputs, attrs, float(_numel(shape)) if flops is None else flops, name=name, shape=shape,
                           dtype=dtype)


def _scalar_op(value: float | int) -> dict[str, Any]:
    """The attrs of a binary operator with a Python number as its second operand."""
    return {"scalar": value, "scalar_first": False}


def _float_operand(c: _Ctx, op: str) -> Node:
    x = c.node(c.fx.args[0])
    if not x.dtype.startswith(("float", "bfloat")):
        raise _Unsupported(f"aten.{op} of a {x.dtype} tensor")
    return x


def _h_logsumexp(c: _Ctx) -> int:
    """`logsumexp(x, dims, keepdim)` as torch computes it: m = amax(x) over dims with infinite maxima set to 0 (a row
    of -inf then gives -inf, not nan), log(sum(exp(x - m))) + m. The sum of a sharded reduced dim is a Partial;
    amax keeps such a dim whole (its rules)."""
    x = _float_operand(c, "logsumexp")
    dims, keep = _all_dims(_arg(c.fx, 1, "dim", None), x.rank), bool(_arg(c.fx, 2, "keepdim", False))
    kept = tuple(1 if d in dims else s for d, s in enumerate(x.shape))
    step, dt = _Steps(c), x.dtype
    m = step("max", "amax", [x.id], {"dims": dims, "keepdim": True}, shape=kept, dtype=dt, flops=x.numel)
    inf = step("inf", "isinf", [m], shape=kept, dtype="bool")
    m = step("shift", "where", [inf, m], {"x": 0.0, "y": None}, shape=kept, dtype=dt)
    e = step("centred", "sub", [x.id, m], shape=x.shape, dtype=dt)
    e = step("exp", "exp", [e], shape=x.shape, dtype=dt)
    s = step("sum", "sum", [e], {"dims": dims, "keepdim": True}, shape=kept, dtype=dt)
    s = step("log", "log", [s], shape=kept, dtype=dt)
    out = step("keepdim", "add", [s, m], shape=kept, dtype=dt, final=keep)
    return out if keep else step("", "view", [out], {"shape": list(c.shape)}, shape=c.shape, dtype=dt, flops=0.0,
                                 final=True)


def _h_rms_norm(c: _Ctx) -> int:
    """`rms_norm(x, normalized_shape, weight, eps)` as torch's decomposition computes it: in float32 for half inputs,
    x * rsqrt(mean(x^2) + eps) (eps by default that of the computation dtype), times the weight, cast back. The
    mean of a sharded normalised dim is a Partial (all-reduced before rsqrt), as in transformers' own RMSNorms."""
    x = _float_operand(c, "rms_norm")
    normalized, w, eps = list(c.fx.args[1]), _arg(c.fx, 2, "weight"), _arg(c.fx, 3, "eps")
    comp = "float32" if x.dtype in ("float16", "bfloat16") else x.dtype
    eps = torch.finfo(getattr(torch, comp)).eps if eps is None else float(eps)
    dims = list(range(x.rank - len(normalized), x.rank))
    kept = tuple(1 if d in dims else s for d, s in enumerate(x.shape))
    step = _Steps(c)
    up = x.id if comp == x.dtype else step("up", "identity", [x.id], {"dtype": comp}, shape=x.shape, dtype=comp)
    sq = step("square", "pow", [up], _scalar_op(2), shape=x.shape, dtype=comp)
    ms = step("mean", "mean", [sq], {"dims": dims, "keepdim": True}, shape=kept, dtype=comp, flops=x.numel)
    ms = step("eps", "add", [ms], _scalar_op(eps), shape=kept, dtype=comp)
    r = step("rsqrt", "rsqrt", [ms], shape=kept, dtype=comp)
    last = w is None and comp == c.dtype
    y = step("normed", "mul", [up, r], shape=x.shape, dtype=comp, final=last)
    if w is not None:
        y = step("scaled", "mul", [y, c.tid(w)], shape=x.shape, dtype=comp, final=comp == c.dtype)
    if comp != c.dtype:
        y = step("", "identity", [y], {"dtype": c.dtype}, shape=x.shape, dtype=c.dtype, final=True)
    return y


def _h_vector_norm(c: _Ctx) -> int:
    """`linalg_vector_norm(x, ord, dim, keepdim)` of a real tensor: ord 2 is sqrt(sum(x^2)), ord p sum(|x|^p)^(1/p),
    ord 1 sum(|x|), ord 0 the count of nonzero entries, ord +-inf amax/amin(|x|): a sharded reduced dim gives a
    Partial sum (all-reduced before the root), and sharded kept dims stay sharded. (At a zero vector the gradient of
    sqrt is unbounded where torch's norm gives 0: a random model never has one.)"""
    x = _float_operand(c, "linalg_vector_norm")
    p = float(_arg(c.fx, 1, "ord", 2))
    dims, keep = _all_dims(_arg(c.fx, 2, "dim", None), x.rank), bool(_arg(c.fx, 3, "keepdim", False))
    if c.fx.kwargs.get("dtype") is not None and str(c.fx.kwargs["dtype"]).removeprefix("torch.") != x.dtype:
        raise _Unsupported("aten.linalg_vector_norm with a dtype change")
    step, dt, red = _Steps(c), x.dtype, {"dims": dims, "keepdim": keep}
    if p == 0:
        nz = step("nonzero", "ne", [x.id], _scalar_op(0), shape=x.shape, dtype="bool")
        nz = step("count", "identity", [nz], {"dtype": dt}, shape=x.shape, dtype=dt)
        return step("", "sum", [nz], red, shape=c.shape, dtype=dt, final=True)
    a = x.id if p == 2 else step("abs", "abs", [x.id], shape=x.shape, dtype=dt)
    if math.isinf(p):
        return step("", "amax" if p > 0 else "amin", [a], red, shape=c.shape, dtype=dt, final=True)
    if p != 1:
        a = step("power", "pow", [a], _scalar_op(p), shape=x.shape, dtype=dt)
    s = step("sum", "sum", [a], red, shape=c.shape, dtype=dt, flops=x.numel, final=p == 1)
    if p == 1:
        return s
    if p == 2:
        return step("", "sqrt", [s], shape=c.shape, dtype=dt, final=True)
    return step("", "pow", [s], _scalar_op(1.0 / p), shape=c.shape, dtype=dt, final=True)


def _h_nll_loss(c: _Ctx) -> int:
    """`nll_loss(logp[N, C, ...], target[N, ...], weight=None, reduction, ignore_index)`: the target's entry of each
    row (`gather` along C, the ignored targets read class 0 and count 0), negated; `mean` divides the sum by the
    number of kept targets, a node of its own as for cross-entropy, so that sharded rows stay exact."""
    x, t = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    if _arg(c.fx, 2, "weight") is not None:
        raise _Unsupported(f"aten.{c.fx.target._opname} with class weights")
    if x.rank < 2:
        raise _Unsupported(f"aten.{c.fx.target._opname} of an unbatched input (add a batch dim)")
    reduction, ignore = int(_arg(c.fx, 3, "reduction", 1)), int(_arg(c.fx, 4, "ignore_index", -100))
    step, dt = _Steps(c), x.dtype
    kept = step("kept", "ne", [t.id], _scalar_op(ignore), shape=t.shape, dtype="bool")
    safe = step("safe", "where", [kept, t.id], {"x": None, "y": 0}, shape=t.shape, dtype=t.dtype)
    col = t.shape[:1] + (1,) + t.shape[1:]
    safe = step("column", "view", [safe], {"shape": list(col)}, shape=col, dtype=t.dtype, flops=0.0)
    picked = step("picked", "gather", [x.id, safe], {"dim": 1}, shape=col, dtype=dt)
    picked = step("rows", "view", [picked], {"shape": list(t.shape)}, shape=t.shape, dtype=dt, flops=0.0)
    picked = step("neg", "neg", [picked], shape=t.shape, dtype=dt)
    losses = step("losses", "where", [kept, picked], {"x": None, "y": 0.0}, shape=t.shape, dtype=dt,
                  final=reduction == 0)
    if reduction == 0:
        return losses
    every = {"dims": list(range(t.rank)), "keepdim": False}
    total = step("total", "sum", [losses], every, shape=(), dtype=dt, final=reduction == 2)
    if reduction == 2:
        return total
    count = step("count", "sum", [kept], every, shape=(), dtype="int64")
    return step("", "div", [total, count], shape=(), dtype=dt, final=True)


def _h_tril(c: _Ctx) -> int:
    """`tril(x, diagonal)` / `triu(x, diagonal)`: a mask of the last two dims by their global indices (rules in
    theory/index.py: those two dims stay whole)."""
    x = c.node(c.fx.args[0])
    return c.emit(c.fx.target._opname, [x.id], {"diagonal": int(_arg(c.fx, 1, "diagonal", 0))}, x.numel)


def _h_im2col(c: _Ctx) -> int:
    """`im2col(x, kernel_size, dilation, padding, stride)` (F.unfold): the sliding patches of x as columns."""
    x = c.node(c.fx.args[0])
    attrs = {k: [int(v) for v in _arg(c.fx, i, k)] for i, k in enumerate(("kernel_size", "dilation", "padding", "stride"), 1)}
    return c.emit("im2col", [x.id], attrs, _numel(c.shape))


def _h_col2im(c: _Ctx) -> int:
    """`col2im(x, output_size, kernel_size, dilation, padding, stride)` (F.fold, MobileViTv2's patches back into
    a feature map): each column's patch added at its place."""
    x = c.node(c.fx.args[0])
    keys = ("output_size", "kernel_size", "dilation", "padding", "stride")
    attrs = {k: [int(v) for v in _arg(c.fx, i, k)] for i, k in enumerate(keys, 1)}
    return c.emit("col2im", [x.id], attrs, x.numel)


def _h_scatter(c: _Ctx) -> int:
    """`scatter.src(x, dim, index, src)` and `scatter.value(x, dim, index, value)`: x with the entries at `index`
    along dim replaced (the reduce overloads are not lowered)."""
    x, idx = c.node(c.fx.args[0]), c.node(c.fx.args[2])
    if c.fx.target._overloadname not in ("src", "value") or c.fx.kwargs.get("reduce") is not None:
        raise _Unsupported(f"aten.scatter.{c.fx.target._overloadname} (a reducing scatter)")
    dim, src = _norm_dim(c.fx.args[1], x.rank), c.fx.args[3]
    if isinstance(src, torch.fx.Node):
        return c.emit("scatter", [x.id, idx.id, c.tid(src)], {"dim": dim}, idx.numel)
    return c.emit("scatter", [x.id, idx.id], {"dim": dim, "value": _scalar(src)}, idx.numel)


_HANDLERS.update({
    "logsumexp": _h_logsumexp, "rms_norm": _h_rms_norm, "linalg_vector_norm": _h_vector_norm,
    "nll_loss_nd": _h_nll_loss, "nll_loss": _h_nll_loss, "tril": _h_tril, "triu": _h_tril, "im2col": _h_im2col,
    "col2im": _h_col2im,
    "scatter": _h_scatter, "view_as": _h_view, "reshape_as": _h_view, "expand_as": _h_expand,
})


# --- complex tensors as (re, im) pairs (issue 29: Llama 4's and DeepSeek-V2's complex rotary, FNet's FFTs) ----
def _is_complex(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


def _touches_complex(fx: torch.fx.Node, b: _Builder) -> bool:
    """Whether `fx` makes a complex tensor or reads one that capture holds as a pair."""
    def complex_made(n: torch.fx.Node) -> bool:
        val = n.meta.get("val")
        return any(_is_complex(v) for v in (val if isinstance(val, (list, tuple)) else [val]))

    return complex_made(fx) or any(a.name in b.pairs or complex_made(a) for a in fx.all_input_nodes)


def _lower_complex(fx: torch.fx.Node, b: _Builder, seg: int, src: str) -> int:
    """A complex-valued step as real ones: every complex tensor is held as a real one with a trailing dim of 2
    (re, im), so views keep that dim and products are spelled out (`_COMPLEX`); any other complex op is refused."""
    opname = getattr(fx.target, "_opname", str(fx.target))
    val, handler = fx.meta.get("val"), _COMPLEX.get(opname)
    if handler is None or not isinstance(val, torch.Tensor):
        raise _Unsupported(f"aten.{opname} of a complex tensor (capture holds complex tensors as (re, im) pairs and "
                           f"lowers only {', '.join(sorted(_COMPLEX))} of them: write this step in real arithmetic)")
    pair = val.is_complex()
    shape, dtype = _shape(val) + ((2,) if pair else ()), str(val.dtype.to_real()).removeprefix("torch.")
    nid = handler(_Ctx(fx, b, seg, src, shape, dtype))
    if pair:
        b.pairs.add(fx.name)
    return nid


def _complex_leaf(kind: str, target: str) -> str:
    """Why a complex parameter, buffer or input is refused: its value reaches the runners from the module as it is,
    while capture holds complex tensors as (re, im) pairs."""
    return (f"complex {kind.lower().replace('_', ' ')} '{target}' (complex tensors are held as real (re, im) pairs "
            "inside the graph, but a leaf's value comes from the module unchanged: store it as "
            "torch.view_as_real(...) and call torch.view_as_complex on it in forward)")


def _is_pair(c: _Ctx, a: Any) -> bool:
    return isinstance(a, torch.fx.Node) and a.name in c.b.pairs


def _pair(c: _Ctx, a: Any) -> Node:
    """The pair node of a complex operand (a real operand where a complex one is expected is refused)."""
    if not _is_pair(c, a):
        raise _Unsupported(f"aten.{c.fx.target._opname} mixing complex and real operands")
    return c.node(a)


def _part(c: _Ctx, x: Node, k: int) -> int:
    """The real (k=0) or imaginary (k=1) part of a pair."""
    return _Steps(c)(f"{x.name}_{'ri'[k]}", "select", [x.id], {"dim": x.rank - 1, "index": k}, shape=x.shape[:-1],
                     dtype=x.dtype, flops=0.0)


def _join(c: _Ctx, re: int, im: int) -> int:
    """The pair (re, im) of two real tensors of the output's complex shape: unsqueezed on the last dim and cat."""
    step, cshape = _Steps(c), c.shape[:-1]
    col = cshape + (1,)
    parts = [step(f"{k}col", "view", [t], {"shape": list(col)}, shape=col, dtype=c.dtype, flops=0.0)
             for k, t in (("re", re), ("im", im))]
    return step("", "cat", parts, {"dim": len(cshape)}, shape=c.shape, dtype=c.dtype, flops=0.0, final=True)


def _c_alias(c: _Ctx) -> int:
    """`view_as_complex(x)` / `view_as_real(z)`: the pair is x itself (x's trailing 2 is (re, im))."""
    return c.tid(c.fx.args[0])


def _c_polar(c: _Ctx) -> int:
    """`polar(abs, angle)` = (abs cos(angle), abs sin(angle))."""
    r, angle = c.node(c.fx.args[0]), c.node(c.fx.args[1])
    step, cshape = _Steps(c), c.shape[:-1]
    waves = [step(op, op, [angle.id], shape=angle.shape, dtype=angle.dtype, flops=_UNARY_FLOPS[op] * angle.numel)
             for op in ("cos", "sin")]
    re, im = (step(f"{k}", "mul", [r.id, w], shape=cshape, dtype=c.dtype) for k, w in zip(("re", "im"), waves))
    return _join(c, re, im)


def _c_mul(c: _Ctx) -> int:
    """complex * complex = (ac - bd, ad + bc); complex * real (a tensor or a number) scales both parts."""
    x, y = c.fx.args[0], c.fx.args[1]
    if _is_pair(c, x) and _is_pair(c, y):
        step, cshape = _Steps(c), c.shape[:-1]
        (a, b), (cc, d) = ((_part(c, n, 0), _part(c, n, 1)) for n in (c.node(x), c.node(y)))
        prods = {k: step(k, "mul", [p, q], shape=cshape, dtype=c.dtype) for k, p, q in
                 (("ac", a, cc), ("bd", b, d), ("ad", a, d), ("bc", b, cc))}
        re = step("re", "sub", [prods["ac"], prods["bd"]], shape=cshape, dtype=c.dtype)
        im = step("im", "add", [prods["ad"], prods["bc"]], shape=cshape, dtype=c.dtype)
        return _join(c, re, im)
    z, other = (x, y) if _is_pair(c, x) else (y, x)
    return _c_scale(c, c.node(z), other, "mul")


def _c_scale(c: _Ctx, z: Node, other: Any, op: str) -> int:
    """A pair times (or over) a real tensor, unsqueezed to broadcast over (re, im), or a real number."""
    if not isinstance(other, torch.fx.Node):
        if isinstance(other, complex):
            raise _Unsupported(f"aten.{c.fx.target._opname} by a complex number")
        return c.emit(op, [z.id], _scalar_op(_scalar(other)), _numel(c.shape))
    r = c.node(other)
    col = c.emit("view", [r.id], {"shape": list(r.shape) + [1]}, name=f"{c.fx.name}_col", shape=r.shape + (1,),
                 dtype=r.dtype)
    return c.emit(op, [z.id, col], flops=_numel(c.shape))


def _c_div(c: _Ctx) -> int:
    """complex / real: both parts divided (a complex divisor is refused)."""
    if _is_pair(c, c.fx.args[1]) or c.fx.kwargs.get("rounding_mode") is not None:
        raise _Unsupported("aten.div by a complex tensor (capture holds complex tensors as (re, im) pairs)")
    return _c_scale(c, _pair(c, c.fx.args[0]), c.fx.args[1], "div")


def _c_add(c: _Ctx) -> int:
    """complex +/- complex: the pairs add part by part (alpha and real operands are refused)."""
    if c.fx.kwargs.get("alpha", 1) != 1:
        raise _Unsupported(f"aten.{c.fx.target._opname} of complex tensors with alpha")
    x, y = (_pair(c, a) for a in c.fx.args[:2])
    return c.emit(c.fx.target._opname, [x.id, y.id], flops=_numel(c.shape))


def _c_neg(c: _Ctx) -> int:
    return c.emit("neg", [_pair(c, c.fx.args[0]).id], flops=_numel(c.shape))


def _c_part(c: _Ctx) -> int:
    """`real(z)` / `imag(z)`: one slot of the pair."""
    z = _pair(c, c.fx.args[0])
    return c.emit("select", [z.id], {"dim": z.rank - 1, "index": int(c.fx.target._opname == "imag")})


def _c_reshape(c: _Ctx) -> int:
    """A view of a complex tensor (view, reshape, flatten, unsqueeze, squeeze, ...): the pair's view, (re, im) kept."""
    z = _pair(c, c.fx.args[0])
    return c.emit("identity" if z.shape == c.shape else "view", [z.id], None if z.shape == c.shape else
                  {"shape": list(c.shape)})


def _c_expand(c: _Ctx) -> int:
    z = _pair(c, c.fx.args[0])
    return c.emit("identity", [z.id]) if z.shape == c.shape else c.emit("expand", [z.id], {"shape": list(c.shape)})


def _c_copy(c: _Ctx) -> int:
    """clone / contiguous / a dtype change between complex dtypes: an identity of the pair (complex to real refused)."""
    z = _pair(c, c.fx.args[0])
    if not _is_complex(c.fx.meta.get("val")):
        raise _Unsupported(f"aten.{c.fx.target._opname} of a complex tensor to a real one (drops the imaginary part: "
                           "take .real explicitly)")
    return c.emit("identity", [z.id], {"dtype": c.dtype} if z.dtype != c.dtype else None)


def _c_slice(c: _Ctx) -> int:
    """slice / select / narrow of a complex tensor along a complex dim (a negative dim counts from the pair's
    second-to-last)."""
    z = _pair(c, c.fx.args[0])
    op, rank = c.fx.target._opname, z.rank - 1
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), rank)
    size = z.shape[dim]
    if op == "select":
        index = c.fx.args[2] + (size if c.fx.args[2] < 0 else 0)
        return c.emit("select", [z.id], {"dim": dim, "index": index})
    if op == "narrow":
        start = c.fx.args[2] + (size if c.fx.args[2] < 0 else 0)
        start, end, step = start, start + c.fx.args[3], 1
    else:
        step = _arg(c.fx, 4, "step", 1)
        start, end, _ = slice(_arg(c.fx, 2, "start"), _arg(c.fx, 3, "end"), step).indices(size)
    if c.shape == z.shape:
        return c.emit("identity", [z.id])
    return c.emit("narrow", [z.id], {"dim": dim, "start": start, "end": max(start, end), "step": int(step)})


def _c_permute(c: _Ctx) -> int:
    """permute / transpose of a complex tensor: the same dims of the pair, (re, im) staying last."""
    z = _pair(c, c.fx.args[0])
    rank = z.rank - 1
    if c.fx.target._opname == "permute":
        dims = [_norm_dim(d, rank) for d in c.fx.args[1]]
    else:
        dims = list(range(rank))
        d0, d1 = (_norm_dim(d, rank) for d in c.fx.args[1:3])
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return c.emit("permute", [z.id], {"dims": dims + [rank]})


def _c_cat(c: _Ctx) -> int:
    """cat / stack of complex tensors along a complex dim (stack: each operand viewed with a 1 there first)."""
    rank = len(c.shape) - 1
    dim = _norm_dim(_arg(c.fx, 1, "dim", 0), rank)
    parts = [_pair(c, t) for t in c.fx.args[0]]
    if c.fx.target._opname == "stack":
        ids = [c.emit("view", [p.id], {"shape": list(p.shape[:dim] + (1,) + p.shape[dim:])}, name=f"{c.fx.name}_part{k}",
                      shape=p.shape[:dim] + (1,) + p.shape[dim:]) for k, p in enumerate(parts)]
    else:
        ids = [p.id for p in parts]
    return c.emit("identity", ids) if len(ids) == 1 else c.emit("cat", ids, {"dim": dim})


_FFT_NORMS = {True: ("backward", "ortho", "forward"), False: ("forward", "ortho", "backward")}
"""`_fft_c2c` / `_fft_r2c`'s normalization (0: none, 1: 1/sqrt(n), 2: 1/n) as torch.fft's `norm`, forward and inverse."""


def _c_fft(c: _Ctx) -> int:
    """An FFT (fft, ifft, rfft and their 2-D and n-D forms, and the core `_fft_c2c` / `_fft_r2c`) of a real tensor or
    of a pair into a pair: one `fft` node over its dims (rules in theory/fft.py), so an FFT's result feeds the next
    FFT (FNet's `fft` per axis) or its parts (`.real`); a one-sided transform is the full one narrowed to n // 2 + 1
    on its last dim. Output sizes (`n`, `s`) are refused: pad or trim explicitly."""
    op, arg, pair = c.fx.target._opname, c.fx.args[0], _is_complex(c.fx.args[0].meta.get("val"))
    x, rank = _pair(c, arg) if pair else c.node(arg), len(c.shape) - 1
    if op.startswith("_fft_"):  # (x, dim, normalization, forward) / (x, dim, normalization, onesided)
        dims, forward = list(c.fx.args[1]), op == "_fft_r2c" or bool(c.fx.args[3])
        norm, onesided = _FFT_NORMS[forward][int(c.fx.args[2])], op == "_fft_r2c" and bool(c.fx.args[3])
    else:
        kind = op.removeprefix("fft_")  # fft, ifft, rfft, fft2, ...
        if _arg(c.fx, 1, "s" if kind[-1] in "2n" else "n") is not None:
            raise _Unsupported(f"aten.{op} with output sizes (pad or trim the input to the transform's length first)")
        default = {"2": [-2, -1], "n": None}.get(kind[-1], -1)
        dims, norm = _arg(c.fx, 2, "dim", default), _arg(c.fx, 3, "norm", None) or "backward"
        forward, onesided = not kind.startswith("i"), kind.startswith("r")
    dims = dims if isinstance(dims, (list, tuple)) or dims is None else [dims]
    halved = _norm_dim(list(dims or [rank - 1])[-1], rank) if onesided else None
    dims = _all_dims(dims, rank)
    if not x.dtype.startswith(("float", "bfloat")):
        raise _Unsupported(f"aten.{op} of a {x.dtype} tensor")
    full = tuple(x.shape[d] if d == halved else s for d, s in enumerate(c.shape[:-1]))
    flops = 5.0 * math.prod(full) * math.log2(max(2, math.prod(full[d] for d in dims)))  # the usual FFT count
    attrs = {"dims": dims, "norm": norm, "inverse": not forward, "pair": pair}
    if not onesided:
        return c.emit("fft", [x.id], attrs, flops)
    spectrum = c.emit("fft", [x.id], attrs, flops, name=f"{c.fx.name}_full", shape=full + (2,))
    return c.emit("narrow", [spectrum], {"dim": halved, "start": 0, "end": c.shape[halved], "step": 1})


_FFT_OPS = tuple(f"fft_{k}{n}" for k in ("", "i", "r") for n in ("fft", "fft2", "fftn")) + ("_fft_c2c", "_fft_r2c")
"""The FFTs `_c_fft` lowers (the inverse of a one-sided one, irfft, and the Hermitian ones are not)."""


_COMPLEX: dict[str, Callable[[_Ctx], int]] = {
    "view_as_complex": _c_alias, "view_as_real": _c_alias, "polar": _c_polar, "mul": _c_mul, "div": _c_div,
    "add": _c_add, "sub": _c_add, "neg": _c_neg, "real": _c_part, "imag": _c_part,
    **{op: _c_reshape for op in _VIEWS | {"unflatten"}}, "expand": _c_expand, "broadcast_to": _c_expand,
    **{op: _c_copy for op in ("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to",
                              "type_as")},
    "slice": _c_slice, "select": _c_slice, "narrow": _c_slice, "permute": _c_permute, "transpose": _c_permute,
    **{op: _c_cat for op in _CATS}, "stack": _c_cat,
    **{op: _c_fft for op in _FFT_OPS},
}
"""Complex-valued operators capture lowers onto (re, im) pairs."""


# --- the automatic fallback: side arithmetic runs unsharded (issue 13) -------------------------
def _check_fallback(fallback: str | None) -> None:
    if fallback not in FALLBACKS:
        raise ModelError(f"fallback {fallback!r} is not known (choose 'auto', 'replicate' or 'strict', or leave it unset)")


@dataclasses.dataclass
class _Lineage:
    """Per captured node: whether it carries a gradient (a float that depends on a parameter) and
    whether it depends on the input batch (on a placeholder). Grown as the builder grows."""

    grad: list[bool] = dataclasses.field(default_factory=list)
    batch: list[bool] = dataclasses.field(default_factory=list)

    def update(self, nodes: list[Node]) -> None:
        for n in nodes[len(self.grad):]:
            floating = n.dtype.startswith(("float", "bfloat", "complex"))
            self.grad.append(floating and (n.op == "parameter" or any(self.grad[i] for i in n.inputs)))
            self.batch.append(n.op == "placeholder" or any(self.batch[i] for i in n.inputs))


_LINEAGE: "weakref.WeakKeyDictionary[_Builder, _Lineage]" = weakref.WeakKeyDictionary()
"""The lineage of each live builder (kept beside it, so the builder itself stays as it is)."""


def _operand_ids(fx: torch.fx.Node, b: _Builder) -> list[int] | None:
    """Captured ids of every tensor operand of `fx`; None when one was not captured."""
    names = [a.name for a in torch.utils._pytree.tree_leaves((fx.args, fx.kwargs)) if isinstance(a, torch.fx.Node)]
    if any(name not in b.ids for name in names):
        return None
    return [b.ids[name] for name in names]


def _may_replicate(fallback: str | None, fx: torch.fx.Node, b: _Builder) -> bool:
    """Whether an op with no rule may be kept opaque under `fallback` (see `FALLBACKS`)."""
    if fallback == "replicate":
        return True
    if fallback == "strict":
        return False
    operands = _operand_ids(fx, b)
    if operands is None:
        return False
    lineage = _LINEAGE.setdefault(b, _Lineage())
    lineage.update(b.nodes)
    return not any(lineage.grad[i] for i in operands) or not any(lineage.batch[i] for i in operands)


def load_model(model: Any, example_inputs: tuple | dict | None = None, *, fallback: str | None = None,
               **knobs: Any) -> Graph:
    """The one entry to get a Graph: `"zoo:NAME"` + knobs, a graph JSON path, a Graph, or a module + inputs.

    A module may be any `torch.nn.Module`, e.g. a transformers model built from a config (on the
    meta device: no weight is allocated); `example_inputs` is a tuple of positional tensors or a
    dict of keyword tensors. `fallback="replicate"` plans operators with no rule unsharded."""
    from engine.model import zoo

    if isinstance(model, Graph):
        return model
    if isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise ModelError("load_model(module, example_inputs): example_inputs are required for a module")
        return capture(model, example_inputs, name=type(model).__name__, origin={"module": type(model).__qualname__},
                       fallback=fallback)
    if not isinstance(model, str):
        raise ModelError(f"load_model: expected 'zoo:NAME', a graph JSON path or a torch.nn.Module, got {type(model).__name__}")
    if model.startswith("zoo:"):
        name = model[4:]
        entry = zoo.entry(name)
        cfg = zoo.make_config(name, **knobs)
        with torch.device("meta"):
            module = entry.build(cfg)
        origin = {"zoo": name, "config": dataclasses.asdict(cfg)}
        return capture(module, entry.example_inputs(cfg, "meta"), name=name, origin=origin, fallback=fallback)
    if knobs:
        raise ModelError(f"knobs {sorted(knobs)} only apply to zoo models ('zoo:NAME')")
    _check_fallback(fallback)
    return Graph.load(model)
