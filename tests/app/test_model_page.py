"""Model page: zoo knobs, graph-JSON upload, and the trust box guarding uploaded Python files."""
from __future__ import annotations

import json

from ui_helpers import app, no_exception, open_page, tiny_graph  # noqa: F401 (fixtures)

from app.services import Keys
from engine import views

MODEL_FILE = '''
from pathlib import Path
import torch
import torch.nn.functional as F

Path({marker!r}).write_text("executed")

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)

def build_model():
    return Tiny()

def example_inputs():
    return torch.randn(6, 8), torch.randint(0, 4, (6,))
'''


def _python_source(at):
    at.radio(key="model.kind").set_value("Python file").run()
    return at


def test_zoo_model_with_knobs_is_loaded_and_summarised(app):
    at = open_page(app, "model")
    at.selectbox(key="model.zoo").set_value("mlp").run()
    for knob, value in {"layers": 1, "in_features": 32, "hidden": 64, "batch": 8}.items():
        at.number_input(key=f"model.knob.mlp.{knob}").set_value(value)
    at.button[0].click().run()
    no_exception(at)
    graph = at.session_state[Keys.GRAPH]
    assert graph.name == "mlp" and graph.placeholders[0].shape == (8, 32)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Parameters"] == f"{graph.num_parameters / 1e6:.2f} M"
    assert metrics["Nodes"] == str(len(graph))
    dot = at.get("graphviz_chart")[0].proto.spec
    assert all(n.name in dot for n in graph.nodes)


def test_graph_json_upload_loads_the_graph(app, tiny_graph):
    at = open_page(app, "model")
    at.radio(key="model.kind").set_value("Graph JSON").run()
    at.file_uploader(key="model.json").set_value(("g.json", tiny_graph.to_json().encode(), "application/json"))
    at.run()
    no_exception(at)
    assert at.session_state[Keys.GRAPH] == tiny_graph
    assert at.session_state[Keys.MODEL_SOURCE] == "graph g.json"


def test_malformed_graph_json_shows_the_one_line_error(app, tiny_graph):
    at = open_page(app, "model")
    at.radio(key="model.kind").set_value("Graph JSON").run()
    at.file_uploader(key="model.json").set_value(("bad.json", b"{not json", "application/json"))
    at.run()
    no_exception(at)
    assert len(at.error) == 1 and "graph JSON is not valid JSON" in at.error[0].value
    assert "\n" not in at.error[0].value
    at.file_uploader(key="model.json").set_value(("other.json", json.dumps({"kind": "x"}).encode(), "application/json"))
    at.run()
    assert 'missing "kind": "hap.graph"' in at.error[0].value
    assert at.session_state[Keys.GRAPH] == tiny_graph  # unchanged


def test_python_file_is_not_executed_unless_trusted(app, tmp_path, tiny_graph):
    marker = tmp_path / "marker.txt"
    source = MODEL_FILE.format(marker=str(marker)).encode()
    at = _python_source(open_page(app, "model"))
    assert "build_model" in at.code[0].value  # the convention is shown
    at.file_uploader(key="model.py").set_value(("tiny_model.py", source, "text/x-python"))
    at.run()
    no_exception(at)
    assert not marker.exists(), "the uploaded file ran without the trust box"
    assert any("NOT executed" in i.value for i in at.info)
    assert at.session_state[Keys.GRAPH] == tiny_graph
    at.checkbox[0].check().run()
    no_exception(at)
    assert marker.read_text() == "executed"
    graph = at.session_state[Keys.GRAPH]
    assert graph.num_parameters == 8 * 4 + 4 and at.session_state[Keys.MODEL_SOURCE] == "python tiny_model.py"
    assert at.session_state[Keys.MODEL_FILE] == ("tiny_model.py", source)  # the Export page ships it in the bundle
    # trust belongs to that file: a different upload is not run until its own box is ticked
    other = tmp_path / "other.txt"
    at.file_uploader(key="model.py").set_value(("other.py", MODEL_FILE.format(marker=str(other)).encode(), "text/x-python"))
    at.run()
    no_exception(at)
    assert not other.exists() and not at.checkbox[0].value
    assert at.session_state[Keys.MODEL_SOURCE] == "python tiny_model.py"


def test_broken_python_file_shows_a_one_line_error(app):
    at = _python_source(open_page(app, "model"))
    at.file_uploader(key="model.py").set_value(("broken.py", b"def build_model(:\n", "text/x-python"))
    at.run()
    at.checkbox[0].check().run()
    no_exception(at)
    assert len(at.error) == 1 and at.error[0].value.startswith("ModelError: model file broken.py: SyntaxError")
    at.file_uploader(key="model.py").set_value(("empty.py", b"x = 1\n", "text/x-python"))
    at.run()
    at.checkbox[0].check().run()
    assert "no function build_model()" in at.error[0].value


def test_graph_collapses_layers_into_one_box_each():
    import engine

    graph = engine.load_model("zoo:mlp", layers=3, in_features=16, hidden=16, batch=4)
    segments = graph.num_segments
    assert segments >= 3
    full = views.graph_dot(graph)
    collapsed = views.graph_dot(graph, expand=[0])
    assert all(f"n{n.id} [" in full for n in graph.nodes)
    assert all(f"seg{s} [" in collapsed for s in range(1, segments)) and "seg0 [" not in collapsed
    assert all(f"n{n.id} [" in collapsed for n in graph.nodes if n.segment == 0)
    assert collapsed.count("->") < full.count("->")


def _hf_source(at, cls: str):
    at.radio(key="model.kind").set_value("Hugging Face model").run()
    at.selectbox(key="model.hf.class").set_value(cls).run()
    return at


def test_hugging_face_model_is_built_from_class_and_config_fields(app):
    at = _hf_source(open_page(app, "model"), "ViTForImageClassification")
    config = json.loads(at.text_area(key="model.hf.config.ViTForImageClassification").value)
    assert config["hidden_size"] == 64 and config["image_size"] == 32  # starts small, editable
    at.text_area(key="model.hf.config.ViTForImageClassification").set_value(
        json.dumps({**config, "num_hidden_layers": 1, "patch_size": 8}))
    at.number_input(key="model.hf.batch").set_value(4)
    at.button(key="model.hf.load").click().run()
    no_exception(at)
    assert not at.error
    graph = at.session_state[Keys.GRAPH]
    assert graph.origin["hf"] == "ViTForImageClassification" and graph.origin["config"]["num_hidden_layers"] == 1
    assert graph.placeholders[0].shape == (4, 3, 32, 32)
    assert at.session_state[Keys.MODEL_SOURCE] == "hf:ViTForImageClassification batch=4"


def test_hugging_face_config_errors_show_one_line(app):
    at = _hf_source(open_page(app, "model"), "LlamaForCausalLM")
    key = "model.hf.config.LlamaForCausalLM"
    assert at.number_input(key="model.hf.seq_len").value == 32  # language models take a sequence length
    at.text_area(key=key).set_value('{"hidden_size": 64,').run()
    at.button(key="model.hf.load").click().run()
    no_exception(at)
    assert len(at.error) == 1 and "config is not valid JSON" in at.error[0].value and "\n" not in at.error[0].value
    at.text_area(key=key).set_value('{"hiden_size": 64}').run()
    at.button(key="model.hf.load").click().run()
    assert "did you mean 'hidden_size'" in at.error[0].value
