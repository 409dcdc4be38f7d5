"""DDP's bucket assignment: reverse order of use, first bucket small, later ones capped."""
from engine.model.graph import Graph, Node
from engine.spmd.overlap import bucket_slots, grad_buckets
from engine.spmd.program import LOAD, Instruction
from engine.theory.core import FULL


def _chain(sizes_mib: list[float]) -> Graph:
    """x -> linear(w0) -> linear(w1) -> ...: parameter k is used at layer k."""
    nodes = [Node(0, "x", "placeholder", (), (4,), "float32", {"index": 0})]
    prev = 0
    for k, mib in enumerate(sizes_mib):
        numel = int(mib * 2**20 / 4)
        w = Node(len(nodes), f"w{k}", "parameter", (), (numel,), "float32", {"target": f"w{k}"})
        nodes.append(w)
        nodes.append(Node(len(nodes), f"y{k}", "add", (prev, w.id), (4,), "float32", {}))
        prev = len(nodes) - 1
    return Graph(tuple(nodes), loss=prev, name="chain")


def test_buckets_fill_in_reverse_order_of_use_with_ddp_caps():
    g = _chain([0.5, 10, 10, 10, 0.75, 0.5])
    names = [[g[i].name for i in b] for b in bucket_slots(g)]
    # the last-used parameters fill the 1 MiB first bucket; then 25 MiB buckets close once full
    assert names == [["w5", "w4"], ["w3", "w2", "w1"], ["w0"]]


def test_a_plan_bucket_holds_only_its_full_parameters():
    g = _chain([0.5, 10, 10, 10, 0.75, 0.5])
    w = {g[i].name: i for i in range(len(g))}
    program = tuple(Instruction(LOAD, w[n], "parameter", (), FULL) for n in ("w5", "w2", "w0"))
    program += (Instruction(LOAD, w["w4"], "parameter", (), 0),)
    assert [[g[i].name for i in b] for b in grad_buckets(g, program)] == [["w5"], ["w2"], ["w0"]]
