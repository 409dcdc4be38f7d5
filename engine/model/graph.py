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

from engine import limits
from engine.errors import ModelError
from engine.readers import read_json

SCHEMA_VERSION = 1
LEAF_OPS = ("placeholder", "parameter", "buffer")
"""Leaves: model inputs, trainable parameters, and buffers (state that is not trained, e.g. position ids)."""
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}
KNOWN_DTYPES = frozenset(_ITEMSIZE) | {"int16", "uint16", "uint32", "uint64", "complex64", "complex128",
                                       "float8_e4m3fn", "float8_e5m2"}
"""Element types a graph may hold (torch dtype names without the `torch.` prefix)."""


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

    def __repr__(self) -> str:
        """One line for logs (the dataclass repr of a GPT ran to tens of thousands of characters)."""
        params = sum(n.numel for n in self.parameters)
        return f"<Graph '{self.name}': {len(self.nodes)} nodes, {params:,} parameters>"

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
        return Graph.from_checked_dict(d, "graph JSON: ")

    @staticmethod
    def from_checked_dict(d: dict[str, Any], where: str) -> "Graph":
        """The graph of dict `d` after `check_graph_dict` (errors prefixed by `where`, e.g. `plan: graph.`)."""
        check_graph_dict(d, where)
        try:
            nodes = tuple(Node.from_dict(x) for x in d["nodes"])
            return Graph(nodes=nodes, loss=d["loss"], name=str(d.get("name", "model")), origin=dict(d.get("origin", {})))
        except (KeyError, TypeError, ValueError, AssertionError) as e:  # check_graph_dict should have said why
            raise ModelError(f"{where}malformed node list ({type(e).__name__}: {e})") from None

    @staticmethod
    def load(path: str | Path) -> "Graph":
        """The graph of a graph JSON file, read within engine.readers' bounds (ModelError in one line)."""
        return Graph.from_dict(read_json(path, f"graph file '{path}'", ModelError))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_graph_dict(d: dict[str, Any], where: str = "graph JSON: ") -> None:
    """Refuse a malformed graph dict with a ModelError naming the first bad field by its JSON path
    (`nodes[3].inputs[0]`): node ids in order, references to earlier nodes only (topological),
    non-negative integer shapes, known dtypes, finite non-negative flops, unique names, and a
    scalar loss node. `load_model` on a graph JSON and every plan (its embedded graph) run it."""
    nodes = d.get("nodes")
    if not isinstance(nodes, list):
        raise ModelError(f"{where}nodes must be a list of nodes, got {type(nodes).__name__} (save a graph with Graph.save or `hap capture`)")
    if not nodes:
        raise ModelError(f"{where}nodes is empty: a graph holds at least its loss node")
    if len(nodes) > limits.MAX_NODES:
        raise ModelError(f"{where}nodes has {len(nodes)} nodes, more than the limit of {limits.MAX_NODES}")
    names: dict[str, int] = {}
    for i, x in enumerate(nodes):
        _check_node_dict(x, i, f"{where}nodes[{i}]", names)
        _check_node_bounds(x, f"{where}nodes[{i}]", len(nodes))
    loss = d.get("loss")
    if not _is_int(loss) or not 0 <= loss < len(nodes):
        raise ModelError(f"{where}loss = {loss!r} is not a node id (0..{len(nodes) - 1}); it must name the scalar loss node")
    if nodes[loss]["shape"] != []:
        raise ModelError(f"{where}loss = {loss} names node '{nodes[loss]['name']}' of shape {nodes[loss]['shape']}, "
                         "not a scalar; the loss must be a scalar node")
    for key, kind in (("name", str), ("origin", dict)):
        if key in d and not isinstance(d[key], kind):
            raise ModelError(f"{where}{key} must be a {kind.__name__}, got {type(d[key]).__name__}")
    _check_origin(d.get("origin", {}), f"{where}origin")


ORIGIN_FIELDS: dict[str, tuple[type, ...]] = {"zoo": (str,), "hf": (str,), "file": (str,), "sha256": (str,),
                                              "task": (str,), "config": (dict,), "inputs": (dict, list),
                                              "implementation": (dict,), "adjusted": (dict,)}
"""Where a graph came from (engine.model.source): the fields the planner and the runner read back (a model
file's inputs are a list of shapes, an hf class's a dict of knobs)."""


def _check_origin(origin: dict[str, Any], where: str) -> None:
    """The origin's known fields have their types, and a batch size in config/inputs is an integer: the
    overlap planner and the runner rebuild the model from them."""
    for key, kinds in ORIGIN_FIELDS.items():
        if key in origin and not isinstance(origin[key], kinds):
            allowed = " or ".join({dict: "a JSON object", list: "a list", str: "a string"}[k] for k in kinds)
            raise ModelError(f"{where}.{key} must be {allowed}, got {type(origin[key]).__name__}")
    for key in ("config", "inputs"):
        batch = origin[key].get("batch") if isinstance(origin.get(key), dict) else None
        if batch is not None and not (_is_int(batch) and 0 < batch <= 2**31):
            raise ModelError(f"{where}.{key}.batch must be a positive integer, got {batch!r}")


