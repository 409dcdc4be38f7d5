"""HAP Workbench engine: plans SPMD training of one model on a heterogeneous cluster (HAP, EuroSys '24).

Public surface (scripts rely on these names):

    engine.load_model("zoo:gpt", layers=12, ...) | engine.load_model(module, example_inputs) | engine.load_model("graph.json")
    engine.load_model("path/model.py") | engine.load_model("hf:LlamaForCausalLM", config="cfg.json", hidden_size=256)
    engine.load_cluster(path_or_dict)
    engine.plan(model, cluster, time_budget_s=None, progress=None, overlap="auto"|"none"|"ddp"|"duplex") -> Plan
    engine.plan(..., parallelism="spmd"|"pipeline"|"auto", microbatches=None) -> Plan | PipelinePlan
                                       (both: .parallelism "spmd"/"pipeline", .predicted_time_s, .search)
    engine.evaluate(model, cluster, "ddp" | "dp-even" | "dp-proportional") -> Plan    (priced as DDP runs)
    engine.Plan.from_json(text_or_path)                       (validated: PlanError naming the first problem)
    engine.validate_plan(plan_or_dict, cluster=None) -> warnings
    engine.replan(old_plan, new_cluster) -> Replan (new plan, report of what changes, resharding table)

The engine never imports Streamlit and never starts a process group.
"""
from .cluster import Cluster, load_cluster
from .errors import ClusterError, HapError, InfeasibleError, ModelError, PlanError, UnsupportedOpError
from .graph import Graph, Node
from .plan import Plan
from .partition import PipelinePlan
from .overlap import OVERLAP_MODES
from .planner import BASELINES, PARALLELISMS, evaluate, plan
from .replan import replan
from .synthesis import SearchProgress
from .validate import validate_plan


def __getattr__(name: str):
    """`engine.load_model` is imported on first use: it needs torch, which takes seconds to import, and
    checking a cluster file or a command line must not wait for it."""
    if name == "load_model":
        from .source import load_model

        return load_model
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["load_model", "load_cluster", "plan", "evaluate", "replan", "validate_plan", "BASELINES", "PARALLELISMS",
           "OVERLAP_MODES", "Plan", "PipelinePlan", "Graph", "Node", "Cluster", "SearchProgress", "HapError", "ClusterError",
           "ModelError", "PlanError", "InfeasibleError", "UnsupportedOpError"]
