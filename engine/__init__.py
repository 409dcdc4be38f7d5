"""HAP Workbench engine: plans SPMD training of one model on a heterogeneous cluster (HAP, EuroSys '24).

Public surface (scripts rely on these names):

    engine.load_model("zoo:gpt", layers=12, ...) | engine.load_model(module, example_inputs) | engine.load_model("graph.json")
    engine.load_model("path/model.py") | engine.load_model("hf:LlamaForCausalLM", config="cfg.json", hidden_size=256)
    engine.load_cluster(path_or_dict)
    engine.plan(model, cluster, time_budget_s=None, progress=None, overlap="auto"|"none"|"ddp"|"duplex") -> Plan
    engine.plan(..., parallelism="spmd"|"pipeline"|"auto", microbatches=None) -> Plan | PipelinePlan
    engine.plan(model, cluster, options=engine.PlanOptions(...))      (the same options as one checked object)
                 both kinds implement engine.AnyPlan: .parallelism, .predicted_time_s, .world_size,
                 .to_dict(), .to_json(), .save(path), .listing(), .summary()
    engine.load_plan(path_or_text_or_dict) -> Plan | PipelinePlan      (validated: PlanError naming the first problem)
    engine.evaluate(model, cluster, "ddp" | "dp-even" | "dp-proportional") -> Plan    (priced as DDP runs)
    engine.validate_plan(plan_or_dict, cluster=None) -> warnings
    engine.replan(old_plan, new_cluster) -> Replan (new plan, report of what changes, resharding table)
    engine.expand_to_gpus(plan, cluster) -> (Plan, Cluster)   (virtual devices split into one rank per GPU)

Layout, by capability (each subpackage's docstring says what it owns and may import; the import
contracts in pyproject.toml enforce it): `model/`, `cluster/`, `theory/`, `spmd/` (HAP), `pipeline/`
(HAPT), `elastic/` (Hetu), `bundle/`; `options`, `planner`, `compare` and `cli` at the top, with `views/`
(the charts both front ends draw) and `notebook` (the Jupyter displays, `plan.show`) above them; `errors`,
`limits`, `timeline` and `display` (the hook `plan.show` calls) on the ground floor. The engine never imports Streamlit or the runner, and
never starts a process group.
"""
from engine.cluster.spec import Cluster, load_cluster
from engine.elastic.per_gpu import expand_to_gpus
from engine.elastic.replan import replan
from engine.errors import ClusterError, HapError, InfeasibleError, ModelError, PlanError, UnsupportedOpError
from engine.model.graph import Graph, Node
from engine.options import OVERLAP_MODES, PARALLELISMS, PlanOptions
from engine.pipeline.plan import PipelinePlan
from engine.planner import BASELINES, AnyPlan, evaluate, load_plan, plan
from engine.spmd.plan import Plan
from engine.spmd.synthesis import SearchProgress
from engine.spmd.validate import validate_plan


def __getattr__(name: str):
    """`engine.load_model` is imported on first use: it needs torch, which takes seconds to import, and
    checking a cluster file or a command line must not wait for it."""
    if name == "load_model":
        from engine.model.source import load_model

        return load_model
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["load_model", "load_cluster", "plan", "evaluate", "replan", "expand_to_gpus", "load_plan", "validate_plan", "PlanOptions",
           "AnyPlan", "BASELINES", "PARALLELISMS", "OVERLAP_MODES", "Plan", "PipelinePlan", "Graph", "Node", "Cluster",
           "SearchProgress", "HapError", "ClusterError", "ModelError", "PlanError", "InfeasibleError",
           "UnsupportedOpError"]
