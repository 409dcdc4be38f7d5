"""The plan validator (issue 17): each check refuses a plan broken in exactly that way, by its JSON
path, in `Plan.from_json`, `hap bundle check` (exit 1) and `hap run` (exit 2, no rank started);
every plan the planner writes passes."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import build_graph, cluster_dict, sample_dict, sample_path

import engine
from engine.bundle.archive import export_bundle
from engine.cluster.spec import Cluster
from engine.errors import ModelError, PlanError
from engine.model.graph import Graph, Node
from engine.planner import load_plan
from engine.spmd.baselines import data_parallel_space
from engine.spmd.cost import CostModel
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.segments import RESPLIT, segment_graph, with_resplits
from engine.spmd.synthesis import synthesize
from engine.spmd.validate import REPRICE_TOLERANCE, validate_plan
from runner.hap import main as hap_main

MLP = dict(layers=2, in_features=8, hidden=16, classes=4, batch=12)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return engine.load_cluster(sample_path("cpu_4_uneven"))


@pytest.fixture(scope="module")
def good(cluster) -> dict[str, Any]:
    """The planner's plan of a two-layer MLP on cpu_4_uneven (data parallel: batch 12 split 4/4/2/2), as JSON."""
    return engine.plan(engine.load_model("zoo:mlp", **MLP), cluster).to_dict()


def index_of(d: dict[str, Any], name: str, kind: str = "compute") -> int:
    """Position in the program of the `kind` instruction on node `name`."""
    node = next(n["id"] for n in d["graph"]["nodes"] if n["name"] == name)
    return next(i for i, ins in enumerate(d["program"]) if ins["node"] == node and ins["kind"] == kind)


def sizes_off(d):
    d["shard_sizes"]["x:0"] = [4, 4, 2, 1]


def sizes_not_rounded(d):
    for key in d["shard_sizes"]:  # every batch dim alike: linked dims stay consistent, the ratios do not
        d["shard_sizes"][key] = [5, 3, 2, 2]


def linked_split_differently(d):
    d["shard_sizes"]["relu:0"] = [5, 3, 2, 2]


def truncated(d):
    d["program"] = d["program"][:-3]


def negative_ratio(d):
    d["ratios"]["0"] = [-0.1, 0.6, 0.25, 0.25]


def ratios_not_one(d):
    d["ratios"]["0"] = [0.3, 0.3, 0.2, 0.1]


def negative_time(d):
    d["predicted_time_s"] = -1.0


def nan_memory(d):
    d["memory_bytes"][1] = math.nan


def operand_missing(d):
    d["program"][index_of(d, "p_layers_0_weight", "load")]["post"] = "S(0)"  # linear_mm wants it Full


def rule_not_in_theory(d):
    d["program"][index_of(d, "relu")]["rule"] = "column"


def bad_graph_reference(d):
    next(n for n in d["graph"]["nodes"] if n["name"] == "linear_mm")["inputs"][0] = 99


def wrong_triple(d):
    d["program"][index_of(d, "relu")]["post"] = "F"  # relu.shard takes S(0) to S(0), not F


def extra_sizes(d):
    d["shard_sizes"]["p_head_weight:0"] = [1, 1, 1, 1]


def missing_sizes(d):
    del d["shard_sizes"]["relu:0"]


def loaded_twice(d):
    i = index_of(d, "p_head_bias", "load")
    d["program"].insert(i + 1, copy.deepcopy(d["program"][i]))


def three_ratios(d):
    d["ratios"]["0"] = [0.5, 0.25, 0.25]


def string_time(d):
    d["predicted_time_s"] = "0.01"


def bad_form(d):
    d["program"][index_of(d, "relu")]["pre"][0][1] = "X(1)"


def unknown_dtype(d):
    d["graph"]["nodes"][0]["dtype"] = "float13"


def negative_shape(d):
    d["graph"]["nodes"][0]["shape"] = [-12, 8]


def bad_loss(d):
    d["graph"]["loss"] = 3


def bad_collective(d):
    i = index_of(d, "linear_mm")
    node = d["program"][i]["node"]
    d["program"].insert(i + 1, {"kind": "comm", "node": node, "rule": "all_gather.padded", "pre": [[node, "S(0)"]], "post": "P"})


