"""The launch files of a bundle: torchrun per node, Slurm, Kubeflow PyTorchJob and TrainJob or a JobSet, README.

Each is plain text, a pure function of the plan, the cluster, the bundle's nodes
(engine.bundle.archive.launch_nodes) and the export settings (`ExportSettings`, recorded whole in
the manifest), so `hap bundle check` can write them again and compare. The YAML is written without a
yaml dependency, deterministically (block style, strings JSON-quoted).
Rank r runs plan device r; node k runs a consecutive block of ranks, as torchrun numbers them.

Kubernetes: every pod asks for its node's GPU count and selects machines by their GPU type (the
`nvidia.com/gpu.product` label of GPU feature discovery; a device's `gpu_product`, else its `gpu_model`).
A PyTorchJob has one Worker template and a TrainJob one trainer, so they are written only when every
machine has one GPU type (and, for them, as many ranks); any other plan gets `jobset.yaml`, a JobSet
with one replicated job per node that knows its node number.

No value from the plan, the cluster or an option is ever code: every one is checked against its
grammar first (engine.bundle.grammar; `launch_problems`), shell gets it through `shlex.quote`, YAML
as a quoted scalar, and none can start a new line.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, fields
from typing import Any, Sequence

from engine.bundle import grammar
from engine.cluster.spec import Cluster, Device
from engine.errors import BundleError
from engine.planner import AnyPlan

DEFAULT_RDZV_PORT = 29500
DEFAULT_RDZV_TIMEOUT_S = 600
"""How long launch_node.sh waits for every node to join the rendezvous (torchrun's own default)."""
DEFAULT_IMAGE = "hap-workbench:latest"
CONTAINER_BUNDLE_DIR = "/workspace/bundle"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label GPU feature discovery sets to the GPU's product name; nodeSelectors pin GPU types by it."""


@dataclass(frozen=True)
class LaunchNode:
    """One machine of the launch: `torchrun --node-rank=node_rank --nproc-per-node=len(ranks)`."""

    node_rank: int
    machine: str
    ranks: tuple[int, ...]
    """Plan devices (= global ranks) this node runs, consecutive."""

    @property
    def nproc(self) -> int:
        return len(self.ranks)


def rank_table(cluster: Cluster, nodes: Sequence[LaunchNode]) -> list[dict[str, Any]]:
    """Rank -> (node, local rank, device, GPU type), as written to the manifest and the README."""
    rows = []
    for node in nodes:
        for local, r in enumerate(node.ranks):
            d = cluster.devices[r]
            rows.append({"rank": r, "node_rank": node.node_rank, "local_rank": local, "machine": d.machine,
                         "device": d.name, "gpu_model": d.gpu_model})
    return rows




@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """Everything `hap export` is told besides the plan, the cluster and the nodes.

    The manifest records every field (`to_dict`), so the launch files can be regenerated and compared;
    a field added here (e.g. a scheduler partition) is recorded, regenerated and grammar-checked the
    same way once `problems` checks it.
    """

    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous; None is node 0's machine, port DEFAULT_RDZV_PORT."""
    image: str = DEFAULT_IMAGE
    """Container image holding hap-workbench and the bundle at CONTAINER_BUNDLE_DIR (Kubernetes)."""
    run_args: tuple[str, ...] = ()
    """Runner options written into the Kubernetes files (e.g. --steps 100), where nobody types them."""
    annotations: bool = False
    """Ship the plan's HSPMD annotations (engine.elastic.annotations)."""
    partition: str | None = None
    """Slurm partition (#SBATCH --partition), of every job component; None: the cluster's default."""
    account: str | None = None
    """Slurm account (#SBATCH --account); None: the user's default."""
    time: str | None = None
    """Slurm time limit (#SBATCH --time) in one of sbatch's formats; None: the partition's default."""
    qos: str | None = None
    """Slurm quality of service (#SBATCH --qos); None: the default."""
    setup: bool = False
    """The bundle ships SETUP_FILE (`hap export --setup`), sourced on every node before torchrun."""

    OPTIONS = {"rdzv_endpoint": "--rdzv-endpoint", "image": "--image", "run_args": "--run-args",
               "annotations": "--annotations", "partition": "--partition", "account": "--account", "time": "--time",
               "qos": "--qos", "setup": "--setup"}
    SLURM = ("partition", "account", "time", "qos")
    """The fields written as `#SBATCH --FIELD=VALUE` lines."""
    """The `hap export` option of each field, for messages."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ExportSettings":
        """The settings a manifest records; BundleError naming the first unknown or mistyped field."""
        if not isinstance(d, dict):
            raise BundleError(f"{where}: must be an object of export settings, got {json.dumps(d)[:80]}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise BundleError(f"{where}.{key}: not an export setting of this hap-workbench (a newer one made the "
                                  f"bundle?); known: {', '.join(sorted(known))}")
        text_or_none = (str, type(None))
        types = {"rdzv_endpoint": text_or_none, "image": str, "run_args": list, "annotations": bool,
                 "partition": text_or_none, "account": text_or_none, "time": text_or_none, "qos": text_or_none,
                 "setup": bool}
        for key, want in types.items():
            if key in d and not isinstance(d[key], want):
                raise BundleError(f"{where}.{key}: wrong type {type(d[key]).__name__}")
        values = dict(d)
        if "run_args" in values:
            values["run_args"] = tuple(values["run_args"])
        return cls(**values)

    def problems(self) -> list[str]:
        """Why a field is outside its grammar, one line each naming the option and what is allowed."""
        checks = [("rdzv_endpoint", None if self.rdzv_endpoint is None else grammar.endpoint_problem(self.rdzv_endpoint)),
                  ("image", grammar.image_problem(self.image)), ("run_args", grammar.run_args_problem(self.run_args))]
        checks += [(name, None if (v := getattr(self, name)) is None else
                    (grammar.slurm_time_problem if name == "time" else grammar.slurm_name_problem)(v))
                   for name in self.SLURM]
        return [f"{self.OPTIONS[name]}: {why}" for name, why in checks if why]


@dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    """What the launch scripts need besides the nodes: the export settings and what the plan decides."""

    job: str
    """Job name (a Kubernetes name), used for rendezvous id, Slurm and Kubernetes."""
    rdzv_endpoint: str
    """HOST:PORT of the c10d rendezvous (node 0's machine by default)."""
    image: str = DEFAULT_IMAGE
    gpus: bool = True
    """Ask launchers for one GPU per rank (False for CPU clusters)."""
    run_args: tuple[str, ...] = ()
    products: tuple[str | None, ...] = ()
    """Per node, the GPU product label value its pods select (None: not pinned, see `unpinned`)."""
    unpinned: tuple[str, ...] = ()
    """Why a node's pods select no GPU type, one line each (written as comments into the manifests)."""
    sbatch: tuple[tuple[str, str], ...] = ()
    """(option, value) of the job-wide #SBATCH lines from the export settings (partition, account, time, qos)."""
    node_slurm: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per bundle node, its machine's Slurm hints (engine.cluster.spec.SLURM_KEYS); () where none."""
    node_gpu: tuple[str, ...] = ()
    """Per bundle node, the GPU types of its machine (as shown in comments)."""
    setup: bool = False
    """Source SETUP_FILE before torchrun."""
    strict_device_check: bool = True
    """A heterogeneous job passes `--device-check error` (SPMD plans; a pipeline run refuses the option)."""


SETUP_FILE = "setup.sh"
"""The prelude `hap export --setup FILE` ships (module loads, environment activation), sourced before torchrun."""
LOG_DIR = "../logs"
"""Where slurm.sbatch sends the scheduler's output, beside the bundle (never in it: every rank refuses an extra
file); Slurm does not create it, the README says `mkdir -p ../logs` before sbatch."""


def job_name(plan: AnyPlan) -> str:
    raw = f"hap-{plan.graph.name}-{plan.cluster_name}"
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")[:52].rstrip("-")


def default_endpoint(machine: str) -> str:
    """node 0's machine at the default port ([ADDR]:PORT when the machine is an IPv6 address)."""
    host = f"[{machine}]" if ":" in machine and not machine.startswith("[") else machine
    return f"{host}:{DEFAULT_RDZV_PORT}"


def launch_settings(plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode], s: ExportSettings) -> LaunchSettings:
    """The launch scripts' settings, refused (BundleError, one line naming the field) unless every value
    that reaches a generated file is within its grammar (`launch_problems`)."""
    problems = launch_problems(plan, cluster, nodes, s)
    if problems:
        raise BundleError(f"{problems[0]} (refused: it would be written into the launch files)")
    gpus = any(d.gpu_model.strip().lower() != "cpu" for d in cluster.devices)
    pins = [node_product(cluster, n) if gpus else (None, None) for n in nodes]
    return LaunchSettings(job=job_name(plan), rdzv_endpoint=s.rdzv_endpoint or default_endpoint(nodes[0].machine),
                          image=s.image, gpus=gpus, run_args=tuple(s.run_args), products=tuple(p for p, _ in pins),
                          unpinned=tuple(why for _, why in pins if why),
                          sbatch=tuple((k, v) for k in ExportSettings.SLURM if (v := getattr(s, k)) is not None),
                          node_slurm=tuple(_node_slurm(cluster, n) for n in nodes),
                          node_gpu=tuple(_gpu_types(cluster, n) for n in nodes), setup=s.setup,
                          strict_device_check=plan.parallelism == "spmd")


def device_product(d: Device) -> str:
    """The GPU product label value a device's machine carries: its `gpu_product`, else its `gpu_model`."""
    return d.gpu_product if d.gpu_product is not None else d.gpu_model


def node_product(cluster: Cluster, node: LaunchNode) -> tuple[str | None, str | None]:
    """(label value, None) for the GPU type node's pods select, or (None, why the node is not pinned)."""
    values = {device_product(cluster.devices[r]) for r in node.ranks}
    if len(values) > 1:
        return None, (f"node {node.node_rank} (machine {_line(node.machine)}) holds several GPU types, "
                      "one label cannot select it")
    (value,) = values
    if grammar.label_value_problem(value):
        return None, (f"node {node.node_rank} (machine {_line(node.machine)}) selects no GPU type: gpu_model "
                      f"{_line(value)} is no label value; give its devices a gpu_product")
    return value, None


def _node_slurm(cluster: Cluster, node: LaunchNode) -> tuple[tuple[str, str], ...]:
    """The Slurm hints of the devices `node` runs; BundleError when they differ (one node is one job component)."""
    hints = {cluster.devices[r].slurm for r in node.ranks}
    if len(hints) > 1:
        raise BundleError(f"node {node.node_rank}: its ranks' devices carry different slurm hints "
                          f"({'; '.join(str(dict(h)) for h in sorted(hints))}); one node is one Slurm job component")
    return hints.pop()


def _gpu_types(cluster: Cluster, node: LaunchNode) -> str:
    """The GPU types of the devices `node` runs, e.g. 'A100-40GB' or 'A100-40GB+V100'."""
    return "+".join(dict.fromkeys(cluster.devices[r].gpu_model for r in node.ranks))


def slurm_hint_problems(cluster: Cluster) -> list[str]:
    """The devices' Slurm hints outside their grammar (each is written into an #SBATCH line), one line each."""
    out = []
    for r, d in enumerate(cluster.devices):
        for key, value in d.slurm:
            check = grammar.slurm_nodelist_problem if key == "nodelist" else grammar.slurm_name_problem
            if why := check(value):
                out.append(f"cluster device {r} slurm.{key}: {why}")
    return out


def launch_problems(plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode], s: ExportSettings) -> list[str]:
    """Every value outside its grammar among those the generated files hold, one line each naming the field."""
    out = [f"node {n.node_rank} machine {why}; rename the machine in the cluster spec"
           for n in nodes if (why := grammar.host_problem(n.machine))]
    out += s.problems()
    out += shown_name_problems(cluster)
    out += slurm_hint_problems(cluster)
    for what, value in (("model name", plan.graph.name), ("plan cluster name", plan.cluster_name),
                        ("plan summary", plan_summary(plan))):
        if why := grammar.text_problem(value):
            out.append(f"{what}: {why}")
    if why := grammar.k8s_name_problem(job_name(plan)):
        out.append(f"job name (from the model and cluster names): {why}")
    elif why := grammar.k8s_name_problem(jobset_host(job_name(plan), len(nodes) - 1)):
        out.append(f"JobSet pod host name of node {len(nodes) - 1}: {why}")
    out += [f"cluster device {r} gpu_product: {why}" for r, d in enumerate(cluster.devices)
            if d.gpu_product is not None and (why := grammar.label_value_problem(d.gpu_product))]
    return out


