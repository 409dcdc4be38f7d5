"""Launch bundles: a plan packed with everything needed to run it on a cluster (`hap export`).

A bundle is a folder (optionally also a zip of it) holding

    plan.json        the plan (it embeds the graph IR): an SPMD plan ("hap.plan") or a pipeline plan
                     ("hap.pipeline_plan"); both bundle alike (through `engine.planner.AnyPlan`)
    cluster.json     the cluster spec the plan was made for (GPU type of every rank)
    model.json       the model source: zoo name + config, hf class + config, or the user's model file
    model/FILE       the user's model file (plans of `--model FILE.py`), checked against the plan's sha256
    launch_node.sh   one `torchrun` line per node (c10d rendezvous); run it on every node
                     (these launch files and the README are written by engine.bundle.launch_files)
    slurm.sbatch     `srun torchrun ...` for Slurm
    pytorchjob.yaml  a Kubeflow `kubeflow.org/v1` PyTorchJob (Master + Workers)
    trainjob.yaml    a Kubeflow Trainer v2 TrainJob (runtime `torch-distributed`)
    jobset.yaml      a JobSet, one replicated job per node pinned to its GPU type, instead of the two
                     above when one pod template cannot fit every node
    README.md        which command to run where
    manifest.json    sha256 of every other file, package versions, creation time, world size,
                     and the rank -> device map

Rank r runs plan device r (the runner runs one process per device). Nodes are the cluster's
machines, in device order; node k runs the ranks of its devices, which must be consecutive.
`check_bundle` validates a bundle without running it (`hap bundle check`), `open_bundle` is what
`hap run BUNDLE` calls first, and `safe_extract` unpacks a zip refusing entries that escape it.
Nothing in a bundle is ever unpickled: every file is JSON or text.

This module is pure: it never starts a process group and never imports the runner.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import platform
import re
import stat
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from engine import limits
from engine.bundle import grammar
from engine.bundle.launch_files import (DEFAULT_IMAGE, SETUP_FILE, ExportSettings, LaunchNode, kubernetes_files,
                                        launch_node_script, launch_settings, rank_table, readme_text, slurm_script)
from engine.bundle.unpack import EXECUTABLE, MANIFEST, is_bundle, read_folder, read_zip
from engine.cluster.spec import Cluster, load_cluster
from engine.errors import BundleError, HapError, PlanError
from engine.readers import parse_json, read_bytes
from engine.pipeline.plan import PIPELINE_PLAN_KIND, check_pipeline_plan
from engine.planner import AnyPlan, load_plan
from engine.spmd.plan import read_plan_json
from engine.spmd.validate import check_devices, validate_plan

BUNDLE_SCHEMA_VERSION = 2
"""2: the manifest records the export settings (`export`) and every generated file is checked by writing it
again. Bundles of schema 1 still check and run; their launch files are vouched for only by their hashes."""
ANNOTATIONS = "hspmd_annotations.json"
"""The plan in Hetu's HSPMD vocabulary (`hap export --annotations`, engine.elastic.annotations)."""
SAMPLES_DIR = Path(__file__).resolve().parents[2] / "sample_clusters"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


# ----------------------------------------------------------------------------- nodes and ranks


def launch_nodes(plan: AnyPlan, cluster: Cluster) -> list[LaunchNode]:
    """The plan's devices grouped by machine into nodes; refuses a plan the runner cannot launch."""
    check_runnable(plan, cluster)
    nodes: list[LaunchNode] = []
    for r, dev in enumerate(cluster.devices):
        if nodes and nodes[-1].machine == dev.machine:
            nodes[-1] = LaunchNode(nodes[-1].node_rank, dev.machine, nodes[-1].ranks + (r,))
        elif any(n.machine == dev.machine for n in nodes):
            first = next(n for n in nodes if n.machine == dev.machine).ranks[0]
            raise BundleError(f"cluster device {r} ({dev.name}) is on machine '{dev.machine}' but device {r - 1} is not: "
                              f"torchrun gives each node consecutive ranks, so list the devices of '{dev.machine}' "
                              f"together (device {first} is on it too) in the cluster spec and plan again")
        else:
            nodes.append(LaunchNode(len(nodes), dev.machine, (r,)))
    return nodes