def load_of_computed(d):
    i = index_of(d, "relu")
    d["program"][i] = {"kind": "load", "node": d["program"][i]["node"], "rule": "relu", "pre": [], "post": "S(0)"}


def edited_graph(d):
    next(n for n in d["graph"]["nodes"] if n["op"] == "cross_entropy")["attrs"]["count"] = 6


def origin_differs(d):
    d["model"]["origin"] = {**d["model"]["origin"], "config": {**d["model"]["origin"]["config"], "batch": 6}}


def inconsistent_shape(d):
    next(n for n in d["graph"]["nodes"] if n["name"] == "relu")["shape"] = [12, 16, 3]
    d["model"]["fingerprint"] = Graph.from_dict(d["graph"]).fingerprint()  # edited on purpose, fingerprint too


def node_out_of_range(d):
    d["program"][index_of(d, "relu")]["node"] = 999


def shard_dim_out_of_range(d):
    d["program"][index_of(d, "relu")]["pre"][0][1] = "S(5)"


BROKEN: list[tuple[Callable, str]] = [
    (sizes_off, r'shard_sizes\["x:0"\]: \[4, 4, 2, 1\] sums to 11 but dim 0 of x has size 12'),
    (sizes_not_rounded, r'shard_sizes\["x:0"\]: \[5, 3, 2, 2\] are not the sizes ratios\["0"\] round to, \[4, 4, 2, 2\] '
                        r'\(nor are the ratios the shares these sizes give, \[0.416667, 0.25, 0.166667, 0.166667\]\)'),
    (linked_split_differently, r'shard_sizes\["relu:0"\]: \[5, 3, 2, 2\] does not split like .*\[4, 4, 2, 2\]: an instruction '
                               r'links the two dims'),
    (truncated, r"program: the program looks truncated: node .* is never computed"),
    (negative_ratio, r'ratios\["0"\]\[0\]: ratio -0.1 of device .* is outside \[0, 1\]'),
    (ratios_not_one, r'ratios\["0"\]: ratios sum to 0.9, not 1'),
    (negative_time, r"predicted_time_s: -1.0 is not a finite non-negative number"),
    (nan_memory, r"memory_bytes\[1\]: NaN is not a finite non-negative number"),
    (operand_missing, r"program\[\d+\] \(linear_mm = linear.batch\(x:S\(0\), p_layers_0_weight:F\) -> S\(0\)\)\.pre\[1\]: "
                      r"operand p_layers_0_weight:F is not available \(it holds only as S\(0\)\)"),
    (rule_not_in_theory, r"program\[\d+\] \(relu = relu.column\(linear:S\(0\)\) -> S\(0\)\): the theory has no rule 'column' "
                         r"for relu node relu"),
    (bad_graph_reference, r"graph.nodes\[\d+\].inputs\[0\] = 99 is not an earlier node"),
    (wrong_triple, r"rule 'shard' of relu does not take \(S\(0\)\) to F for node relu"),
    (extra_sizes, r'shard_sizes\["p_head_weight:0"\]: is not a dim the program shards; remove it'),
    (missing_sizes, r'shard_sizes: has no entry "relu:0"'),
    (loaded_twice, r"p_head_bias is loaded again"),
    (three_ratios, r'ratios\["0"\]: has 3 ratios but the plan has 4 devices'),
    (string_time, r'predicted_time_s: "0.01" is not a finite non-negative number'),
    (bad_form, r"program\[\d+\].pre\[0\]: 'X\(1\)' is not a form"),
    (unknown_dtype, r"graph.nodes\[0\].dtype = 'float13' is not a known dtype"),
    (negative_shape, r"graph.nodes\[0\].shape = \[-12, 8\] must be a list of non-negative integers"),
    (bad_loss, r"graph.loss = 3 names node .* not a scalar"),
    (bad_collective, r"all_gather.padded does not take linear_mm from S\(0\) to P"),
    (load_of_computed, r"loads 'relu', a relu node: only leaves"),
    (node_out_of_range, r"program\[\d+\].node: 999 is not a node of the graph \(0..\d+\)"),
    (shard_dim_out_of_range, r"program\[\d+\].pre\[0\]: linear has 2 dims: no S\(5\)"),
    (edited_graph, r"graph: the graph was edited: its fingerprint .* is not the model.fingerprint"),
    (origin_differs, r"model.origin: differs from graph.origin"),
    (inconsistent_shape, r"graph.nodes\[\d+\]: the theory cannot derive rules for relu node relu: its shape \[12, 16, 3\]"),
]
CASES = [pytest.param(mutate, message, id=mutate.__name__) for mutate, message in BROKEN]


