"""Tests of engine.spmd.synthesis: A* against an exhaustive enumeration of its own successor function,
replay consistency, determinism, time budgets, progress reports, well-formed programs, memory."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import fields
from typing import Iterator

import pytest
import torch
from conftest import ce_graph, cluster_dict, measured_collectives, mse_graph, residual_graph, sample_dict, with_memory

import engine
from engine.errors import InfeasibleError
from engine.model.graph import Graph
from engine.spmd.cost import ZERO, CostModel, evaluate
from engine.spmd.program import COMM, COMPUTE, LOAD, Instruction
from engine.spmd.synthesis import SearchProgress, SearchResult, SearchSpace, _Search, _State, synthesize
from engine.theory import collectives_from, leaf_forms, op_rules
from engine.theory.core import FULL, PARTIAL, OpRule, form_str

# ----------------------------------------------------------------------------- helpers


def enumerate_programs(graph: Graph, cm: CostModel, space: SearchSpace | None = None) -> Iterator[tuple[Instruction, ...]]:
    """Every complete program reachable through the search's successor function.

    Plain exhaustive depth-first enumeration from the state `_Search.run` starts from: no heuristic,
    no dominance, no pruning (not even by memory). A leaf is a state past the last node of the graph.
    """
    search = _Search(graph, cm, space or SearchSpace(), None, None, 500, None)
    end = len(search.prep.order)
    stack = [search.root()]
    while stack:
        s = stack.pop()
        if s.p < end:
            stack.extend(search._children(s))
            continue
        steps = []
        while s is not None:
            steps.append(s.step)
            s = s.parent
        program = tuple(Instruction(*ins) for step in reversed(steps) for ins in step)
        if loss_form(program, graph) in (PARTIAL, FULL):
            yield program


def loss_form(program: tuple[Instruction, ...], graph: Graph) -> int | None:
    """The form the loss holds in at the end of the program (None if never established)."""
    forms = [ins.post for ins in program if ins.node == graph.loss]
    return forms[-1] if forms else None


def fits(memory_bytes: list[float], capacity: list[float]) -> bool:
    return all(m <= c for m, c in zip(memory_bytes, capacity))


def brute_force(graph: Graph, cm: CostModel, capacity: list[float] | None = None,
                space: SearchSpace | None = None) -> tuple[float, int]:
    """(min cost, number of complete programs) over the enumeration; programs over `capacity` are skipped."""
    best, count = math.inf, 0
    for program in enumerate_programs(graph, cm, space):
        count += 1
        b = evaluate(program, cm)
        if capacity is not None and not fits(b.memory_bytes, capacity):
            continue
        best = min(best, b.total_s)
    return best, count


def assert_well_formed(program: tuple[Instruction, ...], graph: Graph) -> None:
    """Every precondition was established earlier; each node computed once in topological order by
    one of its rules; leaves loaded once in a legal form and never communicated; at most one
    communication (other than slice) per tensor; the loss ends Partial or Full."""
    established: set[tuple[int, int]] = set()
    loaded: dict[int, int] = {}
    computed: list[int] = []
    communicated: Counter[int] = Counter()
    for k, ins in enumerate(program):
        node = graph[ins.node]
        where = f"instruction {k} `{ins.render(graph)}`"
        for t, f in ins.pre:
            assert (t, f) in established, f"{where} needs {graph[t].name}:{form_str(f)}, which nothing before it establishes"
        if ins.kind == LOAD:
            assert node.is_leaf, f"{where} loads a non-leaf"
            assert ins.pre == () and ins.rule == node.op, where
            assert ins.node not in loaded, f"{where}: {node.name} is loaded twice"
            assert ins.post in leaf_forms(node), f"{where}: illegal leaf form"
            loaded[ins.node] = ins.post
        elif ins.kind == COMPUTE:
            assert not node.is_leaf, f"{where} computes a leaf"
            assert tuple(t for t, _ in ins.pre) == node.inputs, f"{where}: operands differ from the graph"
            used = OpRule(ins.rule, tuple(f for _, f in ins.pre), ins.post)
            assert used in op_rules(node, graph), f"{where}: {used} is not a rule of {node.op}"
            computed.append(ins.node)
        else:
            assert ins.kind == COMM, where
            assert len(ins.pre) == 1 and ins.pre[0][0] == ins.node, f"{where}: a collective acts on its own tensor"
            src = ins.pre[0][1]
            if ins.rule == "slice":
                assert src == FULL and ins.post >= 0, f"{where}: a slice goes from Full to a shard"
            else:
                assert not node.is_leaf, f"{where}: leaves are never communicated"
                communicated[ins.node] += 1
                legal = {(c.key, g) for c, g in collectives_from(src, node.shape) if c.is_communication}
                assert (ins.rule, ins.post) in legal, f"{where}: not a collective from {form_str(src)}"
        established.add((ins.node, ins.post))
    assert computed == [n.id for n in graph.nodes if not n.is_leaf], "every node computed once, in graph order"
    used_leaves = {t for n in graph.nodes if not n.is_leaf for t in n.inputs if graph[t].is_leaf}
    assert set(loaded) == used_leaves, "every used leaf is loaded"
    assert all(n <= 1 for n in communicated.values()), f"tensors communicated more than once: {communicated}"
    assert loss_form(program, graph) in (PARTIAL, FULL)


def ratios_for(cluster, how) -> list[float]:
    n = cluster.num_devices
    if how == "even":
        return [1.0 / n] * n
    if how == "flops":
        return [f / sum(cluster.flops) for f in cluster.flops]
    return list(how)


def full_parameters(program, graph) -> list[str]:
    return [graph[i.node].name for i in program if i.kind == LOAD and graph[i.node].op == "parameter" and i.post == FULL]


# ----------------------------------------------------------------------------- A* == brute force

HAND = {"hand_mse": mse_graph, "hand_ce": ce_graph, "hand_residual": residual_graph}
SETTINGS = [
    ("cpu_4_uneven", "even"),
    ("cpu_4_uneven", "flops"),
    ("cpu_4_uneven", (0.7, 0.1, 0.1, 0.1)),
    ("cpu_2", (0.8, 0.2)),
    ("a100x2_p100x2", "flops"),
    ("a100_v100_mixed", "even"),  # virtual devices of 8 GPUs: in-box gradient all-reduce
]


@pytest.fixture(scope="module")
def graphs(request) -> dict[str, Graph]:
    out = {name: make() for name, make in HAND.items()}
    out["tiny_mlp"] = request.getfixturevalue("tiny_mlp")
    out["mlp1"] = request.getfixturevalue("mlp1")
    return out


@pytest.mark.parametrize("cluster_name,how", SETTINGS, ids=[f"{c}-{h if isinstance(h, str) else 'skewed'}" for c, h in SETTINGS])
@pytest.mark.parametrize("graph_name", ["tiny_mlp", "mlp1", "hand_mse", "hand_ce", "hand_residual"])
def test_exact_astar_cost_equals_brute_force_minimum(graphs, load_sample, graph_name, cluster_name, how):
    graph = graphs[graph_name]
    cluster = load_sample(cluster_name)
    cm = CostModel(graph, cluster, ratios_for(cluster, how))
    best, count = brute_force(graph, cm)
    assert count > 1 and math.isfinite(best)
    result = synthesize(graph, cm)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)
    assert evaluate(result.program, cm).total_s == pytest.approx(best, rel=1e-9)


def test_exact_astar_equals_brute_force_on_two_layer_zoo_mlp(load_sample):
    """Two captured layers (bias adds, relu, cross entropy): the search's pruning across layers keeps it
    exact. The collectives are those of the paper's Fig. 9 (the whole theory gives this graph a million
    programs, ten minutes of enumeration; the one-layer cases above enumerate the whole theory)."""
    graph = engine.load_model("zoo:mlp", layers=2, in_features=128, hidden=256, classes=8, batch=32)
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(graph, cluster, [0.7, 0.1, 0.1, 0.1])
    space = SearchSpace(collectives=frozenset({"all_reduce", "all_gather.padded", "reduce_scatter", "all_to_all"}))
    best, count = brute_force(graph, cm, space=space)
    assert count > 5000
    result = synthesize(graph, cm, space=space)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("latency_s,bandwidth_Bps", [(0.0, 1e11), (1e-3, 1e8)], ids=["fast-net", "slow-net"])
@pytest.mark.parametrize("graph_name", ["hand_ce", "hand_residual"])
def test_exact_astar_equals_brute_force_on_three_uneven_devices(graphs, graph_name, latency_s, bandwidth_Bps):
    graph = graphs[graph_name]
    cluster = engine.load_cluster(cluster_dict([3e10, 1e10, 1e9], latency_s=latency_s, bandwidth_Bps=bandwidth_Bps))
    cm = CostModel(graph, cluster, [0.6, 0.3, 0.1])
    best, _ = brute_force(graph, cm)
    result = synthesize(graph, cm)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("graph_name", ["tiny_mlp", "hand_ce", "hand_residual"])
def test_exact_astar_equals_brute_force_under_the_roofline_split(graphs, graph_name):
    """Memory-bound operators priced by their bytes (activation_bandwidth_Bps): the search stays exact."""
    graph = graphs[graph_name]
    d = cluster_dict([2e12, 1e12, 5e11], latency_s=1e-4, bandwidth_Bps=1e9)
    for dev, bw in zip(d["devices"], [2e11, 1e11, 2e10]):
        dev["activation_bandwidth_Bps"] = bw
    cm = CostModel(graph, engine.load_cluster(d), [0.5, 0.3, 0.2])
    assert cm.roofline and any(cm.traffic)
    best, _ = brute_force(graph, cm)
    result = synthesize(graph, cm)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("graph_name,ratios", [("hand_ce", (0.25, 0.25, 0.25, 0.25)), ("hand_residual", (0.4, 0.3, 0.2, 0.1)),
                                               ("tiny_mlp", (0.7, 0.1, 0.1, 0.1))])
def test_exact_astar_equals_brute_force_minimum_among_programs_that_fit_memory(graphs, graph_name, ratios):
    graph = graphs[graph_name]
    spec = sample_dict("cpu_4_uneven")
    cm = CostModel(graph, engine.load_cluster(spec), list(ratios))
    programs = list(enumerate_programs(graph, cm))  # enumerated once, priced twice
    memories = [evaluate(p, cm).memory_bytes for p in programs]
    lo = [min(m[j] for m in memories) for j in range(4)]
    hi = [max(m[j] for m in memories) for j in range(4)]
    capacity = [int(a + 0.3 * (b - a)) + 1 for a, b in zip(lo, hi)]  # binds: some programs fit, some don't
    tight = with_memory(spec, capacity)
    cm_tight = CostModel(graph, tight, list(ratios))
    priced = [evaluate(p, cm_tight) for p in programs]
    best = min((b.total_s for b in priced if fits(b.memory_bytes, capacity)), default=math.inf)
    unconstrained = min(b.total_s for b in priced)
    assert math.isfinite(best)
    result = synthesize(graph, cm_tight)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)
    assert all(m <= c for m, c in zip(evaluate(result.program, cm_tight).memory_bytes, capacity))
    assert best >= unconstrained


def test_enumeration_reaches_every_program_the_search_returns(graphs, load_sample):
    graph = graphs["hand_residual"]
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(graph, cluster, ratios_for(cluster, "flops"))
    programs = set(enumerate_programs(graph, cm))
    assert len(programs) > 100
    assert synthesize(graph, cm).program in programs
    for program in programs:
        assert_well_formed(program, graph)


# ----------------------------------------------------------------------------- replay, determinism


@pytest.mark.parametrize("cluster_name,how,beam", [("cpu_4_uneven", "flops", None), ("a100x2_p100x2", "even", 16),
                                                   ("hap_paper_testbed_machines", "flops", 16)])
def test_reported_cost_equals_replayed_cost_for_small_gpt(small_gpt, load_sample, cluster_name, how, beam):
    cluster = load_sample(cluster_name)
    cm = CostModel(small_gpt, cluster, ratios_for(cluster, how))
    result = synthesize(small_gpt, cm, beam_width=beam)
    assert result.cost == pytest.approx(evaluate(result.program, cm).total_s, rel=1e-9)
    assert_well_formed(result.program, small_gpt)
    if beam is None:
        assert result.optimal is True


@pytest.mark.parametrize("cluster_name,how", [("cpu_4_uneven", "even"), ("a100_v100_mixed", "flops"), ("h100x8_node", "even")])
def test_reported_cost_equals_replayed_cost_for_mlp(mlp1, mlp2, load_sample, cluster_name, how):
    cluster = load_sample(cluster_name)
    for graph in (mlp1, mlp2):
        cm = CostModel(graph, cluster, ratios_for(cluster, how))
        result = synthesize(graph, cm)
        assert result.optimal is True
        assert result.cost == pytest.approx(evaluate(result.program, cm).total_s, rel=1e-9)
        assert_well_formed(result.program, graph)


def test_two_searches_return_identical_programs(small_gpt, mlp1, load_sample):
    cluster = load_sample("cpu_4_uneven")
    for graph, beam in ((small_gpt, 16), (mlp1, None)):
        cm = CostModel(graph, cluster, ratios_for(cluster, "flops"))
        a = synthesize(graph, cm, beam_width=beam)
        b = synthesize(graph, CostModel(graph, cluster, ratios_for(cluster, "flops")), beam_width=beam)
        assert a.program == b.program
        assert a.cost == b.cost
        assert (a.expanded, a.generated, a.pruned) == (b.expanded, b.generated, b.pruned)


def test_incumbent_is_returned_when_nothing_beats_it(mlp1, load_sample):
    cluster = load_sample("cpu_2")
    cm = CostModel(mlp1, cluster, [0.5, 0.5])
    best = synthesize(mlp1, cm)
    again = synthesize(mlp1, cm, incumbent=best.program)
    assert again.program == best.program
    assert again.cost == pytest.approx(best.cost, rel=1e-9)


# ----------------------------------------------------------------------------- time budget


@pytest.mark.parametrize("budget", [0.0, 0.01])
def test_time_budget_returns_a_complete_program_not_proven_optimal(gpt4, load_sample, budget):
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(gpt4, cluster, ratios_for(cluster, "even"))
    result = synthesize(gpt4, cm, time_budget_s=budget)
    assert isinstance(result, SearchResult)
    assert result.optimal is False
    assert_well_formed(result.program, gpt4)
    assert result.cost == pytest.approx(evaluate(result.program, cm).total_s, rel=1e-9)


def test_time_budget_on_a_model_of_the_paper_testbed_returns_a_program(load_sample):
    graph = engine.load_model("zoo:gpt", layers=2, hidden=128, heads=4, ffn=512, vocab=512, seq_len=32, batch=16)
    cluster = load_sample("hap_paper_testbed_machines")
    cm = CostModel(graph, cluster, ratios_for(cluster, "flops"))
    result = synthesize(graph, cm, time_budget_s=0.05)
    assert result.optimal is False
    assert_well_formed(result.program, graph)


# ----------------------------------------------------------------------------- progress


def test_progress_callback_receives_search_progress_ending_with_bound_below_best(small_gpt, load_sample):
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(small_gpt, cluster, ratios_for(cluster, "flops"))
    seen: list[SearchProgress] = []
    result = synthesize(small_gpt, cm, progress=seen.append, report_every=64)
    assert len(seen) >= 2
    for p in seen:
        assert isinstance(p, SearchProgress)
        assert {"expanded", "queue_size", "best_cost", "lowest_open_score"} <= {f.name for f in fields(p)}
        assert isinstance(p.expanded, int) and isinstance(p.queue_size, int) and p.queue_size >= 0
        assert p.lowest_open_score <= p.best_cost
        # exact A* with an admissible bound: the lowest open score never exceeds the optimum
        assert p.lowest_open_score <= result.cost * (1 + 1e-9)
    assert [p.expanded for p in seen] == sorted(p.expanded for p in seen)
    costs = [p.best_cost for p in seen]
    assert costs == sorted(costs, reverse=True)
    last = seen[-1]
    assert last.expanded == result.expanded
    assert last.best_cost == pytest.approx(result.cost, rel=1e-12)
    assert last.lowest_open_score <= last.best_cost
    assert result.frontier == seen


def test_progress_is_reported_every_report_every_expansions(small_gpt, load_sample):
    """Not only at common multiples of report_every and 64 (a default of 500 reported every 8000)."""
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(small_gpt, cluster, ratios_for(cluster, "flops"))
    seen: list[SearchProgress] = []
    result = synthesize(small_gpt, cm, progress=seen.append, report_every=50)
    assert result.expanded >= 150
    assert [p.expanded for p in seen[:-1]] == list(range(50, result.expanded + 1, 50))


# ----------------------------------------------------------------------------- well-formedness


@pytest.mark.parametrize("cluster_name", ["cpu_4_uneven", "a100x2_p100x2", "hap_paper_testbed_machines"])
def test_programs_are_well_formed(small_gpt, tiny_mlp, mlp2, load_sample, cluster_name):
    cluster = load_sample(cluster_name)
    for graph in (small_gpt, tiny_mlp, mlp2, residual_graph()):
        cm = CostModel(graph, cluster, ratios_for(cluster, "flops"))
        result = synthesize(graph, cm, beam_width=16)
        assert_well_formed(result.program, graph)


def test_data_parallel_space_yields_full_parameters_and_batch_sharded_inputs(mlp1, load_sample):
    from engine.spmd.baselines import data_parallel_space

    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(mlp1, cluster, ratios_for(cluster, "even"))
    result = synthesize(mlp1, cm, space=data_parallel_space(mlp1))
    assert_well_formed(result.program, mlp1)
    loads = {mlp1[i.node].op: set() for i in result.program if i.kind == LOAD}
    for i in result.program:
        if i.kind == LOAD:
            loads[mlp1[i.node].op].add(i.post)
    assert loads == {"parameter": {FULL}, "placeholder": {0}}
    comms = [i for i in result.program if i.kind == COMM and i.rule != "slice"]
    # only the loss's count of kept targets (a scalar sum over the batch) is all-reduced
    assert [(i.rule, mlp1[i.node].shape) for i in comms] == [("all_reduce", ())]
    assert mlp1[comms[0].node].name.endswith("_count")


# ----------------------------------------------------------------------------- memory


def test_tight_memory_makes_the_search_shard_parameters(mlp2):
    spec = sample_dict("cpu_2")
    roomy = engine.load_cluster(spec)
    free = synthesize(mlp2, CostModel(mlp2, roomy, [0.5, 0.5]))
    free_mem = evaluate(free.program, CostModel(mlp2, roomy, [0.5, 0.5])).memory_bytes
    assert len(full_parameters(free.program, mlp2)) == len(mlp2.parameters)  # data parallel wins with room

    capacity = int(0.9 * free_mem[0])
    tight = with_memory(spec, capacity)
    cm = CostModel(mlp2, tight, [0.5, 0.5])
    result = synthesize(mlp2, cm)
    assert result.optimal is True
    assert all(m <= capacity for m in evaluate(result.program, cm).memory_bytes)
    assert len(full_parameters(result.program, mlp2)) < len(mlp2.parameters)
    assert result.cost >= free.cost
    assert_well_formed(result.program, mlp2)


def test_search_raises_infeasible_when_nothing_fits_memory(mlp2):
    tight = with_memory(sample_dict("cpu_2"), 4096)
    with pytest.raises(InfeasibleError, match=r"^out of memory: every program overflows some device.s memory by node "):
        synthesize(mlp2, CostModel(mlp2, tight, [0.5, 0.5]))


def test_search_space_without_rules_for_a_node_raises_infeasible(mlp1, load_sample):
    cluster = load_sample("cpu_2")
    space = SearchSpace(rule_filter=lambda node, r: mlp1[node].op != "relu")
    with pytest.raises(InfeasibleError, match=r"node '.*' \(relu\) has no rule"):
        synthesize(mlp1, CostModel(mlp1, cluster, [0.5, 0.5]), space=space)


# ----------------------------------------------------------------------------- captured small graph


class _TwoLayerMSE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(6, 8))
        self.w2 = torch.nn.Parameter(torch.randn(8, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.relu(x @ self.w1) @ self.w2, y)


def test_captured_x_w1_relu_w2_mse_model_matches_brute_force(load_sample):
    graph = engine.load_model(_TwoLayerMSE(), (torch.randn(4, 6), torch.randn(4, 3)))
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(graph, cluster, ratios_for(cluster, "flops"))
    best, _ = brute_force(graph, cm)
    result = synthesize(graph, cm)
    assert result.optimal is True
    assert result.cost == pytest.approx(best, rel=1e-9)


# ----------------------------------------------------------------------------- overlap modes

OVERLAP_SETTINGS = [("cpu_4_uneven", (0.7, 0.1, 0.1, 0.1)), ("cpu_2", (0.8, 0.2)), ("a100x2_p100x2", "flops"),
                    ("a100_v100_mixed", "even")]


def overlap_model(graph: Graph, cluster, how, mode: str, caps: tuple[int, int] | None = None) -> CostModel:
    """A cost model in `mode`; with `caps`, bucket slots of those (first, other) caps so small graphs get many."""
    from engine.spmd.overlap import bucket_slots

    cm = CostModel(graph, cluster, ratios_for(cluster, how), overlap=mode)
    if caps is not None:
        cm._slots = bucket_slots(graph, first_cap=caps[0], cap=caps[1])
    return cm


def brute_force_each(graph: Graph, cms: list[CostModel]) -> list[float]:
    """`brute_force`'s minimum under each cost model, enumerating the programs once (the successor
    function does not depend on the overlap mode or the ratios)."""
    programs = list(enumerate_programs(graph, cms[0]))
    assert len(programs) > 1
    return [min(evaluate(p, cm).total_s for p in programs) for cm in cms]


OVERLAP_CASES = [("hand_residual", "cpu_4_uneven", (0.7, 0.1, 0.1, 0.1)), ("hand_residual", "cpu_2", (0.8, 0.2)),
                 ("hand_residual", "a100x2_p100x2", "flops"), ("hand_residual", "a100_v100_mixed", "even"),
                 ("hand_ce", "cpu_4_uneven", "flops"), ("hand_ce", "a100_v100_mixed", "even"),
                 ("tiny_mlp", "cpu_4_uneven", (0.4, 0.3, 0.2, 0.1))]


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
@pytest.mark.parametrize("graph_name,cluster_name,how", OVERLAP_CASES, ids=[f"{g}-{c}" for g, c, _ in OVERLAP_CASES])
def test_exact_astar_equals_brute_force_in_the_overlap_modes(graphs, load_sample, graph_name, cluster_name, how, mode):
    graph = graphs[graph_name]
    cluster = load_sample(cluster_name)
    # DDP's own buckets (one or two on these graphs), then one bucket per parameter (the tiny MLP: just that)
    caps = [(1, 1)] if graph_name == "tiny_mlp" else [None, (1, 1)]
    cms = [overlap_model(graph, cluster, how, mode, c) for c in caps]
    for cm, best in zip(cms, brute_force_each(graph, cms)):
        result = synthesize(graph, cm)
        assert result.optimal is True
        assert result.cost == pytest.approx(best, rel=1e-9)
        assert evaluate(result.program, cm).total_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
@pytest.mark.parametrize("latency_s,bandwidth_Bps,mem_bw", [(0.0, 1e11, None), (1e-3, 1e8, 1e10), (1e-5, 1e9, 1e11)],
                         ids=["fast-net", "slow-net-tail", "mid-net-tail"])
def test_exact_astar_equals_brute_force_in_the_overlap_modes_on_uneven_devices(graphs, mode, latency_s, bandwidth_Bps,
                                                                              mem_bw):
    d = cluster_dict([3e10, 1e10, 1e9], latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
    if mem_bw:
        for dev, bw in zip(d["devices"], [mem_bw, mem_bw / 3, mem_bw / 10]):
            dev["memory_bandwidth_Bps"] = bw  # a per-class tail that differs from the computation's shape
    cluster = engine.load_cluster(d)
    for graph_name in ("hand_ce", "hand_residual"):
        graph = graphs[graph_name]
        cm = overlap_model(graph, cluster, (0.6, 0.3, 0.1), mode, (1, 1))
        [best] = brute_force_each(graph, [cm])
        result = synthesize(graph, cm)
        assert result.optimal is True
        assert result.cost == pytest.approx(best, rel=1e-9), graph_name


@pytest.mark.parametrize("bumpy", [True, False], ids=["bump", "convex"])
@pytest.mark.parametrize("mode", ["none", "ddp", "duplex"])
def test_exact_astar_equals_brute_force_when_collectives_are_read_off_measured_points(graphs, mode, bumpy):
    """With every fit carrying profiled points above its line (sharded collectives looked up at the
    largest ratio, buckets on their chord), the search's cost is still the replayed cost of its program
    and the minimum of all programs."""
    for graph_name in ("hand_ce", "hand_residual", "tiny_mlp"):
        graph = graphs[graph_name]
        d = cluster_dict([3e10, 1e10, 1e9], latency_s=2e-4, bandwidth_Bps=1e9)
        d["network"]["collectives"] = measured_collectives(max(n.nbytes for n in graph.nodes if not n.is_leaf), bumpy=bumpy)
        cm = overlap_model(graph, engine.load_cluster(d), (0.6, 0.3, 0.1), mode, (1, 1) if mode != "none" else None)
        [best] = brute_force_each(graph, [cm])
        result = synthesize(graph, cm)
        assert result.optimal is True
        assert result.cost == pytest.approx(best, rel=1e-9), graph_name
        assert evaluate(result.program, cm).total_s == pytest.approx(best, rel=1e-9), graph_name


@pytest.mark.parametrize("mode", ["none", "ddp", "duplex"])
def test_every_partial_programs_score_is_at_most_the_cost_of_each_completion(graphs, load_sample, mode):
    """Admissibility, state by state: along every enumerated program, no prefix scores above the
    program's replayed cost."""
    graph = graphs["hand_residual"]
    cluster = load_sample("cpu_4_uneven")
    cm = overlap_model(graph, cluster, (0.4, 0.3, 0.2, 0.1), mode, (1, 1) if mode != "none" else None)
    search = _Search(graph, cm, SearchSpace(), None, None, 500, None)
    end = len(search.prep.order)
    stack = [search.root()]
    checked = 0
    while stack:
        s = stack.pop()
        search._finish(s)
        if s.p < end:
            stack.extend(search._children(s))
            continue
        program = search._program(s)
        if loss_form(program, graph) not in (PARTIAL, FULL):
            continue
        cost = evaluate(program, cm).total_s
        assert s.score == pytest.approx(cost, rel=1e-9), "a complete program scores its cost"
        a = s.parent
        while a is not None:
            assert a.score <= cost * (1 + 1e-9)
            a = a.parent
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("mode", ["ddp", "duplex"])
def test_reported_cost_equals_replayed_cost_for_small_gpt_in_the_overlap_modes(small_gpt, load_sample, mode):
    for cluster_name, beam in (("cpu_4_uneven", None), ("hap_paper_testbed_machines", 16)):
        cluster = load_sample(cluster_name)
        cm = CostModel(small_gpt, cluster, ratios_for(cluster, "flops"), overlap=mode)
        result = synthesize(small_gpt, cm, beam_width=beam)
        assert result.cost == pytest.approx(evaluate(result.program, cm).total_s, rel=1e-9)
        assert_well_formed(result.program, small_gpt)
        if beam is None:
            assert result.optimal is True


