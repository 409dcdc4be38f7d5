"""A plan on virtual devices expanded to one rank per GPU, so the runner can run it.

A virtual device of k GPUs (`Device.num_gpus`) carries a share r of every sharded dimension and
of the batch (HAP §3, its GPUs run data parallel inside); the runner starts one process per plan
device. The expansion keeps the program Q and gives each of the k GPUs r / k of every segment's
ratios (and of the ZeRO state shares), on the per-GPU cluster (`engine.cluster.per_gpu`). Q holds
for any number of devices and ratios (its triples say nothing of either, §4.2), so the expanded
plan computes the same model; its time is priced again, at whole units, because inside a machine
the GPUs now split the virtual device's shards instead of each holding all of them.

Pipeline plans are not expanded: their stages are sub-clusters searched for the virtual devices,
and splitting a stage's devices changes its HAP plan and its timing; plan on the per-GPU cluster.
"""
from __future__ import annotations

from typing import Any

from engine.cluster.per_gpu import per_gpu_cluster
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.spmd.baselines import Candidate
from engine.spmd.cost import CostModel, evaluate
from engine.spmd.iteration import make_plan
from engine.spmd.plan import Plan

PIPELINE_REASON = ("A pipeline plan's stages were searched for whole machines, so they cannot be split into one rank "
                   "per GPU; plan again on the per-GPU cluster to run it.")


def expand_to_gpus(the_plan: Any, cluster: Cluster) -> tuple[Plan, Cluster]:
    """(the plan with one device per GPU, the per-GPU cluster it was made for). `cluster` must be the
    plan's; a plan without virtual devices comes back as it is, with its cluster. PlanError (one
    sentence) for a pipeline plan on virtual devices."""
    if the_plan.cluster_fingerprint != cluster.fingerprint():
        raise PlanError(f"the plan was made for cluster '{the_plan.cluster_name}', not for '{cluster.name}' "
                        "(their fingerprints differ)")
    if all(d.num_gpus == 1 for d in cluster.devices):
        return the_plan, cluster
    if the_plan.parallelism != "spmd":
        raise PlanError(PIPELINE_REASON)
    gpus = per_gpu_cluster(cluster)
    owner = [i for i, d in enumerate(cluster.devices) for _ in range(d.num_gpus)]
    split = [1.0 / cluster.devices[i].num_gpus for i in owner]
    ratios = [[row[i] * s for i, s in zip(owner, split)] for row in the_plan.ratio_rows]
    states = the_plan.states
    if states is not None:
        states = states.with_shares([states.shares[i] * s for i, s in zip(owner, split)])
    recompute = frozenset(the_plan.recompute)
    cm = CostModel(the_plan.graph, gpus, ratios, the_plan.options, the_plan.segmentation, overlap=the_plan.overlap,
                   recompute=recompute, states=states)
    cand = Candidate(the_plan.program, cm.ratios, evaluate(the_plan.program, cm).total_s, the_plan.segmentation,
                     the_plan.overlap, recompute, states)
    stats = {"expanded_from": {"cluster": cluster.name, "fingerprint": cluster.fingerprint(),
                               "predicted_time_s": the_plan.predicted_time_s}}
    return make_plan(the_plan.strategy, the_plan.graph, gpus, cand, the_plan.options, [], stats), gpus