def check_nodes(plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode]) -> list[LaunchNode]:
    """Nodes given by hand: numbered 0.., holding ranks 0..world-1 in order (torchrun's numbering)."""
    check_runnable(plan, cluster)
    ranks = [r for n in nodes for r in n.ranks]
    if ranks != list(range(plan.world_size)) or [n.node_rank for n in nodes] != list(range(len(nodes))):
        raise BundleError(f"nodes {[(n.node_rank, list(n.ranks)) for n in nodes]} must be numbered 0.. and hold ranks "
                          f"0..{plan.world_size - 1} in order, node by node (torchrun numbers ranks that way)")
    return list(nodes)


def check_runnable(plan: AnyPlan, cluster: Cluster) -> None:
    """The runner runs one process per plan device: the cluster must be the plan's, one GPU per device."""
    names = [d.name for d in cluster.devices]
    if names != list(plan.device_names):
        raise BundleError(f"cluster '{cluster.name}' has devices {_short(names)} but the plan was made for "
                          f"{_short(plan.device_names)} (cluster '{plan.cluster_name}'); give --cluster the spec the plan was made for")
    virtual = [d for d in cluster.devices if d.num_gpus > 1]
    if virtual:
        d = virtual[0]
        raise BundleError(f"device '{d.name}' is a virtual device of {d.num_gpus} GPUs but the runner runs one process "
                          f"per device: plan for a per-GPU cluster spec (e.g. sample_clusters/hap_paper_testbed.json "
                          f"instead of hap_paper_testbed_machines.json)")


def _short(names: Sequence[str]) -> str:
    return "[" + ", ".join(map(str, names[:4])) + (", ..." if len(names) > 4 else "") + f"] ({len(names)})"


def _family(name: str) -> list[str]:
    """Lower-case alphanumeric tokens of a GPU name without vendor words ('NVIDIA A100-SXM4-40GB' -> a100 sxm4 40gb)."""
    return [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t not in ("nvidia", "tesla", "geforce")]


def gpu_type_check(rank: int, device: str, planned: str, actual: str | None) -> tuple[str, str]:
    """(`ok` | `skipped` | `mismatch`, message) for rank `rank` planned on `device` of type `planned`.

    `actual` is torch.cuda.get_device_name() of the rank's GPU, or None without CUDA. Types match
    when the planned type's first token (the GPU family, e.g. `a100`) is a token of the actual
    name: 'A100-SXM4-40GB' matches 'NVIDIA A100-SXM4-40GB' and 'NVIDIA A100 80GB PCIe'.
    """
    if actual is None:
        if planned.strip().lower() == "cpu":
            return "ok", f"rank {rank}: CPU, as planned for device {device}"
        return "skipped", (f"rank {rank}: GPU type check skipped: no CUDA here, the plan puts this rank on "
                           f"device {device} ({planned})")
    want, have = _family(planned), _family(actual)
    if want and want[0] in have:
        return "ok", f"rank {rank}: {actual}, as planned for device {device} ({planned})"
    return "mismatch", (f"rank {rank} runs on a '{actual}' but the plan puts it on device {device} of type "
                        f"'{planned}'; the plan's ratios assume that type (check the node order of the launch)")


# ----------------------------------------------------------------------------- model source


