"""The plan validator: every plan is checked against the theory before anything runs it.

A plan is a file users edit, write with other tools and carry between machines, so nothing in it
is trusted. `validate_plan` checks, in this order, and raises a `PlanError` naming the first
failure by its JSON path (`shard_sizes["fc1_weight:0"]`, `program[17].pre[1]`) and how to fix it:

1. the schema (`check_plan_dict`): types, required fields, finite non-negative numbers, one
   memory figure and one computation time per device, and the embedded graph well formed (the
   checks `load_model` runs on a graph JSON, `engine.model.graph.check_graph_dict`);
2. the ratios: per segment one per device, each in [0, 1], summing to 1;
3. the program against the theory (HAP §4.2, the Hoare-logic check the synthesis relies on):
   replayed from the empty state, every load is a leaf rule of its node (each leaf loaded once,
   so every parameter's gradient is synchronised as its load form says: a Full parameter's is
   all-reduced, a sharded one's is complete), every compute is a triple the theory gives its node,
   every collective one whose precondition form matches, every precondition was established by an
   earlier instruction (a Shard in the sizes of the segment that uses it, §5.2), every node is
   computed and the loss ends `Partial` or `Full` (the forms the runner accepts);
4. the integer shard sizes: one entry per sharded (tensor, dim, segment) the program needs and no
   other, non-negative, summing to the dim, and the sizes the ratios round to (`shard_sizes`);
5. with a cluster: the world size is the cluster's, and the predicted time re-priced by the cost
   model; a mismatch beyond `REPRICE_TOLERANCE` is a warning returned, not an error (the cluster
   file may have been re-profiled since the plan was made).

`plan_from_dict` (behind `engine.load_plan`) runs 1-4 on every plan it reads; `hap bundle check`, `hap export` and `hap run`
(before any rank starts) add 5 with the cluster they have.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from engine.cluster.hierarchy import HIER_KEYS, machine_groups
from engine.cluster.spec import Cluster
from engine.errors import HapError, PlanError
from engine.model.graph import SCHEMA_VERSION as GRAPH_SCHEMA_VERSION
from engine.model.graph import Graph
from engine.options import OPTIMIZERS, OVERLAP_MODES, PlanOptions
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.plan import PLAN_KIND, PLAN_SCHEMA_VERSION, Plan, plan_from_checked_dict
from engine.spmd.program import COMM, COMPUTE, LOAD, Instruction
from engine.spmd.recompute import layers
from engine.spmd.segments import RESPLIT, instruction_segments, source_segments
from engine.spmd.sizes import realized_ratios, shard_classes, shard_key, shard_sizes
from engine.spmd.utilisation import FIELDS as UTILISATION_FIELDS
from engine.spmd.zero import record_problem, record_schema_problem
from engine.theory import COLLECTIVES, collectives_from, form_str, leaf_forms, op_rules
from engine.theory.core import FULL, PARTIAL, Form, parse_form

RATIO_TOLERANCE = 1e-6
"""How far a segment's ratios may sum from 1 (they are printed floats)."""
REPRICE_TOLERANCE = 0.05
"""Relative difference between the plan's predicted time and the cost model's re-pricing that is reported."""
REGENERATE = "regenerate the plan with `hap plan`"
LOSS_FORMS = (PARTIAL, FULL)
"""Forms of the loss the runner accepts (runner.train: a Partial loss is backpropagated as it is, a Full one scaled by 1/m)."""
COMM_KEYS = frozenset(c.key for c in COLLECTIVES) | {RESPLIT}


def validate_plan(plan: Plan | dict[str, Any], cluster: Cluster | None = None) -> list[str]:
    """Check a plan (a Plan or its JSON dict) and return the re-pricing warnings; PlanError on the first failure."""
    if not isinstance(plan, Plan):
        plan = plan_from_dict(plan)  # checks 1-4
    else:
        check_plan(plan)
    return [] if cluster is None else check_against_cluster(plan, cluster)