def shown_name_problems(cluster: Cluster) -> list[str]:
    """The cluster's names that the README and the comments show, outside their grammar."""
    out = [f"cluster name: {why}" for why in [grammar.text_problem(cluster.name)] if why]
    for r, d in enumerate(cluster.devices):
        for what, value in (("name", d.name), ("gpu_model", d.gpu_model)):
            if why := grammar.text_problem(value):
                out.append(f"cluster device {r} {what}: {why}")
    return out


def cluster_launch_warnings(cluster: Cluster) -> list[str]:
    """What `hap export` would refuse in this cluster spec (machines that are no host names, names with control
    characters), for `hap plan` and the workbench to warn about: a person who only plans is not stopped."""
    devices: dict[str, list[int]] = {}
    for r, d in enumerate(cluster.devices):
        devices.setdefault(d.machine, []).append(r)
    out = [f"{p}; `hap export` will refuse it" for p in slurm_hint_problems(cluster)]
    out += [f"machine of cluster device{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:8]))}"
           f"{', ...' if len(rs) > 8 else ''}: {why}; `hap export` will refuse it, rename the machine"
           for machine, rs in devices.items() if (why := grammar.host_problem(machine))]
    return out + [f"{p}; `hap export` will refuse it" for p in shown_name_problems(cluster)]