def model_source(plan: AnyPlan, model_file: str | Path | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """model.json's content and the extra files of the bundle: the plan's model file (from the path
    its origin names, or `model_file`), checked against the sha256 the plan recorded."""
    origin = plan.graph.origin
    files: dict[str, bytes] = {}
    if model_file is not None or "file" in origin:
        path = Path(model_file if model_file is not None else origin["file"])
        if not path.exists():
            raise BundleError(f"model file '{path}' not found: give --model-file with the Python file that defines the model")
        if why := grammar.file_name_problem(path.name):
            raise BundleError(f"model file name {why}: rename the file (and plan again) to ship it in a bundle")
        data = read_bytes(path, f"model file '{path}'", BundleError, max_bytes=limits.MAX_MODEL_FILE_BYTES,
                          expect="a Python file (.py)")
        if "sha256" in origin and sha256(data) != origin["sha256"]:
            raise BundleError(f"model file '{path}' is not the plan's (sha256 {sha256(data)[:12]}... != "
                              f"{str(origin['sha256'])[:12]}...): it changed since the plan was made; plan again")
        files[f"model/{path.name}"] = data
    return model_json(plan, next(iter(files), None)), files


def model_json(plan: AnyPlan, file: str | None) -> dict[str, Any]:
    """model.json's content: how the runner rebuilds the plan's model (`file` is the bundle's model/NAME)."""
    origin = plan.graph.origin
    src: dict[str, Any] = {"kind": "hap.model_source", "name": plan.graph.name,
                           "fingerprint": plan.graph.fingerprint()}
    if file is not None:
        src["file"] = file
    if "zoo" in origin:
        src.update(zoo=origin["zoo"], config=origin.get("config", {}))
    elif "hf" in origin:
        src.update(hf=origin["hf"], config=origin.get("config", {}), inputs=origin.get("inputs", {}))
        if "implementation" in origin:
            src["implementation"] = origin["implementation"]
    elif file is None:
        raise BundleError(f"plan's model '{plan.graph.name}' is not a zoo model and names no model file or hf class "
                          f"(origin {origin}); pass --model-file with the Python file that defines it")
    else:
        src["origin"] = origin
    return src


def bundled_model_file(files: dict[str, bytes], plan: AnyPlan) -> tuple[str | None, list[str]]:
    """(path in the bundle of the plan's model file, problems): model.json must name a file of the bundle
    whose sha256 is the one the plan recorded, before anything imports it."""
    origin = plan.graph.origin
    if "file" not in origin:
        return None, []
    try:
        rel = parse_json(files.get("model.json", b"{}"), "model.json", BundleError).get("file")
    except (ValueError, AttributeError):
        return None, ["model.json does not parse"]
    if not isinstance(rel, str) or rel not in files:
        return None, [f"model.json: the plan's model file ({Path(origin['file']).name}) is not in the bundle"]
    if sha256(files[rel]) != origin.get("sha256"):
        return None, [f"{rel}: sha256 differs from the model file the plan was made for"]
    return rel, []


# ----------------------------------------------------------------------------- export


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("torch", "hap-workbench"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def bundle_files(plan: AnyPlan, cluster: Cluster, *, model_file: str | Path | None = None,
                 nodes: Sequence[LaunchNode] | None = None, settings: ExportSettings = ExportSettings(),
                 created: str | None = None, setup: bytes | None = None) -> dict[str, bytes]:
    """Every file of the bundle (path -> bytes), manifest included. BundleError, naming the field, when
    a value that would reach a launch file is outside its grammar (engine.bundle.grammar).
    `setup` is the prelude shipped as SETUP_FILE (an input like the model file: hashed, never regenerated)."""
    nodes = launch_nodes(plan, cluster) if nodes is None else check_nodes(plan, cluster, nodes)
    if (setup is not None) != settings.setup:
        raise BundleError(f"--setup: the export settings say setup={settings.setup} but "
                          f"{'no' if setup is None else 'a'} {SETUP_FILE} was given")
    source, extra = model_source(plan, model_file)
    if setup is not None:
        extra = {**extra, SETUP_FILE: setup}
    files: dict[str, bytes] = {"plan.json": plan.to_json().encode(),
                               "cluster.json": (json.dumps(cluster.to_dict(), indent=1) + "\n").encode(), **extra}
    files.update(generated_files(plan, cluster, nodes, settings, source.get("file")))
    files[MANIFEST] = manifest_json(files, plan, cluster, nodes, created, source, settings).encode()
    return files


GENERATED = ("model.json", "launch_node.sh", "slurm.sbatch", "pytorchjob.yaml", "trainjob.yaml", "jobset.yaml",
             ANNOTATIONS, "README.md")
"""The files that are a pure function of plan.json, cluster.json, the nodes and the export settings:
`hap bundle check` writes them again and compares."""


def generated_files(plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode], settings: ExportSettings,
                    model_file: str | None) -> dict[str, bytes]:
    """model.json, the launch files, the annotations (when asked for) and the README, as `hap export` writes them."""
    s = launch_settings(plan, cluster, nodes, settings)
    files = {"model.json": (json.dumps(model_json(plan, model_file), indent=1) + "\n").encode()}
    texts = {"launch_node.sh": launch_node_script(nodes, s), "slurm.sbatch": slurm_script(nodes, s)}
    manifests, skipped = kubernetes_files(nodes, s)
    for name, text in {**texts, **manifests}.items():
        files[name] = text.encode()
    if settings.annotations:
        if plan.parallelism != "spmd":
            raise BundleError("--annotations: HSPMD annotations describe an SPMD plan's sharded tensors, and a "
                              f"{plan.parallelism} plan has none; export it without --annotations")
        from engine.elastic.annotations import annotations_json

        files[ANNOTATIONS] = (json.dumps(annotations_json(plan), indent=1) + "\n").encode()
    files["README.md"] = readme_text(plan, cluster, nodes, s, skipped).encode()
    return files


def manifest_json(files: dict[str, bytes], plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode],
                  created: str | None, source: dict[str, Any], settings: ExportSettings) -> str:
    manifest = {"kind": "hap.bundle", "schema_version": BUNDLE_SCHEMA_VERSION,
                "created": created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "packages": package_versions(), "parallelism": plan.parallelism, "world_size": plan.world_size,
                "model": {k: source[k] for k in ("name", "zoo", "hf", "file") if k in source},
                "export": settings.to_dict(),
                "nodes": [{"node_rank": n.node_rank, "machine": n.machine, "nproc": n.nproc, "ranks": list(n.ranks)}
                          for n in nodes],
                "ranks": rank_table(cluster, nodes),
                "files": {name: {"sha256": sha256(data), "bytes": len(data)} for name, data in sorted(files.items())}}
    return json.dumps(manifest, indent=1) + "\n"


