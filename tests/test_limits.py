"""Bounds on every input (issue 17 item 2): absurd numbers are refused by name before anything is
expanded, allocated or handed to the LP solver."""
from __future__ import annotations

import copy
import json
import math

import pytest
from conftest import SAMPLES, cluster_dict, mse_graph

import engine
from engine import limits
from engine.cli import main
from engine.cluster.spec import load_cluster
from engine.errors import BundleError, ClusterError, ModelError, PlanError
from engine.model.graph import Graph
from engine.model.zoo import make_config
from engine.options import PlanOptions
from engine.spmd.balance import balance

CPU4 = SAMPLES / "cpu_4_uneven.json"


def _cpu4() -> dict:
    return json.loads(CPU4.read_text())


def _hap(args: list[str], capsys) -> tuple[int, str]:
    rc = main(args)
    return rc, capsys.readouterr().err.strip()


# ----------------------------------------------------------------------------- the acceptance cases, at the CLI


def test_hap_plan_refuses_a_device_count_of_1e308_naming_it(tmp_path, capsys) -> None:
    d = _cpu4()
    d["devices"][0]["count"] = 1e308
    (tmp_path / "c.json").write_text(json.dumps(d))
    rc, err = _hap(["plan", "--model", "zoo:mlp", "--cluster", str(tmp_path / "c.json"), "--time-budget", "3"], capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("hap: error: devices[0].count: 1e+308 is outside the sane range [1, 4096]")


def test_hap_plan_refuses_a_knob_of_10_to_the_12_naming_it(capsys) -> None:
    rc, err = _hap(["plan", "--model", "zoo:mlp", "--set", "layers=1000000000000", "--cluster", str(CPU4)], capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert "knob 'layers': 1000000000000 is above the limit 1024" in err


def test_hap_plan_refuses_a_nan_bandwidth_naming_it(tmp_path, capsys) -> None:
    d = _cpu4()
    d["network"]["bandwidth_Bps"]["intra_machine"] = math.nan
    (tmp_path / "c.json").write_text(json.dumps(d))
    rc, err = _hap(["plan", "--model", "zoo:mlp", "--cluster", str(tmp_path / "c.json")], capsys)
    assert rc == 2 and "network.bandwidth_Bps.intra_machine: must be a positive number, got nan" in err


@pytest.mark.parametrize("budget", ["nan", "inf", "-1", "0", "1e308"])
def test_hap_plan_refuses_an_unusable_time_budget(budget: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "zoo:mlp", "--cluster", str(CPU4), "--time-budget", budget])
    assert exc.value.code == 2 and "--time-budget: expected seconds in (0, 86400]" in capsys.readouterr().err


@pytest.mark.parametrize("segments", ["0", "1000000000000", "-3", "1e3"])
def test_hap_plan_refuses_a_segment_count_out_of_range(segments: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "zoo:mlp", "--cluster", str(CPU4), "--segments", segments])
    assert exc.value.code == 2 and "expected a segment count in 1..1024" in capsys.readouterr().err


def test_hap_capture_to_a_folder_is_one_line_not_a_traceback(tmp_path, capsys) -> None:
    rc, err = _hap(["capture", "--model", "zoo:mlp", "--set", "layers=1", "--out", str(tmp_path)], capsys)
    assert rc == 2 and err.startswith("hap: error: ") and len(err.splitlines()) == 1


def test_hap_export_refuses_unbalanced_run_args_and_a_nameless_out_in_one_line(tmp_path, capsys) -> None:
    graph = engine.load_model("zoo:mlp", layers=1, in_features=8, hidden=16, classes=4, batch=8)
    engine.plan(graph, CPU4, time_budget_s=5).save(tmp_path / "plan.json")
    base = ["export", str(tmp_path / "plan.json"), "--cluster", str(CPU4)]
    rc, err = _hap([*base, "--out", str(tmp_path / "b"), "--run-args", "'unclosed"], capsys)
    assert rc == 2 and "--run-args \"'unclosed\": No closing quotation" in err and len(err.splitlines()) == 1
    rc, err = _hap([*base, "--out", ""], capsys)
    assert rc == 2 and "--out '' names no new folder" in err and len(err.splitlines()) == 1


def test_a_bundle_zip_is_refused_by_its_declared_size_before_inflating(tmp_path, monkeypatch) -> None:
    from engine.bundle.archive import zip_bytes
    from engine.bundle.unpack import read_zip

    path = tmp_path / "b.zip"
    path.write_bytes(zip_bytes({"manifest.json": b"{}" * 600, "plan.json": b"x"}, "b"))
    assert read_zip(path)["plan.json"] == b"x"
    monkeypatch.setattr(limits, "MAX_BUNDLE_BYTES", 1000)
    with pytest.raises(BundleError, match=r"2 files of 1201 bytes unpacked, more than a bundle holds"):
        read_zip(path)