def torchrun_args(nnodes: int, node_rank: str, nproc: str, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's options for one node (values may be shell or Kubernetes variable references)."""
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]


def _line(value: str) -> str:
    """A value as written into a comment or prose: refused if it could start a new line (the grammar already
    keeps such values out; this keeps any caller of these functions from writing one)."""
    if grammar.text_problem(value):
        raise BundleError(f"{value!r} cannot be written into a launch file: {grammar.text_problem(value)}")
    return value


def launch_node_script(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str:
    """`bash launch_node.sh NODE_RANK [runner options]`: one torchrun line per node."""
    q = shlex.quote
    lines = ["#!/usr/bin/env bash",
             "# Run on every node of the job, each with its own NODE_RANK (see README.md):",
             "#   bash launch_node.sh NODE_RANK [runner options, e.g. --steps 100 --checkpoint-dir DIR --resume]",
             "# HAP_RDZV_ENDPOINT=HOST:PORT overrides the rendezvous (node 0's machine by default);",
             f"# HAP_RDZV_TIMEOUT=S is how long a node waits for the others to join (default {DEFAULT_RDZV_TIMEOUT_S} s).",
             "set -euo pipefail",
             'BUNDLE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
             f'NODE_RANK="${{1:?usage: launch_node.sh NODE_RANK [runner options] (NODE_RANK 0..{len(nodes) - 1})}}"',
             "shift",
             f"DEFAULT_RDZV_ENDPOINT={q(s.rdzv_endpoint)}",
             'RDZV_ENDPOINT="${HAP_RDZV_ENDPOINT:-$DEFAULT_RDZV_ENDPOINT}"',
             f'RDZV_TIMEOUT="${{HAP_RDZV_TIMEOUT:-{DEFAULT_RDZV_TIMEOUT_S}}}"',
             'case "$RDZV_TIMEOUT" in',
             "  ''|*[!0-9]*) echo \"launch_node.sh: HAP_RDZV_TIMEOUT must be a whole number of seconds, got $RDZV_TIMEOUT\" >&2; exit 2 ;;",
             "esac",
             "export HAP_NODE_RANK=\"$NODE_RANK\"  # the runner maps (node, local rank) to the plan's rank",
             "# torchrun reports a rendezvous that timed out as a bare RendezvousTimeoutError: say what it means",
             "explain_timeout() {",
             "  while IFS= read -r line; do",
             "    printf '%s\\n' \"$line\" >&2",
             "    case \"$line\" in *RendezvousTimeoutError*)",
             f'      printf \'%s\\n\' "launch_node.sh: node $NODE_RANK waited $RDZV_TIMEOUT s at $RDZV_ENDPOINT but not all '
             f'{len(nodes)} nodes joined: start \\`bash launch_node.sh K\\` on every node K in 0..{len(nodes) - 1} with the same '
             f'HAP_RDZV_ENDPOINT, or raise HAP_RDZV_TIMEOUT" >&2 ;;',
             "    esac",
             "  done",
             "}"]
    if s.setup:
        lines += [f"# {SETUP_FILE}: the prelude the bundle's author shipped (module loads, environment activation)",
                  f'set +u; source "$BUNDLE_DIR/{SETUP_FILE}"; set -u']
    lines += ['case "$NODE_RANK" in']
    for n in nodes:
        args = torchrun_args(len(nodes), str(n.node_rank), str(n.nproc), '"$RDZV_ENDPOINT"', q(s.job))
        args.append('--rdzv-conf=join_timeout="$RDZV_TIMEOUT"')
        lines.append(f"  {n.node_rank})  # machine {_line(n.machine)}: ranks {_span(n.ranks)}")
        lines.append(f'    exec torchrun {" ".join(args)} -m runner.launch "$BUNDLE_DIR" "$@" 2> >(explain_timeout) ;;')
    lines += [f'  *) echo "launch_node.sh: NODE_RANK must be 0..{len(nodes) - 1}, got $NODE_RANK" >&2; exit 2 ;;',
              "esac", ""]
    return "\n".join(lines)


def _span(ranks: Sequence[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def slurm_script(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str:
    """`sbatch slurm.sbatch [runner options]`: one task per node, each runs torchrun (c10d on the first host).

    A plain job when the machines are alike (same ranks, GPU types and Slurm hints); else a heterogeneous job,
    component k = bundle node k, each asking for its machine's hardware (`_component_lines`)."""
    if grammar.k8s_name_problem(s.job):  # an #SBATCH line is read by sbatch, not by a shell: no quoting helps there
        raise BundleError(f"job name {grammar.k8s_name_problem(s.job)}")
    hints = s.node_slurm or tuple(() for _ in nodes)
    gpu = s.node_gpu or tuple("" for _ in nodes)
    het = len({(n.nproc, h, g) for n, h, g in zip(nodes, hints, gpu)}) > 1
    head = ["#!/usr/bin/env bash", f"#SBATCH --job-name={s.job}", f"#SBATCH --output={LOG_DIR}/%x-%j.out",
            f"#SBATCH --error={LOG_DIR}/%x-%j.out"]
    if het:
        for n in nodes:
            head += [f"# component {n.node_rank} = bundle node {n.node_rank}: machine {_line(n.machine)}, "
                     f"ranks {_span(n.ranks)} ({_line(gpu[n.node_rank] or 'any')})", *_component_lines(n, hints[n.node_rank], s)]
            head += ["#SBATCH hetjob"] if n.node_rank < len(nodes) - 1 else []
    else:
        head += [f"#SBATCH --nodes={len(nodes)}", *_component_lines(nodes[0], hints[0], s)[1:]]
    if not any(hints):
        head += ["# Nothing pins the hardware: no device of the cluster spec has `slurm` hints (feature, gres_type,",
                 "# nodelist), so Slurm may start this job on other GPU types than planned (see README.md)."]
    head += ["# Submit from the bundle folder (on a file system every node sees); the job's output goes to",
             f"# {LOG_DIR}/JOBNAME-JOBID.out beside the bundle, a folder Slurm does not create:",
             f"#   mkdir -p {LOG_DIR} && sbatch slurm.sbatch [runner options, e.g. --steps 100 --checkpoint-dir DIR --resume]",
             "set -euo pipefail",
             'BUNDLE_DIR="${HAP_BUNDLE_DIR:-$SLURM_SUBMIT_DIR}"']
    nodelist = "$SLURM_JOB_NODELIST_HET_GROUP_0" if het else "$SLURM_JOB_NODELIST"
    head += [f'HEAD_NODE="$(scontrol show hostnames "{nodelist}" | head -n 1)"',
             f'export RDZV_ENDPOINT="$HEAD_NODE:{DEFAULT_RDZV_PORT}"']
    if het:
        return "\n".join(head + [_het_srun(nodes, s), ""])
    comment = [f"# node {n.node_rank} (SLURM_NODEID): ranks {_span(n.ranks)}, planned for machine {_line(n.machine)}"
               for n in nodes]
    return "\n".join(head + comment + [_plain_srun(nodes, s), ""])


def _component_lines(n: LaunchNode, hints: tuple[tuple[str, str], ...], s: LaunchSettings) -> list[str]:
    """The #SBATCH lines of one job component (one node): its size, the export's Slurm settings, its hardware."""
    h = dict(hints)
    lines = ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"]
    lines += [f"#SBATCH --{key}={_sbatch_value(key, value)}" for key, value in s.sbatch]
    if s.gpus:
        gres = h.get("gres_type")
        lines.append(f"#SBATCH --gres=gpu:{_sbatch_value('gres_type', gres)}:{n.nproc}" if gres
                     else f"#SBATCH --gpus-per-node={n.nproc}")
    if "feature" in h:
        lines.append(f"#SBATCH --constraint={_sbatch_value('feature', h['feature'])}")
    if "nodelist" in h:
        lines.append(f"#SBATCH --nodelist={_sbatch_value('nodelist', h['nodelist'])}")
    return lines


def _sbatch_value(key: str, value: str) -> str:
    """A value as written into an #SBATCH line (read by sbatch, not a shell): refused outside its grammar."""
    check = {"time": grammar.slurm_time_problem, "nodelist": grammar.slurm_nodelist_problem}.get(key,
                                                                                             grammar.slurm_name_problem)
    if why := check(value):
        raise BundleError(f"slurm {key} {why}")
    return value


def _task_command(node_rank: str, nproc: str, nnodes: int, s: LaunchSettings) -> str:
    """One srun task's `bash -c '...'` (single-quoted: variables are the task's, not the batch shell's)."""
    args = torchrun_args(nnodes, node_rank, nproc, '"$RDZV_ENDPOINT"', '"$SLURM_JOB_ID"')
    setup = f'set +u; source "$0/{SETUP_FILE}"; set -u; ' if s.setup else ""
    return (f"bash -c '{setup}export HAP_NODE_RANK={node_rank}; "
            f"exec torchrun {' '.join(args)} -m runner.launch \"$0\" \"$@\"'")


def _plain_srun(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str:
    """srun over a plain job (its nodes alike, each running as many ranks): node rank = SLURM_NODEID."""
    cmd = _task_command('"$SLURM_NODEID"', str(nodes[0].nproc), len(nodes), s)
    return f'srun --ntasks={len(nodes)} --ntasks-per-node=1 {cmd} "$BUNDLE_DIR" "$@"'


def _het_srun(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str:
    """One srun over every component: component k runs bundle node k (HAP_NODE_RANK=k, written in, not read from
    SLURM_NODEID, which a heterogeneous step numbers across components); a GPU-type mismatch stops the run
    (--device-check error before the user's options, which may override it; SPMD plans only). srun reads every bare
    ':' as the next component, so a runner option ':' cannot be passed (the runner takes none)."""
    strict = " --device-check error" if s.strict_device_check else ""
    parts = [f'--het-group={n.node_rank} --ntasks=1 {_task_command(str(n.node_rank), str(n.nproc), len(nodes), s)} '
             f'"$BUNDLE_DIR"{strict} "$@"' for n in nodes]
    return "srun " + " \\\n  : ".join(parts)


def _yaml_scalar(value: Any) -> str:
    """A YAML scalar: numbers bare, strings double-quoted (JSON escaping is valid YAML), {} and [] when empty."""
    if isinstance(value, (dict, list)):
        return "{}" if isinstance(value, dict) else "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines of nested dicts/lists of scalars (deterministic, no yaml dependency)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines += _yaml(v, indent + 2)
            else:
                lines.append(f"{pad}{k}: {_yaml_scalar(v)}")
    else:
        for item in value:
            if isinstance(item, (dict, list)) and item:
                sub = _yaml(item, indent + 2)
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines += sub[1:]
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
    return lines


def _container(s: LaunchSettings, args: list[str], nproc: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "pytorch", "image": s.image, "imagePullPolicy": "IfNotPresent",
                         "workingDir": CONTAINER_BUNDLE_DIR, "command": ["torchrun"], "args": args}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if s.gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": nproc}}
    return c


def _pod_spec(s: LaunchSettings, node: LaunchNode, container: dict[str, Any], restart: str) -> dict[str, Any]:
    """A pod spec running `container`, on a machine of node's GPU type when it has one to select."""
    spec: dict[str, Any] = {"restartPolicy": restart}
    product = s.products[node.node_rank] if s.products else None
    if product is not None:
        spec["nodeSelector"] = {GPU_PRODUCT_LABEL: product}
    spec["containers"] = [container]
    return spec


def _pin_comments(s: LaunchSettings) -> list[str]:
    """The header lines saying which GPU type the pods select, and which nodes select none."""
    if not s.gpus:
        return []
    return [f"# Pods select machines by the node label {GPU_PRODUCT_LABEL} (GPU feature discovery)."] + \
        [f"# {_line(why)}" for why in s.unpinned]


def one_gpu_type(s: LaunchSettings) -> bool:
    """Whether one pod template fits every node's GPU type (CPU clusters: always)."""
    return not s.gpus or len(set(s.products)) <= 1


def pytorchjob_yaml(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str | None:
    """A Kubeflow PyTorchJob; None when workers would need different process counts or GPU types (one Worker
    template)."""
    workers = nodes[1:]
    if len({n.nproc for n in workers}) > 1 or not one_gpu_type(s):
        return None
    header = ["# Kubeflow training operator PyTorchJob (kubeflow.org/v1): kubectl apply -f pytorchjob.yaml",
              f"# The image must hold hap-workbench and this bundle at {CONTAINER_BUNDLE_DIR} (see README.md).",
              "# The operator sets RANK (the pod's node rank), MASTER_ADDR and MASTER_PORT in every pod.",
              *_pin_comments(s)]

    def replica(n: LaunchNode, count: int) -> dict[str, Any]:
        args = torchrun_args(len(nodes), "$(RANK)", str(n.nproc), "$(MASTER_ADDR):$(MASTER_PORT)", s.job)
        args += ["-m", "runner.launch", CONTAINER_BUNDLE_DIR, *s.run_args]
        pod = _pod_spec(s, n, _container(s, args, n.nproc), "OnFailure")
        del pod["restartPolicy"]  # the replica's restartPolicy rules here
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    specs = {"Master": replica(nodes[0], 1)}
    if workers:
        specs["Worker"] = replica(workers[0], len(workers))
    doc = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": s.job},
           "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": specs}}
    return "\n".join(header + _yaml(doc) + [""])


def trainjob_yaml(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str | None:
    """A Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime; None unless every node runs as many
    ranks on one GPU type."""
    if len({n.nproc for n in nodes}) > 1 or not one_gpu_type(s):
        return None
    header = ["# Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1): kubectl apply -f trainjob.yaml",
              f"# The image must hold hap-workbench and this bundle at {CONTAINER_BUNDLE_DIR} (see README.md).",
              "# The torch-distributed runtime sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR",
              "# and PET_MASTER_PORT, which torchrun reads as its defaults."]
    if s.gpus and s.products and s.products[0] is not None:
        header.append(f"# It asks for GPUs, not their type: run it where every GPU is a {_line(s.products[0])} "
                      f"(or use pytorchjob.yaml, which selects {GPU_PRODUCT_LABEL}).")
    trainer: dict[str, Any] = {"image": s.image, "numNodes": len(nodes), "numProcPerNode": nodes[0].nproc,
                               "command": ["torchrun", "-m", "runner.launch", CONTAINER_BUNDLE_DIR, *s.run_args]}
    if s.gpus:
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": nodes[0].nproc}}
    doc = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": s.job},
           "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer}}
    return "\n".join(header + _yaml(doc) + [""])


def jobset_replica_name(node_rank: int) -> str:
    """The JobSet replicated job running bundle node `node_rank` (short: it is part of every pod's host name)."""
    return f"n{node_rank}"


def jobset_host(job: str, node_rank: int) -> str:
    """The host name JobSet gives the one pod of node `node_rank`: <jobset>-<replicated job>-<job index>-<pod index>."""
    return f"{job}-{jobset_replica_name(node_rank)}-0-0"


def jobset_yaml(nodes: Sequence[LaunchNode], s: LaunchSettings) -> str | None:
    """A JobSet (jobset.x-k8s.io/v1alpha2) with one replicated job per node, each pinned to its GPU type;
    None when a PyTorchJob fits (pytorchjob_yaml)."""
    if pytorchjob_yaml(nodes, s) is not None:
        return None
    endpoint = f"{jobset_host(s.job, 0)}.{s.job}:{DEFAULT_RDZV_PORT}"
    header = ["# JobSet (jobset.x-k8s.io/v1alpha2, needs the JobSet controller): kubectl apply -f jobset.yaml",
              f"# The image must hold hap-workbench and this bundle at {CONTAINER_BUNDLE_DIR} (see README.md).",
              "# One replicated job per bundle node (n0, n1, ...), each one pod that passes its node number to",
              "# torchrun and HAP_NODE_RANK; node 0's pod hosts the c10d rendezvous (the JobSet's headless service):",
              f"# {endpoint}",
              *_pin_comments(s)]

    def replicated(n: LaunchNode) -> dict[str, Any]:
        args = torchrun_args(len(nodes), str(n.node_rank), str(n.nproc), endpoint, s.job)
        strict = ["--device-check", "error"] if s.strict_device_check else []  # machines differ: a wrong GPU stops
        args += ["-m", "runner.launch", CONTAINER_BUNDLE_DIR, *strict, *s.run_args]
        container = _container(s, args, n.nproc, {"HAP_NODE_RANK": str(n.node_rank)})
        job = {"parallelism": 1, "completions": 1, "backoffLimit": 0,
               "template": {"spec": _pod_spec(s, n, container, "Never")}}
        return {"name": jobset_replica_name(n.node_rank), "replicas": 1, "template": {"spec": job}}

    doc = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": s.job},
           "spec": {"network": {"enableDNSHostnames": True}, "failurePolicy": {"maxRestarts": 0},
                    "replicatedJobs": [replicated(n) for n in nodes]}}
    return "\n".join(header + _yaml(doc) + [""])


def kubernetes_files(nodes: Sequence[LaunchNode], s: LaunchSettings) -> tuple[dict[str, str], dict[str, str]]:
    """({file: text}, {file: why not written, for the README}) of the Kubernetes manifests: PyTorchJob and
    TrainJob where one template fits every node, else a JobSet (never listed as missing: it replaces them)."""
    texts = {"pytorchjob.yaml": pytorchjob_yaml(nodes, s), "trainjob.yaml": trainjob_yaml(nodes, s),
             "jobset.yaml": jobset_yaml(nodes, s)}
    counts = ", ".join(str(n.nproc) for n in nodes)
    if not one_gpu_type(s):
        one = (f"one pod template cannot select the machines' different GPU types "
               f"({', '.join(str(p) for p in s.products)})")
    else:
        one = f"its worker pods share one template, but the nodes run different numbers of ranks ({counts})"
    fallback = "use jobset.yaml" if texts["jobset.yaml"] else "use pytorchjob.yaml"
    skipped = {k: f"{one}; {fallback}, launch_node.sh or slurm.sbatch" for k in ("pytorchjob.yaml", "trainjob.yaml")
               if texts[k] is None}
    return {k: v for k, v in texts.items() if v is not None}, skipped


def plan_summary(plan: AnyPlan) -> str:
    """What the plan is, in a few words: its strategy, or a pipeline's stages, schedule and microbatches."""
    if plan.parallelism == "pipeline":
        return (f"Pipeline plan ({len(plan.stages)} stages, schedule `{plan.schedule}`, "  # type: ignore[attr-defined]
                f"{plan.microbatches} microbatches)")  # type: ignore[attr-defined]
    return f"Plan `{plan.strategy}`"  # type: ignore[attr-defined]


SPMD_RUN_OPTIONS = """Runner options go after the bundle or the script, the same on every node: `--steps N`, `--verify`, `--metrics FILE`,
`--checkpoint-dir DIR --checkpoint-every N` (on a file system every rank sees) and `--resume`
(continue from the last complete checkpoint; starts at step 0 when there is none, so a
restarted job can always pass it)."""

PIPELINE_RUN_OPTIONS = """Runner options go after the bundle or the script, the same on every node: `--steps N`, `--verify`,
`--seed S`, `--metrics FILE`, `--data PATH`, `--optimizer sgd|adam|adamw`, `--lr LR`, `--weight-decay W`,
`--lr-schedule constant|cosine|linear`, `--warmup N`, `--min-lr R`, `--clip-grad-norm C`, `--grad-accum K`,
`--eval-data PATH --eval-every N`, `--init-from PATH`, `--save-model DIR`, `--timeout S` and `--emulate-links`
(each stage-to-stage transfer takes at least its predicted time). A pipeline plan runs over NCCL on each
rank's GPU where CUDA is present, else over gloo on the CPU; it does not checkpoint yet, and refuses
those options."""

SPMD_DEVICE_CHECK = """At start every rank
compares its GPU (`torch.cuda.get_device_name`) with the planned type and reports a mismatch
naming the rank and both types (`--device-check error` makes it fatal)."""


def _slurm_hardware_note(s: LaunchSettings) -> str:
    """What pins each node's hardware under Slurm, or the risk when nothing does."""
    if any(s.node_slurm):
        return ("It is a heterogeneous job where the machines differ: component k runs node k, asking for its machine's "
                "GPU type (the cluster spec's `slurm` hints: feature -> --constraint, gres_type -> --gres, nodelist), and "
                "a rank on another GPU type stops the run (`--device-check error`).")
    return ("Nothing pins the hardware: the cluster spec gives no `slurm` hints (a device's `slurm`: `feature`, "
            "`gres_type`, `nodelist`), so Slurm may place a node on GPUs other than planned and the plan's ratios "
            "no longer hold; add them to the spec and export again.")


def _setup_note(s: LaunchSettings) -> str:
    """The README's word on the shipped prelude."""
    if not s.setup:
        return ""
    return (f"\n  Both scripts source `{SETUP_FILE}` (the author's prelude: module loads, environment activation) "
            "on every node before torchrun; read it before you run the bundle.")


def readme_text(plan: AnyPlan, cluster: Cluster, nodes: Sequence[LaunchNode], s: LaunchSettings,
                skipped: dict[str, str]) -> str:
    """The bundle's README: which command to run where, and the rank -> device map."""
    pipeline = plan.parallelism == "pipeline"
    rows = "\n".join(f"| {r['rank']} | {r['node_rank']} | {r['local_rank']} | {r['machine']} | {r['device']} | {r['gpu_model']} |"
                     for r in rank_table(cluster, nodes))
    node_lines = "\n".join(f"    bash launch_node.sh {n.node_rank}   # on machine {n.machine} ({n.nproc} ranks: {_span(n.ranks)})"
                           for n in nodes)
    not_made = "".join(f"\n- `{f}` was not generated: {why}." for f, why in skipped.items())
    k8s_use = (f"`jobset.yaml` (`{s.image}` now), then `kubectl apply -f jobset.yaml` (JobSet controller; one\n"
               "  replicated job per node)" if "pytorchjob.yaml" in skipped else
               f"`pytorchjob.yaml` (`{s.image}` now), then `kubectl apply -f pytorchjob.yaml` (Kubeflow training\n"
               "  operator); with Kubeflow Trainer v2, `kubectl apply -f trainjob.yaml`")
    return f"""# Launch bundle: {plan.graph.name} on {cluster.name}

{plan_summary(plan)} for {plan.world_size} ranks on {len(nodes)} node(s), predicted iteration
{plan.predicted_time_s * 1e3:.2f} ms. Every node needs `hap-workbench` installed (it provides
`torchrun` and `runner.launch`) and this folder at the same path (or on a shared file system).

Check the bundle first, with the digest its author sent you apart from it (`hap export` printed it;
exit 0 valid, 1 invalid: a changed, extra or missing file is named, 2 usage error):

    hap bundle check . --digest SHA256

and pass `--digest SHA256` to `hap run` and the launch scripts too: every rank then refuses any other bundle.

## Which command to run where

- One machine (all ranks local): `hap run . --steps 100` (starts torchrun for you).
- torchrun on each node, node 0's machine hosts the c10d rendezvous
  (`HAP_RDZV_ENDPOINT=HOST:PORT` overrides `{s.rdzv_endpoint}`; a node waits `HAP_RDZV_TIMEOUT`
  seconds, default {DEFAULT_RDZV_TIMEOUT_S}, for the others to join, then stops saying which were missing):

{node_lines}

- Slurm: `mkdir -p {LOG_DIR} && sbatch slurm.sbatch --steps 100` from this folder (one `srun` task per node,
  each runs torchrun). The job's output goes to `{LOG_DIR}/JOBNAME-JOBID.out`, beside this folder and never in
  it (every rank refuses a bundle holding a file it does not list); Slurm does not create that folder.
  {_slurm_hardware_note(s)}{_setup_note(s)}
- Kubernetes: build an image holding hap-workbench and this folder
  at `{CONTAINER_BUNDLE_DIR}` (e.g. `FROM` your PyTorch image, `pip install hap-workbench`,
  `COPY . {CONTAINER_BUNDLE_DIR}`), set it in {k8s_use}.
  Pods ask for their node's GPUs and select machines by `{GPU_PRODUCT_LABEL}` (a device's
  `gpu_product` in the cluster spec, else its `gpu_model`). Their runner options come from
  `hap export --run-args '...'` (append more to the container
  args).{not_made}

{PIPELINE_RUN_OPTIONS if pipeline else SPMD_RUN_OPTIONS}

## Ranks and devices

Rank r runs plan device r; node k runs a consecutive block of ranks. torchrun's c10d rendezvous
orders the nodes itself, so `launch_node.sh`, `slurm.sbatch` and `jobset.yaml` pass the node number
(`HAP_NODE_RANK`) and every rank joins as the rank this table gives it.{"" if pipeline else " " + SPMD_DEVICE_CHECK}

| rank | node | local rank | machine | device | GPU type |
|---|---|---|---|---|---|
{rows}

Never edit files here: `hap run` and every rank refuse a bundle whose files differ from
`manifest.json`. Nothing in a bundle is pickled; every file is JSON or text.
"""