def bundle_digest(files: dict[str, bytes]) -> str:
    """The bundle's digest: the sha256 of manifest.json, which holds the sha256 of every other file."""
    return sha256(files[MANIFEST])


def digest_problem(files: dict[str, bytes], expected: str) -> str | None:
    """Why the bundle is not the one whose digest is `expected` (hex, optionally `sha256:`-prefixed), or None."""
    want = expected.strip().lower().removeprefix("sha256:")
    have = bundle_digest(files) if MANIFEST in files else "(no manifest.json)"
    if have == want:
        return None
    return (f"digest mismatch: this bundle's manifest.json has sha256 {have}, not the {want} given by --digest; "
            "it is not the bundle that was exported (ask its author for the digest `hap export` printed)")


def find_cluster(plan: AnyPlan, cluster: str | Path | Cluster | None) -> Cluster:
    """The given cluster spec, else the sample cluster of the plan's name when its fingerprint matches."""
    if cluster is not None:
        return load_cluster(cluster)
    sample = SAMPLES_DIR / f"{plan.cluster_name}.json"
    if sample.is_file():
        found = load_cluster(sample)
        if found.fingerprint() == plan.cluster_fingerprint:
            return found
    raise BundleError(f"plan was made for cluster '{plan.cluster_name}', which is not a sample cluster: "
                      "pass --cluster with its spec JSON")


def validated(plan: AnyPlan) -> AnyPlan:
    """`plan` after the validator's checks (a plan made in code has not been through `engine.load_plan`)."""
    if plan.parallelism == "spmd":
        validate_plan(plan)  # type: ignore[arg-type]
    elif plan.graph is None:
        plan.to_dict()  # PlanError: a pipeline plan has no graph to embed
    else:
        check_pipeline_plan(plan)  # type: ignore[arg-type]
    return plan


def check_on_cluster(plan: AnyPlan, cluster: Cluster) -> list[str]:
    """PlanError unless `plan` runs on `cluster`'s devices; the warnings: an SPMD plan re-priced on it
    (engine.spmd.validate), a pipeline plan whose cluster spec changed (its fingerprint) since it was made."""
    if plan.parallelism == "spmd":
        return validate_plan(plan, cluster)  # type: ignore[arg-type]
    check_devices(plan, cluster)
    if cluster.fingerprint() != plan.cluster_fingerprint:
        return [f"the pipeline plan was made for cluster '{plan.cluster_name}' (fingerprint "
                f"{plan.cluster_fingerprint[:12]}...) but cluster '{cluster.name}' has fingerprint "
                f"{cluster.fingerprint()[:12]}...: the cluster spec changed since the plan was made (re-profiled?); "
                "plan again to use the new figures"]
    return []


