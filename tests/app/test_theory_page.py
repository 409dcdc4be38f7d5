"""Theory page: the triples of the background theory, filters, counts per rule, the form sentences."""
from __future__ import annotations

from ui_helpers import app, no_exception, open_page, tiny_graph  # noqa: F401 (fixtures)

from engine import views


def test_theory_lists_every_triple_and_filters(app, tiny_graph):
    at = open_page(app, "theory")
    no_exception(at)
    rows = views.theory_rows(tiny_graph)
    table = at.dataframe[0].value
    assert len(table) == len(rows)
    text = " ".join(m.value for m in at.markdown)
    assert all(s in text for s in views.FORM_SENTENCES.values())
    at.multiselect(key="theory.ops").set_value(["linear"]).run()
    table = at.dataframe[0].value
    assert len(table) == sum(r["op"] == "linear" for r in rows) > 0 and set(table["op"]) == {"linear"}
    counts = at.dataframe[1].value
    assert counts["triples"].sum() == len(table)
    assert {"batch", "column", "row", "replicate", "partial"} <= set(counts["rule"])


def test_filter_by_tensor_and_collective(app, tiny_graph):
    at = open_page(app, "theory")
    name = next(n.name for n in tiny_graph.nodes if n.op == "linear")
    at.multiselect(key="theory.tensors").set_value([name])
    at.multiselect(key="theory.colls").set_value(["all_reduce"]).run()
    table = at.dataframe[0].value
    assert list(table["rule"]) == ["all_reduce"] and list(table["tensor"]) == [name]
    assert table["triple"][0] == f"{{{name}:P}} all_reduce {{{name}:F}}"


def test_theory_rows_hold_the_paper_rules(tiny_graph):
    rows = views.theory_rows(tiny_graph)
    lin = next(n for n in tiny_graph.nodes if n.op == "linear")
    row_rule = [r for r in rows if r["tensor"] == lin.name and r["rule"] == "row"]
    assert len(row_rule) == 1 and row_rule[0]["post"] == "P"  # row-parallel linear yields Partial (§4.2)
    param = tiny_graph.parameters[0]
    leaf = {r["rule"] for r in rows if r["tensor"] == param.name}
    assert "Parameter-Full" in leaf and any(x.startswith("Parameter-Shard(") for x in leaf)
    assert not any(r["kind"] == "collective" and r["tensor"] == param.name for r in rows)  # leaves never communicated
    kinds = {r["kind"] for r in rows}
    assert kinds == {"leaf", "compute", "collective"}
    assert {"all_gather.padded", "all_gather.grouped", "reduce_scatter", "all_to_all", "slice"} <= {r["rule"] for r in rows}