def test_a_damaged_bundle_zip_is_one_bundle_error(tmp_path) -> None:
    from engine.bundle import archive as bundle

    data = bytearray(bundle.zip_bytes({"manifest.json": b"{" * 5000, "plan.json": b"p" * 5000}, "b"))
    data[60:90] = b"\x00" * 30  # inside the first member's deflate stream
    (tmp_path / "b.zip").write_bytes(bytes(data))
    report = bundle.check_bundle(tmp_path / "b.zip")
    assert not report.ok and "not a readable zip" in report.problems[0] and "\n" not in report.problems[0]


# ----------------------------------------------------------------------------- cluster


@pytest.mark.parametrize("field,value,message", [
    ("count", 5000, r"devices\[0\]\.count: 5000 is outside the sane range \[1, 4096\]"),
    ("num_gpus", 10**9, r"devices\[0\]\.num_gpus: 1000000000 is outside the sane range"),
    ("flops_per_gpu", 1e-300, r"devices\[0\]\.flops_per_gpu: 1e-300 is outside the sane range \[1, 1e\+18\]"),
    ("flops_per_gpu", 1e300, r"devices\[0\]\.flops_per_gpu: 1e\+300 is outside"),
    ("memory_bytes_per_gpu", 2**70, r"devices\[0\]\.memory_bytes_per_gpu: .* is outside the sane range"),
    ("intra_bandwidth_Bps", 1e-9, r"devices\[0\]\.intra_bandwidth_Bps: 1e-09 is outside"),
])
def test_device_figures_beyond_sane_bounds_are_refused_by_name(field: str, value, message: str) -> None:
    d = _cpu4()
    d["devices"][0][field] = value
    with pytest.raises(ClusterError, match=message):
        load_cluster(d)


def test_counts_that_add_up_past_the_device_limit_are_refused_before_expansion() -> None:
    d = _cpu4()
    d["devices"][0]["count"] = 4000
    d["devices"][1]["count"] = 4000
    with pytest.raises(ClusterError, match=r"devices\[1\]\.count: 4000 devices here bring the cluster above the limit"):
        load_cluster(d)


def test_network_latency_and_fits_are_bounded() -> None:
    d = _cpu4()
    d["network"]["latency_s"] = 1e9
    with pytest.raises(ClusterError, match=r"network\.latency_s: 1000000000\.0 is outside the sane range \[0, 3600\]"):
        load_cluster(d)
    d = _cpu4()
    d["network"]["collectives"] = {"all_reduce": {"latency_s": 0.0, "bandwidth_Bps": 1e31}}
    with pytest.raises(ClusterError, match=r"network\.collectives\.all_reduce\.bandwidth_Bps: 1e\+31 is outside"):
        load_cluster(d)


def test_a_resolved_cluster_round_trips_within_the_bounds() -> None:
    """to_dict writes the 1e30 'free' fit of a one-device cluster: from_dict must accept its own output."""
    one = load_cluster(cluster_dict([1e12]))
    assert load_cluster(one.to_dict()) == one


# ----------------------------------------------------------------------------- graph JSON