def broken(good: dict[str, Any], mutate: Callable) -> dict[str, Any]:
    d = copy.deepcopy(good)
    mutate(d)
    return d


def test_the_planners_plan_is_valid_and_round_trips(good, cluster):
    assert validate_plan(good, cluster) == []
    assert load_plan(json.dumps(good)).to_dict() == good


@pytest.mark.parametrize("mutate, message", CASES)
def test_plan_from_json_refuses_a_plan_broken_in_one_way_naming_it(good, mutate, message):
    text = json.dumps(broken(good, mutate))
    with pytest.raises(PlanError, match=message) as err:
        load_plan(text)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("plan: ") and "regenerate the plan" in str(err.value)


@pytest.fixture(scope="module")
def bundle(good, cluster, tmp_path_factory) -> Path:
    return export_bundle(load_plan(copy.deepcopy(good)), cluster, tmp_path_factory.mktemp("b") / "bundle")


def with_plan(bundle: Path, d: dict[str, Any], dest: Path, *, regenerate: bool = False) -> Path:
    """A copy of the bundle whose plan.json is `d`, its manifest updated (so only the plan is wrong); with
    `regenerate`, the files generated from the plan (the README shows its predicted time) written again too."""
    shutil.copytree(bundle, dest)
    data = json.dumps(d, indent=1).encode()
    (dest / "plan.json").write_bytes(data)
    manifest = json.loads((dest / "manifest.json").read_text())
    if regenerate:
        from engine.bundle.archive import ExportSettings, generated_files, manifest_nodes

        plan, cluster = load_plan(data.decode()), engine.load_cluster(str(dest / "cluster.json"))
        nodes = manifest_nodes(manifest, plan.world_size)
        for name, text in generated_files(plan, cluster, nodes, ExportSettings.from_dict(manifest["export"], "export"), None).items():
            (dest / name).write_bytes(text)
    for f in sorted(dest.iterdir()):
        if f.name != "manifest.json":
            manifest["files"][f.name] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dest


