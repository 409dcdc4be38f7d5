"""Program synthesis by A* search over Hoare triples (HAP §4.3, Fig. 10, and §4.5).

Search space. A state is a partial program, summarised by the position `p` of the next node of
the single-device graph to compute (nodes are computed in the graph's topological order) and the
set of *live* properties of the program. From a state the search may

- compute node p by any of its rules whose precondition holds; leaves (placeholders, parameters)
  have empty preconditions and are fused into their first consumer (§4.5, first optimisation):
  the consumer's rule chooses the form they are loaded in;
- run one collective on an operand of node p that the node's rules need in another form. Each
  reference tensor is communicated at most once (§4.5, second optimisation; a free local slice
  does not count), and leaves are never communicated.

Properties of tensors whose last consumer has run are dropped (§4.5, third optimisation), which
makes equivalent programs meet in the same state. A program is complete when the loss holds as
`Partial` or `Full`.

Under a beam, side arithmetic (nodes none of whose operands needs a gradient: masks, position ids,
rotary tables) runs replicated: its Full result slices to any shard for free, and its sharded
variants, a hair cheaper, would fill the beam (`_Prepared._replicate_side`). Exact A* keeps them.

Score. g = cost of the closed stages plus the open forward and backward stages' slowest device;
h = the remaining computation perfectly balanced over all devices at infinite bandwidth, less
what the open stages can still absorb without getting longer: admissible, so A* is optimal for
its rule set. Ties prefer deeper states, then insertion order (deterministic).

Dominance (Fig. 10, lines 9-14): among states with the same position and properties, one whose
closed cost plus its open stages' excess over the other's is no larger, with no more memory on
any device, dominates; dominated states are dropped, also from the queue. A state whose memory
already exceeds a device's capacity is dropped (memory only grows).

Overlap (`cm.overlap`, priced as `engine.spmd.cost` says). The state carries more, so the search
optimises exactly the replayed cost (`_Ddp`, `_Duplex` below say what and why it is exact):
per-parameter-byte work goes to a per-class tail; Full parameters' gradients fill DDP's fixed
bucket slots, one of which at a time is open (`_SLOT` marks that it holds a Full parameter).
- ddp: the backward chain closed so far (cb), the durations of the finished slots (D), and the
  slots' overlap terms max_k (D_k - w_k): E for slots whose ready point lies in a closed stage, a
  per-class vector G for those in the open stage (their ready point depends on work still to come);
- duplex: per pass, the HiDup chain's closed sum S and its last element (Eq. 5 telescoped).
Their scores stay admissible and their dominance tests sound: HiDup's Pareto states (Theorem 1)
generalised to the max-plus terms that the open stages can still change.
"""
from __future__ import annotations

import gc
import heapq
import math
import threading
import time
from bisect import bisect_left
from contextlib import contextmanager
from operator import add as _plus
from operator import mul as _times
from operator import sub as _minus
from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Iterator

from engine.errors import InfeasibleError
from engine.model.graph import Graph
from engine.spmd.cost import DUAL, MEM_ZERO, ZERO, Acc, CostModel, add
from engine.spmd.overlap import first_use
from engine.spmd.program import COMM, COMPUTE, LOAD, Instruction
from engine.spmd.segments import RESPLIT, Segmentation
from engine.spmd.step_terms import StepTerms
from engine.theory import collectives_from, leaf_forms, op_rules
from engine.theory.core import FULL, PARTIAL, OpRule

_K = 16          # property code = tensor * _K + form + _OFF
_OFF = 3         # forms -2 (P), -1 (F), 0.. (S(d)); code 0 is the "communicated" marker
_COMMUNICATED = -3
_BUCKET = -1     # a property-set marker (not a tensor code): the gradient bucket's latency is paid
_SLOT = -2       # ddp, duplex: the open bucket slot holds a Full parameter (its latency is paid)


Comm = tuple[int, int, str, int, float, "float | None"]
"""A fused collective of a child: (tensor, source form, key, target form, forward seconds, backward seconds
of its dual or None when the tensor needs no gradient)."""


def _way_seconds(way: tuple) -> float:
    """Seconds of a collective way (`_Search._ways`) and its dual: how the search ranks ways to one form."""
    return way[4] + (way[5] or 0.0) if way[0] == "comm" else 0.0


def code(tensor: int, form: int) -> int:
    return tensor * _K + form + _OFF


@dataclass(frozen=True)
class SearchSpace:
    """Restrictions on the theory, used for baselines and ablations (all allowed by default)."""

    param_forms: Callable[[int, int], bool] = lambda node, form: True
    placeholder_forms: Callable[[int, int], bool] = lambda node, form: True
    collectives: frozenset[str] = frozenset({"all_reduce", "reduce_scatter", "all_gather.padded",
                                             "all_gather.grouped", "all_to_all", "slice", "all_reduce.hier",
                                             "reduce_scatter.hier", "all_gather.hier"})
    rule_filter: Callable[[int, OpRule], bool] = lambda node, r: True


@dataclass
class SearchProgress:
    """What the search reports while it runs (the UI draws it as the search frontier)."""

    expanded: int
    queue_size: int
    best_cost: float
    """Cost of the best complete program so far (inf if none yet)."""
    lowest_open_score: float
    """Lowest score in the queue: a lower bound of the optimum while the search runs."""
    elapsed_s: float
    iteration: int = 0
    """Which Q<->B iteration of the planner this search belongs to."""


@dataclass
class SearchResult:
    program: tuple[Instruction, ...]
    cost: float
    optimal: bool
    """False when the time budget stopped the search before it proved optimality."""
    expanded: int
    generated: int
    pruned: int
    elapsed_s: float
    frontier: list[SearchProgress] = field(default_factory=list)


class _State:
    """A partial program: its position, live properties and cost so far. The open forward and backward
    stages are held as per-class seconds (`tf`, `tb`), built up step by step, with whether they hold any
    work at all (`fw`, `bw`: an empty stage is no stage, and duplex's chain tells them apart)."""

    __slots__ = ("p", "props", "closed", "tf", "tb", "fw", "bw", "mem", "score", "parent", "step", "alive", "ov",
                 "aux")

    def __init__(self, p: int, props: frozenset, closed: float, tf: tuple[float, ...], tb: tuple[float, ...],
                 fw: bool, bw: bool, mem: tuple[float, ...], parent: "_State | None", step: tuple) -> None:
        self.p, self.props, self.closed, self.tf, self.tb, self.fw, self.bw = p, props, closed, tf, tb, fw, bw
        self.mem, self.parent, self.step, self.alive = mem, parent, step, True
        self.score = 0.0
        self.ov: tuple = ()
        """Overlap modes: the mode's extra state (`_Ddp`, `_Duplex`); empty in mode none."""
        self.aux: tuple = ()
        """Overlap modes: vectors the score computed that the dominance test compares."""


