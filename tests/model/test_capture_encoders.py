"""Encoders, vision and encoder-decoder models as people bring them (issue 13): transformers models
built from their default configs with only the sizes shrunk (dropout on), on `meta`, with dict
inputs and labels, plus two plain-torch models; each captures without asking for a fallback and
plans on a GPU and a CPU sample cluster."""
from __future__ import annotations

import pytest
from conftest import load_bench, sample_path

import engine
from engine.model.graph import Graph
from engine.model.zoo import ecosystem
from engine.spmd.plan import Plan
from engine.spmd.program import COMPUTE
from engine.theory import missing_rules

pytest.importorskip("transformers")

MODELS = ["bert", "roberta", "distilbert", "t5", "bart", "vit", "resnet", "convnext", "swin",
          "transformer_classifier", "residual_cnn"]
DROPOUT = {"bert", "roberta", "distilbert", "t5", "bart", "transformer_classifier"}
"""Models whose default config drops out (ViT's, Swin's and the CNNs' do not; Swin's drop path draws `rand`)."""
CLUSTERS = ["a100x2_p100x2", "cpu_4_uneven"]


@pytest.fixture(scope="module", params=MODELS)
def captured(request) -> tuple[str, Graph]:
    module, inputs = ecosystem.build(request.param, "meta")
    return request.param, engine.load_model(module, inputs)


def _lineage(g: Graph) -> tuple[list[bool], list[bool]]:
    """(carries a gradient, depends on the batch) per node, as capture's automatic fallback sees it."""
    grad, batch = [], []
    for n in g.nodes:
        grad.append(n.dtype.startswith(("float", "bfloat")) and (n.op == "parameter" or any(grad[i] for i in n.inputs)))
        batch.append(n.op == "placeholder" or any(batch[i] for i in n.inputs))
    return grad, batch


def test_captures_with_rules_for_every_node_and_only_side_arithmetic_opaque(captured) -> None:
    name, g = captured
    assert missing_rules(g) == []
    assert {n.attrs["name"] for n in g.placeholders} >= {"labels"}
    grad, batch = _lineage(g)
    on_activations = [n.name for n in g.nodes if n.op == "opaque"
                      and any(grad[i] for i in n.inputs) and any(batch[i] for i in n.inputs)]
    assert on_activations == [], f"{name}: opaque ops on activations {on_activations}"
    assert any(n.attrs.get("p" if n.op == "dropout" else "dropout_p", 0) > 0 for n in g.nodes) == (name in DROPOUT), \
        "dropout stays as the default config has it"
    assert any(n.op == "rand" for n in g.nodes) == (name == "swin"), "Swin's default drop path draws site-keyed numbers"


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_plans_and_beats_or_matches_every_baseline(captured, cluster: str) -> None:
    name, g = captured
    cl = engine.load_cluster(sample_path(cluster))
    p: Plan = engine.plan(g, cl, time_budget_s=30.0)  # ample: under load a 5 s budget cut the baselines' own searches short
    assert p.predicted_time_s > 0
    assert all(m <= d.memory_bytes_per_gpu for m, d in zip(p.memory_bytes, cl.devices))
    assert any(v is not None for v in p.search["baselines_s"].values()), \
        f"{name}: data parallelism (with the fallback) is always a candidate"
    baselines = [engine.evaluate(g, cl, s).predicted_time_s for s in ("dp-even", "dp-proportional")]  # at whole units
    assert p.predicted_time_s <= min(baselines) * (1 + 1e-9), "a plan is never predicted slower than data parallelism"
    computed = [ins.node for ins in p.program if ins.kind == COMPUTE]
    assert sorted(computed) == [n.id for n in g.nodes if not n.is_leaf], "every node runs exactly once"


def test_ecosystem_model_file_plans_through_the_file_contract(tmp_path) -> None:
    """The model file the coverage bench hands to `hap plan --model` captures the same model."""
    path = tmp_path / "residual_cnn.py"
    path.write_text(ecosystem.model_file("residual_cnn"))
    g = engine.load_model(str(path))
    assert g.origin.get("file") and g.origin.get("sha256")
    direct = engine.load_model(*ecosystem.build("residual_cnn", "meta"))
    assert [n.op for n in g.nodes] == [n.op for n in direct.nodes]
    batch = ecosystem.draw_inputs("residual_cnn")
    assert int(batch["labels"].max()) < ecosystem.NUM_LABELS and batch["pixel_values"].dtype.is_floating_point


def test_coverage_bench_reports_capture_plan_and_errors_per_model() -> None:
    bench = load_bench("coverage")
    row = bench.bench_model("residual_cnn", budget_s=2.0, run=False)
    assert row.captured and row.nodes > 0 and set(row.plans) == set(bench.PLAN_CLUSTERS)
    assert all(p.planned and p.speedup >= 0.999 and 0 < p.sharded <= 1 for p in row.plans.values())
    broken = bench.Row("broken", False, "ModelError: cannot capture")
    text = bench.table([row, broken], run=False)
    assert "residual_cnn" in text and "broken" in text and "ModelError: cannot capture" in text