@pytest.fixture(scope="module")
def graph_json() -> dict:
    return json.loads(mse_graph(B=8, I=16, H=32, O=4).to_json())


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["nodes"][2].__setitem__("inputs", [0, 9]), r"nodes\[2\]\.inputs\[1\] = 9 is not an earlier node \(ids 0\.\.1\)"),
    (lambda d: d["nodes"][0].__setitem__("inputs", [0]), r"nodes\[0\]\.inputs\[0\] = 0 is not an earlier node"),
    (lambda d: d["nodes"][2].__setitem__("flops", math.inf), r"nodes\[2\]\.flops = inf must be a finite non-negative number"),
    (lambda d: d["nodes"][2].__setitem__("flops", 1e308), r"nodes\[2\]\.flops = 1e\+308 is above the limit 1e\+24"),
    (lambda d: d["nodes"][1].__setitem__("shape", [2**30, 2**30]),
     r"nodes\[1\]\.shape = \[1073741824, 1073741824\] has 2 dims and 1\.15e\+18 elements; the limits are 16 dims and 2\*\*48"),
    (lambda d: d["nodes"][1].__setitem__("shape", [2] * 17), r"nodes\[1\]\.shape = .* has 17 dims"),
    (lambda d: d["nodes"][1].__setitem__("shape", [32, "16"]), r"nodes\[1\]\.shape = \[32, '16'\] must be a list of non-negative"),
    (lambda d: d["nodes"][1].__setitem__("shape", [32, 1e308]), r"nodes\[1\]\.shape = \[32, 1e\+308\] must be a list"),
    (lambda d: d["nodes"][3].__setitem__("name", 7), r"nodes\[3\]\.name must be a non-empty string, got 7"),
    (lambda d: d["nodes"][3].__setitem__("id", 9), r"nodes\[3\]\.id = 9 but node ids must be 0\.\.n-1 in list order"),
    (lambda d: d["nodes"][3].__setitem__("segment", 10**12), r"nodes\[3\]\.segment = 1000000000000 but a graph of 8 nodes"),
    (lambda d: d["nodes"][7].__setitem__("attrs", {"count": 10**300}), r"nodes\[7\]\.attrs\.count = 1000000000000000000000.* is beyond \+-2\*\*53"),
    (lambda d: d["nodes"][7].__setitem__("attrs", {"a": [[[[[[[[[1]]]]]]]]]}), r"nodes\[7\]\.attrs\.a.* nests deeper than 8"),
    (lambda d: d["nodes"].__setitem__(4, []), r"nodes\[4\] must be a node object, got list"),
    (lambda d: d.__setitem__("loss", 1e308), r"loss = 1e\+308 is not a node id \(0\.\.7\)"),
    (lambda d: d.__setitem__("nodes", {}), r"nodes must be a list of nodes, got dict"),
])
def test_graph_json_out_of_range_is_a_model_error_naming_node_and_field(graph_json, mutate, message: str) -> None:
    d = copy.deepcopy(graph_json)
    mutate(d)
    with pytest.raises(ModelError, match=message):
        Graph.from_dict(d)


def test_floats_in_attrs_are_data_of_any_size_but_integers_stay_bounded(graph_json) -> None:
    """Floats are data (GPT-Neo's mask value is finfo(float32).min, as a constant and as `where`'s scalar);
    integers are sizes and counts, held to 2**53."""
    d = copy.deepcopy(graph_json)
    d["nodes"][7]["attrs"] = {"value": [-3.4028234663852886e+38, 0.5], "y": -3.4028234663852886e+38}
    assert Graph.from_dict(d).nodes[7].attrs["value"][0] == -3.4028234663852886e+38
    d["nodes"][7]["attrs"] = {"value": [2**60]}
    with pytest.raises(ModelError, match=r"attrs\.value\[0\] = 1152921504606846976 is beyond"):
        Graph.from_dict(d)


def test_a_node_whose_shape_contradicts_its_operator_is_a_model_error_at_planning(graph_json) -> None:
    d = copy.deepcopy(graph_json)
    d["nodes"][2]["shape"] = [8]  # linear's output lost a dim: the rules of its consumer index it
    with pytest.raises(ModelError, match=r"node 3 \('r', relu\): output shape \[8, 32\] .* inputs of shapes \[\[8\]\] "
                                         r"\(IndexError: .*\); recapture the model or fix the graph JSON"):
        engine.plan(Graph.from_dict(d), CPU4, time_budget_s=1)


# ----------------------------------------------------------------------------- zoo knobs, planner arguments, LP


