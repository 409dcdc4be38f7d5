"""The graph IR: the single-device program (HAP §3, the graph (V, E)) that the theory reasons about.

Each `Node` is one canonical operator with its output shape, dtype, forward flops and segment
(layer) id. Leaves are `placeholder` (model inputs) and `parameter` nodes. The IR is plain data:
it serialises to JSON so a model can be shared and planned without its code.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import limits
from .errors import ModelError

SCHEMA_VERSION = 1
LEAF_OPS = ("placeholder", "parameter", "buffer")
"""Leaves: model inputs, trainable parameters, and buffers (state that is not trained, e.g. position ids)."""
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Node:
    """One instruction of the single-device program and the reference tensor it produces."""

    id: int
    """Index in the topological order of the graph."""
    name: str
    """Readable name (from the captured program), unique in the graph."""
    op: str
    """Canonical operator, e.g. `linear`, `add`, `view`, `placeholder`, `parameter`."""
    inputs: tuple[int, ...]
    """Ids of the tensor operands, in the operator's argument order."""
    shape: tuple[int, ...]
    """Shape of the output tensor."""
    dtype: str = "float32"
    """Element type of the output tensor (torch dtype name without the `torch.` prefix)."""
    attrs: dict[str, Any] = field(default_factory=dict)
    """Non-tensor arguments (JSON values), e.g. `{"dim": -1}` or `{"shape": [4, 8, 32]}`."""
    flops: float = 0.0
    """Forward floating point operations of the whole (unsharded) instruction."""
    segment: int = 0
    """Segment (layer) id, used for per-segment sharding ratios (HAP §5.2)."""
    source: str = ""
    """Where the node comes from (module path), for messages."""

    @property
    def is_leaf(self) -> bool:
        return self.op in LEAF_OPS

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE.get(self.dtype, 4)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "op": self.op, "inputs": list(self.inputs),
                "shape": list(self.shape), "dtype": self.dtype, "attrs": self.attrs,
                "flops": self.flops, "segment": self.segment, "source": self.source}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Node":
        """A node from its JSON object, every field type- and bounds-checked (see `_NodeReader`)."""
        return _NodeReader(d, "node").node()


