"""Cached wrappers over the engine's public API, and every session-state key of the app.

Pages call only this module (and `engine.views` to draw, `components` for the cluster editor's tables). Expensive engine calls are cached on
content hashes: a graph by the sha256 of its JSON, a cluster by its fingerprint, an upload by
its bytes. Plans are kept in one process-wide store keyed the same way, so the default plan is
computed once per server, and a search run with a live progress callback is stored for reuse.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import streamlit as st

import engine
from engine import Cluster, Graph, HapError, ModelError, PipelinePlan, Plan, PlanOptions, views
from engine import compare as engine_compare
from engine.bundle.archive import MANIFEST, bundle_digest
from engine.bundle.launch_files import cluster_launch_warnings
from engine.cluster.per_gpu import per_gpu_cluster
from engine.model import source as engine_source
from engine.model.zoo import ZOO
from engine.readers import parse_json

from . import components as ui

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DIR = ROOT / "sample_clusters"
DEFAULT_ZOO = "gpt"
DEFAULT_KNOBS: dict[str, Any] = {"layers": 4, "hidden": 512, "heads": 8, "ffn": 2048, "vocab": 16384,
                                 "seq_len": 128, "batch": 32}
"""A GPT small enough to plan in a couple of seconds, big enough to need more than data parallelism."""
DEFAULT_CLUSTER = "a100x2_p100x2.json"
"""HAP §2.4's small heterogeneous cluster (2 A100 + 2 P100, one device per GPU): its plans export as they are
and run here as 4 CPU ranks."""
PAPER_TESTBED = "hap_paper_testbed_machines.json"
"""The paper's testbed (§7.1) as 8 virtual devices, one click from the first screen."""
DEFAULT_BUDGET_S = 10.0
REPORT_EVERY = 64
"""Expansions between two progress reports of the search (a point of the frontier chart)."""


class Keys:
    """Every `st.session_state` key, prefixed by the page that owns it."""

    GRAPH = "model.graph"
    MODEL_SOURCE = "model.source"
    MODEL_FILE = "model.file"
    """(name, bytes) of the trusted Python upload the current model came from (a bundle ships it)."""
    CLUSTER = "cluster.cluster"
    CLUSTER_SOURCE = "cluster.source"
    PLAN = "search.plan"
    PLAN_FOR = "search.plan_for"
    """(model fingerprint, cluster fingerprint, model source, cluster name) the current plan was made from:
    names for the stale-plan message, used while the fingerprints are the plan's."""
    BUDGET = "search.budget"
    OVERLAP = "search.overlap"
    """The overlap mode asked of the planner (`auto`, `none`, `ddp`, `duplex`)."""
    PARALLELISM = "search.parallelism"
    """The kind of plan asked of the planner (`spmd`, `pipeline`, `auto`)."""
    FRONTIER = "search.frontier"
    PRECISION = "search.precision"
    """The training precision asked of the planner (`fp32`, `bf16`, `fp16`)."""
    GRAD_DTYPE = "search.grad_dtype"
    """The dtype gradients are all-reduced in (`fp32`, `bf16`)."""
    RECOMPUTE = "search.recompute"
    """Activation recomputation (`auto`, `none`, `all`)."""
    SHARD_STATES = "search.shard_states"
    """ZeRO stage of replicated weights' states (`auto`, 0, 1, 2, 3)."""
    KEPT = "inputs.kept"
    """{widget key: value} of every input that goes through `kept`: what each showed when its page was last drawn."""
    PYTHON_TRUST = "model.trust"
    EDITOR = "cluster.editor"
    BASE = "cluster.base"


# ----------------------------------------------------------------------------- keys and hashes


def graph_key(graph: Graph) -> str:
    """Content hash of a graph (its full JSON, names included)."""
    return hashlib.sha256(graph.to_json().encode()).hexdigest()


def content_digest(data: bytes) -> str:
    """Short sha256 of uploaded bytes (names widget keys that belong to one upload)."""
    return hashlib.sha256(data).hexdigest()[:16]


def plan_key(plan: Plan | PipelinePlan) -> str:
    """Content hash of a plan's JSON (either kind)."""
    text = plan.to_json(indent=None)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- models