def plan_from_dict(d: Any) -> Plan:
    """Parse and validate an SPMD plan's JSON dict (checks 1-4); PlanError naming the first problem."""
    if not isinstance(d, dict) or d.get("kind") != PLAN_KIND:
        raise PlanError(f"not a plan: missing \"kind\": \"{PLAN_KIND}\" (make one with `hap plan`)")
    if d.get("schema_version") != PLAN_SCHEMA_VERSION or isinstance(d.get("schema_version"), bool):
        raise PlanError(f"plan schema_version {d.get('schema_version')!r} is not supported (expected {PLAN_SCHEMA_VERSION})")
    check_plan_dict(d)
    plan = plan_from_checked_dict(d)
    check_plan(plan, d["model"]["fingerprint"])
    return plan


def check_plan(plan: Plan, model_fingerprint: str | None = None) -> None:
    """Checks 2-4 on a constructed plan (the schema, 1, is `check_plan_dict` on its JSON, which
    gives the `model_fingerprint` the plan recorded: an edited graph no longer has it)."""
    if model_fingerprint is not None and model_fingerprint != plan.model_fingerprint:
        raise _fail("graph", f"the graph was edited: its fingerprint {plan.model_fingerprint[:12]}... is not the "
                    f"model.fingerprint {model_fingerprint[:12]}... the plan was made for")
    check_structure(plan)
    check_ratios(plan)
    check_program(plan)
    check_shard_sizes(plan)
    if (bad := record_problem(plan.graph, plan.program, plan.world_size, plan.shard_states)) is not None:
        raise _fail(*bad)


# ----------------------------------------------------------------------------- 1. schema