class _Prepared:
    """Per-graph tables the search consults in its inner loop."""

    def __init__(self, graph: Graph, space: SearchSpace, segmentation: Segmentation,
                 side: list[bool] | None = None) -> None:
        self.graph = graph
        self.order = [n.id for n in graph.nodes if not n.is_leaf]
        self.segment = [segmentation.of_node[nid] for nid in self.order] + [0]
        """Segment of each position (§5.2); a change between p-1 and p is a segment boundary."""
        pos_of = {nid: k for k, nid in enumerate(self.order)}
        self.rules = [[r for r in op_rules(graph[nid], graph) if space.rule_filter(nid, r)] for nid in self.order]
        self.side_replicated = 0
        """Side-arithmetic nodes held to their replicate rule (`_replicate_side`)."""
        if side is not None and "slice" in space.collectives:
            self.rules = [self._replicate_side(rules, side[nid]) for nid, rules in zip(self.order, self.rules)]
        for nid, rules in zip(self.order, self.rules):
            if not rules:
                raise InfeasibleError(f"node '{graph[nid].name}' ({graph[nid].op}) has no rule in this search space")
        self.pairs = [[list(zip(graph[nid].inputs, r.inputs)) for r in rules] for nid, rules in zip(self.order, self.rules)]
        """Per position and rule, (operand, form) of each operand the rule asks for."""
        self.leaf_ok = {n.id: [f for f in leaf_forms(n) if _leaf_filter(space, n.op)(n.id, f)]
                        for n in graph.nodes if n.is_leaf}
        self.collectives = space.collectives
        self.last_use = [-1] * len(graph)
        for nid in self.order:
            for i in graph[nid].inputs:
                self.last_use[i] = pos_of[nid]
        self.last_use[graph.loss] = len(self.order)
        self.dead_after: list[list[int]] = [[] for _ in self.order]
        for t, p in enumerate(self.last_use):
            if 0 <= p < len(self.order):
                self.dead_after[p].append(t)
        self.codes = [[code(t, f) for f in range(_COMMUNICATED, graph[t].rank)] for t in range(len(graph))]
        self.forms = [[(f, code(t, f)) for f in range(PARTIAL, graph[t].rank)] for t in range(len(graph))]
        """Per tensor, (form, property code) of every form it can hold (`_comm_ways`' lookup)."""
        self.shard_codes = [tuple(code(t, d) for d in range(graph[t].rank)) for t in range(len(graph))]
        """Per tensor, the property codes of its shards (a Full form subsumes them)."""
        self.full_param = [n.op == "parameter" for n in graph.nodes]
        """Whether each tensor is a parameter (loaded Full, its gradient joins the bucket)."""
        self.leaf = [n.is_leaf for n in graph.nodes]
        """Whether each tensor is a leaf (the inner loop's lookup, without a node access)."""
        self.dead_codes = [frozenset(c for t in dead for c in self.codes[t]) for dead in self.dead_after]
        self.live_inputs = [[t for t in dict.fromkeys(graph[nid].inputs) if self.last_use[t] > k]
                            for k, nid in enumerate(self.order)]
        self.live_marks = [[(t, code(t, _COMMUNICATED)) for t in live] for live in self.live_inputs]
        self.spent = [frozenset(t for t in graph[nid].inputs if graph[nid].inputs.count(t) == 1
                                and self.last_use[t] == k and not self.leaf[t]) for k, nid in enumerate(self.order)]
        """Per position, the operands it reads once and last: whichever collective brings one into the form a rule
        wants, its properties die with the node, so the children differ only in cost and the cheapest dominates
        (a 128-way `cat` of a scan's steps had 2^128 combinations of its operands' ways)."""
        """Per position, each operand still live after it with the code that marks it communicated."""
        self.wanted = [self._wanted_forms(k) for k in range(len(self.order))]
        self.consumers: list[list[int]] = [[] for _ in range(len(graph))]
        for k, nid in enumerate(self.order):
            for t in dict.fromkeys(graph[nid].inputs):
                self.consumers[t].append(k)
        self.wanted_after = [self._suffix_wanted(t) for t in range(len(graph))]

    def _replicate_side(self, rules: list[OpRule], side: bool) -> list[OpRule]:
        """Only the all-Full rule of a side-arithmetic node (`side`: no operand needs a gradient, e.g. an
        attention mask, position ids, a rotary table, shifted labels), when it has one. Its Full
        result slices to any shard for free, so a sharded rule saves at most that node's own
        compute, a hair; but its variants multiply the states (2^k for k such nodes) that differ by
        that hair and fill a beam before the choices that matter. In a Llama the causal mask's form
        is fixed near the graph's start and read by every layer's attention: left sharded by a full
        beam, it ruled out the attention layouts that need it whole (issue 26: 11.0 s predicted for
        an 8-layer 1.9B Llama against 7.8 s with this rule)."""
        full = [r for r in rules if r.output == FULL and all(f == FULL for f in r.inputs)]
        if not side or not full or len(full) == len(rules):
            return rules
        self.side_replicated += 1
        return full

    def _suffix_wanted(self, t: int) -> list[frozenset[int]]:
        """For each consumer index i of t: the forms wanted by consumers i, i+1, ... (plus the goal for the loss)."""
        acc: set[int] = {PARTIAL, FULL} if t == self.graph.loss else set()
        out = []
        for k in reversed(self.consumers[t]):
            acc |= self.wanted[k].get(t, set())
            out.append(frozenset(acc))
        out.reverse()
        return out + [frozenset({PARTIAL, FULL} if t == self.graph.loss else ())]

    def next_consumer(self, t: int, p: int) -> int:
        """Index into consumers[t] of the first consumer at position >= p."""
        return bisect_left(self.consumers[t], p)

    def _wanted_forms(self, k: int) -> dict[int, set[int]]:
        """For node k's non-leaf operands: the forms some rule of node k asks for."""
        nid = self.order[k]
        want: dict[int, set[int]] = {}
        for r in self.rules[k]:
            for t, f in zip(self.graph[nid].inputs, r.inputs):
                if not self.graph[t].is_leaf:
                    want.setdefault(t, set()).add(f)
        return want