def side_arithmetic_graph(B: int = 8, H: int = 16) -> Graph:
    """o = (x W) * (2 m): the scaled mask 2 m needs no gradient (side arithmetic, as an attention mask)."""
    from conftest import build_graph

    return build_graph([
        ("x", "placeholder", (), (B, H)),
        ("m", "placeholder", (), (B, H)),
        ("mm", "mul", (1,), (B, H), B * H, {"scalar": 2.0, "scalar_first": False}),
        ("w", "parameter", (), (H, H)),
        ("h", "linear", (0, 3), (B, H), 2 * B * H * H),
        ("o", "mul", (4, 2), (B, H), B * H),
        ("y", "placeholder", (), (B, H)),
        ("loss", "mse_loss", (5, 6), (), 3 * B * H, {"count": B * H}),
    ], name="hand_side")


def test_under_a_beam_side_arithmetic_runs_replicated_and_the_result_is_not_called_optimal():
    g = side_arithmetic_graph()
    cm = CostModel(g, engine.load_cluster(cluster_dict([1e12, 5e11])), [2 / 3, 1 / 3])
    exact, beamed = synthesize(g, cm), synthesize(g, cm, beam_width=64)
    side = [i.rule for r in (exact, beamed) for i in r.program if i.kind == COMPUTE and i.node == 2]
    assert side[1] == "replicate" and not beamed.optimal, "its Full result slices to any shard for free"
    assert exact.optimal and beamed.cost >= exact.cost
    assert beamed.cost - exact.cost <= g[2].flops / 5e11, "at most the side node's own compute"


