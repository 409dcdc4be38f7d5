"""HSPMD annotations of a plan (issue 16, Hetu v2 §3): `hap export --annotations`."""
from __future__ import annotations

import contextlib
import io
import json

from conftest import sample_path

import engine
from engine.bundle.archive import ANNOTATIONS, check_bundle
from engine.cli import main
from engine.elastic.annotations import annotate, annotate_form, runs
from engine.theory.core import FULL, PARTIAL

TINY_GPT = dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=10)


def test_full_and_partial_are_one_subgroup_duplicated_or_partial_across_it():
    full = annotate_form("w", [6, 4], FULL, 3, None)
    assert (full.dg_union, full.ds_union, full.hsize, full.hdim, full.hdim_sizes) == ([[0, 1, 2]], [{-1: 3}], 1, -1, [])
    part = annotate_form("g", [6, 4], PARTIAL, 3, None)
    assert (part.dg_union, part.ds_union, part.hsize, part.hdim) == ([[0, 1, 2]], [{-2: 3}], 1, -1)


def test_an_even_shard_is_plain_spmd_and_an_uneven_one_splits_unevenly_across_subgroups():
    even = annotate_form("x", [8, 4], 0, 4, [2, 2, 2, 2])
    assert (even.dg_union, even.ds_union, even.hsize, even.hdim) == ([[0, 1, 2, 3]], [{0: 4}], 1, -1)
    uneven = annotate_form("x", [11, 4], 0, 5, [3, 3, 2, 2, 1])
    assert uneven.dg_union == [[0, 1], [2, 3], [4]]
    assert uneven.ds_union == [{0: 2}, {0: 2}, {-1: 1}]
    assert (uneven.hsize, uneven.hdim, uneven.hdim_sizes) == (3, 0, [6, 4, 1])
    assert runs([5, 5, 5]) == [[0, 1, 2]] and runs([1, 2, 1]) == [[0], [1], [2]]


def test_every_form_of_a_plan_is_annotated_consistently():
    plan = engine.plan(engine.load_model("zoo:gpt", **TINY_GPT), sample_path("cpu_4_uneven"))
    found = annotate(plan)
    assert len(found) == len({(i.node, i.post) for i in plan.program})
    for a in found:
        ranks = sorted(r for g in a.dg_union for r in g)
        assert ranks == list(range(plan.world_size)), a  # disjoint subgroups covering every device
        assert a.hsize == len(a.dg_union) == len(a.ds_union)
        if a.hdim >= 0:
            assert sum(a.hdim_sizes) == a.shape[a.hdim] and a.hsize > 1
    assert any(a.hsize > 1 for a in found), "cpu_4_uneven's batch split should be uneven"


def test_hap_export_annotations_writes_them_into_the_checked_bundle(tmp_path):
    plan = engine.plan(engine.load_model("zoo:gpt", **TINY_GPT), sample_path("cpu_4_uneven"))
    plan.save(tmp_path / "plan.json")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(tmp_path / "plan.json"), "--out", str(tmp_path / "b"), "--annotations",
                     "--cluster", str(sample_path("cpu_4_uneven"))]) == 0
    data = json.loads((tmp_path / "b" / ANNOTATIONS).read_text())
    assert data["devices"] == plan.device_names and data["kind"] == "hap.hspmd_annotations"
    assert [t["tensor"] for t in data["tensors"]] == [a.tensor for a in annotate(plan)]
    assert ANNOTATIONS in json.loads((tmp_path / "b" / "manifest.json").read_text())["files"]
    assert check_bundle(tmp_path / "b").ok
