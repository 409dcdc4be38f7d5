"""Every input keeps its value across pages (issue 30, item 6): Streamlit drops a widget's state when a page
without it runs, so the pages start each input from `services.kept`."""
from __future__ import annotations

import json

import pytest
from ui_helpers import app, no_exception, open_page  # noqa: F401 (fixtures)

from app.services import Keys


def _there_and_back(at, page: str):
    return open_page(open_page(at, "plan"), page)


def test_model_and_search_inputs_survive_a_visit_to_another_page(app):
    pytest.importorskip("transformers")
    at = open_page(app, "model")
    at.radio(key="model.kind").set_value("Hugging Face model").run()
    cls = at.selectbox(key="model.hf.class").value
    edited = '{"hidden_size": 32, "num_hidden_layers": 1}'
    at.text_area(key=f"model.hf.config.{cls}").set_value(edited)
    at.number_input(key="model.hf.batch").set_value(4).run()
    at = _there_and_back(at, "model")
    no_exception(at)
    assert at.radio(key="model.kind").value == "Hugging Face model"  # was reset to "Zoo model"
    assert at.text_area(key=f"model.hf.config.{cls}").value == edited
    assert at.number_input(key="model.hf.batch").value == 4

    at = open_page(at, "search")
    at.slider(key="search.budget_slider").set_value(7.0)
    at.selectbox(key=f"{Keys.RECOMPUTE}_choice").set_value("all")
    at.selectbox(key="search.parallelism_kind").set_value("auto").run()
    at = _there_and_back(at, "search")
    assert at.slider(key="search.budget_slider").value == 7.0
    assert at.selectbox(key=f"{Keys.RECOMPUTE}_choice").value == "all"
    assert at.selectbox(key="search.parallelism_kind").value == "auto"


def test_cluster_inputs_and_an_uploaded_cluster_survive_a_visit_to_another_page(app):
    at = open_page(app, "cluster")
    at.radio(key="cluster.kind").set_value("Upload JSON").run()
    text = at.session_state[Keys.CLUSTER].to_dict() | {"name": "mine"}
    at.file_uploader(key="cluster.upload").set_value(("mine.json", json.dumps(text).encode(), "application/json"))
    at.run()
    assert at.session_state[Keys.CLUSTER].name == "mine"
    at = _there_and_back(at, "cluster")
    no_exception(at)
    assert at.radio(key="cluster.kind").value == "Upload JSON"
    assert "In use: mine.json, uploaded earlier. Upload another file to replace it." in [c.value for c in at.caption]
    fp = at.session_state[Keys.CLUSTER].fingerprint()[:12]
    at.number_input(key=f"cluster.latency.{fp}").set_value(1000.0).run()  # µs
    edited = at.session_state[Keys.CLUSTER]
    assert edited.network.latency_s == pytest.approx(1e-3)
    at = _there_and_back(at, "cluster")
    assert at.session_state[Keys.CLUSTER] == edited  # and the tables show it, edits included
    assert at.number_input(key=f"cluster.latency.{edited.fingerprint()[:12]}").value == pytest.approx(1000.0)
