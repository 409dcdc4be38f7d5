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
        return Node(id=int(d["id"]), name=str(d["name"]), op=str(d["op"]),
                    inputs=tuple(int(i) for i in d["inputs"]), shape=tuple(int(s) for s in d["shape"]),
                    dtype=str(d.get("dtype", "float32")), attrs=dict(d.get("attrs", {})),
                    flops=float(d.get("flops", 0.0)), segment=int(d.get("segment", 0)),
                    source=str(d.get("source", "")))


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
        if not isinstance(d, dict) or d.get("kind") != "hap.graph":
            raise ModelError("graph JSON: missing \"kind\": \"hap.graph\" (save a graph with Graph.save or `hap capture`)")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ModelError(f"graph JSON: schema_version {d.get('schema_version')!r} is not supported (expected {SCHEMA_VERSION})")
        try:
            nodes = tuple(Node.from_dict(x) for x in d["nodes"])
            graph = Graph(nodes=nodes, loss=int(d["loss"]), name=str(d.get("name", "model")), origin=dict(d.get("origin", {})))
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            raise ModelError(f"graph JSON: malformed node list ({type(e).__name__}: {e})") from None
        if not 0 <= graph.loss < len(nodes) or nodes[graph.loss].shape != ():
            raise ModelError(f"graph JSON: loss {graph.loss} is not a scalar node of the graph")
        return graph

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


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)