def plan_warnings(plan: AnyPlan, cluster: Cluster | str | Path | None) -> list[str]:
    """The validator's warnings for `plan` on the cluster a bundle ships (see `check_on_cluster`)."""
    return check_on_cluster(plan, find_cluster(plan, cluster))


def export_bundle(plan: AnyPlan | str | Path, cluster: Cluster | str | Path | None, out_dir: str | Path, *,
                  zip: bool = False, model_source: str | Path | None = None,
                  nodes: Sequence[LaunchNode] | None = None, rdzv_endpoint: str | None = None,
                  image: str = DEFAULT_IMAGE, run_args: Sequence[str] = (), annotations: bool = False,
                  slurm: dict[str, str | None] | None = None, setup: str | Path | None = None) -> Path:
    """Write the bundle folder `out_dir` (and `out_dir`.zip with `zip=True`); returns the folder.

    `model_source` is a user's model file to ship (zoo plans carry their name and config);
    `nodes` overrides the grouping of devices into nodes (default: by the cluster's machines);
    `run_args` are runner options for the Kubernetes files (the scripts take them on their command line);
    `slurm` the #SBATCH settings (partition, account, time, qos; ExportSettings.SLURM); `setup` a prelude file
    shipped as SETUP_FILE and sourced before torchrun on every node.
    """
    plan = load_plan(plan) if isinstance(plan, (str, Path)) else validated(plan)
    cl = find_cluster(plan, cluster)
    unknown = sorted(set(slurm or {}) - set(ExportSettings.SLURM))
    if unknown:
        raise BundleError(f"slurm settings: {', '.join(unknown)} unknown; known: {', '.join(ExportSettings.SLURM)}")
    settings = ExportSettings(rdzv_endpoint=rdzv_endpoint, image=image, run_args=tuple(run_args),
                              annotations=annotations, setup=setup is not None, **(slurm or {}))
    prelude = None if setup is None else read_bytes(Path(setup), f"--setup file '{setup}'", BundleError,
                                                    max_bytes=limits.MAX_MODEL_FILE_BYTES)
    files = bundle_files(plan, cl, model_file=model_source, nodes=nodes, settings=settings, setup=prelude)
    out = Path(out_dir)
    if not out.name:  # '', '.' or '/': the bundle (and its zip) needs a folder name of its own
        raise BundleError(f"--out {str(out_dir)!r} names no new folder: give one, e.g. --out bundle")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"--out {out} exists and is not an empty folder: choose a new folder")
    for name, data in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if name in EXECUTABLE:
            path.chmod(0o755)
    if zip:
        out.with_name(out.name + ".zip").write_bytes(zip_bytes(files, out.name))
    return out