def _check_node_dict(x: Any, i: int, path: str, names: dict[str, int]) -> None:
    """One node of `check_graph_dict`; `names` collects the names seen so far."""
    if not isinstance(x, dict):
        raise ModelError(f"{path} must be a node object, got {type(x).__name__}")
    for key in ("id", "name", "op", "inputs", "shape"):
        if key not in x:
            raise ModelError(f"{path}.{key} is missing (every node has id, name, op, inputs and shape)")
    if not _is_int(x["id"]) or x["id"] != i:
        raise ModelError(f"{path}.id = {x['id']!r} but node ids must be 0..n-1 in list order (expected {i})")
    for key in ("name", "op", "source"):
        if key in x and (not isinstance(x[key], str) or (key != "source" and not x[key])):
            raise ModelError(f"{path}.{key} must be a non-empty string, got {x[key]!r}")
    if x["name"] in names:
        raise ModelError(f"{path}.name '{x['name']}' is also the name of node {names[x['name']]}; node names must be unique")
    names[x["name"]] = i
    if not isinstance(x["inputs"], list):
        raise ModelError(f"{path}.inputs must be a list of node ids, got {type(x['inputs']).__name__}")
    for k, j in enumerate(x["inputs"]):
        if not _is_int(j) or not 0 <= j < i:
            raise ModelError(f"{path}.inputs[{k}] = {j!r} is not an earlier node (ids 0..{i - 1}): "
                             "nodes are in topological order and refer to earlier nodes only")
    if not isinstance(x["shape"], list) or not all(_is_int(s) and s >= 0 for s in x["shape"]):
        raise ModelError(f"{path}.shape = {x['shape']!r} must be a list of non-negative integers")
    if not isinstance(x.get("dtype", "float32"), str) or x.get("dtype", "float32") not in KNOWN_DTYPES:
        raise ModelError(f"{path}.dtype = {x.get('dtype')!r} is not a known dtype ({', '.join(sorted(KNOWN_DTYPES))})")
    flops = x.get("flops", 0.0)
    if not isinstance(flops, (int, float)) or isinstance(flops, bool) or not math.isfinite(flops) or flops < 0:
        raise ModelError(f"{path}.flops = {flops!r} must be a finite non-negative number")
    if not _is_int(x.get("segment", 0)) or x.get("segment", 0) < 0:
        raise ModelError(f"{path}.segment = {x.get('segment')!r} must be a non-negative integer")
    if not isinstance(x.get("attrs", {}), dict):
        raise ModelError(f"{path}.attrs must be an object, got {type(x['attrs']).__name__}")


def _check_node_bounds(x: dict[str, Any], path: str, count: int) -> None:
    """The sane ranges of `engine.limits` on one (type-checked) node: rank, elements, flops, segment and
    the numbers in attrs, so that every cost the engine derives from the node stays a finite float."""
    shape = x["shape"]
    if len(shape) > limits.MAX_RANK or math.prod(shape) > limits.MAX_NUMEL:
        raise ModelError(f"{path}.shape = {shape!r} has {len(shape)} dims and {math.prod(shape):.3g} elements; "
                         f"the limits are {limits.MAX_RANK} dims and 2**48 elements")
    if x.get("flops", 0.0) > limits.MAX_NODE_FLOPS:
        raise ModelError(f"{path}.flops = {x['flops']!r} is above the limit {limits.MAX_NODE_FLOPS:g}")
    if x.get("segment", 0) >= count:
        raise ModelError(f"{path}.segment = {x['segment']!r} but a graph of {count} nodes has segments 0..{count - 1}")
    _check_attr_bounds(x.get("attrs", {}), f"{path}.attrs", 0)


def _check_attr_bounds(value: Any, path: str, depth: int) -> None:
    """Attrs nest at most MAX_ATTR_DEPTH levels and hold integers (dims, sizes, counts) of magnitude at most
    2**53. Floats are data, any finite value (a mask's `finfo(float32).min`, a scalar operand)."""
    if depth > limits.MAX_ATTR_DEPTH:
        raise ModelError(f"{path} nests deeper than {limits.MAX_ATTR_DEPTH} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_attr_bounds(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for k, v in enumerate(value):
            _check_attr_bounds(v, f"{path}[{k}]", depth + 1)
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > limits.MAX_ATTR_NUMBER:
            raise ModelError(f"{path} = {value!r} is beyond +-2**53")


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def parse_equation(equation: str) -> tuple[list[str], str]:
    """The operands' and the output's index letters of an einsum node's `equation` attr:
    `"btd,edf->btef"` -> (["btd", "edf"], "btef"); spaces ignored; an explicit output is required."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        raise ValueError(f"einsum equation '{equation}' needs an explicit '->' output and no '...'")
    lhs, out = eq.split("->")
    return lhs.split(","), out
