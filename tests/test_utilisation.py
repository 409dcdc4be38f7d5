"""Model FLOPs, the compute bound and MFU on every plan (`engine.spmd.utilisation`): the arithmetic on a
hand-built graph, both kinds of plan after planning and after a save/load round trip, plans written
before the fields, the validator, the comparison table and `hap plan`'s report."""
from __future__ import annotations

import copy
import json
import re

import pytest
from conftest import GIB, ROOT, cluster_dict, mse_graph, sample_path

import engine
from engine import PipelinePlan, Plan, PlanError, PlanOptions, load_plan
from engine.cli import main
from engine.cluster.spec import Cluster
from engine.compare import Comparison, Row
from engine.pipeline.partition import fixed_pipeline
from engine.spmd.utilisation import FIELDS, Utilisation, model_flops, peak_flops, percent

OLD = ROOT / "tests" / "fixtures" / "written_by_66fbce9"
B, I, H, O = 64, 256, 512, 16


def expected_model_flops() -> float:
    """mse_graph by hand: forward, then backward one forward's worth per operand needing a gradient
    (h: only w1, x is data; r: h; o: r and w2; loss: o, y is data)."""
    h, r, o, loss = 2 * B * I * H, B * H, 2 * B * H * O, 3 * B * O
    forward = h + r + o + loss
    backward = 1 * h + 1 * r + 2 * o + 1 * loss
    return forward + backward


def mixed_cluster() -> Cluster:
    """Two devices: a 2-GPU box and one GPU, each with an fp32 and a bf16 rate."""
    d = cluster_dict([4e12, 1e12])
    d["devices"][0].update({"flops_per_gpu": {"fp32": 4e12, "bf16": 3.2e13}, "num_gpus": 2,
                            "intra_bandwidth_Bps": 1e11})
    d["devices"][1]["flops_per_gpu"] = {"fp32": 1e12, "bf16": 8e12}
    return Cluster.from_dict(d)


@pytest.fixture(scope="module")
def hand_plan() -> Plan:
    return engine.plan(mse_graph(B, I, H, O), Cluster.from_dict(cluster_dict([4e12, 1e12])), time_budget_s=2)


def test_model_flops_are_forward_plus_the_cost_models_backward():
    assert model_flops(mse_graph(B, I, H, O)) == expected_model_flops()


def test_the_peak_sums_every_gpu_at_the_plans_precision_and_falls_back_to_fp32():
    d = mixed_cluster().to_dict()
    d["devices"][1]["flops_per_gpu"] = 1e12
    c = Cluster.from_dict(d)
    assert peak_flops(c) == peak_flops(c, "fp32") == 2 * 4e12 + 1e12
    assert peak_flops(c, "bf16") == 2 * 3.2e13 + 1e12  # the second device gives no bf16 rate: its fp32 one
    assert peak_flops(c, "fp16") == 2 * 4e12 + 1e12


def test_an_spmd_plan_carries_its_compute_bound_and_mfu(hand_plan):
    bound = expected_model_flops() / (4e12 + 1e12)
    assert hand_plan.peak_flops == 5e12
    assert hand_plan.compute_bound_s == pytest.approx(bound, rel=1e-12)
    assert hand_plan.mfu == pytest.approx(bound / hand_plan.predicted_time_s, rel=1e-12)
    assert 0 < hand_plan.mfu < 1 and hand_plan.compute_bound_s < hand_plan.predicted_time_s
    d = hand_plan.to_dict()
    assert {k: d[k] for k in FIELDS} == {"model_flops": expected_model_flops(), "peak_flops": 5e12,
                                         "compute_bound_s": hand_plan.compute_bound_s, "mfu": hand_plan.mfu}


def test_a_bf16_plan_is_bounded_by_the_bf16_peak():
    p = engine.plan(mse_graph(B, I, H, O), mixed_cluster(), options=PlanOptions(precision="bf16", time_budget_s=2))
    assert p.peak_flops == 2 * 3.2e13 + 8e12
    assert p.compute_bound_s == pytest.approx(expected_model_flops() / p.peak_flops, rel=1e-12)
    assert "summed bf16 peak" in p.summary()


def test_the_fields_survive_a_save_and_load(hand_plan, tmp_path):
    hand_plan.save(tmp_path / "p.json")
    again = load_plan(str(tmp_path / "p.json"))
    assert (again.peak_flops, again.compute_bound_s, again.mfu) == (hand_plan.peak_flops, hand_plan.compute_bound_s,
                                                                   hand_plan.mfu)
    assert again.to_json() == hand_plan.to_json()