def zoo_knobs(name: str) -> list[tuple[str, type, Any]]:
    """(knob, type, default) of a zoo model's config, in declaration order."""
    types = {"int": int, "float": float, "bool": bool, "str": str}
    out = []
    for f in dataclasses.fields(ZOO[name].config_cls):
        kind = f.type if isinstance(f.type, type) else types.get(str(f.type), str)
        out.append((f.name, kind, f.default))
    return out


@st.cache_data(show_spinner="Capturing the model with torch.export ...", max_entries=32)
def zoo_model(name: str, knobs: tuple[tuple[str, Any], ...]) -> Graph:
    """A zoo model captured on the meta device (cached on name and knobs)."""
    return engine.load_model(f"zoo:{name}", **dict(knobs))


@st.cache_data(max_entries=16)
def graph_from_json(data: bytes) -> Graph:
    """A graph-IR JSON upload (safe: plain data); ModelError with the engine's message if malformed,
    too large, too deep or holding an over-long number (engine.readers)."""
    return Graph.from_dict(parse_json(data, "graph JSON", ModelError))


PYTHON_CONVENTION = """\
The file must define two functions at top level:

    def build_model() -> torch.nn.Module        # the model; its forward returns a scalar loss
    def example_inputs() -> tuple | dict        # the forward's arguments

Create tensors without device= : the engine calls both on the meta device (nothing allocated) and
`hap run` on the CPU, seeding torch's global RNG per step before example_inputs() (see engine.model.source)."""


@st.cache_data(show_spinner="Running the uploaded model file and capturing it ...", max_entries=8)
def model_from_python(source: bytes, filename: str) -> Graph:
    """Execute an uploaded model file (only ever called after the user trusts it) and capture it."""
    return engine_source.capture_source(source, filename)


HF_CLASSES = engine_source.HF_CLASSES
HF_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 256, "image_size": 32}
"""Sizes the Hugging Face form starts from (the keys a class's config has): plans in seconds."""


def hf_small_config(cls: str) -> str:
    """JSON of the HF_SMALL keys that `cls`'s default config holds as integers (a starting point to edit)."""
    default = engine_source.hf_class(cls).config_class()
    if hf_is_vision(cls) and not isinstance(getattr(default, "num_attention_heads", None), int):
        return "{}"  # convolutional or windowed vision models: their sizes are lists, keep the defaults
    keys = {k: v for k, v in HF_SMALL.items() if isinstance(getattr(default, k, None), int)}
    return json.dumps(keys, indent=1)


def hf_is_vision(cls: str) -> bool:
    return engine_source.task_of(cls) == "image_classification"


@st.cache_data(show_spinner="Building the Hugging Face model from its config and capturing it ...", max_entries=16)
def hf_model(cls: str, config_text: str, batch: int, seq_len: int | None) -> Graph:
    """A transformers class built from its default config updated by `config_text` (JSON), captured on meta."""
    config = parse_json(config_text or "{}", f"hf:{cls} config", ModelError)
    if not isinstance(config, dict):
        raise ModelError(f"hf:{cls} config: expected a JSON object of config keys, got {type(config).__name__}")
    knobs = {"batch": batch} if seq_len is None else {"batch": batch, "seq_len": seq_len}
    return engine.load_model(f"hf:{cls}", config=config, **knobs)


@st.cache_data(max_entries=16)
def theory(key: str, _graph: Graph) -> list[dict[str, Any]]:
    """Every triple of the graph's background theory (cached on the graph's content hash)."""
    return views.theory_rows(_graph)


# ----------------------------------------------------------------------------- clusters


def sample_clusters() -> list[str]:
    return sorted(p.name for p in SAMPLE_DIR.glob("*.json"))


@st.cache_data(max_entries=16)
def sample_cluster(name: str) -> Cluster:
    return engine.load_cluster(SAMPLE_DIR / name)


@st.cache_data(max_entries=16)
def cluster_from_json(data: bytes) -> Cluster:
    """A cluster JSON upload; ClusterError with the engine's one-line message if malformed, too large,
    too deep or holding an over-long number (engine.readers)."""
    return engine.load_cluster(parse_json(data, "cluster JSON", engine.ClusterError))