# ----------------------------------------------------------------------------- operands read once and last


def _cat_graph(k: int, B: int = 16, H: int = 8) -> Graph:
    """k linears of one input concatenated on the feature dim, then a loss: each linear's result is
    read once, by the cat, and dies there."""
    from conftest import build_graph

    rows: list[tuple] = [("x", "placeholder", (), (B, H))]
    outs = []
    for i in range(k):
        rows.append((f"w{i}", "parameter", (), (H, H)))
        rows.append((f"h{i}", "linear", (0, len(rows) - 1), (B, H), 2 * B * H * H))
        outs.append(len(rows) - 1)
    rows.append(("c", "cat", tuple(outs), (B, k * H), 0.0, {"dim": 1}))
    rows.append(("y", "placeholder", (), (B, k * H)))
    rows.append(("loss", "mse_loss", (len(rows) - 1, len(rows) - 2), (), 3 * B * k * H, {"count": B * k * H}))
    return build_graph(rows, name=f"hand_cat{k}")


def test_an_operand_read_once_and_last_keeps_only_its_cheapest_way_and_the_optimum(load_sample):
    """Whichever collective brings such an operand into the form a rule wants, its properties die with
    the node: the children differ only in cost, and keeping the cheapest loses no optimum."""
    graph = _cat_graph(3)
    cluster = load_sample("cpu_4_uneven")
    cm = CostModel(graph, cluster, ratios_for(cluster, (0.4, 0.3, 0.2, 0.1)))
    reduced = _Search(graph, cm, SearchSpace(), None, None, 500, None)
    assert reduced.prep.spent[len(reduced.prep.order) - 2] == frozenset(range(2, 8, 2)), "the cat reads h0..h2 last"
    every = _Search(graph, cm, SearchSpace(), None, None, 500, None)
    every.prep.spent = [frozenset()] * len(every.prep.spent)
    a, b = reduced.run(), every.run()
    assert a.cost == pytest.approx(b.cost, rel=1e-12)
    assert a.generated < b.generated


def test_a_wide_cat_of_operands_in_the_wrong_form_plans_without_enumerating_their_combinations(load_sample):
    """A scan's 128 steps stacked by one cat (Mamba) never finished: every combination of its operands'
    ways was a child (12 operands: 16,541 children against 159)."""
    graph = _cat_graph(12)
    cluster = load_sample("cpu_4_uneven")
    result = synthesize(graph, CostModel(graph, cluster, ratios_for(cluster, "flops")), beam_width=4)
    assert result.generated < 1_000
