"""Cluster page: samples, uploads, the device table validated live by the engine, the picture."""
from __future__ import annotations

import json

from ui_helpers import ROOT, app, cpu_cluster, no_exception, open_page  # noqa: F401 (fixtures)

from app.services import Keys
from engine import views


def _editor_key(cluster) -> str:
    return f"{Keys.EDITOR}.{cluster.fingerprint()[:12]}"


def test_cluster_table_and_picture(app, cpu_cluster):
    at = open_page(app, "cluster")
    no_exception(at)
    table = at.data_editor[0].value
    assert list(table["name"]) == [d.name for d in cpu_cluster.devices]
    dot = at.get("graphviz_chart")[0].proto.spec
    assert "machine m0" in dot and "machine m1" in dot
    assert "1.25 GB/s" in dot and "10 GB/s" in dot  # inter- and intra-machine links labelled


def test_pick_a_sample_cluster(app):
    at = open_page(app, "cluster")
    at.selectbox(key="cluster.sample").set_value("cpu_2.json").run()
    at.button[0].click().run()
    no_exception(at)
    assert at.session_state[Keys.CLUSTER].name == "cpu_2"
    assert at.session_state[Keys.CLUSTER_SOURCE] == "sample_clusters/cpu_2.json"


def test_malformed_cluster_uploads_show_the_engine_message(app, cpu_cluster):
    at = open_page(app, "cluster")
    at.radio(key="cluster.kind").set_value("Upload JSON").run()
    at.file_uploader(key="cluster.upload").set_value(("c.json", b"[1, 2", "application/json")).run()
    no_exception(at)
    assert len(at.error) == 1 and "cluster JSON is not valid JSON" in at.error[0].value
    bad = json.loads((ROOT / "sample_clusters" / "cpu_2.json").read_text())
    bad["devices"][0]["flops_per_gpu"] = -3
    at.file_uploader(key="cluster.upload").set_value(("c.json", json.dumps(bad).encode(), "application/json")).run()
    assert at.error[0].value.startswith("ClusterError: devices[0].flops_per_gpu: must be a positive number, got -3 "
                                        "(the sustained FLOP/s of one GPU, e.g. 1.5e13 (read as fp32), or one per dtype")
    assert at.session_state[Keys.CLUSTER] == cpu_cluster


def test_valid_upload_becomes_the_cluster(app):
    at = open_page(app, "cluster")
    at.radio(key="cluster.kind").set_value("Upload JSON").run()
    data = (ROOT / "sample_clusters" / "cpu_4_uneven.json").read_bytes()
    at.file_uploader(key="cluster.upload").set_value(("mine.json", data, "application/json")).run()
    no_exception(at)
    assert at.session_state[Keys.CLUSTER].name == "cpu_4_uneven"
    assert at.session_state[Keys.CLUSTER_SOURCE] == "upload mine.json"


def test_table_edits_are_validated_live(app, cpu_cluster):
    app.session_state[_editor_key(cpu_cluster)] = {"edited_rows": {0: {"flops_per_gpu": -1.0}}, "added_rows": [], "deleted_rows": []}
    at = open_page(app, "cluster")
    no_exception(at)
    # the A100 rates each dtype, so the table's flops_per_gpu is the fp32 entry of its map
    assert len(at.error) == 1 and "devices[0].flops_per_gpu.fp32: must be a positive number" in at.error[0].value
    assert at.session_state[Keys.CLUSTER] == cpu_cluster
    at.session_state[_editor_key(cpu_cluster)] = {"edited_rows": {0: {"flops_per_gpu": 4e14}}, "added_rows": [], "deleted_rows": [1]}
    at.run()
    no_exception(at)
    edited = at.session_state[Keys.CLUSTER]
    assert edited.num_devices == cpu_cluster.num_devices - 1 and edited.devices[0].flops_per_gpu == 4e14
    assert edited.devices[0].flops_per_gpu_in("bf16") == cpu_cluster.devices[0].flops_per_gpu_in("bf16")
    assert not at.error


def test_cluster_dot_groups_devices_by_machine():
    import engine

    cluster = engine.load_cluster(ROOT / "sample_clusters" / "hap_paper_testbed.json")
    dot = views.cluster_dot(cluster)
    assert dot.count("subgraph cluster_m") == len(cluster.machines) == 8
    assert dot.count("shape=box, label=") == 64
    assert "1.3 GB/s" in dot and "10 GB/s" in dot


def test_a_machine_export_would_refuse_is_warned_about_while_planning(app, cpu_cluster):
    import dataclasses

    devices = [dataclasses.replace(d, machine="m0;touch x") if d.machine == "m0" else d for d in cpu_cluster.devices]
    at = app
    at.session_state[Keys.CLUSTER] = dataclasses.replace(cpu_cluster, devices=tuple(devices))
    at = open_page(at, "cluster")
    no_exception(at)
    assert [w.value for w in at.warning if "hap export" in w.value] == [
        "machine of cluster devices 0, 1: 'm0;touch x' is not a host name (RFC 1123: dot-separated labels of letters, "
        "digits and '-') or an IPv4/IPv6 address; `hap export` will refuse it, rename the machine"]