def zip_bytes(files: dict[str, bytes], root: str) -> bytes:
    """A deterministic zip of the files under folder `root`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(files):
            info = zipfile.ZipInfo(f"{root}/{name}", date_time=_ZIP_DATE)
            info.external_attr = ((0o755 if name in EXECUTABLE else 0o644) | stat.S_IFREG) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, files[name])
    return buf.getvalue()


# ----------------------------------------------------------------------------- check


@dataclass
class BundleReport:
    """What `check_bundle` found: `problems` empty means valid."""

    path: str
    problems: list[str] = field(default_factory=list)
    world_size: int | None = None
    parallelism: str | None = None
    """The plan's kind: "spmd" or "pipeline"."""
    files: int = 0
    warnings: list[str] = field(default_factory=list)
    """Not fatal: e.g. the plan's predicted time re-priced differently on cluster.json (engine.spmd.validate)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        warned = [f"warning: {w}" for w in self.warnings]
        if self.ok:
            kind = "" if self.parallelism == "spmd" else f", {self.parallelism} plan"
            return "\n".join(warned + [f"bundle {self.path}: OK ({self.files} files checked, world size "
                                        f"{self.world_size}{kind})"])
        return "\n".join(warned + [f"bundle {self.path}: INVALID"] + [f"  {p}" for p in self.problems])


def check_files(files: dict[str, bytes], label: str) -> BundleReport:
    """Validate a bundle's files: manifest, every sha256, no extra file, plan, cluster and world sizes."""
    report = BundleReport(label)
    if MANIFEST not in files:
        report.problems.append(f"{MANIFEST} missing: not a bundle (make one with `hap export PLAN --out DIR`)")
        return report
    try:
        manifest = parse_json(files[MANIFEST], MANIFEST, BundleError)
        listed = manifest["files"]
        if manifest.get("kind") != "hap.bundle" or not isinstance(listed, dict):
            raise ValueError("kind is not hap.bundle")
        if manifest.get("schema_version") not in range(1, BUNDLE_SCHEMA_VERSION + 1):
            raise ValueError(f"schema_version {json.dumps(manifest.get('schema_version'))[:40]} is not one this "
                             f"hap-workbench reads (1..{BUNDLE_SCHEMA_VERSION}); a newer one made it?")
    except (ValueError, KeyError, TypeError) as e:
        report.problems.append(f"{MANIFEST} does not parse as a bundle manifest: {e}")
        return report
    report.problems += _file_problems(files, listed)
    report.files = len(listed)
    if "plan.json" not in files:
        report.problems.append("plan.json missing")
        return report
    try:
        plan = load_plan(files["plan.json"].decode())
    except (PlanError, UnicodeDecodeError) as e:
        report.problems.append(f"plan.json: {e}")
        return report
    report.world_size, report.parallelism = plan.world_size, plan.parallelism
    if manifest.get("parallelism", "spmd") != plan.parallelism:
        report.problems.append(f"{MANIFEST}: parallelism {json.dumps(manifest.get('parallelism'))} but plan.json "
                               f"is a {plan.parallelism} plan")
    report.problems += bundled_model_file(files, plan)[1]
    report.problems += _size_problems(files, manifest, plan)
    if not report.problems:
        try:  # the plan against the bundle's cluster: devices, and the predicted time re-priced or the fingerprint
            cluster = load_cluster(parse_json(files["cluster.json"], "cluster.json", BundleError))
            report.warnings += check_on_cluster(plan, cluster)
        except PlanError as e:
            report.problems.append(f"plan.json: {e}")
            return report
        if manifest.get("schema_version") == 1:
            report.warnings.append(OLD_SCHEMA_WARNING)
        else:
            report.problems += regeneration_problems(files, manifest, plan, cluster)
    return report


OLD_SCHEMA_WARNING = (f"{MANIFEST}: schema 1 (made before hap-workbench recorded its export settings): its launch "
                      "files are vouched for by their hashes only, not written again and compared; `hap run` does "
                      "not use them, and `hap export` makes a bundle whose launch files are checked")


def regeneration_problems(files: dict[str, bytes], manifest: dict[str, Any], plan: AnyPlan,
                          cluster: Cluster) -> list[str]:
    """The generated files (GENERATED) written again from plan.json, cluster.json, the manifest's nodes and export
    settings, and compared: a hand-edited launch script is refused even when its hash was edited too."""
    inputs = {"plan.json", "cluster.json", MANIFEST}
    export = manifest.get("export")
    if isinstance(export, dict) and export.get("setup") is True:
        inputs.add(SETUP_FILE)  # the author's prelude: an input, covered by its hash, not written again
    models = sorted(n for n in files if n.startswith("model/"))
    strays = sorted(n for n in files if n not in inputs and n not in GENERATED and n not in models[:1])
    if strays:
        return [f"{name}: not a file `hap export` writes; a bundle holds only its plan, cluster, model and "
                "generated files" for name in strays]
    try:
        settings = ExportSettings.from_dict(manifest.get("export"), f"{MANIFEST} export")
        nodes = check_nodes(plan, cluster, manifest_nodes(manifest, plan.world_size))
        expected = generated_files(plan, cluster, nodes, settings, models[0] if models else None)
    except BundleError as e:
        return [str(e)]
    problems = [] if not settings.setup or SETUP_FILE in files else \
        [f"{SETUP_FILE}: missing, but the manifest's export settings say the bundle ships one (--setup)"]
    for name in GENERATED:
        have, want = files.get(name), expected.get(name)
        if have is None and want is not None:
            problems.append(f"{name}: missing, but `hap export` writes it for this plan and these export settings")
        elif have is not None and want is None:
            problems.append(f"{name}: `hap export` does not write this file for this plan and these export settings")
        elif have != want:
            problems.append(f"{name}: not the file `hap export` writes for this plan, cluster and export settings "
                            f"({first_difference(have, want)}); export the bundle again")
    return problems