def cluster_with_edits(cluster: Cluster, devices: list[dict[str, Any]], links: list[dict[str, Any]],
                       latency_s: float) -> Cluster:
    """The cluster with edited devices, link levels and latency, validated by the engine (raises
    ClusterError naming the bad field). Unchanged input gives the cluster back as it is."""
    d = cluster.to_dict()
    hints = {dev.name: dict(dev.slurm) for dev in cluster.devices if dev.slurm}  # not in the table: kept by name
    devices = [{**row, "slurm": hints[row["name"]]} if row.get("name") in hints and "slurm" not in row else row
               for row in map(ui.flops_map, devices)]
    levels = {str(r.get("level", "")): r.get("bandwidth_Bps") for r in map(ui.from_table_units, links)}
    if _same(devices, d["devices"]) and _same(levels, d["network"]["bandwidth_Bps"]) and _same(latency_s, d["network"]["latency_s"]):
        return cluster
    d["devices"] = devices
    d["network"] = {"latency_s": latency_s, "bandwidth_Bps": levels}  # collective fits re-derived for the new layout
    return engine.load_cluster(d)


def _same(a: Any, b: Any) -> bool:
    """Equal up to the rounding of a unit round trip (19.5 TFLOP/s back to FLOP/s): the tables, read back unedited,
    are the cluster itself, not an edit of it."""
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- plans


@st.cache_resource
def _plan_store() -> dict[tuple, Plan]:
    """Plans by (graph hash, cluster fingerprint, budget), shared by every session of the server."""
    return {}


_store_lock = threading.Lock()


def plan_options(budget_s: float, segments: int = 1, overlap: str = "auto", parallelism: str = "spmd",
                 precision: str = "fp32", grad_dtype: str = "fp32", recompute: str = "auto",
                 shard_states: str | int = "auto") -> PlanOptions:
    """The options of a search on the Search page (one `PlanOptions`, checked: a bad value is one PlanError line)."""
    return PlanOptions(time_budget_s=budget_s, segments=segments, overlap=overlap, parallelism=parallelism,
                       precision=precision, grad_dtype=grad_dtype, recompute=recompute, shard_states=shard_states,
                       report_every=REPORT_EVERY)