@dataclass(frozen=True)
class Graph:
    """A captured single-device training program ending in a scalar loss."""

    nodes: tuple[Node, ...]
    loss: int
    """Id of the scalar loss node (the program's output)."""
    name: str = "model"
    origin: dict[str, Any] = field(default_factory=dict)
    """How to rebuild the module (e.g. `{"zoo": "gpt", "config": {...}}`); used by the runner."""

    def __post_init__(self) -> None:
        for i, n in enumerate(self.nodes):
            assert n.id == i, f"node ids must be 0..n-1 in order, node {n.name} has id {n.id} at {i}"
            assert all(j < i for j in n.inputs), f"node {n.name} uses a later node"

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    @property
    def parameters(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "parameter"]

    @property
    def placeholders(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "placeholder"]

    @property
    def num_parameters(self) -> int:
        return sum(n.numel for n in self.parameters)

    @property
    def flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    @property
    def num_segments(self) -> int:
        return max(n.segment for n in self.nodes) + 1

    def users(self) -> list[list[int]]:
        """For each node, the ids of the nodes that consume it (in order)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                out[i].append(n.id)
        return out

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op] = hist.get(n.op, 0) + 1
        return dict(sorted(hist.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": "hap.graph", "name": self.name,
                "loss": self.loss, "origin": self.origin, "nodes": [n.to_dict() for n in self.nodes]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    def fingerprint(self) -> str:
        """sha256 of the program (names and origin excluded: same computation, same print)."""
        core = [[n.op, list(n.inputs), list(n.shape), n.dtype, n.attrs, n.segment] for n in self.nodes]
        return hashlib.sha256(json.dumps([core, self.loss], sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Graph":
        """A graph from its JSON object; raises ModelError naming the first bad node and field."""
        if not isinstance(d, dict) or d.get("kind") != "hap.graph":
            raise ModelError("graph JSON: missing \"kind\": \"hap.graph\" (save a graph with Graph.save or `hap capture`)")
        if d.get("schema_version") != SCHEMA_VERSION or isinstance(d.get("schema_version"), bool):
            raise ModelError(f"graph JSON: schema_version {d.get('schema_version')!r} is not supported (expected {SCHEMA_VERSION})")
        raw = d.get("nodes")
        if not isinstance(raw, list) or not raw:
            got = "an empty list" if raw == [] else _kind(raw)
            raise ModelError(f"graph JSON: \"nodes\" must be a non-empty list of node objects, got {got}")
        if len(raw) > limits.MAX_NODES:
            raise ModelError(f"graph JSON: {len(raw)} nodes, more than the limit of {limits.MAX_NODES}")
        nodes = tuple(_NodeReader(x, f"node {i}", i, len(raw)).node() for i, x in enumerate(raw))
        loss = d.get("loss")
        if not _is_int(loss) or not 0 <= loss < len(nodes) or nodes[loss].shape != ():
            raise ModelError(f"graph JSON: loss {loss!r} is not the id of a scalar node of the graph (0..{len(nodes) - 1})")
        name, origin = d.get("name", "model"), d.get("origin", {})
        if not isinstance(name, str) or not isinstance(origin, dict):
            raise ModelError("graph JSON: \"name\" must be a string and \"origin\" an object")
        return Graph(nodes=nodes, loss=loss, name=name, origin=origin)

    @staticmethod
    def load(path: str | Path) -> "Graph":
        p = Path(path)
        if not p.exists():
            raise ModelError(f"graph file '{p}' not found")
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"graph file '{p}' cannot be read: {e.__class__.__name__}: {e}") from None
        except json.JSONDecodeError as e:
            raise ModelError(f"graph file '{p}' is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
        return Graph.from_dict(d)


def _is_int(value: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """JSON-ish name of a value's type, for messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class _NodeReader:
    """Reads one node object of a graph JSON, naming the node and the field in every error."""

    def __init__(self, d: Any, where: str, position: int | None = None, count: int | None = None) -> None:
        if not isinstance(d, dict):
            raise ModelError(f"graph JSON: {where}: must be an object, got {_kind(d)}")
        self.d, self.where, self.position, self.count = d, where, position, count
        name = d.get("name")
        if isinstance(name, str) and name:
            self.where = f"{where} ({name!r})"

    def fail(self, field: str, why: str) -> ModelError:
        """The error for a bad field of this node."""
        return ModelError(f"graph JSON: {self.where}: \"{field}\" {why}")

    def text(self, field: str, default: str | None = None, allow_empty: bool = True) -> str:
        """A string field."""
        value = self.d.get(field, default)
        if value is None:
            raise self.fail(field, "is missing")
        if not isinstance(value, str) or (not allow_empty and not value):
            raise self.fail(field, f"must be a{'' if allow_empty else ' non-empty'} string, got {_kind(value)}")
        return value

    def integer(self, field: str, low: int, high: int, default: int | None = None) -> int:
        """An integer field in [low, high]."""
        value = self.d.get(field, default)
        if value is None:
            raise self.fail(field, "is missing")
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            value = int(value)
        if not _is_int(value) or not low <= value <= high:
            raise self.fail(field, f"must be an integer in {low}..{high}, got {value!r}")
        return value

    def int_list(self, field: str, low: int, high: int, max_len: int) -> tuple[int, ...]:
        """A list of integers, each in [low, high]."""
        value = self.d.get(field)
        if not isinstance(value, list):
            raise self.fail(field, f"must be a list of integers, got {_kind(value) if field in self.d else 'nothing'}")
        if len(value) > max_len:
            raise self.fail(field, f"has {len(value)} entries, more than {max_len}")
        for k, x in enumerate(value):
            if high < low:
                raise self.fail(field, f"must be empty here, got {value!r}: a node uses only earlier nodes")
            if not _is_int(x) or not low <= x <= high:
                raise self.fail(field, f"[{k}] must be an integer in {low}..{high}, got {x!r}")
        return tuple(value)

    def flops(self) -> float:
        """Forward flops: a finite number in [0, MAX_NODE_FLOPS]."""
        value = self.d.get("flops", 0.0)
        if not limits.in_range(value, 0, limits.MAX_NODE_FLOPS):
            raise self.fail("flops", f"must be a number in [0, {limits.MAX_NODE_FLOPS:g}], got {value!r}")
        return float(value)

    def attrs(self) -> dict[str, Any]:
        """Non-tensor arguments: an object of JSON values, numbers bounded, nesting shallow."""
        value = self.d.get("attrs", {})
        if not isinstance(value, dict):
            raise self.fail("attrs", f"must be an object, got {_kind(value)}")
        self._check_attr(value, "attrs", 0)
        return value

    def _check_attr(self, value: Any, path: str, depth: int) -> None:
        if depth > limits.MAX_ATTR_DEPTH:
            raise self.fail(path, f"nests deeper than {limits.MAX_ATTR_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                self._check_attr(v, f"{path}.{k}", depth + 1)
        elif isinstance(value, list):
            for k, v in enumerate(value):
                self._check_attr(v, f"{path}[{k}]", depth + 1)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value) and abs(value) > limits.MAX_ATTR_NUMBER:
                raise self.fail(path, f"{value!r} is beyond +-2**53")

    def shape(self) -> tuple[int, ...]:
        """Output shape: at most MAX_RANK non-negative dims whose product is at most MAX_NUMEL."""
        shape = self.int_list("shape", 0, limits.MAX_NUMEL, limits.MAX_RANK)
        if math.prod(shape) > limits.MAX_NUMEL:
            raise self.fail("shape", f"{list(shape)} has {math.prod(shape):.3g} elements, more than 2**48")
        return shape

    def node(self) -> Node:
        """The checked node; ids are positions, inputs name earlier nodes."""
        position = self.position
        top = limits.MAX_NODES if position is None else position
        node_id = self.integer("id", 0, top)
        if position is not None and node_id != position:
            raise self.fail("id", f"is {node_id} but the node is at position {position}; ids must be 0..n-1 in order")
        segments = limits.MAX_NODES if self.count is None else self.count - 1
        return Node(id=node_id, name=self.text("name", allow_empty=False), op=self.text("op", allow_empty=False),
                    inputs=self.int_list("inputs", 0, node_id - 1, 4096), shape=self.shape(),
                    dtype=self.text("dtype", "float32", allow_empty=False), attrs=self.attrs(), flops=self.flops(),
                    segment=self.integer("segment", 0, segments, 0), source=self.text("source", ""))


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)
