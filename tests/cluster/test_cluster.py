"""Tests of engine.cluster: loading, validation messages, nominal collective fits, round trips."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import cluster_dict

from engine.cluster.spec import (COLLECTIVES, FREE_BANDWIDTH_BPS, Cluster, CollectiveFit, fit_collective, load_cluster,
                                 nominal_collectives)
from engine.errors import ClusterError

SAMPLES = Path(__file__).resolve().parents[2] / "sample_clusters"
SAMPLE_FILES = sorted(SAMPLES.glob("*.json"))
GiB16 = 17179869184


def _device(name: str, machine: str = "m0", **extra: Any) -> dict[str, Any]:
    """A valid device entry."""
    d = {"name": name, "gpu_model": "V100", "machine": machine, "flops_per_gpu": 1.5e13,
         "memory_bytes_per_gpu": GiB16}
    d.update(extra)
    return d


def _spec(**overrides: Any) -> dict[str, Any]:
    """A valid 4-device spec on two machines (2 devices each)."""
    spec: dict[str, Any] = {
        "schema_version": 1,
        "name": "t",
        "description": "test",
        "sources": ["made up"],
        "devices": [_device("a", "m0"), _device("b", "m0"), _device("c", "m1"), _device("d", "m1")],
        "network": {"latency_s": 1e-5, "bandwidth_Bps": {"intra_machine": 1e10, "inter_machine": 1e9}},
    }
    spec.update(overrides)
    return spec


def _error(spec: Any) -> str:
    """The ClusterError message of loading spec."""
    with pytest.raises(ClusterError) as info:
        load_cluster(spec)
    return str(info.value)


# ----------------------------------------------------------------------------- sample files


def test_sample_directory_has_the_expected_files() -> None:
    names = {p.name for p in SAMPLE_FILES}
    assert names >= {"hap_paper_testbed.json", "hap_paper_testbed_machines.json", "a100x2_p100x2.json",
                     "a100_v100_mixed.json", "h100x8_node.json", "cpu_2.json", "cpu_4_uneven.json"}


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.name)
def test_every_sample_loads_round_trips_and_has_stable_fingerprint(path: Path) -> None:
    cluster = load_cluster(path)
    again = Cluster.from_dict(cluster.to_dict())
    assert again == cluster
    assert again.fingerprint() == cluster.fingerprint()
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    assert cluster.description and cluster.sources
    assert set(cluster.collectives) == set(COLLECTIVES)


def test_load_accepts_str_path_dict_and_cluster() -> None:
    path = SAMPLES / "cpu_2.json"
    from_path = load_cluster(path)
    assert load_cluster(str(path)) == from_path
    assert load_cluster(json.loads(path.read_text())) == from_path
    assert load_cluster(from_path) is from_path


def test_hap_paper_testbed_has_64_devices_on_8_machines_with_16_v100() -> None:
    cluster = load_cluster(SAMPLES / "hap_paper_testbed.json")
    assert cluster.num_devices == 64
    assert len(cluster.machines) == 8
    assert sum(d.gpu_model.startswith("V100") for d in cluster.devices) == 16
    assert sum(d.gpu_model.startswith("P100") for d in cluster.devices) == 48
    assert cluster.network.bandwidth_Bps["inter_machine"] == pytest.approx(1.3e9)
    assert cluster.bottleneck_bandwidth_Bps == pytest.approx(1.3e9)


def test_hap_machines_file_has_8_virtual_devices_of_8_gpus() -> None:
    cluster = load_cluster(SAMPLES / "hap_paper_testbed_machines.json")
    assert cluster.num_devices == 8
    assert all(d.num_gpus == 8 for d in cluster.devices)
    assert cluster.flops[0] == pytest.approx(8 * 1.57e13)
    assert cluster.devices[0].intra_bandwidth_Bps > cluster.devices[-1].intra_bandwidth_Bps


def test_mixed_file_bottleneck_is_the_inter_group_link() -> None:
    cluster = load_cluster(SAMPLES / "a100_v100_mixed.json")
    assert cluster.link_levels == ("inter_machine", "inter_group")
    assert cluster.bottleneck_bandwidth_Bps == pytest.approx(5e8)


def test_cpu_4_uneven_declares_uneven_flops() -> None:
    assert load_cluster(SAMPLES / "cpu_4_uneven.json").flops == (2e10, 2e10, 1e10, 1e10)


# ----------------------------------------------------------------------------- cost model


def test_collective_fit_time_is_latency_plus_bytes_over_bandwidth() -> None:
    assert CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e9).time(2e9) == pytest.approx(2.001)


def test_a_fit_with_measured_points_reads_its_time_off_them_between_the_smallest_and_largest_payload() -> None:
    """Between neighbouring points the time is linear; beyond the last one the line's bandwidth carries on
    from it; below the first one it falls at that bandwidth, never under the latency."""
    fit = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6, points=((1e3, 2e-3), (1e4, 8e-3), (1e5, 0.1)))
    assert fit.time(1e3) == pytest.approx(2e-3) and fit.time(1e4) == pytest.approx(8e-3)
    assert fit.time(5.5e3) == pytest.approx(5e-3)  # halfway between the first two points
    assert fit.time(2e5) == pytest.approx(0.1 + 1e5 / 1e6)
    assert fit.time(500) == pytest.approx(1.5e-3) and fit.time(0) == pytest.approx(1e-3)
    assert CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6).time(1e4) == pytest.approx(11e-3)  # no points: the line


def _hull_value(fit: CollectiveFit, upto: float, x: float) -> float:
    return max(const + per * x for const, per in fit.lines(upto))


def test_a_fits_lines_are_its_lower_convex_hull_the_curve_itself_where_it_is_convex() -> None:
    """The LP's form of a sharded collective (`CollectiveFit.lines`): the maximum of the lines equals
    `time` on a convex stretch, lies below it across a bump and never above it, and touches it at the
    payload bounds; without points it is the one line."""
    convex = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6, points=((1e3, 2e-3), (1e4, 12e-3), (2e4, 3e-2)))
    bump = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6, points=((1e3, 2e-3), (1e4, 3e-2), (1e5, 4e-2)))
    payloads = [0, 300, 1e3, 5e3, 1e4, 1.5e4, 2e4, 6e4, 1e5]
    for x in payloads[:7]:
        assert _hull_value(convex, 2e4, x) == pytest.approx(convex.time(x), rel=1e-12, abs=1e-15)
    assert len(convex.lines(2e4)) == 3  # falling at the bandwidth to the first point, then two segments
    below = [bump.time(x) - _hull_value(bump, 1e5, x) for x in payloads]
    assert min(below) >= -1e-15 and below[payloads.index(1e4)] > 0.01  # the bump's top is cut
    assert below[0] == pytest.approx(0, abs=1e-15) and below[-1] == pytest.approx(0, abs=1e-15)
    line = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6)
    assert line.lines(1e5) == ((1e-3, 1e-6),)


def test_a_buckets_chord_runs_from_the_latency_to_the_measured_time_at_its_size() -> None:
    fit = CollectiveFit(latency_s=1e-3, bandwidth_Bps=1e6, points=((1e3, 2e-3), (1e4, 3e-2), (1e5, 4e-2)))
    for size in (1e3, 5e3, 1e5, 3e5):
        assert fit.latency_s + size * fit.chord_s_per_byte(size) == pytest.approx(fit.time(size), rel=1e-12)
    assert fit.chord_s_per_byte(0) == 1e-6


def test_fit_collective_keeps_its_points_and_they_round_trip_through_the_spec() -> None:
    sizes, secs = [2**14, 2**17, 2**20, 2**22], [2.2e-3, 5.3e-3, 7.1e-3, 11.7e-3]  # gloo's step above 64 KiB
    fit = fit_collective(sizes, secs)
    assert fit.points == tuple(zip(map(float, sizes), secs))
    assert fit.time(2**17) == pytest.approx(5.3e-3) and fit.latency_s + 2**17 / fit.bandwidth_Bps < 3e-3
    assert fit_collective([8, 8], [1e-3, 3e-3]).points == ()  # one payload: nothing to read between
    spec = _spec()
    spec["network"]["collectives"] = {"all_reduce": fit.to_dict()}
    cluster = load_cluster(spec)
    assert cluster.collectives["all_reduce"] == fit and Cluster.from_dict(cluster.to_dict()) == cluster
    half = cluster.scaled(bandwidth_scale=2.0).collectives["all_reduce"]
    assert half.time(2**17) == pytest.approx(fit.latency_s + (5.3e-3 - fit.latency_s) / 2)


def test_nominal_fits_for_four_devices_follow_ring_formulas() -> None:
    cluster = load_cluster(_spec())  # m = 4, bottleneck 1e9 (inter_machine), a = 1e-5
    fits = cluster.collectives
    assert fits["all_reduce"].latency_s == pytest.approx(6e-5)
    assert fits["all_reduce"].bandwidth_Bps == pytest.approx(1e9 * 4 / 6)
    for name in ("all_gather", "reduce_scatter"):
        assert fits[name].latency_s == pytest.approx(3e-5)
        assert fits[name].bandwidth_Bps == pytest.approx(1e9 / 3)
    assert fits["all_to_all"].latency_s == pytest.approx(3e-5)
    assert fits["all_to_all"].bandwidth_Bps == pytest.approx(1e9 * 4 / 3)
    assert fits["broadcast"].latency_s == pytest.approx(1e-5)
    assert fits["broadcast"].bandwidth_Bps == pytest.approx(1e9)


def test_bottleneck_is_slowest_level_the_layout_uses() -> None:
    one_machine = _spec(devices=[_device("a"), _device("b")],
                        network={"latency_s": 0, "bandwidth_Bps": {"intra_machine": 5e9, "inter_machine": 1e8}})
    assert load_cluster(one_machine).bottleneck_bandwidth_Bps == pytest.approx(5e9)
    assert load_cluster(_spec()).bottleneck_bandwidth_Bps == pytest.approx(1e9)


def test_explicit_collective_fit_overrides_nominal() -> None:
    spec = _spec()
    spec["network"]["collectives"] = {"all_reduce": {"latency_s": 0.5, "bandwidth_Bps": 123.0}}
    cluster = load_cluster(spec)
    assert cluster.collectives["all_reduce"] == CollectiveFit(latency_s=0.5, bandwidth_Bps=123.0)
    assert cluster.collectives["broadcast"] == load_cluster(_spec()).collectives["broadcast"]
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_to_dict_writes_resolved_collectives_and_levels() -> None:
    d = load_cluster(_spec()).to_dict()
    assert set(d["network"]["collectives"]) == set(COLLECTIVES)
    assert d["network"]["bandwidth_Bps"] == {"intra_machine": 1e10, "inter_machine": 1e9}
    assert d["schema_version"] == 1


def test_single_device_communication_is_free() -> None:
    cluster = load_cluster(_spec(devices=[_device("solo")], network={"latency_s": 1e-3, "bandwidth_Bps": {}}))
    for fit in cluster.collectives.values():
        assert fit.latency_s == 0.0
        assert fit.bandwidth_Bps == FREE_BANDWIDTH_BPS
        assert fit.time(1e12) < 1e-15
    assert nominal_collectives(1, 1.0, 1.0)["all_reduce"].bandwidth_Bps == FREE_BANDWIDTH_BPS


def test_count_expands_to_numbered_devices() -> None:
    cluster = load_cluster(_spec(devices=[_device("gpu", count=3)],
                                 network={"latency_s": 0, "bandwidth_Bps": {"intra_machine": 1e10}}))
    assert [d.name for d in cluster.devices] == ["gpu-0", "gpu-1", "gpu-2"]
    assert "count" not in cluster.to_dict()["devices"][0]


def test_virtual_device_flops_multiply_num_gpus() -> None:
    cluster = load_cluster(_spec(devices=[_device("box", num_gpus=4)], network={"latency_s": 0, "bandwidth_Bps": {}}))
    assert cluster.flops == (4 * 1.5e13,)


def test_fingerprint_changes_with_content() -> None:
    a = load_cluster(_spec())
    b = load_cluster(_spec(name="other"))
    assert a.fingerprint() != b.fingerprint()
    assert len(a.fingerprint()) == 64


# ----------------------------------------------------------------------------- scaled


def test_scaled_changes_only_flops_of_named_model() -> None:
    base = load_cluster(SAMPLES / "a100x2_p100x2.json")
    out = base.scaled(flops_scale={"P100-PCIE-16GB": 2.0})
    for old, new in zip(base.devices, out.devices):
        factor = 2.0 if old.gpu_model == "P100-PCIE-16GB" else 1.0
        assert new.flops_per_gpu == pytest.approx(old.flops_per_gpu * factor)
        assert new.memory_bytes_per_gpu == old.memory_bytes_per_gpu
    assert out.network == base.network
    assert out.collectives == base.collectives
    assert out.name == base.name
    assert base.devices[-1].flops_per_gpu == pytest.approx(9.3e12)  # original untouched


def test_scaled_bandwidth_scales_levels_and_fits_but_not_latency() -> None:
    base = load_cluster(_spec())
    out = base.scaled(bandwidth_scale=0.5)
    assert out.devices == base.devices
    assert out.network.latency_s == base.network.latency_s
    assert out.network.bandwidth_Bps == {k: v * 0.5 for k, v in base.network.bandwidth_Bps.items()}
    for name in COLLECTIVES:
        assert out.collectives[name].latency_s == base.collectives[name].latency_s
        assert out.collectives[name].bandwidth_Bps == pytest.approx(base.collectives[name].bandwidth_Bps * 0.5)
    assert Cluster.from_dict(out.to_dict()) == out


def test_scaled_rejects_unknown_model_and_bad_factor() -> None:
    base = load_cluster(_spec())
    with pytest.raises(ClusterError, match=r"flops_scale\['A100'\]: unknown gpu_model"):
        base.scaled(flops_scale={"A100": 2.0})
    with pytest.raises(ClusterError, match="bandwidth_scale: must be a positive number"):
        base.scaled(bandwidth_scale=0)


# ----------------------------------------------------------------------------- errors


def test_missing_file_error(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"cluster file '.*nope\.json' not found"):
        load_cluster(tmp_path / "nope.json")


def test_invalid_json_error_gives_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text('{\n  "name": "x",\n  oops\n}\n')
    msg = _error(path)
    assert "is not valid JSON: line 3 column 3:" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda s: s["devices"][2].update(flops_per_gpu=-1),
         r"^devices\[2\]\.flops_per_gpu: must be a positive number, got -1 \(the sustained FLOP/s of one GPU"),
        (lambda s: s["devices"][0].pop("memory_bytes_per_gpu"),
         r"^devices\[0\]\.memory_bytes_per_gpu: missing \(bytes of memory of one GPU, e\.g\. 17179869184"),
        (lambda s: s["devices"][1].update(flops_per_gpu="fast"), r"^devices\[1\]\.flops_per_gpu: must be a positive"),
        (lambda s: s["devices"][1].update(flops_per_gpu=True), r"^devices\[1\]\.flops_per_gpu: .*got True"),
        (lambda s: s["devices"][0].update(num_gpus=2.5), r"^devices\[0\]\.num_gpus: must be a positive integer"),
        (lambda s: s["devices"][1].update(memory_bandwidth_Bps=0),
         r"^devices\[1\]\.memory_bandwidth_Bps: must be a positive number, got 0 \(bytes/s one GPU reads and writes"),
        (lambda s: s["devices"][0].update(name=3), r"^devices\[0\]\.name: must be a string"),
        (lambda s: s["devices"][0].update(flop=1), r"^devices\[0\]\.flop: unknown field; did you mean 'flops_per_gpu'\?"),
        (lambda s: s.update(nmae="x"), r"^nmae: unknown field; did you mean 'name'\?"),
        (lambda s: s["devices"][3].update(name="a"), r"^devices\[3\]\.name: duplicate device name 'a'"),
        (lambda s: s.update(devices=[]), r"^devices: empty"),
        (lambda s: s.update(devices={}), r"^devices: must be a list"),
        (lambda s: s.update(schema_version=2), r"^schema_version: unsupported version 2"),
        (lambda s: s.pop("schema_version"), r"^schema_version: missing"),
        (lambda s: s["network"]["bandwidth_Bps"].pop("inter_machine"),
         r"^network\.bandwidth_Bps\.inter_machine: missing; the devices span 2 machines"),
        (lambda s: s["network"]["bandwidth_Bps"].pop("intra_machine"),
         r"^network\.bandwidth_Bps\.intra_machine: missing; some machine holds more than one device"),
        (lambda s: s["network"]["bandwidth_Bps"].update(inter_rack=1e9),
         r"^network\.bandwidth_Bps\.inter_rack: unknown field"),
        (lambda s: s["network"].update(collectives={"allreduce": {"latency_s": 0, "bandwidth_Bps": 1}}),
         r"^network\.collectives\.allreduce: unknown collective; did you mean 'all_reduce'\?"),
        (lambda s: s["network"].update(collectives={"broadcast": {"latency_s": -1, "bandwidth_Bps": 1}}),
         r"^network\.collectives\.broadcast\.latency_s: must be a non-negative number, got -1"),
        (lambda s: s["network"].update(latency_s=-0.1), r"^network\.latency_s: must be a non-negative number"),
        (lambda s: s["network"].update(collectives={"broadcast": {"latency_s": 0}}),
         r"^network\.collectives\.broadcast\.bandwidth_Bps: missing"),
        (lambda s: s.pop("network"), r"^network: missing"),
        (lambda s: s["network"].update(collectives={"all_reduce": {"latency_s": 0, "bandwidth_Bps": 1, "points": [[1, 1]]}}),
         r"^network\.collectives\.all_reduce\.points: must be a list of at least two \[payload_bytes, seconds\] pairs"),
        (lambda s: s["network"].update(collectives={"all_reduce": {"latency_s": 0, "bandwidth_Bps": 1,
                                                                   "points": [[1, 1], [2, 0]]}}),
         r"^network\.collectives\.all_reduce\.points\[1\]\[1\]: must be a positive number, got 0 \(seconds the"),
        (lambda s: s["network"].update(collectives={"all_reduce": {"latency_s": 0, "bandwidth_Bps": 1,
                                                                   "points": [[1, 1], [1, 2]]}}),
         r"^network\.collectives\.all_reduce\.points: two points share a payload"),
        (lambda s: s["network"].update(collectives={"all_reduce": {"latency_s": 0, "bandwidth_Bps": 1,
                                                                   "points": [[1, 1], "x"]}}),
         r"^network\.collectives\.all_reduce\.points\[1\]: must be a \[payload_bytes, seconds\] pair"),
        (lambda s: s["devices"][2].update(count=0), r"^devices\[2\]\.count: must be a positive integer"),
        (lambda s: s["devices"][1].update(overlap_slowdown={"ddpp": 1.1}),
         r"^devices\[1\]\.overlap_slowdown: unknown overlap mode 'ddpp' \(choose from: ddp, duplex\)"),
        (lambda s: s["devices"][1].update(overlap_slowdown={"duplex": 0}),
         r"^devices\[1\]\.overlap_slowdown\.duplex: must be a positive number, got 0 \(per overlap mode"),
        (lambda s: s["devices"][1].update(overlap_slowdown={"duplex": 50}),
         r"^devices\[1\]\.overlap_slowdown\.duplex: 50 is outside the sane range \[0\.5, 20\]"),
        (lambda s: s["devices"][1].update(overlap_slowdown=1.2), r"^devices\[1\]\.overlap_slowdown: must be an object"),
        (lambda s: s["devices"][2].update(group="x"), r"^devices\[3\]\.group: machine 'm1' is in group 'x'"),
    ],
)
def test_bad_spec_gives_one_line_error_naming_the_field(mutate: Any, pattern: str) -> None:
    spec = copy.deepcopy(_spec())
    mutate(spec)
    msg = _error(spec)
    assert "\n" not in msg
    with pytest.raises(ClusterError, match=pattern):
        load_cluster(spec)


def test_inter_group_level_required_for_two_groups() -> None:
    spec = _spec(devices=[_device("a", "m0", group="g1"), _device("b", "m1", group="g2")],
                 network={"latency_s": 0, "bandwidth_Bps": {"inter_machine": 1e9}})
    with pytest.raises(ClusterError, match=r"^network\.bandwidth_Bps\.inter_group: missing; the devices span 2 groups"):
        load_cluster(spec)


def test_non_object_top_level_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ClusterError, match="cluster: must be a JSON object, got list"):
        load_cluster(path)
    with pytest.raises(ClusterError, match="expected a JSON file path, a dict or a Cluster"):
        load_cluster(42)  # type: ignore[arg-type]


def test_file_errors_are_cluster_errors_and_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_spec(devices=[])))
    with pytest.raises(ValueError, match="devices: empty"):
        load_cluster(path)


def test_activation_bandwidth_must_be_on_every_device_or_none():
    d = cluster_dict([1e12, 1e12])
    d["devices"][0]["activation_bandwidth_Bps"] = 1e12
    with pytest.raises(ClusterError, match=r"devices\[1\]\.activation_bandwidth_Bps: missing on device 'dev-1'") as e:
        Cluster.from_dict(d)
    assert "\n" not in str(e.value)
    d["devices"][1]["activation_bandwidth_Bps"] = -1
    with pytest.raises(ClusterError, match=r"devices\[1\]\.activation_bandwidth_Bps"):
        Cluster.from_dict(d)
    d["devices"][1]["activation_bandwidth_Bps"] = 5e11
    c = Cluster.from_dict(d)
    assert [x.activation_bandwidth_Bps for x in c.devices] == [1e12, 5e11]
    assert Cluster.from_dict(c.to_dict()) == c


def test_overlap_slowdown_round_trips_and_defaults_to_full_speed():
    spec = cluster_dict([1e12, 1e12])
    spec["devices"][0]["overlap_slowdown"] = {"duplex": 1.5, "ddp": 1.1}
    cluster = load_cluster(spec)
    first, second = cluster.devices
    assert (first.slowdown("ddp"), first.slowdown("duplex"), first.slowdown("none")) == (1.1, 1.5, 1.0)
    assert second.slowdown("duplex") == 1.0 and "overlap_slowdown" not in second.to_dict()
    assert load_cluster(cluster.to_dict()) == cluster


def test_slowdown_modes_are_the_overlap_modes_that_overlap():
    from engine.cluster.spec import SLOWDOWN_MODES
    from engine.options import OVERLAP_MODES

    assert set(SLOWDOWN_MODES) == set(OVERLAP_MODES) - {"none"}


# ----------------------------------------------------------------------------- Slurm hints (issue 25)


def _hinted(hints: list[dict | None]) -> dict:
    """Two machines of one CPU device each, device k carrying Slurm hints hints[k] (None: none)."""
    dev = {"gpu_model": "cpu", "flops_per_gpu": 1e10, "memory_bytes_per_gpu": 2**30}
    devices = [{**dev, "name": f"d{k}", "machine": f"m{k}", **({"slurm": h} if h is not None else {})}
               for k, h in enumerate(hints)]
    return {"schema_version": 1, "name": "hinted", "devices": devices,
            "network": {"latency_s": 1e-5, "bandwidth_Bps": {"intra_machine": 1e10, "inter_machine": 1e9}}}


def test_slurm_hints_round_trip_and_leave_the_fingerprint_alone():
    """Hints say where a job runs, not what it costs: a plan made before they were added stays valid."""
    hinted = Cluster.from_dict(_hinted([{"feature": "a100", "gres_type": "a100"}, {"nodelist": "gpu[01-02]"}]))
    plain = Cluster.from_dict(_hinted([None, None]))
    assert hinted.devices[0].slurm == (("feature", "a100"), ("gres_type", "a100"))
    assert Cluster.from_dict(hinted.to_dict()) == hinted
    assert hinted.to_dict()["devices"][1]["slurm"] == {"nodelist": "gpu[01-02]"}
    assert "slurm" not in plain.to_dict()["devices"][0]
    assert hinted.fingerprint() == plain.fingerprint()


@pytest.mark.parametrize("hints, message", [
    ({"partition": "gpu"}, "devices[0].slurm.partition"),
    ({"feature": 3}, "devices[0].slurm.feature: must be a string"),
    ({"feature": ""}, "devices[0].slurm.feature: must be a non-empty string"),
    ("a100", "devices[0].slurm: must be a JSON object"),
])
def test_a_bad_slurm_hint_is_one_cluster_error_naming_the_field(hints, message):
    with pytest.raises(ClusterError, match=re.escape(message)) as e:
        Cluster.from_dict(_hinted([hints, None]))
    assert "\n" not in str(e.value)


def test_every_device_of_a_machine_carries_the_same_slurm_hints():
    d = _hinted([{"feature": "a100"}, {"feature": "a100"}])
    d["devices"][1]["machine"] = "m0"
    assert Cluster.from_dict(d).devices[1].slurm == (("feature", "a100"),)
    d["devices"][1]["slurm"] = {"feature": "p100"}
    with pytest.raises(ClusterError, match=r"devices\[1\]\.slurm: machine 'm0' has slurm"):
        Cluster.from_dict(d)