@pytest.mark.parametrize("knob,value,message", [
    ("layers", 10**12, "knob 'layers': 1000000000000 is above the limit 1024"),
    ("layers", "1e12", "knob 'layers': 1000000000000 is above the limit 1024"),
    ("hidden", "1e999", "knob 'hidden': must be a finite number, got '1e999'"),
    ("batch", 2**21, "knob 'batch': 2097152 is above the limit 1048576"),
])
def test_zoo_knobs_are_bounded(knob: str, value, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        make_config("mlp", **{knob: value})


def test_float_knobs_must_be_finite_and_bounded() -> None:
    with pytest.raises(ModelError, match="knob 'dropout': must be a finite number, got 'nan'"):
        make_config("vgg19", dropout="nan")
    with pytest.raises(ModelError, match=r"knob 'width': 1e\+300 is outside"):
        make_config("vgg19", width=1e300)
    assert make_config("mlp", layers=1024).layers == 1024


@pytest.mark.parametrize("budget", [math.nan, math.inf, -1.0, 0.0, "3"])
def test_plan_refuses_an_unusable_time_budget(budget) -> None:
    with pytest.raises(PlanError, match="time_budget_s: must be a number of seconds in"):
        engine.plan(mse_graph(), cluster_dict([1e12, 1e12]), time_budget_s=budget)


def test_plan_and_evaluate_refuse_an_unknown_optimizer_by_name() -> None:
    with pytest.raises(PlanError, match="optimizer 'lamb' is not known"):
        engine.plan(mse_graph(), cluster_dict([1e12, 1e12]), optimizer="lamb")
    with pytest.raises(PlanError, match="optimizer 'lamb' is not known"):
        engine.evaluate(mse_graph(), cluster_dict([1e12, 1e12]), "dp-even", optimizer="lamb")


@pytest.mark.parametrize("segments", [10**12, 0, 2.0, True])
def test_plan_refuses_a_segment_count_out_of_range(segments) -> None:
    """10**12 segments once meant a loop of 10**12 steps before any search."""
    with pytest.raises(PlanError, match="segments = .*; give an integer from 1 to 1024"):
        engine.plan(mse_graph(), cluster_dict([1e12, 1e12]), segments=segments)


def test_the_load_balancer_refuses_non_finite_coefficients_with_a_typed_error() -> None:
    """A graph built in Python skips the JSON bounds; the LP must still not see inf (PuLP's PulpError)."""
    from dataclasses import replace

    from engine.spmd.cost import CostModel
    from engine.spmd.synthesis import synthesize

    graph = mse_graph(B=8, I=16, H=32, O=4)
    cluster = load_cluster(cluster_dict([1e12, 1e12]))
    program = synthesize(graph, CostModel(graph, cluster, [0.5, 0.5], PlanOptions(optimizer="adam"))).program
    broken = Graph(nodes=tuple(replace(n, flops=math.inf) if n.name == "h" else n for n in graph.nodes), loss=graph.loss)
    with pytest.raises(PlanError, match=r"load balancer: stage \d+ \(forward .*\) has a non-finite coefficient \(inf\)"):
        balance(program, broken, cluster)


def test_limits_keep_the_worst_cost_finite() -> None:
    """The bounds' premise: the largest time and byte figures they allow are finite floats."""
    worst_time = limits.MAX_NODE_FLOPS / limits.MIN_RATE * limits.MAX_NODES
    worst_bytes = limits.MAX_NUMEL * 8 * 4 * limits.MAX_NODES
    assert math.isfinite(worst_time) and math.isfinite(worst_bytes / limits.MIN_RATE)


# ----------------------------------------------------------------------------- runner options


@pytest.mark.parametrize("args,message", [
    (["--steps", "1000000000000"], "--steps must be at most 1000000000, got 1000000000000"),
    (["--seed", str(10**30)], "--seed must be in"),
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--timeout", "1e308"], "--timeout must be a positive number of seconds"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be in 0.."),
])
def test_runner_options_are_bounded(args: list[str], message: str, capsys) -> None:
    from runner.config import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["plan.json", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--sizes", "4K,inf"], "--sizes: payloads must be 64 bytes to 16G, got 'INF'"),
    (["--sizes", "4K,1e30"], "--sizes: payloads must be 64 bytes to 16G"),
    (["--nproc", "1000000"], "--nproc must be at most 1024"),
    (["--matmul", "1000000000"], "--matmul sizes must be at most 65536"),
    (["--repeats", "1000000000000"], "--repeats and --warmup must be at most 10000"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds up to a week"),
])
def test_profiler_options_are_bounded(args: list[str], message: str, capsys) -> None:
    from runner.profile import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", "c.json", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_search_out_of_time_returns_its_incumbent_after_one_expansion() -> None:
    """The time budget is honoured however large the search: with a program in hand (the Q<->B loop's
    previous Q, or a baseline) an expired search stops at once instead of diving for a new one."""
    from engine.spmd.baselines import data_parallel_space
    from engine.spmd.cost import CostModel
    from engine.spmd.synthesis import synthesize

    graph = mse_graph()
    cm = CostModel(graph, load_cluster(cluster_dict([1e12, 5e11])), [2 / 3, 1 / 3], PlanOptions(optimizer="adam"))
    dp = synthesize(graph, cm, space=data_parallel_space(graph)).program
    result = synthesize(graph, cm, time_budget_s=1e-9, incumbent=dp)
    assert result.program == dp and not result.optimal and result.expanded == 1
    assert synthesize(graph, cm, time_budget_s=1e-9).expanded > 1  # no incumbent: it dives to finish one


def test_a_bad_cluster_is_refused_without_importing_torch(tmp_path):
    """`hap plan` checks the cluster and the knobs before anything imports torch (seconds to import),
    so a bad input fails at once: no module the CLI and `import engine` load may import it at the top."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import sample_path

    root = Path(__file__).resolve().parent.parent
    bad = tmp_path / "nan.json"
    bad.write_text(Path(sample_path("cpu_4_uneven")).read_text().replace('"intra_machine": 2e09', '"intra_machine": NaN'))
    code = ("import sys, engine, engine.cli\n"
            f"rc = engine.cli.main(['plan', '--model', 'zoo:mlp', '--cluster', {str(bad)!r}])\n"
            "assert rc == 2, rc\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "intra_machine" in r.stderr