def test_a_pipeline_plan_carries_them_too_and_round_trips(mlp2, tmp_path):
    c = Cluster.from_dict(cluster_dict([4e12, 1e12], 16 * GIB))
    pipe = fixed_pipeline(mlp2, c, [(0, 1, (0,)), (1, 2, (1,))], 2)
    assert isinstance(pipe, PipelinePlan) and pipe.peak_flops == 5e12
    assert pipe.compute_bound_s == pytest.approx(model_flops(mlp2) / 5e12, rel=1e-12)
    assert pipe.mfu == pytest.approx(pipe.compute_bound_s / pipe.predicted_s, rel=1e-12)
    assert "compute bound" in pipe.summary() and percent(pipe.mfu) in pipe.summary()
    pipe.save(tmp_path / "pipe.json")
    d = json.loads((tmp_path / "pipe.json").read_text())
    assert d["peak_flops"] == 5e12 and d["mfu"] == pipe.mfu
    again = load_plan(str(tmp_path / "pipe.json"))
    assert (again.compute_bound_s, again.mfu) == (pipe.compute_bound_s, pipe.mfu)
    assert again.to_json() == pipe.to_json()


def test_plans_written_before_the_fields_load_with_the_bound_unknown():
    for name in ("spmd_plan.json", "pipeline_plan.json"):
        text = (OLD / name).read_text()
        assert "peak_flops" not in text
        p = load_plan(str(OLD / name))
        assert p.peak_flops is None and p.compute_bound_s is None and p.mfu is None
        assert p.utilisation.model_flops == model_flops(p.graph) > 0
        assert "compute bound and MFU unknown" in p.summary()
        assert not set(FIELDS) & set(p.to_dict())  # written back as it was


@pytest.mark.parametrize("key, value, says", [
    ("peak_flops", -1.0, "peak_flops: -1.0 is not a finite non-negative number"),
    ("peak_flops", 0, "peak_flops: is 0"),
    ("mfu", "high", "mfu: \"high\" is not a finite non-negative number"),
    ("compute_bound_s", float("inf"), "compute_bound_s: Infinity is not a finite"),
])
def test_a_bad_recorded_figure_is_refused_by_name(hand_plan, key, value, says):
    d = copy.deepcopy(hand_plan.to_dict())
    d[key] = value
    with pytest.raises(PlanError, match=re.escape(says)):
        load_plan(d)


def test_a_null_peak_loads_as_unknown(hand_plan):
    d = {**hand_plan.to_dict(), "peak_flops": None, "compute_bound_s": None, "mfu": None}
    assert load_plan(d).mfu is None


def test_the_recorded_peak_not_the_derived_figures_is_what_a_plan_reads_back(hand_plan):
    d = {**hand_plan.to_dict(), "mfu": 0.99, "compute_bound_s": 123.0}
    again = load_plan(d)
    assert again.mfu == hand_plan.mfu and again.to_dict()["mfu"] == hand_plan.mfu


def test_utilisation_lines_and_unknowns():
    u = Utilisation(model_flops=1.2e15, peak_flops=1e15, iteration_s=8.0)
    assert u.line() == "predicted iteration 8000.00 ms · compute bound 1200.00 ms · MFU 15.0%"
    assert u.mfu_at(2.4) == pytest.approx(0.5) and u.mfu_at(None) is None and u.mfu_at(0.0) is None
    unknown = Utilisation(model_flops=1.2e15, peak_flops=None, iteration_s=8.0)
    assert unknown.compute_bound_s is None and unknown.mfu is None and "MFU unknown" in unknown.line()
    assert percent(0.15) == "15.0%" and percent(9.3e-6) == "0.00093%" and percent(None) == "unknown"


def test_the_comparison_table_gives_every_row_its_mfu():
    rows = [Row("ddp", "data parallel", 0.4), Row("Q+B+C", "the plan", 0.2, is_plan=True), Row("Q", "oom", None)]
    table = Comparison(0.2, rows, compute_bound_s=0.1).table()
    assert [t["mfu"] for t in table] == [0.25, 0.5, None]
    assert [t["mfu"] for t in Comparison(0.2, rows).table()] == [None, None, None]


def test_hap_plan_reports_the_bound_and_mfu_beside_the_predicted_time(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    rc = main(["plan", "--model", "zoo:mlp", "--set", "layers=2", "--set", "in_features=64", "--set", "hidden=128",
               "--set", "batch=32", "--cluster", sample_path("cpu_2"), "--time-budget", "2", "--out", str(out_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    plan = load_plan(str(out_path))
    assert plan.utilisation.line() in out.splitlines()
    m = re.search(r"^predicted iteration ([\d.]+) ms · compute bound ([\d.]+) ms · MFU ([\d.]+)%$", out, re.M)
    assert m, out
    assert float(m.group(1)) == pytest.approx(plan.predicted_time_s * 1e3, abs=0.006)
    assert float(m.group(3)) == pytest.approx(plan.mfu * 100, rel=0.06, abs=1e-6)
    hap_row = next(x for x in out.splitlines() if x.startswith("hap "))
    assert hap_row.rstrip().endswith(percent(plan.mfu))