def first_difference(have: bytes, want: bytes) -> str:
    """'line N is ... where export writes ...' for the first line where two texts differ (both shown quoted)."""
    a, b = have.decode(errors="replace").split("\n"), want.decode(errors="replace").split("\n")
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x != y:
            return f"line {i + 1} is {_quoted(x)} where export writes {_quoted(y)}"
    return "the same lines, other bytes"


def _quoted(line: str | None) -> str:
    if line is None:
        return "past the end"
    text = repr(line)
    return text if len(text) <= 100 else text[:97] + "..."


def _file_problems(files: dict[str, bytes], listed: dict[str, Any]) -> list[str]:
    problems = []
    for name in sorted(listed):
        if name not in files:
            problems.append(f"missing file: {name} (listed in {MANIFEST})")
        elif not isinstance(listed[name], dict) or sha256(files[name]) != listed[name].get("sha256"):
            problems.append(f"changed file: {name} (sha256 differs from {MANIFEST})")
    for name in sorted(set(files) - set(listed) - {MANIFEST}):
        problems.append(f"extra file: {name} (not in {MANIFEST})")
    return problems


_NNODES = re.compile(r"--nnodes=(\d+)")
_NPROC = re.compile(r"--nproc-per-node=(\d+)")


def _size_problems(files: dict[str, bytes], manifest: dict[str, Any], plan: AnyPlan) -> list[str]:
    """World size of the plan against the manifest, the cluster and every launch script."""
    w = plan.world_size
    out = []
    if manifest.get("world_size") != w:
        out.append(f"{MANIFEST}: world_size {manifest.get('world_size')} but plan.json has {w} devices")
    try:
        nodes = manifest_nodes(manifest, w)
    except BundleError as e:
        out.append(str(e))
        nodes = ()
    try:
        cluster = load_cluster(parse_json(files.get("cluster.json", b"null"), "cluster.json", BundleError))
        if [d.name for d in cluster.devices] != list(plan.device_names):
            out.append(f"cluster.json: devices {_short([d.name for d in cluster.devices])} are not the plan's {_short(plan.device_names)}")
    except (HapError, ValueError) as e:
        out.append(f"cluster.json: {e}")
    if "launch_node.sh" in files:
        text = files["launch_node.sh"].decode(errors="replace")
        procs, nnodes = [int(x) for x in _NPROC.findall(text)], {int(x) for x in _NNODES.findall(text)}
        if sum(procs) != w or nnodes != {len(procs)}:
            out.append(f"launch_node.sh: {len(procs)} torchrun lines with --nnodes {sorted(nnodes)} and "
                       f"--nproc-per-node {procs} (sum {sum(procs)}) do not launch {w} ranks")
    for name in ("slurm.sbatch", "pytorchjob.yaml", "jobset.yaml"):
        if name in files:
            text = files[name].decode(errors="replace")
            nnodes = {int(x) for x in _NNODES.findall(text)}
            if nnodes != {len(nodes)}:
                out.append(f"{name}: --nnodes {sorted(nnodes)} but the manifest lists {len(nodes)} nodes")
    return out


def manifest_nodes(manifest: dict[str, Any], world_size: int) -> tuple[LaunchNode, ...]:
    """The manifest's launch nodes, checked: numbered 0.., each with a machine, its ranks and their count,
    all ranks together 0..world_size-1 in order (torchrun's numbering); BundleError naming the first problem."""
    nodes = manifest.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise BundleError(f"{MANIFEST}: nodes must be a non-empty list of launch nodes")
    out = []
    for i, n in enumerate(nodes):
        ok = (isinstance(n, dict) and n.get("node_rank") == i and type(n.get("node_rank")) is int
              and isinstance(n.get("machine"), str) and isinstance(n.get("ranks"), list)
              and all(type(r) is int for r in n["ranks"]) and n.get("nproc") == len(n["ranks"]))
        if not ok:
            raise BundleError(f"{MANIFEST}: nodes[{i}] must be {{node_rank: {i}, machine: NAME, ranks: [...], "
                              f"nproc: len(ranks)}}, got {json.dumps(n)[:120]}")
        out.append(LaunchNode(i, n["machine"], tuple(n["ranks"])))
    ranks = [r for n in out for r in n.ranks]
    if ranks != list(range(world_size)):
        raise BundleError(f"{MANIFEST}: nodes run ranks {_short([str(r) for r in ranks])} but plan.json has "
                          f"{world_size} devices (ranks 0..{world_size - 1} in order)")
    return tuple(out)