def synthesize(graph: Graph, cm: CostModel, *, space: SearchSpace | None = None, time_budget_s: float | None = None,
               progress: Callable[[SearchProgress], None] | None = None, report_every: int = 500,
               beam_width: int | None = None, incumbent: tuple[Instruction, ...] | None = None) -> SearchResult:
    """Find the cheapest distributed program for the ratios in `cm` (Fig. 10).

    `beam_width` caps the states expanded at each position of the graph (the best-scored ones are
    expanded first): None is exact A*; a cap keeps large models fast, and the result says whether
    the cap may have cost optimality (`optimal`). An `incumbent` program (e.g. the previous Q of the
    Q<->B loop) bounds the search from the start and is returned if nothing beats it.
    """
    with collector_paused():
        search = _Search(graph, cm, space or SearchSpace(), time_budget_s, progress, report_every, beam_width)
        if incumbent is not None:
            search.set_incumbent(incumbent)
        try:
            return search.run()
        finally:
            search.release()  # before the collector is back: it would walk every state once more


class _CollectorPause:
    """Python's cyclic garbage collector off while any search runs, back on (if it was on) when the
    last concurrent one ends. A search allocates hundreds of thousands of small acyclic objects
    (states, property sets, cost tuples) that stay alive until it ends; the collector's repeated
    passes over them took a quarter of the search's time on an 8-layer GPT, and they free nothing
    that reference counting does not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if self.running == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1
                if self.running == 0 and self.was_enabled:
                    gc.enable()


collector_paused = _CollectorPause()


class _Search:
    def __init__(self, graph: Graph, cm: CostModel, space: SearchSpace, budget: float | None,
                 progress: Callable[[SearchProgress], None] | None, report_every: int, beam_width: int | None = None) -> None:
        self.graph, self.cm, self.budget, self.progress, self.report_every = graph, cm, budget, progress, report_every
        self.beam_width = beam_width
        self.beam_cut = math.inf  # lowest score of a state the beam skipped
        side = [not n.is_leaf and not g for n, g in zip(graph.nodes, cm.requires_grad)]
        self.prep = _Prepared(graph, space, cm.segmentation, side if beam_width is not None else None)
        """Under a beam, side arithmetic runs replicated (`_Prepared._replicate_side`); exact A* keeps every rule."""
        self.seg = self.prep.segment
        n = len(self.prep.order)
        self.rem_f = [0.0] * (n + 1)
        self.rem_b = [0.0] * (n + 1)
        for k in range(n - 1, -1, -1):
            nid = self.prep.order[k]
            self.rem_f[k] = self.rem_f[k + 1] + cm.fwd_flops[nid]
            self.rem_b[k] = self.rem_b[k + 1] + cm.bwd_flops[nid]
        self.sum_flops = cm.total_flops
        self.weights = [c.flops * len(c.devices) for c in cm.classes]
        self.seen: dict[tuple[int, frozenset], list[_State]] = {}
        self.heap: list[tuple] = []
        self.counter = 0
        self.expanded = self.generated = self.pruned = 0
        self.best: _State | None = None
        self.incumbent: tuple[Instruction, ...] | None = None
        self.best_cost = math.inf
        self.greedy = False
        self.frontier: list[SearchProgress] = []
        self.width_used = [0] * (len(self.prep.order) + 1)
        self.debt_cache: dict[tuple, float] = {}
        self.state_debt: dict[tuple[int, frozenset], float] = {}
        """`_debt` per (position, properties): every state of one dominance bucket owes the same."""
        self.terms = StepTerms(cm)
        """Load, rule and half-collective terms, computed once per search (`engine.spmd.step_terms`)."""
        self.ways_cache: dict[tuple, list[tuple]] = {}
        self.slice_ok = "slice" in self.prep.collectives
        self.deltas = [{(sh, whole): self._compute_delta(k, sh, whole) for sh in (False, True) for whole in (False, True)}
                       for k in range(n)]
        self.rule_memory = [{(r.inputs, r.output): cm.memory_by_class(cm.activation_memory(nid, r.inputs, r.output),
                                                                      self.seg[k])
                             for r in self.prep.rules[k]} for k, nid in enumerate(self.prep.order)]
        """Per position and rule, the per-class bytes its instruction keeps for backward (they depend on
        the forms of the operands it saves, `engine.spmd.saved`)."""
        self.memory_binds = not cm.fits(_worst_memory(graph, cm))
        self.rerun = [bool(cm.recompute) and graph[nid].segment in cm.recompute for nid in self.prep.order]
        """Whether position k's layer is recomputed: its collectives run again in backward (engine.spmd.recompute)."""
        self.bucket_latency, self.bucket_s_per_byte = cm.bucket_line(None)
        """Mode none's one gradient bucket (`CostModel.bucket_line`); the overlap modes price each slot's."""
        self.zero_times = (0.0,) * len(cm.classes)
        """The class times of no work (an open stage a collective has just closed)."""
        self.mode = _Ddp(self) if cm.overlap == "ddp" else _Duplex(self) if cm.overlap == "duplex" else None
        self.deepest = 0
        """Furthest position any kept state reached: where a failed search got stuck."""
        self.over_memory = 0
        """States dropped because some device's memory overflowed."""

    def root(self) -> _State:
        """The empty program."""
        zero = self.zero_times
        s = _State(0, frozenset(), 0.0, zero, zero, False, False, (0.0,) * len(self.cm.classes), None, ())
        if self.mode is not None:
            s.ov = self.mode.root()
        return s

    def _compute_delta(self, k: int, sharded: bool, whole: bool) -> tuple[Acc, Acc]:
        """Forward and backward work of computing position k (`whole`: its parameter operands read
        whole, see `CostModel.compute_delta`); its memory is the rule's (`rule_memory`)."""
        f, b, _ = self.cm.compute_delta(self.prep.order[k], sharded, whole)
        return f, b

    def set_incumbent(self, program: tuple[Instruction, ...]) -> None:
        """Bound the search by `program`, unless it overflows a device's memory under these ratios
        (then it is no solution, and its cost would prune the programs that fit)."""
        from engine.spmd.cost import evaluate, replay

        if not self.cm.fits(self.cm.class_memory(replay(program, self.cm)[1])):
            return
        self.incumbent = program
        self.best_cost = evaluate(program, self.cm).total_s * (1 + 1e-9)

    # --- scoring -------------------------------------------------------------------------
    def _bound(self, times: tuple[float, ...], remaining: float) -> float:
        """The earliest end of an open stage with class times `times` and `remaining` flops still to
        compute: no sooner than its slowest device, nor than its work so far and the remaining flops
        spread perfectly over every device (admissible, §4.3)."""
        return max(max(times), (remaining + sum(map(_times, self.weights, times))) / self.sum_flops)

    def _finish(self, s: _State) -> None:
        if self.mode is not None:
            s.score = self.mode.score(s)
            return
        s.score = s.closed + self._bound(s.tf, self.rem_f[s.p]) + self._bound(s.tb, self.rem_b[s.p]) + self._debt(s)

    def _debt(self, s: _State) -> float:
        """Communication that live tensors must still pay: a tensor none of whose forms its next
        consumer accepts needs at least one collective (forward and backward dual). Admissible."""
        key = (s.p, s.props)
        total = self.state_debt.get(key)
        if total is None:
            total = self.state_debt[key] = self._props_debt(s)
        return total

    def _props_debt(self, s: _State) -> float:
        forms: dict[int, list[int]] = {}
        for c in s.props:
            if c >= 0:
                forms.setdefault(c // _K, []).append(c % _K - _OFF)
        total = 0.0
        for t, fs in forms.items():
            if self.prep.leaf[t]:
                continue
            key = (t, s.p, tuple(sorted(fs)))
            d = self.debt_cache.get(key)
            if d is None:
                d = self.debt_cache[key] = self._tensor_debt(t, s.p, fs)
            total += d
        return total

    def _tensor_debt(self, t: int, p: int, fs: list[int]) -> float:
        prep = self.prep
        i = prep.next_consumer(t, p)
        if i == len(prep.consumers[t]):
            return 0.0
        consumer = prep.consumers[t][i]
        want = prep.wanted[consumer].get(t, set())
        where = (self.seg[consumer],)
        if any(f in want for f in fs):
            return 0.0
        slice_ok = "slice" in prep.collectives and FULL in fs
        if slice_ok and any(g >= 0 for g in want):
            return 0.0
        if _COMMUNICATED in fs:
            return math.inf  # dead end: it cannot be communicated again
        best = math.inf
        for f in fs:
            if f == _COMMUNICATED:
                continue
            for coll, g in collectives_from(f, self.graph[t].shape):
                if coll.key in prep.collectives and coll.is_communication and (g in want or (g == FULL and slice_ok)):
                    c = self.cm.comm_time(coll.key, t, where)
                    if self.cm.requires_grad[t]:
                        c += self.cm.comm_time(DUAL[coll.key], t, where)
                    best = min(best, c)
        return best

    def _dominates(self, a: _State, b: _State) -> bool:
        if self.mode is not None:
            return self.mode.dominates(a, b) and (not self.memory_binds or all(x <= y for x, y in zip(a.mem, b.mem)))
        ef = max(0.0, max(x - y for x, y in zip(a.tf, b.tf)))
        eb = max(0.0, max(x - y for x, y in zip(a.tb, b.tb)))
        if a.closed + ef + eb > b.closed * (1 + 1e-12) + 1e-15:
            return False
        return not self.memory_binds or all(x <= y for x, y in zip(a.mem, b.mem))

    # --- queue ---------------------------------------------------------------------------
    def _push(self, s: _State) -> None:
        self.generated += 1
        self._finish(s)
        if s.score >= self.best_cost:
            self.pruned += 1
            return
        if self.memory_binds and not self.cm.fits(s.mem):  # else even the all-Full program fits
            self.pruned += 1
            self.over_memory += 1
            return
        if s.p > self.deepest:
            self.deepest = s.p
        key = (s.p, s.props)
        bucket = self.seen.setdefault(key, [])
        for other in bucket:
            if self._dominates(other, s):
                self.pruned += 1
                return
        for other in bucket:
            if self._dominates(s, other):
                other.alive = False
        bucket[:] = [o for o in bucket if o.alive] + [s]
        if s.p == len(self.prep.order):
            if self._complete(s):
                cost = s.score
                if cost < self.best_cost:
                    self.best, self.best_cost = s, cost
            return
        self.counter += 1
        heapq.heappush(self.heap, self._key(s))

    def _key(self, s: _State) -> tuple:
        if self.greedy:
            return (-s.p, s.score, self.counter, s)
        return (s.score, -s.p, self.counter, s)

    def _complete(self, s: _State) -> bool:
        loss = self.graph.loss
        return code(loss, PARTIAL) in s.props or code(loss, FULL) in s.props

    # --- main loop -----------------------------------------------------------------------
    def run(self) -> SearchResult:
        start = time.perf_counter()
        self._push(self.root())
        optimal = True
        while self.heap:
            score, _, _, s = self.heap[0] if not self.greedy else (self.heap[0][1], 0, 0, self.heap[0][3])
            if not self.greedy and score >= self.best_cost:
                break
            heapq.heappop(self.heap)
            if not s.alive or s.score >= self.best_cost:
                continue
            if self.beam_width is not None:
                if self.width_used[s.p] >= self.beam_width:
                    self.beam_cut = min(self.beam_cut, s.score)
                    continue
                self.width_used[s.p] += 1
            self.expanded += 1
            for child in self._children(s):
                self._push(child)
            # the clock is read after every expansion: one expansion over thousands of device classes
            # takes milliseconds, so checking every 64th could overrun a short budget several times
            if self.budget is not None and time.perf_counter() - start > self.budget:
                optimal = False
                if self.best is not None or self.incumbent is not None:
                    break  # out of time with a program in hand (the incumbent counts): return it
                if not self.greedy:
                    self._go_greedy()
            if self.expanded % self.report_every == 0:
                self._report(start)
        self._report(start)
        optimal = optimal and self.beam_cut >= self.best_cost and not self.prep.side_replicated
        if self.best is None and self.incumbent is not None:
            return SearchResult(self.incumbent, self.best_cost, optimal, self.expanded,
                                self.generated, self.pruned, time.perf_counter() - start, self.frontier)
        if self.best is None:
            raise InfeasibleError(self._why_none())
        return SearchResult(self._program(self.best), self.best_cost, optimal, self.expanded, self.generated,
                            self.pruned, time.perf_counter() - start, self.frontier)

    def release(self) -> None:
        """Drop the states and tables of a finished search (the result holds only its program)."""
        self.heap.clear()
        self.seen.clear()
        self.state_debt.clear()
        self.debt_cache.clear()
        self.ways_cache.clear()
        self.best = None

    def _why_none(self) -> str:
        """Why no complete program was found: memory, or the node no program got past, and how."""
        k = min(self.deepest, len(self.prep.order) - 1)
        node = self.graph[self.prep.order[k]]
        where = f"node '{node.name}' ({node.op}{', ' + node.source if node.source else ''})"
        beam = (f"; the beam ({self.beam_width} states per node) dropped some programs: try beam_width=None"
                if self.beam_cut < math.inf else "")
        if self.over_memory:
            return (f"out of memory: every program overflows some device's memory by {where} under these ratios "
                    f"({self.over_memory} partial programs dropped){beam}")
        rules = ", ".join(str(r) for r in self.prep.rules[k])
        return (f"no program gets past {where}: none of its rules ({rules}) can have its operands in the forms "
                f"they need in this search space{beam}")

    def _go_greedy(self) -> None:
        """Out of time with no complete program: dive depth-first to finish one."""
        self.greedy = True
        entries = []
        for *_, s in self.heap:
            self.counter += 1  # a unique tie-breaker per entry: states themselves are not ordered
            entries.append(self._key(s))
        self.heap = entries
        heapq.heapify(self.heap)

    def _report(self, start: float) -> None:
        if not self.greedy:
            lowest = self.heap[0][0] if self.heap else self.best_cost  # the queue is ordered by score
        else:
            lowest = min((k[1] for k in self.heap), default=self.best_cost)
        p = SearchProgress(self.expanded, len(self.heap), self.best_cost, min(lowest, self.best_cost), time.perf_counter() - start)
        self.frontier.append(p)
        if self.progress is not None:
            self.progress(p)

    def _program(self, s: _State | None) -> tuple[Instruction, ...]:
        steps: list[tuple[tuple, ...]] = []
        while s is not None:
            steps.append(s.step)
            s = s.parent
        return tuple(Instruction(*ins) for step in reversed(steps) for ins in step)

    # --- successors ----------------------------------------------------------------------
    def _children(self, s: _State) -> Iterator[_State]:
        """Compute node p by each rule; operands missing a form get it by a fused collective or slice."""
        nid = self.prep.order[s.p]
        k = self.seg[s.p]
        props = s.props
        known: dict[tuple[int, int], list[tuple]] = {}  # rules of one node share operand forms
        for r, pairs in zip(self.prep.rules[s.p], self.prep.pairs[s.p]):
            ways = []
            for operand in pairs:
                w = known.get(operand)
                if w is None:
                    w = self._ways(props, operand[0], operand[1], k)
                    if len(w) > 1 and operand[0] in self.prep.spent[s.p]:
                        w = [min(w, key=_way_seconds)]  # every way leaves the same properties: the cheapest dominates
                    known[operand] = w
                if not w:
                    break
                ways.append(w)
            else:
                for combo in product(*ways):
                    loads: dict[int, int] = {}
                    comms: list[Comm] = []
                    slices: list[tuple[int, int]] = []
                    if self._merge(combo, pairs, loads, comms, slices):
                        yield self._after_compute(s, nid, r, loads, comms, slices)

    def _ways(self, props: frozenset, t: int, f: int, k: int) -> list[tuple]:
        """How operand t can be had in form f: ("have",), ("slice",), ("load", g), or ("comm", src, key, g,
        forward seconds, backward seconds or None) by a collective (and its dual)."""
        base = t * _K + _OFF  # code(t, form) = base + form
        if base + f in props:
            return [("have",)]
        if f >= 0 and self.slice_ok and base + FULL in props:
            return [("slice",)]
        if self.prep.leaf[t]:
            if any(c in props for c in self.prep.codes[t]):
                return []  # loaded in another form already; leaves are never communicated
            ok = self.prep.leaf_ok[t]
            ways = [("load", f)] if f in ok else []
            if f >= 0 and self.slice_ok and FULL in ok and len(self.prep.consumers[t]) > 1:
                ways.append(("load", FULL))  # Full for a later consumer, sliced here
            return ways
        if base + _COMMUNICATED in props:
            return []
        return self._comm_ways(props, t, f, k)

    def _comm_ways(self, props: frozenset, t: int, f: int, k: int) -> list[tuple]:
        present = tuple(src for src, c in self.prep.forms[t] if c in props)
        key = (t, f, present, k)
        ways = self.ways_cache.get(key)
        if ways is None:
            ways = self.ways_cache[key] = self._comm_ways_from(t, f, present, k)
        return ways

    def _comm_ways_from(self, t: int, f: int, present: tuple[int, ...], k: int) -> list[tuple]:
        best: dict[int, tuple[float, tuple]] = {}
        for src in present:
            for coll, g in collectives_from(src, self.graph[t].shape):
                if not coll.is_communication or coll.key not in self.prep.collectives:
                    continue
                if g == f or (g == FULL and f >= 0 and self.slice_ok):
                    forward = self.cm.comm_time(coll.key, t, (k,))
                    backward = self.cm.comm_time(DUAL[coll.key], t, (k,)) if self.cm.requires_grad[t] else None
                    c = forward + (backward or 0.0)
                    if g not in best or c < best[g][0]:  # same post: keep the cheaper implementation (§4.4)
                        best[g] = (c, ("comm", src, coll.key, g, forward, backward))
        return [w for _, w in best.values()]

    def _comm_cost(self, key: str, t: int, segments: tuple[int, ...]) -> float:
        """A collective on t and, when t needs a gradient, its dual in the backward pass."""
        c = self.cm.comm_time(key, t, segments)
        if self.cm.requires_grad[t]:
            c += self.cm.comm_time(DUAL[key], t, segments)
        return c

    @staticmethod
    def _merge(combo: tuple, pairs: list[tuple[int, int]], loads: dict[int, int], comms: list, slices: list) -> bool:
        """Combine the per-operand ways of one rule; False if they contradict each other."""
        for (t, f), way in zip(pairs, combo):
            kind = way[0]
            if kind == "load":
                if loads.get(t, way[1]) != way[1]:
                    return False
                loads[t] = way[1]
                if way[1] != f:
                    slices.append((t, f))
            elif kind == "comm":
                entry = (t, *way[1:])
                if any(c[0] == t for c in comms):
                    if entry not in comms:
                        return False
                    continue
                comms.append(entry)
                if way[3] != f:
                    slices.append((t, f))
            elif kind == "slice":
                slices.append((t, f))
        return True

    def _after_compute(self, s: _State, nid: int, r: OpRule, loads: dict[int, int],
                       comms: list[Comm], slices: list[tuple[int, int]]) -> _State:
        if self.mode is not None:
            return self._after_compute_overlap(s, nid, r, loads, comms, slices)
        cm, graph = self.cm, self.graph
        closed, mem = s.closed, s.mem
        tf, tb, fw, bw = s.tf, s.tb, s.fw, s.bw  # the open stages, until a collective closes them
        zero = self.zero_times
        props = set(s.props)
        k = self.seg[s.p]
        step: list[tuple] = []  # instructions as plain tuples; built into Instructions only for the result
        prep = self.prep
        for t, src, key, g, forward, backward in comms:
            closed += max(tf) + forward
            tf, fw = zero, False
            if backward is not None:
                closed += max(tb) + backward
                tb, bw = zero, False
            if self.rerun[s.p]:
                closed += max(tb) + forward
                tb, bw = zero, False
            props.add(t * _K + g + _OFF)
            props.add(t * _K + _COMMUNICATED + _OFF)
            if g == FULL and self.slice_ok:  # Full subsumes every shard: a slice is free
                props.difference_update(prep.shard_codes[t])
            step.append((COMM, t, key, ((t, src),), g))
        for t, f in loads.items():
            _, m, sync = self.terms.load(t, f, k)
            mem = tuple(map(_plus, mem, m))
            if f == FULL and prep.full_param[t]:  # its gradient joins the bucket (engine.spmd.cost)
                closed += cm.nbytes[t] * self.bucket_s_per_byte
                if _BUCKET not in props:
                    closed += self.bucket_latency
                    props.add(_BUCKET)
            if sync is not None:
                tb, bw = tuple(map(_plus, tb, sync)), True
            props.add(t * _K + f + _OFF)
            step.append((LOAD, t, graph[t].op, (), f))
        tf, tb, fw, bw, mem = self._compute_step(s, nid, r, slices, props, step, tf, tb, fw, bw, mem)
        p = s.p + 1
        if p == len(self.prep.order) or self.seg[p] != k:  # the program is whole, or a segment ends (§5.2)
            closed += max(tf) + max(tb)
            tf, tb, fw, bw = zero, zero, False, False
            if p < len(self.prep.order):
                closed += self._resplit(props, step, (k, self.seg[p]))
        return _State(p, frozenset(props), closed, tf, tb, fw, bw, mem, s, tuple(step))

    def _compute_step(self, s: _State, nid: int, r: OpRule, slices: list[tuple[int, int]], props: set[int],
                      step: list[tuple], tf: tuple[float, ...], tb: tuple[float, ...], fw: bool, bw: bool,
                      mem: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...], bool, bool, tuple[float, ...]]:
        """Node p's own instructions once its operands are in place (free slices, then the compute),
        its work (per-class seconds of the open stages) and memory added, and the forms no later
        consumer wants dropped from `props`."""
        for t, f in slices:
            step.append((COMM, t, "slice", ((t, FULL),), f))
        df, db, dm, wf, wb, instruction = self.terms.rule(self, s.p, nid, r)
        step.append(instruction)
        props.add(nid * _K + r.output + _OFF)
        props -= self.prep.dead_codes[s.p]
        for t, communicated in self.prep.live_marks[s.p]:
            if communicated in props:
                self._drop_redundant(props, t, s.p + 1)
        return tuple(map(_plus, tf, df)), tuple(map(_plus, tb, db)), fw or wf, bw or wb, tuple(map(_plus, mem, dm))

    def _after_compute_overlap(self, s: _State, nid: int, r: OpRule, loads: dict[int, int],
                               comms: list[Comm], slices: list[tuple[int, int]]) -> _State:
        """`_after_compute` in the overlap modes: the same instructions and properties; stages, buckets
        and the tail go through the mode's state (`_Ddp`, `_Duplex`)."""
        cm, graph, mode = self.cm, self.graph, self.mode
        ov = list(s.ov)
        closed, mem = s.closed, s.mem
        tf, tb, fw, bw = s.tf, s.tb, s.fw, s.bw  # the open stages, until a collective closes them
        zero = self.zero_times
        props = set(s.props)
        k = self.seg[s.p]
        step: list[tuple] = []
        for t, src, key, g, _, _ in comms:
            closed = mode.open_forward(ov, closed, fw, tf, key, t, (k,))
            tf, fw = zero, False
            if cm.requires_grad[t]:
                closed = mode.open_backward(ov, closed, bw, tb, DUAL[key], t, (k,))
                tb, bw = zero, False
            if self.rerun[s.p]:
                closed = mode.open_backward(ov, closed, bw, tb, key, t, (k,))
                tb, bw = zero, False
            props.add(code(t, g))
            props.add(code(t, _COMMUNICATED))
            if g == FULL and self.slice_ok:
                props.difference_update(code(t, d) for d in range(graph[t].rank))
            step.append((COMM, t, key, ((t, src),), g))
        for t, f in loads.items():
            _, m, sync_times = self.terms.load(t, f, k)
            mem = add(mem, m)
            if sync_times is not None:
                ov[0] = tuple(map(_plus, ov[0], sync_times))
            props.add(code(t, f))
            step.append((LOAD, t, graph[t].op, (), f))
        for slot, members, finishes in self.slot_events[s.p]:
            latency, per_byte = cm.bucket_line(slot)
            for t in members:
                if loads.get(t) == FULL:
                    nbytes = cm.nbytes[t] * per_byte
                    if _SLOT in props:
                        closed = mode.grow_slot(ov, closed, nbytes)
                    else:
                        props.add(_SLOT)
                        closed = mode.start_slot(ov, closed, latency + nbytes, tb)
            if finishes and _SLOT in props:
                props.discard(_SLOT)
                mode.finish_slot(ov)
        tf, tb, fw, bw, mem = self._compute_step(s, nid, r, slices, props, step, tf, tb, fw, bw, mem)
        p = s.p + 1
        if p == len(self.prep.order) or self.seg[p] != k:
            closed = mode.close(ov, closed, fw, tf, bw, tb, last=p == len(self.prep.order))
            tf, tb, fw, bw = zero, zero, False, False
            if p < len(self.prep.order):
                for t, d in self._live_shards(props):
                    segments = (k, self.seg[p])
                    closed = mode.open_forward(ov, closed, False, zero, RESPLIT, t, segments)
                    if cm.requires_grad[t]:
                        closed = mode.open_backward(ov, closed, False, zero, RESPLIT, t, segments)
                    step.append((COMM, t, RESPLIT, ((t, d),), d))
        out = _State(p, frozenset(props), closed, tf, tb, fw, bw, mem, s, tuple(step))
        out.ov = tuple(ov)
        return out

    @staticmethod
    def _live_shards(props: set[int]) -> list[tuple[int, int]]:
        """(tensor, dim) of every live sharded tensor, in the order `_resplit` re-splits them."""
        return [(c // _K, c % _K - _OFF) for c in sorted(props) if c >= 0 and c % _K - _OFF >= 0]

    def _resplit(self, props: set[int], step: list[tuple], segments: tuple[int, int]) -> float:
        """Re-split every live sharded tensor to the next segment's sizes by an all-to-all; its cost."""
        cost = 0.0
        for c in sorted(props):
            if c < 0 or c % _K - _OFF < 0:
                continue
            t, d = c // _K, c % _K - _OFF
            cost += self._comm_cost(RESPLIT, t, segments)
            step.append((COMM, t, RESPLIT, ((t, d),), d))
        return cost

    def _drop_redundant(self, props: set[int], t: int, p: int) -> None:
        """Third optimisation of §4.5: once t is communicated, drop forms no remaining consumer wants."""
        if code(t, _COMMUNICATED) not in props:
            return
        prep = self.prep
        want = prep.wanted_after[t][prep.next_consumer(t, p)]
        keep_full = self.slice_ok and any(g >= 0 for g in want)
        for f in range(-2, self.graph[t].rank):
            c = code(t, f)
            if c in props and f not in want and not (f == FULL and keep_full):
                props.discard(c)


def _leaf_filter(space: SearchSpace, op: str) -> Callable[[int, int], bool]:
    """Which forms a leaf may be loaded in: the space decides for parameters and inputs; a buffer is
    untrained state, free to load in any form (a local slice of a copy every device has)."""
    if op == "buffer":
        return lambda node, form: True
    return space.param_forms if op == "parameter" else space.placeholder_forms


def _worst_memory(graph: Graph, cm: CostModel) -> tuple[float, ...]:
    """Per-class bytes of the most memory-hungry program (everything Full): if even it fits, memory never binds."""
    mem = MEM_ZERO
    for n in graph.nodes:
        if n.op == "parameter":
            mem = add(mem, cm.load_delta(n.id, FULL)[1])
        elif not n.is_leaf:
            mem = add(mem, cm.compute_delta(n.id, False)[2])
    return cm.memory_by_class(mem)  # Full terms do not depend on the ratios


# --- overlap modes ---------------------------------------------------------------------------


def _maxdiff(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """max_c (a_c - b_c): bounds max_c(a_c + y_c) - max_c(b_c + y_c) for every y (either sign)."""
    return max(map(_minus, a, b))


class _Mode:
    """What the overlap modes share: the bucket slots' events per position and the per-class tail."""

    def __init__(self, search: "_Search") -> None:
        self.search, self.cm = search, search.cm
        n = len(search.prep.order)
        pos = {nid: k for k, nid in enumerate(search.prep.order)}
        use = first_use(search.graph)
        events: list[list[tuple[int, tuple[int, ...], bool]]] = [[] for _ in range(n + 1)]
        for slot, members in enumerate(self.cm.slots):
            where = {m: pos[use[m]] for m in members if use[m] >= 0}
            if not where:
                continue
            last = max(where.values())
            for p in sorted(set(where.values())):
                events[p].append((slot, tuple(m for m in members if where.get(m) == p), p == last))
        for row in events:  # a slot finishes before the next (in launch order, the one used earlier) starts
            row.sort(key=lambda e: -e[0])
        search.slot_events = events
        self.zero = search.zero_times

    def half_time(self, key: str, t: int, segments: tuple[int, ...]) -> float:
        return self.search.terms.half_time(key, t, segments)


class _Ddp(_Mode):
    """ddp. State `ov` = (tail, cb, D, E, G, dp, pre, wp):
    tail  per-class seconds of per-parameter-byte work (run after the buckets);
    cb    the backward chain closed so far, the open stage's dual collective included (so the
          chain that runs after a point of the open stage is cb + that stage's work before it);
    D     summed durations of the finished slots (launched after every slot still to come);
    E     max over finished slots whose ready point lies in a closed stage of D_k - w_k
          (w_k: the backward chain after the ready point), -inf if none;
    G     per class, max over finished slots whose ready point lies in the open stage of
          D_k - pre_k (pre_k: the open stage's work before it), None if none;
    dp, pre, wp  the open slot: its duration so far, and its ready point (pre while in the open
          stage, then wp), when it holds a Full parameter (`_SLOT`).

    Cost = F + W + max(0, max_k (D_k - w_k)) + U, which for every completion is the max of
    V + max_c(b_c + Y_c + H_c), V + max_c(b_c + Y_c + P_c) and D + dp + (terms of the future),
    with b the open stage's class times, Y, V what the future adds to it and after it,
    H_c = max(G_c, cb + max(0, E)) and P_c the open slot's (D + dp - pre_c, or cb + D + dp - wp).
    Hence the score (each term bounded like mode none's open stage) and the dominance test (each
    term of one state no larger than the other's, after the forward and tail excesses)."""

    def root(self) -> tuple:
        return (self.zero, 0.0, 0.0, -math.inf, None, 0.0, None, None)

    def open_forward(self, ov: list, closed: float, work: bool, ftimes: tuple[float, ...], key: str, t: int,
                     segments: tuple[int, ...]) -> float:
        return closed + max(ftimes) + self.cm.comm_time(key, t, segments)

    def open_backward(self, ov: list, closed: float, work: bool, btimes: tuple[float, ...], key: str, t: int,
                      segments: tuple[int, ...]) -> float:
        top = self._close_backward(ov, btimes)
        dual = self.cm.comm_time(key, t, segments)
        ov[1] += top + dual
        return closed + top + dual

    def _close_backward(self, ov: list, tot: tuple[float, ...]) -> float:
        """Close the open backward stage of class times `tot`: fix the ready points inside it; its slowest device's time."""
        top = max(tot)
        cb = ov[1]
        if ov[4] is not None:
            ov[3] = max(ov[3], max(x + g for x, g in zip(tot, ov[4])) - (cb + top))
            ov[4] = None
        if ov[6] is not None:
            ov[7] = cb + top - max(x - y for x, y in zip(tot, ov[6]))
            ov[6] = None
        return top

    def start_slot(self, ov: list, closed: float, duration: float, btimes: tuple[float, ...]) -> float:
        ov[5], ov[6], ov[7] = duration, btimes, None
        return closed

    def grow_slot(self, ov: list, closed: float, duration: float) -> float:
        ov[5] += duration
        return closed

    def finish_slot(self, ov: list) -> None:
        ov[2] += ov[5]
        d = ov[2]
        if ov[6] is not None:
            g = tuple(d - y for y in ov[6])
            ov[4] = g if ov[4] is None else tuple(max(a, b) for a, b in zip(ov[4], g))
        else:
            ov[3] = max(ov[3], d - ov[7])
        ov[5], ov[6], ov[7] = 0.0, None, None

    def close(self, ov: list, closed: float, fw: bool, ftimes: tuple[float, ...], bw: bool,
              btimes: tuple[float, ...], last: bool) -> float:
        top = self._close_backward(ov, btimes)
        ov[1] += top
        return closed + max(ftimes) + top

    def score(self, s: _State) -> float:
        search = self.search
        tail, cb, d, e, g, dp, pre, wp = s.ov
        base = cb + max(0.0, e)
        th = tuple(x + max(y, base) for x, y in zip(s.tb, g)) if g is not None else tuple(x + base for x in s.tb)
        debt = search._debt(s)
        term = search._bound(th, search.rem_b[s.p]) + debt
        tp: tuple[float, ...] = ()
        if _SLOT in s.props:
            tp = tuple(x + d + dp - y for x, y in zip(s.tb, pre)) if pre is not None else \
                tuple(x + cb + d + dp - wp for x in s.tb)
            term = max(term, search._bound(tp, search.rem_b[s.p]) + debt)
        s.aux = (th, tp)
        return (s.closed - cb) + search._bound(s.tf, search.rem_f[s.p]) + max(term, d + dp) + max(tail)

    def dominates(self, a: _State, b: _State) -> bool:
        ta, cba, da, _, _, dpa, _, _ = a.ov
        tb, cbb, db, _, _, dpb, _, _ = b.ov
        tol = 1e-12 * abs(b.closed) + 1e-15
        lead = (a.closed - cba) - (b.closed - cbb) + _maxdiff(a.tf, b.tf) + _maxdiff(ta, tb)
        if lead + _maxdiff(a.aux[0], b.aux[0]) > tol or lead + (da + dpa) - (db + dpb) > tol:
            return False
        return not a.aux[1] or lead + _maxdiff(a.aux[1], b.aux[1]) <= tol


class _Duplex(_Mode):
    """duplex. State `ov` = (tail, Sf, lf, bf, Sb, lb, bb): per pass (forward f, backward b) the
    HiDup chain's sum S of x_0 and the max of every adjacent pair appended so far, its last element
    l, and whether the open stage is blank (opened by a segment boundary or the start, not by a
    collective: its half-collective 0 joins the chain only if the stage gets work, as replay drops
    an empty stage). A collective appends its per-half time m; closing a stage appends c = its
    slowest device's time / 2; the end adds the last element. Buckets and their latencies are in
    `closed` (they run after both passes).

    Score: what a pass still adds is at least l + C + max(Mf, C) (blank) or C + max(l + Mf, C)
    (opened by a collective), with C >= B/2 the halves of its remaining computation (B: mode
    none's bound) and Mf its remaining per-half collectives; both passes' Mf sum to at least half
    the debt. Dominance: with the open stage's time excess e, a pass costs at most
    S_a - S_b + max(l_a - l_b, e/2) + max(0, e/2) more (collective-opened; HiDup's (psi, phi)) or
    S_a - S_b + max(0, l_a - l_b) + max(0, e) (blank, same emptiness)."""

    def root(self) -> tuple:
        return (self.zero, 0.0, 0.0, True, 0.0, 0.0, True)

    @staticmethod
    def _append_stage(ov: list, i: int, c: float, work: bool) -> None:
        """Close pass i's open stage (chain fields at i, i+1, i+2) with half computation c."""
        s, last, blank = ov[i], ov[i + 1], ov[i + 2]
        if not blank:
            ov[i] = s + max(last, c)
        elif work:
            ov[i] = s + last + c  # the blank stage's 0, then c
        else:
            return  # an empty blank stage is no stage
        ov[i + 1] = c

    def _open(self, ov: list, i: int, work: bool, times: tuple[float, ...], m: float) -> None:
        self._append_stage(ov, i, max(times) / 2, work)
        ov[i] += max(ov[i + 1], m)
        ov[i + 1], ov[i + 2] = m, False

    def open_forward(self, ov: list, closed: float, work: bool, ftimes: tuple[float, ...], key: str, t: int,
                     segments: tuple[int, ...]) -> float:
        self._open(ov, 1, work, ftimes, self.half_time(key, t, segments))
        return closed

    def open_backward(self, ov: list, closed: float, work: bool, btimes: tuple[float, ...], key: str, t: int,
                      segments: tuple[int, ...]) -> float:
        self._open(ov, 4, work, btimes, self.half_time(key, t, segments))
        return closed

    def start_slot(self, ov: list, closed: float, duration: float, btimes: tuple[float, ...]) -> float:
        return closed + duration

    def grow_slot(self, ov: list, closed: float, duration: float) -> float:
        return closed + duration

    def finish_slot(self, ov: list) -> None:
        return None

    def close(self, ov: list, closed: float, fw: bool, ftimes: tuple[float, ...], bw: bool,
              btimes: tuple[float, ...], last: bool) -> float:
        for i, work, times in ((1, fw, ftimes), (4, bw, btimes)):
            self._append_stage(ov, i, max(times) / 2, work)
            ov[i + 2] = True
            if last:
                ov[i] += ov[i + 1]
                ov[i + 1] = 0.0
        return closed

    def score(self, s: _State) -> float:
        search = self.search
        tail, sf, lf, bf, sb, lb, bb = s.ov
        low = base = 0.0
        for last, blank, times, rem in ((lf, bf, s.tf, search.rem_f[s.p]), (lb, bb, s.tb, search.rem_b[s.p])):
            c = search._bound(times, rem) / 2
            low += last + 2 * c if blank else c + max(last, c)
            base += last + c
        return s.closed + sf + sb + max(low, base + search._debt(s) / 2) + max(tail)

    def dominates(self, a: _State, b: _State) -> bool:
        oa, ob = a.ov, b.ov
        total = a.closed - b.closed + _maxdiff(oa[0], ob[0])
        for i, ta, tb, work_a, work_b in ((1, a.tf, b.tf, a.fw, b.fw), (4, a.tb, b.tb, a.bw, b.bw)):
            if oa[i + 2] != ob[i + 2]:
                return False
            e = _maxdiff(ta, tb)
            if oa[i + 2]:
                if work_a != work_b:
                    return False
                total += oa[i] - ob[i] + max(0.0, oa[i + 1] - ob[i + 1]) + max(0.0, e)
            else:
                total += oa[i] - ob[i] + max(oa[i + 1] - ob[i + 1], e / 2) + max(0.0, e / 2)
        return total <= 1e-12 * abs(b.closed + ob[1] + ob[4]) + 1e-15