@pytest.mark.parametrize("mutate, message", CASES)
def test_hap_bundle_check_exits_1_naming_the_problem(good, bundle, tmp_path, capsys, mutate, message):
    folder = with_plan(bundle, broken(good, mutate), tmp_path / "b")
    assert hap_main(["bundle", "check", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "INVALID" in err and re.search(message, err), err


def test_hap_bundle_check_accepts_the_same_bundle_unbroken(good, bundle, tmp_path, capsys):
    assert hap_main(["bundle", "check", str(with_plan(bundle, good, tmp_path / "b"))]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("mutate, message", CASES)
def test_hap_run_exits_2_before_any_rank_starts(good, tmp_path, capsys, monkeypatch, mutate, message):
    import runner.cli

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(runner.cli, "run_torchrun", lambda *a, **k: pytest.fail("torchrun started for a broken plan"))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(broken(good, mutate)))
    assert hap_main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hap run: error: plan: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("mutate", [sizes_off, truncated, operand_missing], ids=lambda f: f.__name__)
def test_every_rank_refuses_a_broken_plan_before_its_process_group(good, tmp_path, capsys, mutate):
    from runner.config import DistEnv, RunConfig
    from runner.launch import run

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(broken(good, mutate)))
    assert run(RunConfig(plan=str(path), steps=1), DistEnv(2, 4, 2, 4)) == 2
    assert "hap run: error: plan: " in capsys.readouterr().err


def test_hap_export_refuses_a_broken_plan(good, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(broken(good, truncated)))
    assert hap_main(["export", str(path), "--out", str(tmp_path / "b"), "--cluster", sample_path("cpu_4_uneven")]) == 2
    assert "never computed" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_export_bundle_refuses_a_broken_plan_object(good, cluster, tmp_path):
    plan = load_plan(copy.deepcopy(good))
    plan.shard_sizes["x:0"] = [4, 4, 2, 1]
    with pytest.raises(PlanError, match="sums to 11"):
        export_bundle(plan, cluster, tmp_path / "b")


# ----------------------------------------------------------------------------- valid variants


def test_an_extra_legal_collective_is_accepted(good):
    """A program is checked against the theory, not against the planner's output: an all-gather the
    plan does not need is a legal instruction (its precondition holds) and the plan stays valid."""
    d = copy.deepcopy(good)
    i = index_of(d, "linear_mm")
    node = d["program"][i]["node"]
    d["program"].insert(i + 1, {"kind": "comm", "node": node, "rule": "all_gather.padded",
                                "pre": [[node, "S(0)"]], "post": "F"})
    assert load_plan(d).program[i + 1].rule == "all_gather.padded"


def test_a_collective_needs_its_precondition(good):
    d = copy.deepcopy(good)
    i = index_of(d, "linear_mm")
    node = d["program"][i]["node"]
    d["program"].insert(i + 1, {"kind": "comm", "node": node, "rule": "all_reduce", "pre": [[node, "P"]], "post": "F"})
    with pytest.raises(PlanError, match=r"\.pre\[0\]: operand linear_mm:P is not available \(it holds only as S\(0\)\)"):
        load_plan(d)


# ----------------------------------------------------------------------------- sizes against realised ratios


@pytest.fixture(scope="module")
def two_classes() -> tuple[Plan, Cluster]:
    """Batch-sharded x (2 rows) then an all-to-all to a row-parallel linear (10 features): two classes
    of linked dims in one segment. At LP ratios 0.6/0.4 they split [1, 1] and [6, 4]; the plan stores
    the ratios these sizes realise (0.524/0.476, x's bytes dominate), which round to [5, 5]."""
    from engine.spmd.program import COMM as C
    from engine.spmd.program import COMPUTE as P
    from engine.spmd.program import LOAD as L
    from engine.spmd.program import Instruction as Ins
    from engine.theory.core import FULL, PARTIAL

    graph = build_graph([("x", "placeholder", (), (2, 8192)), ("w1", "parameter", (), (10, 8192)),
                         ("h", "linear", (0, 1), (2, 10), 1.0), ("w2", "parameter", (), (512, 10)),
                         ("o", "linear", (2, 3), (2, 512), 1.0), ("loss", "sum", (4,), (), 1.0, {"dims": [0, 1], "keepdim": False})])
    program = (Ins(L, 0, "placeholder", (), 0), Ins(L, 1, "parameter", (), FULL), Ins(P, 2, "batch", ((0, 0), (1, FULL)), 0),
               Ins(C, 2, "all_to_all", ((2, 0),), 1), Ins(L, 3, "parameter", (), 1),
               Ins(P, 4, "row", ((2, 1), (3, 1)), PARTIAL), Ins(P, 5, "partial", ((4, PARTIAL),), PARTIAL))
    cluster = Cluster.from_dict(cluster_dict([2e12, 1e12]))
    return plan_of(program, graph, cluster, [0.6, 0.4]), cluster


def test_sizes_whose_realised_ratios_round_otherwise_are_valid(two_classes):
    plan, cluster = two_classes
    assert plan.shard_sizes["h:1"] == [6, 4] and plan.ratios["0"][0] == pytest.approx(0.5239, abs=1e-4)
    assert validate_plan(plan.to_dict(), cluster) == []


def test_ratios_that_neither_round_to_the_sizes_nor_are_their_shares_are_refused(two_classes):
    d = two_classes[0].to_dict()
    d["ratios"]["0"] = [d["ratios"]["0"][0] + 0.01, d["ratios"]["0"][1] - 0.01]
    with pytest.raises(PlanError, match=r'shard_sizes\["h:1"\]: \[6, 4\] are not the sizes ratios\["0"\] round to, \[5, 5\] '
                                        r'\(nor are the ratios the shares these sizes give, \[0.523858, 0.476142\]\)'):
        load_plan(d)


# ----------------------------------------------------------------------------- segments


@pytest.fixture(scope="module")
def segmented() -> tuple[Plan, Cluster]:
    """A two-segment data-parallel plan of two layers with different ratios: resplits at the boundary."""
    rows = [("x", "placeholder", (), (16, 8), 0, {"index": 0, "name": "x"}), ("w1", "parameter", (), (8, 8)),
            ("h", "linear", (0, 1), (16, 8), 2048), ("r", "relu", (2,), (16, 8), 128), ("w2", "parameter", (), (4, 8)),
            ("o", "linear", (3, 4), (16, 4), 1024), ("y", "placeholder", (), (16, 4), 0, {"index": 1, "name": "y"}),
            ("loss", "mse_loss", (5, 6), (), 192, {"count": 64})]
    base = build_graph(rows, name="two_layer")
    layer = {"w2": 1, "o": 1, "y": 1, "loss": 1}
    graph = Graph(nodes=tuple(Node(**{**n.__dict__, "segment": layer.get(n.name, 0)}) for n in base.nodes), loss=base.loss)
    cluster = Cluster.from_dict(cluster_dict([2e12, 1e12]))
    seg = segment_graph(graph, 2)
    program = synthesize(graph, CostModel(graph, cluster, [0.5, 0.5]), space=data_parallel_space(graph)).program
    return plan_of(with_resplits(program, seg, graph), graph, cluster, [[0.5, 0.5], [0.75, 0.25]], segmentation=seg), cluster


def test_a_segmented_plan_with_its_resplits_is_valid(segmented):
    plan, cluster = segmented
    assert plan.segmentation.count == 2 and any(i.rule == RESPLIT for i in plan.program)
    assert validate_plan(plan.to_dict(), cluster) == []


def test_a_shard_used_in_the_next_segment_without_its_resplit_is_refused(segmented):
    plan, _ = segmented
    d = plan.to_dict()
    d["program"] = [i for i in d["program"] if i["rule"] != RESPLIT]
    with pytest.raises(PlanError, match=r"operand r:S\(0\) has the sizes of segment 0 but is used in segment 1"):
        load_plan(d)


def test_ratios_need_one_row_per_segment(segmented):
    d = segmented[0].to_dict()
    del d["ratios"]["1"]
    with pytest.raises(PlanError, match=r"ratios: has keys \['0'\] but the plan has 2 segment\(s\)"):
        load_plan(d)


# ----------------------------------------------------------------------------- against a cluster


def test_repricing_on_a_re_profiled_cluster_is_a_warning(good, cluster):
    slower = sample_dict("cpu_4_uneven")
    slower["network"]["latency_s"] *= 10  # the tiny MLP's step is mostly the gradient all-reduce's latency
    warnings = validate_plan(good, engine.load_cluster(slower))
    assert len(warnings) == 1 and "re-profiled" in warnings[0] and "\n" not in warnings[0]
    assert validate_plan(good, cluster) == []


def test_repricing_tolerates_small_drift(good, cluster):
    d = copy.deepcopy(good)
    d["predicted_time_s"] *= 1 + REPRICE_TOLERANCE / 2
    assert validate_plan(d, cluster) == []
    d["predicted_time_s"] = good["predicted_time_s"] * (1 + 2 * REPRICE_TOLERANCE)
    assert "prices it at" in validate_plan(d, cluster)[0]


def test_a_cluster_of_another_world_size_is_refused(good):
    with pytest.raises(PlanError, match=r"the plan has 4 devices but cluster 'cpu_2' has 2"):
        validate_plan(good, engine.load_cluster(sample_path("cpu_2")))


def test_hap_bundle_check_prints_the_repricing_warning_in_one_line(good, bundle, tmp_path, capsys):
    d = copy.deepcopy(good)
    d["predicted_time_s"] *= 3
    assert hap_main(["bundle", "check", str(with_plan(bundle, d, tmp_path / "b", regenerate=True))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warning: the plan predicts") and out[-1].endswith(")") and "OK" in out[-1]


# ----------------------------------------------------------------------------- graph JSON


def test_load_model_on_a_graph_json_names_the_bad_node_field(tmp_path):
    g = build_graph([("x", "placeholder", (), (4, 2)), ("w", "parameter", (), (3, 2)),
                     ("o", "linear", (0, 1), (4, 3)), ("loss", "sum", (2,), ())])
    d = g.to_dict()
    d["nodes"][2]["inputs"] = [0, 3]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ModelError, match=r"graph JSON: nodes\[2\].inputs\[1\] = 3 is not an earlier node \(ids 0..1\)"):
        engine.load_model(str(path))
    d["nodes"][2]["inputs"] = [0, 1]
    d["nodes"][3]["name"] = "x"
    path.write_text(json.dumps(d))
    with pytest.raises(ModelError, match=r"nodes\[3\].name 'x' is also the name of node 0"):
        engine.load_model(str(path))


# ----------------------------------------------------------------------------- every planner plan passes


SMALL = {
    "mlp": MLP,
    "gpt": dict(layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=8),
    "vgg19": dict(batch=4, image_size=32, width=0.125, hidden=32, classes=5, pool_size=2),
    "vit": dict(batch=3, image_size=16, patch=4, hidden=24, layers=2, heads=4, mlp=48, classes=5),
    "bert": dict(layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=8, predictions=2),
    "bert_moe": dict(layers=2, hidden=32, heads=2, ffn=64, vocab=64, seq_len=8, batch=8, experts=4, predictions=2),
}
CLUSTERS = sorted(p.stem for p in Path(sample_path("cpu_2")).parent.glob("*.json"))


@pytest.fixture(scope="module")
def zoo_graphs() -> dict[str, Graph]:
    return {}


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("model", sorted(SMALL))
def test_every_plan_the_planner_writes_passes_the_validator(zoo_graphs, model, cluster_name):
    if model not in zoo_graphs:
        zoo_graphs[model] = engine.load_model(f"zoo:{model}", **SMALL[model])
    graph, cluster = zoo_graphs[model], engine.load_cluster(sample_path(cluster_name))
    segments = 2 if cluster_name in ("cpu_4_uneven", "hap_paper_testbed") else 1
    plans = [engine.plan(graph, cluster, segments=segments, time_budget_s=10), engine.evaluate(graph, cluster, "dp-even")]
    for plan in plans:
        assert validate_plan(json.loads(plan.to_json()), cluster) == []


def test_hap_export_and_hap_run_print_the_repricing_warning_in_one_line(good, tmp_path, capsys, monkeypatch):
    import runner.cli

    slower = sample_dict("cpu_4_uneven")
    slower["network"]["latency_s"] *= 10
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(slower))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(good))
    assert hap_main(["export", str(plan), "--out", str(tmp_path / "b"), "--cluster", str(spec)]) == 0
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: ")]
    assert len(warned) == 1 and "re-profiled" in warned[0]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(runner.cli, "run_torchrun", lambda *a, **k: 0)
    assert hap_main(["run", str(tmp_path / "b"), "--steps", "1"]) == 0
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: ")] == warned