def _fail(path: str, problem: str, fix: str = REGENERATE) -> PlanError:
    return PlanError(f"plan: {path}: {problem}; {fix}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _non_negative(x: Any, path: str) -> None:
    if not _is_number(x) or not math.isfinite(x) or x < 0:
        raise _fail(path, f"{_shown(x)} is not a finite non-negative number")


def _shown(x: Any) -> str:
    text = json.dumps(x) if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _typed(d: dict[str, Any], key: str, kind: type | tuple[type, ...], path: str = "", required: bool = True) -> Any:
    """d[key], refused unless it has type `kind` (missing: refused when required, else None)."""
    where = f"{path}{key}"
    if key not in d:
        if required:
            raise _fail(where, "is missing")
        return None
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _fail(where, f"must be a {names}, got {type(value).__name__} {_shown(value)}")
    return value


def check_plan_dict(d: dict[str, Any]) -> None:
    """Check 1: the JSON of a plan has every field, of the right type, numbers finite and non-negative."""
    for key, kind in (("strategy", str), ("cluster", dict), ("ratios", dict), ("shard_sizes", dict),
                      ("memory_bytes", list), ("stages", list), ("program", list), ("graph", dict)):
        _typed(d, key, kind)
    _typed(d, "history", list, required=False)
    _check_search_options(_typed(d, "search", dict, required=False) or {})
    check_utilisation_fields(d)
    _non_negative(d.get("predicted_time_s"), "predicted_time_s")
    _check_cluster_field(d["cluster"])
    for j, m in enumerate(d["memory_bytes"]):
        _non_negative(m, f"memory_bytes[{j}]")
    for i, s in enumerate(d["stages"]):
        _check_stage(s, f"stages[{i}]")
    for k, row in d["ratios"].items():
        if not isinstance(k, str):
            raise _fail("ratios", f"key {_shown(k)} is not a segment number as a string (\"0\", \"1\", ...)")
        _check_row(row, f"ratios[{json.dumps(k)}]", _is_number, "a list of numbers")
    for k, row in d["shard_sizes"].items():
        _check_row(row, f"shard_sizes[{json.dumps(k)}]", _is_int, "a list of integers")
    overlap = _typed(d, "overlap", str, required=False)
    if overlap is not None and overlap not in OVERLAP_MODES:
        raise _fail("overlap", f"{_shown(overlap)} is not an overlap mode (one of: {', '.join(OVERLAP_MODES)})")
    if (bad := record_schema_problem(d.get("shard_states", {}))) is not None:
        raise _fail(*bad)
    segments = _typed(d, "segments", list, required=False) or []
    for i, s in enumerate(segments):
        if not _is_int(s) or s < 0:
            raise _fail(f"segments[{i}]", f"{_shown(s)} is not a segment number (a non-negative integer)")
    for i, layer in enumerate(_typed(d, "recompute", list, required=False) or []):
        if not _is_int(layer) or layer < 0:
            raise _fail(f"recompute[{i}]", f"{_shown(layer)} is not a layer number (a non-negative integer)")
    for i, ins in enumerate(d["program"]):
        _check_instruction_dict(ins, f"program[{i}]")
    if d["graph"].get("kind") != "hap.graph":
        raise _fail("graph.kind", f"{_shown(d['graph'].get('kind'))} is not \"hap.graph\"")
    if d["graph"].get("schema_version") != GRAPH_SCHEMA_VERSION:
        raise _fail("graph.schema_version", f"{_shown(d['graph'].get('schema_version'))} is not supported "
                    f"(expected {GRAPH_SCHEMA_VERSION})")
    model = _typed(d, "model", dict)
    _typed(model, "fingerprint", str, "model.")
    if model.get("origin", {}) != d["graph"].get("origin", {}):
        raise _fail("model.origin", "differs from graph.origin (the runner rebuilds the model from it)")
    # the graph itself is checked as it is built (engine.model.graph.check_graph_dict, paths `graph.nodes[i]...`)


def check_utilisation_fields(d: dict[str, Any]) -> None:
    """The utilisation figures a plan may record (`engine.spmd.utilisation.FIELDS`; plans written before
    them have none): each a finite non-negative number or null, and a recorded peak positive."""
    for key in UTILISATION_FIELDS:
        if d.get(key) is not None:
            _non_negative(d[key], key)
    if d.get("peak_flops") == 0:
        raise _fail("peak_flops", "is 0: the summed FLOP/s of the plan's devices must be positive")


def _check_search_options(search: dict[str, Any]) -> None:
    """The options a plan records (`search.options`, and `search.optimizer` in every plan) are ones
    `PlanOptions` accepts: the runner and the re-pricing read them."""
    if "optimizer" in search and search["optimizer"] not in OPTIMIZERS:
        raise _fail("search.optimizer", f"{_shown(search['optimizer'])} is not an optimizer (one of: {', '.join(OPTIMIZERS)})")
    if "options" in search:
        try:
            PlanOptions.from_dict(search["options"])
        except PlanError as e:
            raise _fail("search.options", str(e)) from None


def _check_cluster_field(c: dict[str, Any]) -> None:
    _typed(c, "name", str, "cluster.")
    _typed(c, "fingerprint", str, "cluster.")
    devices = _typed(c, "devices", list, "cluster.")
    if not devices:
        raise _fail("cluster.devices", "is empty: a plan runs on at least one device")
    for j, name in enumerate(devices):
        if not isinstance(name, str) or not name:
            raise _fail(f"cluster.devices[{j}]", f"{_shown(name)} is not a device name")
    if len(set(devices)) != len(devices):
        dup = next(n for n in devices if devices.count(n) > 1)
        raise _fail("cluster.devices", f"device '{dup}' is listed twice: device names must be unique")
    machines = _typed(c, "machines", list, "cluster.", required=False)
    if machines is not None:
        if len(machines) != len(devices):
            raise _fail("cluster.machines", f"has {len(machines)} entries but the plan has {len(devices)} devices")
        for j, name in enumerate(machines):
            if not isinstance(name, str) or not name:
                raise _fail(f"cluster.machines[{j}]", f"{_shown(name)} is not a machine name")


def _check_stage(s: Any, path: str) -> None:
    if not isinstance(s, dict):
        raise _fail(path, f"must be an object, got {type(s).__name__}")
    for key in ("direction", "comm", "comm_tensor"):
        _typed(s, key, str, f"{path}.")
    _non_negative(s.get("comm_s"), f"{path}.comm_s")
    for j, t in enumerate(_typed(s, "comp_s", list, f"{path}.")):
        _non_negative(t, f"{path}.comp_s[{j}]")
    if not _is_int(s.get("segment", 0)) or s.get("segment", 0) < 0:
        raise _fail(f"{path}.segment", f"{_shown(s.get('segment'))} is not a segment number")
    extra = set(s) - {"direction", "comm", "comm_tensor", "comm_s", "comp_s", "segment"}
    if extra:
        raise _fail(f"{path}", f"unknown field {sorted(extra)[0]!r}")


def _check_row(row: Any, path: str, ok, what: str) -> None:
    if not isinstance(row, list) or not row or not all(ok(x) for x in row):
        raise _fail(path, f"{_shown(row) if not isinstance(row, list) else row[:8]} is not {what} (one per device)")


def _check_instruction_dict(ins: Any, path: str) -> None:
    if not isinstance(ins, dict):
        raise _fail(path, f"must be an instruction object, got {type(ins).__name__}")
    kind = _typed(ins, "kind", str, f"{path}.")
    if kind not in (LOAD, COMPUTE, COMM):
        raise _fail(f"{path}.kind", f"'{kind}' is not load, compute or comm")
    if not _is_int(ins.get("node")):
        raise _fail(f"{path}.node", f"{_shown(ins.get('node'))} is not a node id")
    _typed(ins, "rule", str, f"{path}.")
    pre = _typed(ins, "pre", list, f"{path}.")
    for k, p in enumerate(pre):
        if not (isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and isinstance(p[1], str)):
            raise _fail(f"{path}.pre[{k}]", f"{_shown(p) if not isinstance(p, list) else p} is not a [node id, form] pair")
        _parse(p[1], f"{path}.pre[{k}]")
    _parse(_typed(ins, "post", str, f"{path}."), f"{path}.post")


def _parse(text: str, path: str) -> Form:
    try:
        form = parse_form(text)
    except ValueError:
        form = None
    if form is None or form < PARTIAL:
        raise _fail(path, f"'{text}' is not a form (F, P or S(dim))")
    return form


# ----------------------------------------------------------------------------- 2. structure and ratios


def check_structure(plan: Plan) -> None:
    """Per-device lists have one entry per device; segments name every node; ratios one row per segment."""
    m, n = plan.world_size, len(plan.graph)
    if len(plan.memory_bytes) != m:
        raise _fail("memory_bytes", f"has {len(plan.memory_bytes)} entries but the plan has {m} devices")
    for i, s in enumerate(plan.stages):
        if len(s.comp_s) != m:
            raise _fail(f"stages[{i}].comp_s", f"has {len(s.comp_s)} entries but the plan has {m} devices")
    if plan.segment_of and len(plan.segment_of) != n:
        raise _fail("segments", f"has {len(plan.segment_of)} entries but the graph has {n} nodes (one segment per node, or none)")
    count = max(plan.segment_of) + 1 if plan.segment_of else 1
    missing = sorted(set(range(count)) - set(plan.segment_of)) if plan.segment_of else []
    if missing:
        raise _fail("segments", f"segment {missing[0]} holds no node (segments are numbered 0..{count - 1} without gaps)")
    known = set(layers(plan.graph))
    for i, layer in enumerate(plan.recompute):
        if layer not in known or layer in plan.recompute[:i]:
            raise _fail(f"recompute[{i}]", f"layer {layer} is {'listed twice' if layer in known else 'not a layer of the graph'} "
                        f"(its layers are the segments of its computed nodes: {sorted(known)[:8]})")
    expected = [str(k) for k in range(count)]
    if sorted(plan.ratios, key=lambda k: (len(k), k)) != expected:
        raise _fail("ratios", f"has keys {sorted(plan.ratios)[:6]} but the plan has {count} segment(s): "
                    f"expected keys {expected[:6]}")


def check_ratios(plan: Plan) -> None:
    """Check 2: per segment one ratio per device, each in [0, 1], summing to 1."""
    m = plan.world_size
    for k in sorted(plan.ratios, key=int):
        row, path = plan.ratios[k], f"ratios[{json.dumps(k)}]"
        if len(row) != m:
            raise _fail(path, f"has {len(row)} ratios but the plan has {m} devices ({_names(plan)})")
        for j, r in enumerate(row):
            if not math.isfinite(r) or not 0 <= r <= 1:
                raise _fail(f"{path}[{j}]", f"ratio {r!r} of device '{plan.device_names[j]}' is outside [0, 1]")
        if abs(math.fsum(row) - 1) > RATIO_TOLERANCE:
            raise _fail(path, f"ratios sum to {math.fsum(row):.9g}, not 1")


def _names(plan: Plan) -> str:
    names = plan.device_names
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


# ----------------------------------------------------------------------------- 3. program against the theory


Triples = dict[tuple[tuple[Form, ...], Form], str]
_TRIPLES: dict[tuple, Triples] = {}
"""Triples by node signature, shared by every validation: the layers of a model repeat the same nodes."""
_TRIPLES_MAX = 100_000


class _Theory:
    """The triples of a graph's nodes, from the rule registry, cached by node signature."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def rules(self, node: int) -> Triples:
        """(input forms, output form) -> rule name of every triple the theory gives `node`.

        A rule generator sees the node's op, attrs and shape and its operands' shapes (engine/theory),
        so nodes equal in those have the same triples."""
        n = self.graph[node]
        key = (n.op, json.dumps(n.attrs, sort_keys=True, default=str), n.shape, tuple(self.graph[i].shape for i in n.inputs))
        found = _TRIPLES.get(key)
        if found is None:
            if len(_TRIPLES) >= _TRIPLES_MAX:
                _TRIPLES.clear()
            try:
                found = {(r.inputs, r.output): r.name for r in op_rules(n, self.graph)}
            except (IndexError, KeyError, TypeError, ValueError, AssertionError, ZeroDivisionError) as e:
                raise _fail(f"graph.nodes[{node}]", f"the theory cannot derive rules for {n.op} node {n.name}: its "
                            f"shape {list(n.shape)} or attrs do not fit its operands ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:80] if str(e) else ''})") from None
            _TRIPLES[key] = found
        return found


def check_program(plan: Plan) -> None:
    """Check 3: replay the program from the empty state against the theory."""
    _Replay(plan).run()
    _check_complete(plan)


class _Replay:
    """The Hoare-logic replay: which properties hold (with the segment whose sizes a Shard has)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.graph = plan, plan.graph
        self.theory = _Theory(plan.graph)
        self.holds: dict[tuple[int, Form], int] = {}
        """(tensor, form) -> segment of its layout, for every property established so far."""
        self.loaded: dict[int, int] = {}
        """Leaf -> the instruction that loaded it."""

    def run(self) -> None:
        """Check every instruction's references, then replay the instructions in order."""
        for i, ins in enumerate(self.plan.program):
            self.check_references(i, ins)
        seg = self.plan.segmentation
        program = self.plan.program
        for i, (ins, own, src) in enumerate(zip(program, instruction_segments(program, seg), source_segments(program, seg))):
            {LOAD: self.load, COMPUTE: self.compute, COMM: self.comm}[ins.kind](i, ins, own, src)
            self.holds[(ins.node, ins.post)] = own

    def check_references(self, i: int, ins: Instruction) -> None:
        """Nodes in range and Shard dims within their tensor's rank (what the segment helpers index)."""
        n = len(self.graph)
        if not 0 <= ins.node < n:
            raise _fail(f"program[{i}].node", f"{ins.node} is not a node of the graph (0..{n - 1})")
        for k, (t, f) in enumerate(ins.pre):
            if not 0 <= t < n:
                raise _fail(f"program[{i}].pre[{k}]", f"tensor {t} is not a node of the graph (0..{n - 1})")
            if f >= self.graph[t].rank:
                raise _fail(f"program[{i}].pre[{k}]", f"{self.graph[t].name} has {self.graph[t].rank} dims: no S({f})")
        if ins.post >= self.graph[ins.node].rank:
            raise _fail(f"program[{i}].post", f"{self.graph[ins.node].name} has {self.graph[ins.node].rank} dims: no S({ins.post})")

    def where(self, i: int, ins: Instruction) -> str:
        return f"program[{i}] ({ins.render(self.graph)})"

    def load(self, i: int, ins: Instruction, own: int, src: int) -> None:
        node = self.graph[ins.node]
        if not node.is_leaf:
            raise _fail(self.where(i, ins), f"loads '{node.name}', a {node.op} node: only leaves (inputs, parameters, "
                        "buffers) are loaded, other nodes are computed")
        if ins.rule != node.op or ins.pre:
            raise _fail(self.where(i, ins), f"a load of a {node.op} has rule '{node.op}' and no precondition")
        if ins.post not in leaf_forms(node):
            raise _fail(self.where(i, ins), f"{node.name} of shape {list(node.shape)} cannot be loaded as "
                        f"{form_str(ins.post)} (a leaf loads Full or sharded on a dim of size >= 2)")
        if ins.node in self.loaded:
            raise _fail(self.where(i, ins), f"{node.name} is loaded again (first by program[{self.loaded[ins.node]}]): "
                        "each leaf is loaded once, in one form, so its gradient is synchronised once")
        self.loaded[ins.node] = i

    def compute(self, i: int, ins: Instruction, own: int, src: int) -> None:
        node = self.graph[ins.node]
        if node.is_leaf:
            raise _fail(self.where(i, ins), f"computes '{node.name}', a {node.op}: leaves are loaded, not computed")
        operands = tuple(t for t, _ in ins.pre)
        if operands != node.inputs:
            names = [self.graph[t].name for t in node.inputs]
            raise _fail(self.where(i, ins), f"operands {[self.graph[t].name for t in operands]} are not the inputs "
                        f"of {node.name}, {names}")
        forms = tuple(f for _, f in ins.pre)
        rules = self.theory.rules(ins.node)
        name = rules.get((forms, ins.post))
        if name != ins.rule:
            raise _fail(self.where(i, ins), self._no_triple(node, forms, ins, rules))
        self._require(i, ins, own)

    def _no_triple(self, node, forms: tuple[Form, ...], ins: Instruction, rules: dict) -> str:
        pre = ", ".join(form_str(f) for f in forms)
        named = sorted({str(n) for n in rules.values()})
        if ins.rule not in named:
            return f"the theory has no rule '{ins.rule}' for {node.op} node {node.name} (its rules: {', '.join(named) or 'none'})"
        return f"rule '{ins.rule}' of {node.op} does not take ({pre}) to {form_str(ins.post)} for node {node.name}"

    def comm(self, i: int, ins: Instruction, own: int, src: int) -> None:
        node = self.graph[ins.node]
        if ins.rule not in COMM_KEYS:
            raise _fail(self.where(i, ins), f"'{ins.rule}' is not a collective ({', '.join(sorted(COMM_KEYS))})")
        if len(ins.pre) != 1 or ins.pre[0][0] != ins.node:
            raise _fail(self.where(i, ins), f"a collective on {node.name} takes exactly one operand, {node.name} itself")
        before = ins.pre[0][1]
        if ins.rule == RESPLIT:
            legal = before >= 0 and ins.post == before
        else:
            legal = any(c.key == ins.rule and g == ins.post for c, g in collectives_from(before, node.shape))
        if not legal:
            raise _fail(self.where(i, ins), f"{ins.rule} does not take {node.name} from {form_str(before)} to "
                        f"{form_str(ins.post)} (see engine/theory/collectives.py for the collective triples)")
        if ins.rule in HIER_KEYS and machine_groups(self.plan.machines) is None:
            raise _fail(self.where(i, ins), f"{ins.rule} needs at least 2 machines of the same number (>= 2) of "
                        f"devices, but cluster.machines is {self.plan.machines or 'absent'}")
        self._require(i, ins, src if ins.rule == RESPLIT else own)

    def _require(self, i: int, ins: Instruction, segment: int) -> None:
        """Every precondition holds: established earlier, a Shard in the sizes of `segment`."""
        for k, (t, f) in enumerate(ins.pre):
            got = self.holds.get((t, f))
            if got is None:
                have = sorted(form_str(g) for (u, g) in self.holds if u == t)
                now = f"it holds only as {', '.join(have)}" if have else "no earlier instruction establishes it"
                raise _fail(f"{self.where(i, ins)}.pre[{k}]",
                            f"operand {self.graph[t].name}:{form_str(f)} is not available ({now})")
            if f >= 0 and got != segment:
                raise _fail(f"{self.where(i, ins)}.pre[{k}]",
                            f"operand {self.graph[t].name}:{form_str(f)} has the sizes of segment {got} but is used in "
                            f"segment {segment} (a resplit must move it across the boundary)")


def _check_complete(plan: Plan) -> None:
    """Every node is computed (hence every used parameter loaded), the loss in a form the runner accepts."""
    graph, program = plan.graph, plan.program
    done = {ins.node for ins in program if ins.kind in (LOAD, COMPUTE)}
    missing = [n for n in graph.nodes if not n.is_leaf and n.id not in done]
    cut = "the program looks truncated: " if missing and missing[-1].id == graph.loss else ""
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _fail("program", f"{cut}node {missing[0].name} ({missing[0].op}) is never computed{more}")
    # every compute's operands are its node's inputs, available when it runs: so every parameter
    # some node uses has been loaded (once: `_Replay.load`), and the optimizer sees all of them
    # the loss is a scalar (check_graph_dict): every triple of the theory leaves it Partial or Full
    assert {ins.post for ins in program if ins.node == graph.loss} <= set(LOSS_FORMS), "a scalar loss sharded"


# ----------------------------------------------------------------------------- 4. shard sizes


def check_shard_sizes(plan: Plan) -> None:
    """Check 4: one entry per sharded (tensor, dim, segment), non-negative, summing to the dim, split
    as the ratios say.

    The planner rounds the LP's ratios to whole units (`shard_sizes`) and then stores the ratios
    those units realise (`realized_ratios`, what the runner executes), which may round to other
    sizes. So a segment's sizes are consistent with its ratios when they are the rounding of the
    ratios, or when the ratios are the shares the sizes give and linked dims split alike.
    """
    graph, seg = plan.graph, plan.segmentation
    expected = shard_sizes(plan.program, graph, plan.ratio_rows, seg)
    keys = {shard_key(graph, seg, t, d, k): (t, d, k) for t, d, k in expected}
    for key in plan.shard_sizes:
        if key not in keys:
            raise _fail(f"shard_sizes[{json.dumps(key)}]", "is not a dim the program shards; remove it")
    got: dict[tuple[int, int, int], list[int]] = {}
    for key, (t, d, k) in keys.items():
        path = f"shard_sizes[{json.dumps(key)}]"
        if key not in plan.shard_sizes:
            raise _fail("shard_sizes", f"has no entry {json.dumps(key)} (dim {d} of {graph[t].name}, which the program shards)")
        sizes, dim = plan.shard_sizes[key], graph[t].shape[d]
        if len(sizes) != plan.world_size:
            raise _fail(path, f"has {len(sizes)} sizes but the plan has {plan.world_size} devices")
        if any(s < 0 for s in sizes):
            raise _fail(path, f"{sizes} has a negative size")
        if sum(sizes) != dim:
            raise _fail(path, f"{sizes} sums to {sum(sizes)} but dim {d} of {graph[t].name} has size {dim}")
        got[(t, d, k)] = sizes
    for k in range(seg.count):
        _check_segment_split(plan, k, got, expected, keys)


def _check_segment_split(plan: Plan, k: int, got: dict, expected: dict, keys: dict) -> None:
    """Segment k's sizes are the rounding of its ratios, or its ratios are the shares of its sizes (linked alike)."""
    mine = {key: tkd for key, tkd in keys.items() if tkd[2] == k}
    if all(got[tkd] == expected[tkd] for tkd in mine.values()):
        return
    graph, row = plan.graph, plan.ratio_rows[k]
    for members in shard_classes(plan.program, graph, plan.segmentation):
        if members[0][2] != k:
            continue
        common = Counter(_units(graph, m, got[m]) for m in members).most_common(1)[0][0]
        a = next(m for m in members if _units(graph, m, got[m]) == common)  # blame the odd one out
        b = next((m for m in members if _units(graph, m, got[m]) != _units(graph, a, got[a])), None)
        if b is not None:
            raise _fail(f"shard_sizes[{json.dumps(_key(plan, b))}]",
                        f"{got[b]} does not split like {_key(plan, a)}'s {got[a]}: an instruction links the two dims, "
                        "so they split into the same pieces")
    shares = realized_ratios(graph, got, [list(r) for r in plan.ratio_rows])[k]
    if any(abs(a - b) > RATIO_TOLERANCE for a, b in zip(shares, row)):
        key, tkd = next((key, tkd) for key, tkd in mine.items() if got[tkd] != expected[tkd])
        raise _fail(f"shard_sizes[{json.dumps(key)}]", f"{got[tkd]} are not the sizes ratios[\"{k}\"] round to, "
                    f"{expected[tkd]} (nor are the ratios the shares these sizes give, {[round(x, 6) for x in shares]})")


def _units(graph: Graph, m: tuple[int, int, int], sizes: list[int]) -> tuple[float, ...]:
    """A dim's split as fractions of the dim (linked dims split alike have equal fractions)."""
    dim = graph[m[0]].shape[m[1]]
    return tuple(round(s / dim, 12) for s in sizes)


def _key(plan: Plan, m: tuple[int, int, int]) -> str:
    return shard_key(plan.graph, plan.segmentation, *m)


# ----------------------------------------------------------------------------- 5. against a cluster


def check_devices(plan: Any, cluster: Cluster) -> None:
    """The plan's devices (of either kind of plan: `device_names`, `world_size`) are the cluster's, in order."""
    names = [d.name for d in cluster.devices]
    if cluster.num_devices != plan.world_size:
        raise _fail("cluster.devices", f"the plan has {plan.world_size} devices but cluster '{cluster.name}' has "
                    f"{cluster.num_devices}", "plan again for this cluster (hap plan --cluster FILE)")
    if names != list(plan.device_names):
        j = next(j for j, (a, b) in enumerate(zip(names, plan.device_names)) if a != b)
        raise _fail(f"cluster.devices[{j}]", f"device '{plan.device_names[j]}' but cluster '{cluster.name}' has "
                    f"'{names[j]}' there", "plan again for this cluster (hap plan --cluster FILE)")


def check_against_cluster(plan: Plan, cluster: Cluster) -> list[str]:
    """Check 5: the plan's devices are the cluster's; returns a warning when the cost model re-prices it differently."""
    check_devices(plan, cluster)
    names = [d.name for d in cluster.devices]
    machines = [d.machine for d in cluster.devices]
    if plan.machines and plan.machines != machines:
        j = next(j for j, (a, b) in enumerate(zip(machines, plan.machines)) if a != b)
        raise _fail(f"cluster.machines[{j}]", f"device '{names[j]}' is on machine '{plan.machines[j]}' in the plan but on "
                    f"'{machines[j]}' in cluster '{cluster.name}'", "plan again for this cluster (hap plan --cluster FILE)")
    try:
        cm = CostModel(plan.graph, cluster, plan.ratio_rows, plan.options, plan.segmentation, overlap=plan.overlap,
                       recompute=frozenset(plan.recompute), states=plan.states)
        repriced = evaluate(plan.program, cm).total_s
    except (HapError, ValueError, KeyError, ZeroDivisionError) as e:
        return [f"the plan could not be re-priced on cluster '{cluster.name}' ({type(e).__name__}: {e})"]
    was = plan.predicted_time_s
    if abs(repriced - was) > REPRICE_TOLERANCE * max(abs(repriced), abs(was), 1e-300):
        return [f"the plan predicts {was * 1e3:.4g} ms per iteration but cluster '{cluster.name}' prices it at "
                f"{repriced * 1e3:.4g} ms ({(repriced / was - 1) * 100 if was else math.inf:+.0f}%): the cluster spec "
                "changed since the plan was made (re-profiled?); plan again to use the new figures"]
    return []