def check_bundle(path: str | Path, digest: str | None = None) -> BundleReport:
    """Validate a bundle folder or zip without running it (`hap bundle check`); with `digest`, also that it
    is the bundle whose manifest.json has that sha256 (the digest `hap export` printed)."""
    p = Path(path)
    try:
        if p.is_dir():
            files = read_folder(p)
        elif p.is_file():
            files = read_zip(p)
        else:
            return BundleReport(str(path), [f"{path} not found: give a bundle folder or zip from `hap export`"])
    except BundleError as e:
        return BundleReport(str(path), [str(e)])
    if digest is not None and (why := digest_problem(files, digest)):
        return BundleReport(str(path), [why])
    return check_files(files, str(path))


@dataclass(frozen=True)
class OpenedBundle:
    """A checked bundle folder: where its plan is, the cluster (GPU type of every rank), the nodes."""

    folder: Path
    plan_path: Path
    cluster: Cluster
    nodes: tuple[LaunchNode, ...]


def open_bundle(folder: str | Path, digest: str | None = None) -> OpenedBundle:
    """Check a bundle folder (`hap run` and every rank call this before the first step), and its digest when
    given (`--digest`); BundleError if invalid."""
    report = check_bundle(folder, digest)
    if not report.ok:
        raise BundleError(f"bundle {folder} is invalid: " + "; ".join(report.problems))
    f = Path(folder)
    manifest = parse_json(read_bytes(f / MANIFEST, f"{folder}/{MANIFEST}", BundleError), MANIFEST, BundleError)
    nodes = manifest_nodes(manifest, load_plan(f / "plan.json").world_size)
    return OpenedBundle(f, f / "plan.json", load_cluster(f / "cluster.json"), nodes)


def plan_parallelism(path: str | Path) -> str | None:
    """"spmd" or "pipeline" by the "kind" of a plan file or of a bundle's plan.json (folder or zip),
    read without checks (a rank picks its entry by it, which then checks everything); None when unreadable."""
    p = Path(path)
    try:
        if is_bundle(p):
            data = read_bytes(p / "plan.json", f"{p}/plan.json", BundleError) if p.is_dir() else read_zip(p)["plan.json"]
            d = parse_json(data, "plan.json", BundleError)
        else:
            d = read_plan_json(str(p))
    except (HapError, KeyError, ValueError, OSError):
        return None
    kind = d.get("kind") if isinstance(d, dict) else None
    return {"hap.plan": "spmd", PIPELINE_PLAN_KIND: "pipeline"}.get(kind)  # type: ignore[arg-type]


def model_file_of(opened: OpenedBundle) -> Path | None:
    """The bundle's copy of its plan's model file (None for zoo and hf: plans); BundleError unless its
    sha256 is the plan's, so nothing imports another file."""
    rel, problems = bundled_model_file(read_folder(opened.folder), load_plan(opened.plan_path))
    if problems:
        raise BundleError(f"bundle {opened.folder} is invalid: " + "; ".join(problems))
    return opened.folder / rel if rel else None


def plan_rank(nodes: Sequence[LaunchNode], node_rank: int, local_rank: int, local_world_size: int) -> int:
    """The plan device (= rank) that local rank `local_rank` of bundle node `node_rank` runs.

    torchrun's c10d rendezvous numbers the nodes in an order of its own (by host name), so the
    launch files tell each rank its bundle node (HAP_NODE_RANK) and the runner joins the process
    group as the rank the bundle gave it: rank r runs plan device r wherever its node came.
    """
    if not 0 <= node_rank < len(nodes):
        raise BundleError(f"HAP_NODE_RANK={node_rank} but the bundle has nodes 0..{len(nodes) - 1}")
    node = nodes[node_rank]
    if local_world_size != node.nproc:
        raise BundleError(f"node {node_rank} (machine {node.machine}) runs {node.nproc} ranks in the bundle but this "
                          f"launch started {local_world_size} (LOCAL_WORLD_SIZE); use --nproc-per-node={node.nproc}")
    return node.ranks[local_rank]