def stored_plan(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan | PipelinePlan | None:
    with _store_lock:
        return _plan_store().get((graph_key(graph), cluster.fingerprint(), options))


def run_plan(graph: Graph, cluster: Cluster, options: PlanOptions,
             progress: Callable[[engine.SearchProgress], None] | None = None) -> Plan | PipelinePlan:
    """Plan with the engine under `options` (the Q<->B loop, A* + LP, in the overlap mode and kind of
    parallelism they ask for) and keep it in the store, keyed by the model, the cluster and the options."""
    found = stored_plan(graph, cluster, options)
    if found is not None:
        return found
    result = engine.plan(graph, cluster, progress=progress, options=options)
    with _store_lock:
        _plan_store()[(graph_key(graph), cluster.fingerprint(), options)] = result
    return result


def plan_json(plan: Plan | PipelinePlan) -> str:
    """The plan file of either kind ("hap.plan" or "hap.pipeline_plan")."""
    return plan.to_json()


def plan_matches(plan: Plan | PipelinePlan, graph: Graph, cluster: Cluster) -> bool:
    """Whether the plan was made for this model and cluster."""
    return plan_status(plan, graph, cluster).current


@dataclasses.dataclass(frozen=True)
class PlanStatus:
    """Whether a plan belongs to the current model and cluster and, if not, what changed."""

    changed: tuple[str, ...]
    """"model" and/or "cluster": the inputs whose fingerprint differs from the one the plan records."""
    message: str
    """Sentences for the page ("The cluster changed from X to Y since this plan was made."); "" when current."""

    @property
    def current(self) -> bool:
        return not self.changed


def plan_status(plan: Plan | PipelinePlan, graph: Graph, cluster: Cluster,
                made_for: tuple[str, str] | None = None, now: tuple[str, str] | None = None) -> PlanStatus:
    """Compare the graph and cluster fingerprints the plan records (either kind of plan) with the current
    model's and cluster's. `made_for` and `now` are (model name, cluster name) for the message; by default
    the plan's graph and cluster names and the current ones."""
    old_model, old_cluster = made_for or (plan.graph.name if plan.graph is not None else "another model",
                                          plan.cluster_name)
    new_model, new_cluster = now or (graph.name, cluster.name)
    sentences, changed = [], []
    if plan.model_fingerprint != graph.fingerprint():
        changed.append("model")
        sentences.append(_change_sentence("model", old_model, new_model))
    if plan.cluster_fingerprint != cluster.fingerprint():
        changed.append("cluster")
        sentences.append(_change_sentence("cluster", old_cluster, new_cluster))
    return PlanStatus(tuple(changed), " ".join(sentences))


def _change_sentence(what: str, old: str, new: str) -> str:
    if old == new:
        return f"The {what} {new} was edited since this plan was made."
    return f"The {what} changed from {old} to {new} since this plan was made."


def current_status() -> PlanStatus:
    """plan_status of the session's plan against the session's model and cluster, with the names they were
    chosen under (the model's source, the cluster's name)."""
    graph, cluster, plan = current()
    assert plan is not None, "current_status needs a plan"
    ss = st.session_state
    recorded = ss.get(Keys.PLAN_FOR)
    made_for = recorded[2:] if recorded and recorded[:2] == (plan.model_fingerprint, plan.cluster_fingerprint) else None
    now = (ss.get(Keys.MODEL_SOURCE) or graph.name, cluster.name)
    return plan_status(plan, graph, cluster, made_for, now)


def set_plan(plan: Plan | PipelinePlan) -> None:
    """Make `plan` the session's plan, recording the names of the model and cluster it was made for."""
    ss = st.session_state
    ss[Keys.PLAN] = plan
    ss[Keys.PLAN_FOR] = (plan.model_fingerprint, plan.cluster_fingerprint,
                         ss.get(Keys.MODEL_SOURCE) or ss[Keys.GRAPH].name, plan.cluster_name)


def plan_again() -> None:
    """Plan the current model on the current cluster with the stale plan's options; make it current."""
    graph, cluster, plan = current()
    with st.spinner("Planning the current model on the current cluster ..."):
        set_plan(run_plan(graph, cluster, plan.options))


def current_plan(page: str) -> tuple[Graph, Cluster, Plan | PipelinePlan]:
    """The guard of every page that shows a plan: (model, cluster, plan) when the plan belongs to the
    current model and cluster. Otherwise the page says what changed, offers "Plan again" and stops,
    drawing nothing of the old plan."""
    graph, cluster, plan = current()
    if plan is None:
        st.info("No plan yet: run the search on the Search page.")
        st.stop()
    status = current_status()
    if not status.current:
        st.warning(f"{status.message} Its numbers belong to the old inputs, so this page shows none of them "
                   "until the current model is planned on the current cluster.")
        if st.button("Plan again", type="primary", key=f"{page}.plan_again"):
            try:
                plan_again()
            except HapError as e:
                show_error(e)
                st.stop()
            st.rerun()
        st.stop()
    return graph, cluster, plan


@st.cache_data(max_entries=16)
def pipeline_gantt(key: str, schedule: str, _plan: PipelinePlan) -> list[dict[str, Any]]:
    """Gantt rows of a pipeline plan's iteration under `schedule` (`engine.pipeline.schedule.run_schedule`
    on the plan's stages: one box per microbatch forward/backward per stage, transfers per link).
    The plan's own schedule uses its warm-up counts (those checked against memory)."""
    return views.pipeline_gantt_rows(_plan, schedule)


@st.cache_data(max_entries=16)
def ratio_reason(key: str, cluster_fp: str, _plan: Plan, _cluster: Cluster) -> engine_compare.RatioReason:
    """Why the plan's ratios look as they do (`engine.compare.ratio_reason`, cached on plan and cluster hashes)."""
    return engine_compare.ratio_reason(_plan, _cluster)


def plan_on_sample(name: str) -> None:
    """Make the sample cluster `name` current and plan the current model on it with the session plan's options
    (the first screen's one click to the paper's testbed)."""
    ss = st.session_state
    cluster = sample_cluster(name)
    ss[Keys.BASE] = ss[Keys.CLUSTER] = cluster
    ss[Keys.CLUSTER_SOURCE] = f"sample_clusters/{name}"
    graph, _, plan = current()
    options = plan.options if plan is not None else plan_options(DEFAULT_BUDGET_S)
    with st.spinner(f"Planning the current model on {cluster.name} ..."):
        set_plan(run_plan(graph, cluster, options))


@st.cache_data(show_spinner="Comparing with the baselines and the ablations ...", max_entries=16)
def comparison(key: str, cluster_fp: str, budget_s: float, _plan: Plan, _cluster: Cluster) -> engine_compare.Comparison:
    """Plan vs ddp, dp-even, dp-proportional, the Fig. 15 ablations and the plan with and without
    duplex (cached on plan and cluster hashes)."""
    return engine_compare.compare(_plan, _cluster, time_budget_s=budget_s)


@st.cache_data(max_entries=16)
def predicted_lanes(key: str, cluster_fp: str, group: bool, _plan: Plan, _cluster: Cluster) -> list[dict[str, Any]]:
    """Gantt rows of the plan's predicted iteration, a compute and a network lane per device
    (`engine.compare.predicted_schedule`, cached on plan and cluster hashes)."""
    return views.plan_lane_rows(_plan, _cluster, group=group)


@st.cache_data(show_spinner="Re-planning on the changed cluster ...", max_entries=32)
def what_if(key: str, cluster_fp: str, flops: tuple[str, float] | None, link: tuple[str, float] | None,
            budget_s: float, _plan: Plan, _cluster: Cluster) -> engine_compare.WhatIf:
    """The plan on a cluster with one GPU model's flops and one link level's bandwidth scaled."""
    return engine_compare.what_if(_plan, _cluster, flops_scale=dict([flops]) if flops else None,
                                  link_scale=link, time_budget_s=budget_s)


def cluster_json(cluster: Cluster) -> str:
    return json.dumps(cluster.to_dict(), indent=1)


def model_file_of(plan: Plan) -> tuple[str, bytes] | None:
    """The uploaded model file the plan was made from (its sha256 is the plan's), to ship in its bundle."""
    found = st.session_state.get(Keys.MODEL_FILE)
    if found and engine_source.sha256_of(found[1]) == plan.graph.origin.get("sha256"):
        return found
    return None


@st.cache_data(show_spinner="Building the launch bundle ...", max_entries=4)
def bundle_zip(plan_json: str, cluster_text: str,
               model_file: tuple[str, bytes] | None = None) -> tuple[bytes | None, str, str | None]:
    """A launch bundle made by `hap export PLAN --out DIR --zip [--model-file F]`: (zip bytes or None, the
    command's one-line message, the bundle's digest: the sha256 of its manifest.json, or None).
    `model_file` is (name, bytes) of an uploaded model file."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "plan.json").write_text(plan_json)
        (d / "cluster.json").write_text(cluster_text)
        cmd = [sys.executable, "-m", "engine.cli", "export", str(d / "plan.json"), "--cluster", str(d / "cluster.json"),
               "--out", str(d / "bundle"), "--zip"]
        if model_file is not None:
            (d / "model").mkdir()
            (d / "model" / Path(model_file[0]).name).write_bytes(model_file[1])
            cmd += ["--model-file", str(d / "model" / Path(model_file[0]).name)]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        zips = sorted(d.rglob("*.zip"))
        if res.returncode != 0 or not zips:
            lines = (res.stderr or res.stdout).strip().splitlines()
            return None, browser_message(lines[-1]) if lines else "The launch bundle could not be built.", None
        digest = bundle_digest({MANIFEST: (d / "bundle" / MANIFEST).read_bytes()})
        return zips[0].read_bytes(), (res.stdout.strip().splitlines() or [""])[0], digest


PREFIXES = re.compile(r"^(?:(?:hap(?: [a-z]+)?|error|[A-Za-z]*Error):\s*)+")
FLAG = re.compile(r"(?:^|\s)--[a-z][a-z-]*")


def browser_message(text: str) -> str:
    """A command's error line as a sentence for a browser user: no "hap export: hap: error:" prefixes and no
    clause that tells the reader to pass a flag."""
    text = PREFIXES.sub("", text.strip())
    kept = [c for c in text.split("; ") if not FLAG.search(c)] or [FLAG.sub("", text.split("; ")[0])]
    sentence = "; ".join(kept).strip().rstrip(".:;,")
    return sentence[:1].upper() + sentence[1:] + "." if sentence else "The launch bundle could not be built."


@dataclasses.dataclass(frozen=True)
class ExportSet:
    """What the Export page offers together: a plan, the cluster it was made for and their bundle."""

    plan: Plan | PipelinePlan | None
    """The plan of plan.json: the current plan, or its expansion to one rank per GPU; None when it cannot run."""
    cluster: Cluster
    """The cluster of cluster.json, the one `plan` was made for (the per-GPU cluster after an expansion)."""
    note: str
    """A sentence on what was done to the plan, or why it cannot run ("" when it is exported as it is)."""


@st.cache_data(show_spinner="Expanding the plan to one rank per GPU ...", max_entries=8)
def export_set(key: str, cluster_fp: str, _plan: Plan | PipelinePlan, _cluster: Cluster) -> ExportSet:
    """The matching set to export for the current plan (cached on the plan's and the cluster's hashes). A plan
    on virtual devices is expanded by the engine to one rank per GPU (engine.expand_to_gpus); a pipeline plan
    there cannot be, and the set holds only the per-GPU cluster to plan on."""
    virtual = [d for d in _cluster.devices if d.num_gpus > 1]
    if not virtual:
        return ExportSet(_plan, _cluster, "")
    try:
        plan, gpus = engine.expand_to_gpus(_plan, _cluster)
    except engine.PlanError as e:
        return ExportSet(None, per_gpu_cluster(_cluster), browser_message(str(e)))
    note = (f"The runner starts one process per GPU, so this plan's {len(virtual)} virtual devices (machines of "
            f"{', '.join(sorted({str(d.num_gpus) for d in virtual}))} GPUs) are exported expanded to {plan.world_size} "
            f"ranks on the per-GPU cluster {gpus.name}: the same program with each machine's share split evenly "
            f"among its GPUs, predicted at {views.ms(plan.predicted_time_s)} per iteration "
            f"({views.ms(_plan.predicted_time_s)} as planned).")
    return ExportSet(plan, gpus, note)


def launch_warnings(cluster: Cluster) -> list[str]:
    """What `hap export` would refuse in this cluster (machines that are no host names, names with control
    characters): shown while planning, so nobody is stopped before export (engine.bundle.launch_files)."""
    return cluster_launch_warnings(cluster)


# ----------------------------------------------------------------------------- session defaults


def init_state() -> None:
    """Default model, cluster and plan, so the first screen shows a real plan (cached per server)."""
    ss = st.session_state
    if Keys.GRAPH not in ss:
        ss[Keys.GRAPH] = zoo_model(DEFAULT_ZOO, tuple(DEFAULT_KNOBS.items()))
        ss[Keys.MODEL_SOURCE] = f"zoo:{DEFAULT_ZOO} " + " ".join(f"{k}={v}" for k, v in DEFAULT_KNOBS.items())
    if Keys.CLUSTER not in ss:
        ss[Keys.CLUSTER] = sample_cluster(DEFAULT_CLUSTER)
        ss[Keys.CLUSTER_SOURCE] = f"sample_clusters/{DEFAULT_CLUSTER}"
    ss.setdefault(Keys.BUDGET, DEFAULT_BUDGET_S)
    ss.setdefault(Keys.OVERLAP, "auto")
    ss.setdefault(Keys.PARALLELISM, "spmd")
    for key, default in ((Keys.PRECISION, "fp32"), (Keys.GRAD_DTYPE, "fp32"), (Keys.RECOMPUTE, "auto"),
                         (Keys.SHARD_STATES, "auto")):
        ss.setdefault(key, default)
    if Keys.PLAN not in ss:
        with st.spinner("Planning the default model on the default cluster ..."):
            set_plan(run_plan(ss[Keys.GRAPH], ss[Keys.CLUSTER], plan_options(DEFAULT_BUDGET_S)))


def set_model(graph: Graph, source: str, model_file: tuple[str, bytes] | None = None) -> None:
    """Make `graph` the current model (with the uploaded file it came from, if any); rerun when it
    changed so the sidebar (drawn first) follows."""
    changed = st.session_state.get(Keys.GRAPH) != graph
    st.session_state[Keys.GRAPH] = graph
    st.session_state[Keys.MODEL_SOURCE] = source
    st.session_state[Keys.MODEL_FILE] = model_file
    if changed:
        st.rerun()


def set_cluster(cluster: Cluster, source: str) -> None:
    """Make `cluster` the current cluster; rerun when it changed (see set_model)."""
    changed = st.session_state.get(Keys.CLUSTER) != cluster
    st.session_state[Keys.CLUSTER] = cluster
    st.session_state[Keys.CLUSTER_SOURCE] = source
    if changed:
        st.rerun()


VALUE_PARAMETER = {"selectbox": "index", "radio": "index", "multiselect": "default"}
"""The argument that starts each kind of Streamlit input (`value` for the others)."""


def kept(widget: Callable[..., Any], label: str, key: str, default: Any, *args: Any, **kwargs: Any) -> Any:
    """`widget(label, *args, key=key, **kwargs)` (e.g. `st.selectbox`, `cols[0].slider`) started from the value it
    had when its page was last drawn, `default` the first time. Streamlit drops a widget's state as soon as a page
    without it runs, so every input of the workbench goes through here to survive navigation (issue 30, item 6)."""
    store = st.session_state.setdefault(Keys.KEPT, {})
    value = store.get(key, default)
    parameter = VALUE_PARAMETER.get(getattr(widget, "__name__", ""), "value")
    if parameter == "index":
        options = list(args[0])
        kwargs["index"] = options.index(value) if value in options else options.index(default) if default in options else 0
    elif parameter == "default":
        kwargs["default"] = [v for v in value if v in list(args[0])]
    else:
        kwargs["value"] = value
    store[key] = out = widget(label, *args, key=key, **kwargs)
    return out


def earlier_upload(source: str, prefix: str) -> str:
    """A sentence naming the file the current model or cluster (`source`, e.g. "graph net.json") was uploaded from,
    shown once the upload box is empty again (Streamlit empties it when the page is left); "" when `source` is not
    an upload of that kind (`prefix`, e.g. "graph ")."""
    if not source.startswith(prefix):
        return ""
    return f"In use: {source[len(prefix):]}, uploaded earlier. Upload another file to replace it."


def current() -> tuple[Graph, Cluster, Plan | PipelinePlan | None]:
    ss = st.session_state
    return ss[Keys.GRAPH], ss[Keys.CLUSTER], ss.get(Keys.PLAN)


def show_error(e: HapError) -> None:
    """The engine's one-line message, never a traceback."""
    st.error(f"{type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- re-planning (issue 16)


REPLAN = "cluster.replan"
"""Session key of the last re-plan shown on the Cluster page: (plan key, new cluster fingerprint, Replan)."""


def changed_cluster(cluster: Cluster, remove: list[str], add_copy_of: str | None) -> Cluster:
    """`cluster` less the devices in `remove`, plus (optionally) a copy of device `add_copy_of` under a new name."""
    from engine.elastic.replan import with_device, without_devices

    out = without_devices(cluster, remove) if remove else cluster
    if add_copy_of:
        template = next(d for d in cluster.devices if d.name == add_copy_of)
        taken = {d.name for d in out.devices}
        candidates = (f"{add_copy_of}-new{i or ''}" for i in range(len(taken) + 1))
        name = next(n for n in candidates if n not in taken)
        out = with_device(out, {**template.to_dict(), "name": name})
    return out


@st.cache_data(show_spinner="Re-planning on the changed cluster ...", max_entries=16)
def replan(key: str, cluster_fp: str, budget_s: float, _plan: Plan, _cluster: Cluster) -> Any:
    """engine.replan of the plan on the changed cluster (cached on the plan's and the cluster's hashes)."""
    return engine.replan(_plan, _cluster, time_budget_s=budget_s)