def test_schema_version_true_is_not_version_1():
    """JSON `true` equals 1 in Python; a plan must give the schema version as the number."""
    import engine
    from engine.errors import PlanError

    plan = engine.plan(engine.load_model("zoo:mlp", layers=1, hidden=16, batch=8),
                       engine.load_cluster("sample_clusters/cpu_2.json"), time_budget_s=5)
    d = plan.to_dict()
    d["schema_version"] = True
    with pytest.raises(PlanError, match="schema_version"):
        load_plan(d)


def test_zoo_knobs_of_a_plans_origin_are_bounded_before_a_rank_builds_the_model():
    """A hand-edited origin (`layers: 1e12`) is refused with the same knob bounds as `hap plan --set`."""
    from engine.errors import ModelError
    from engine.model import source

    source.check_rebuildable({"zoo": "mlp", "config": {"layers": 2, "hidden": 16}})
    with pytest.raises(ModelError, match="layers"):
        source.check_rebuildable({"zoo": "mlp", "config": {"layers": 10**12}})
    with pytest.raises(ModelError, match="config"):
        source.check_rebuildable({"zoo": "mlp", "config": [1, 2]})


def test_an_unknown_overlap_mode_is_refused_by_name():
    import engine
    from engine.spmd.plan import Plan

    d = engine.plan("zoo:mlp", "sample_clusters/cpu_4_uneven.json", time_budget_s=5, overlap="none").to_dict()
    assert d["overlap"] == "none" and load_plan({**d, "overlap": "duplex"}).overlap == "duplex"
    with pytest.raises(PlanError, match='overlap: "bogus" is not an overlap mode'):
        load_plan({**d, "overlap": "bogus"})
