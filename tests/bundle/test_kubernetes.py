"""Kubernetes manifests (issue 25): GPU types pinned per machine, node numbers right, each manifest checked by
well-kept libraries rather than a schema written here.

Who checks what:
* core types (the pod templates of a PyTorchJob, the Job templates of a JobSet): `kubernetes-validate`'s strict
  schemas of Kubernetes K8S_VERSION (unknown fields, types, required fields);
* PyTorchJob: the `kubeflow-training` SDK's models (deserialized, and no field of ours left out);
* TrainJob: the `kubeflow` SDK's Trainer models (`kubeflow_trainer_api`, pydantic: types, no field left out);
* JobSet: no installed library describes it, so the `kubernetes` client's V1JobTemplateSpec model checks each
  replicated job's template; JobSet's own fields (network, failurePolicy, replicatedJobs[].name/replicas) are
  only asserted by these tests, not validated.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import kubernetes_validate
import pytest
import yaml
from conftest import cluster_dict, sample_path
from kubeflow.training import ApiClient as KubeflowClient
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
from kubernetes.client import ApiClient

import engine
from engine.bundle import grammar
from engine.bundle.archive import BundleError, check_bundle, export_bundle
from engine.bundle.launch_files import GPU_PRODUCT_LABEL, jobset_host

K8S_VERSION = "1.35.0"
"""The Kubernetes version whose schemas (kubernetes-validate) the core types are checked against."""
TINY_GPT = dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=8)


# ----------------------------------------------------------------------------- validators (test-only)


class _Response:
    """What ApiClient.deserialize reads: an HTTP response's JSON body."""

    def __init__(self, data: Any) -> None:
        self.data = json.dumps(data)


def dropped_fields(data: Any, back: Any, path: str = "") -> list[str]:
    """Paths of the keys in `data` that a model's round trip (`back`) lost: fields the model does not know."""
    if isinstance(data, dict):
        back = back if isinstance(back, dict) else {}
        return [p for k, v in data.items()
                for p in ([f"{path}.{k}"] if k not in back else dropped_fields(v, back[k], f"{path}.{k}"))]
    if isinstance(data, list) and isinstance(back, list):
        return [p for i, (a, b) in enumerate(zip(data, back)) for p in dropped_fields(a, b, f"{path}[{i}]")]
    return []


def openapi_problems(client: Any, data: Any, klass: str) -> list[str]:
    """Unknown fields of `data` as the OpenAPI model `klass` (kubernetes / kubeflow-training client) reads it."""
    try:
        obj = client.deserialize(_Response(data), klass)
    except (ValueError, TypeError) as e:
        return [f"{klass}: {e}"]
    return [f"{klass}{p}: unknown field" for p in dropped_fields(data, client.sanitize_for_serialization(obj))]


def core_problems(doc: dict[str, Any]) -> list[str]:
    """Where a core Kubernetes object breaks the strict schema of K8S_VERSION (kubernetes-validate)."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{doc['kind']}.{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def pod_template_problems(template: dict[str, Any]) -> list[str]:
    """A pod template checked as a core v1 PodTemplate."""
    return core_problems({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def pytorchjob_problems(doc: dict[str, Any]) -> list[str]:
    """A PyTorchJob checked by the kubeflow-training models, its pod templates by the core schemas."""
    out = openapi_problems(KubeflowClient(), doc, "KubeflowOrgV1PyTorchJob")
    for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
        out += [f"{role}: {p}" for p in pod_template_problems(spec["template"])]
    return out


def trainjob_problems(doc: dict[str, Any]) -> list[str]:
    """A TrainJob checked by the kubeflow SDK's Trainer models (pydantic)."""
    try:
        back = TrainerV1alpha1TrainJob.from_dict(doc).to_dict()
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        return [f"TrainJob: {str(e).splitlines()[0]}"]
    return [f"TrainJob{p}: unknown field" for p in dropped_fields(doc, back)]


def jobset_problems(doc: dict[str, Any]) -> list[str]:
    """Each replicated job's template checked by the kubernetes client's V1JobTemplateSpec and as a batch/v1 Job."""
    out = []
    for rjob in doc["spec"]["replicatedJobs"]:
        out += openapi_problems(ApiClient(), rjob["template"], "V1JobTemplateSpec")
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rjob["name"]}, **rjob["template"]}
        out += [f"{rjob['name']}: {p}" for p in core_problems(job)]
    return out


VALIDATORS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "pytorchjob.yaml": pytorchjob_problems, "trainjob.yaml": trainjob_problems, "jobset.yaml": jobset_problems}


# ----------------------------------------------------------------------------- bundles


