"""Stage cuts at layer boundaries (HAPT §5.1): the bytes crossing each cut and what a stage holds."""
from dataclasses import replace

import pytest
from conftest import build_graph, cluster_dict

import engine
from engine.errors import PlanError
from engine.model.graph import Graph
from engine.pipeline.stages import StageGraph
from engine.spmd.cost import CostModel

B, T, C = 4, 8, 32  # batch, sequence, width of the small GPT below


@pytest.fixture(scope="module")
def gpt3() -> Graph:
    return engine.load_model("zoo:gpt", layers=3, hidden=C, heads=4, ffn=64, vocab=128, seq_len=T, batch=B)


@pytest.fixture(scope="module")
def mlp3() -> Graph:
    return engine.load_model("zoo:mlp", layers=3, in_features=16, hidden=48, classes=5, batch=6)


def test_gpt_cuts_send_the_residual_stream_and_its_gradient(gpt3):
    sg = StageGraph(gpt3)
    assert sg.num_layers == 3 and len(sg.cuts) == 2
    for cut in sg.cuts:
        assert len(cut.tensors) == 1 and gpt3[cut.tensors[0]].shape == (B, T, C)
        assert cut.forward_bytes == cut.backward_bytes == B * T * C * 4  # fp32 (B, T, C)
        assert cut.shared_parameters == ()


def test_mlp_cuts_send_one_hidden_activation(mlp3):
    sg = StageGraph(mlp3)
    assert [c.forward_bytes for c in sg.cuts] == [6 * 48 * 4, 6 * 48 * 4]
    assert [c.backward_bytes for c in sg.cuts] == [6 * 48 * 4, 6 * 48 * 4]
    assert all(mlp3[c.tensors[0]].op == "relu" for c in sg.cuts)


def test_stages_add_up_to_the_graph_and_use_the_cost_models_flops(gpt3):
    sg = StageGraph(gpt3)
    whole = sg.stage(0, 3)
    assert whole.forward_flops == pytest.approx(gpt3.flops)
    assert whole.parameter_bytes == gpt3.num_parameters * 4
    cm = CostModel(gpt3, engine.load_cluster(cluster_dict([1e10])), [1.0])
    assert whole.backward_flops == pytest.approx(sum(cm.bwd_flops))
    parts = [sg.stage(0, 1), sg.stage(1, 2), sg.stage(2, 3)]
    assert sum(p.forward_flops for p in parts) == pytest.approx(whole.forward_flops)
    assert sum(p.activation_bytes for p in parts) == pytest.approx(whole.activation_bytes)
    assert sorted(i for p in parts for i in p.nodes) == sorted(whole.nodes)
    assert parts[0].input_bytes == 0 and parts[0].output_bytes == B * T * C * 4 and parts[2].output_bytes == 0
    with pytest.raises(PlanError, match="not a run of layers"):
        sg.stage(2, 2)


def test_tied_weights_are_shared_by_the_first_and_last_stage():
    g = engine.load_model("zoo:gpt", layers=2, hidden=C, heads=4, ffn=64, vocab=128, seq_len=T, batch=B, tie_weights=True)
    cut = StageGraph(g).cuts[0]
    assert len(cut.shared_parameters) == 1 and g[cut.shared_parameters[0]].shape == (128, C)


def test_a_tensor_without_gradient_crosses_forward_only():
    g = build_graph([
        ("x", "placeholder", (), (4, 8)),
        ("mask", "placeholder", (), (4, 8)),
        ("w", "parameter", (), (8, 8)),
        ("m2", "relu", (1,), (4, 8), 32),          # layer 0, computed from an input only: no gradient
        ("h", "linear", (0, 2), (4, 8), 512),      # layer 0
        ("y", "mul", (4, 3), (4, 8), 32),          # layer 1
        ("loss", "sum", (5,), (), 32),
    ])
    g = Graph(tuple(replace(n, segment=1 if n.id >= 5 else 0) for n in g.nodes), g.loss)
    cut = StageGraph(g).cuts[0]
    assert cut.tensors == (3, 4)
    assert cut.forward_bytes == 2 * 4 * 8 * 4 and cut.backward_bytes == 4 * 8 * 4