def two_machines(gpus: tuple[str, str], products: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """A cluster spec of machines m0 and m1 with 2 devices each, of the given GPU models (and gpu_product labels)."""
    d = cluster_dict([1e13] * 4, name="two")
    for i, dev in enumerate(d["devices"]):
        dev.update(machine=f"m{i // 2}", gpu_model=gpus[i // 2])
        if products[i // 2] is not None:
            dev["gpu_product"] = products[i // 2]
    d["network"]["bandwidth_Bps"]["inter_machine"] = 1e9
    return d


@pytest.fixture(scope="module")
def tiny_gpt():
    return engine.load_model("zoo:gpt", **TINY_GPT)


def export(graph: Any, spec: dict[str, Any] | str, out: Path) -> Path:
    cluster = engine.load_cluster(spec)
    plan = engine.evaluate(graph, cluster, "dp-even", optimizer="sgd")
    return export_bundle(plan, None if isinstance(spec, str) else spec, out)


@pytest.fixture(scope="module")
def hetero(tiny_gpt, tmp_path_factory) -> Path:
    """The bundle of sample_clusters/a100x2_p100x2.json: m0 with 2 A100s, m1 with 2 P100s."""
    return export(tiny_gpt, sample_path("a100x2_p100x2"), tmp_path_factory.mktemp("k") / "hetero")


@pytest.fixture(scope="module")
def uniform(tiny_gpt, tmp_path_factory) -> Path:
    """Two machines of 2 A100s each, with the GPU feature discovery product label given."""
    spec = two_machines(("A100-40GB", "A100-40GB"), ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"))
    return export(tiny_gpt, spec, tmp_path_factory.mktemp("k") / "uniform")


def load(bundle: Path, name: str) -> dict[str, Any]:
    return yaml.safe_load((bundle / name).read_text())


def pod_specs(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["template"]["spec"]["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]]


# ----------------------------------------------------------------------------- what the manifests ask for


def test_heterogeneous_bundle_gets_a_jobset_that_pins_each_machines_gpu_type(hetero):
    assert not (hetero / "pytorchjob.yaml").exists() and not (hetero / "trainjob.yaml").exists()
    pods = pod_specs(load(hetero, "jobset.yaml"))
    assert [p["nodeSelector"][GPU_PRODUCT_LABEL] for p in pods] == ["A100-40GB", "P100-PCIE-16GB"]
    assert [p["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for p in pods] == [2, 2]
    readme = (hetero / "README.md").read_text()
    assert "`pytorchjob.yaml` was not generated: one pod template cannot select" in readme
    assert "kubectl apply -f jobset.yaml" in readme
    assert check_bundle(hetero).ok


def test_jobset_gives_each_node_its_bundle_node_number_and_node_0_hosts_the_rendezvous(hetero):
    doc = load(hetero, "jobset.yaml")
    job = doc["metadata"]["name"]
    endpoint = f"--rdzv-endpoint={jobset_host(job, 0)}.{job}:29500"
    assert jobset_host(job, 0) == f"{job}-n0-0-0" and doc["spec"]["network"] == {"enableDNSHostnames": True}
    for k, rjob in enumerate(doc["spec"]["replicatedJobs"]):
        assert (rjob["name"], rjob["replicas"]) == (f"n{k}", 1)
        assert rjob["template"]["spec"]["parallelism"] == rjob["template"]["spec"]["completions"] == 1
        (c,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
        assert c["env"] == [{"name": "HAP_NODE_RANK", "value": str(k)}]
        assert f"--node-rank={k}" in c["args"] and "--nnodes=2" in c["args"] and endpoint in c["args"]
        assert c["args"][-2:] == ["--device-check", "error"]  # machines differ: a rank on the wrong GPU type stops


def test_uniform_bundle_pins_its_one_gpu_type_by_the_gpu_product_label(uniform):
    assert not (uniform / "jobset.yaml").exists()
    specs = load(uniform, "pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Worker"):
        assert specs[role]["template"]["spec"]["nodeSelector"] == {GPU_PRODUCT_LABEL: "NVIDIA-A100-SXM4-40GB"}
    assert load(uniform, "trainjob.yaml")["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 2}}


def test_same_gpu_type_but_uneven_workers_get_a_jobset(tiny_gpt, tmp_path):
    spec = cluster_dict([1e13] * 5, name="uneven")
    for dev, m in zip(spec["devices"], ["m0", "m0", "m1", "m2", "m2"]):
        dev.update(machine=m, gpu_model="A100-40GB")
    spec["network"]["bandwidth_Bps"]["inter_machine"] = 1e9
    out = export(tiny_gpt, spec, tmp_path / "b")
    assert not (out / "pytorchjob.yaml").exists()
    pods = pod_specs(load(out, "jobset.yaml"))
    assert [p["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for p in pods] == [2, 1, 2]
    assert jobset_problems(load(out, "jobset.yaml")) == []


def test_cpu_bundle_selects_no_gpu_type(tiny_gpt, tmp_path):
    out = export(tiny_gpt, sample_path("cpu_4_uneven"), tmp_path / "b")
    spec = load(out, "pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "nodeSelector" not in spec and pytorchjob_problems(load(out, "pytorchjob.yaml")) == []


def test_a_gpu_model_that_is_no_label_value_leaves_its_node_unpinned_and_says_so(tiny_gpt, tmp_path):
    out = export(tiny_gpt, two_machines(("A100-40GB", "RTX 3090")), tmp_path / "b")
    text = (out / "jobset.yaml").read_text()
    assert "# node 1 (machine m1) selects no GPU type: gpu_model RTX 3090 is no label value" in text
    assert [p.get("nodeSelector") for p in pod_specs(yaml.safe_load(text))] == [{GPU_PRODUCT_LABEL: "A100-40GB"}, None]


@pytest.mark.parametrize("bad", ["A100 40GB", "-A100", "x" * 64, "A100\n"])
def test_a_gpu_product_outside_the_label_grammar_is_refused(tiny_gpt, tmp_path, bad):
    spec = two_machines(("A100-40GB", "P100-PCIE-16GB"), (bad, None))
    with pytest.raises(BundleError, match="cluster device 0 gpu_product: .* is not a Kubernetes label value"):
        export(tiny_gpt, spec, tmp_path / "b")


def test_gpu_product_round_trips_through_the_cluster_spec_and_must_be_a_string():
    spec = two_machines(("A100-40GB", "P100-PCIE-16GB"), ("NVIDIA-A100-SXM4-40GB", None))
    cluster = engine.load_cluster(spec)
    assert [d.gpu_product for d in cluster.devices] == ["NVIDIA-A100-SXM4-40GB"] * 2 + [None] * 2
    assert engine.load_cluster(cluster.to_dict()) == cluster and "gpu_product" not in cluster.to_dict()["devices"][2]
    spec["devices"][0]["gpu_product"] = 100
    with pytest.raises(engine.errors.ClusterError, match=r"devices\[0\]\.gpu_product: must be a string"):
        engine.load_cluster(spec)


def test_label_value_grammar():
    assert all(grammar.label_value_problem(v) is None for v in ("A100-40GB", "Tesla-P100-PCIE-16GB", "a.b_c", "x" * 63))
    assert all(grammar.label_value_problem(v) for v in ("", "a b", "a/b", "-a", "a-", "x" * 64, 100))


def test_an_edited_jobset_is_refused_by_bundle_check(hetero, tmp_path):
    import shutil

    out = shutil.copytree(hetero, tmp_path / "b")
    path = out / "jobset.yaml"
    path.write_text(path.read_text().replace('"P100-PCIE-16GB"', '"A100-40GB"'))
    problems = check_bundle(out).problems
    assert any("jobset.yaml" in p for p in problems), problems


# ----------------------------------------------------------------------------- validated by the libraries


@pytest.mark.parametrize("bundle, name", [("hetero", "jobset.yaml"), ("uniform", "pytorchjob.yaml"),
                                          ("uniform", "trainjob.yaml")])
def test_generated_manifests_pass_the_libraries(bundle, name, request):
    assert VALIDATORS[name](load(request.getfixturevalue(bundle), name)) == []


PLANTED = [  # (bundle, file, path to a mapping, key, value, what the report names)
    ("hetero", "jobset.yaml", ["spec", "replicatedJobs", 1, "template", "spec", "template", "spec"],
     "nodeSelectr", {"a": "b"}, "nodeSelectr"),
    ("hetero", "jobset.yaml", ["spec", "replicatedJobs", 0, "template", "spec"], "parallelism", "one", "parallelism"),
    ("hetero", "jobset.yaml", ["spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0],
     "gpu", 2, "gpu"),
    ("uniform", "pytorchjob.yaml", ["spec", "pytorchReplicaSpecs", "Worker"], "replica", 1, "replica"),
    ("uniform", "pytorchjob.yaml", ["spec", "pytorchReplicaSpecs", "Master", "template", "spec", "containers", 0],
     "imagePullPolicyy", "Always", "imagePullPolicyy"),
    ("uniform", "trainjob.yaml", ["spec", "trainer"], "numProcsPerNode", 2, "numProcsPerNode"),
    ("uniform", "trainjob.yaml", ["spec", "trainer"], "numNodes", "2", "TrainJob"),
]


@pytest.mark.parametrize("bundle, name, path, key, value, named", PLANTED)
def test_a_planted_wrong_field_fails_validation(bundle, name, path, key, value, named, request):
    doc = copy.deepcopy(load(request.getfixturevalue(bundle), name))
    where = doc
    for step in path:
        where = where[step]
    where[key] = value
    problems = VALIDATORS[name](doc)
    assert problems and any(named in p for p in problems), problems
