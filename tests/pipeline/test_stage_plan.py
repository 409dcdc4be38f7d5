"""HAP inside pipeline stages (engine/pipeline/stage_plan.py): stage graphs, their plans, prices and validation."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
from conftest import ROOT, cluster_dict

import engine
from engine.cluster.spec import Cluster
from engine.errors import PlanError
from engine.options import PlanOptions
from engine.pipeline.partition import fixed_pipeline
from engine.pipeline.stage_cost import DataParallelPricer, group_cluster
from engine.pipeline.stage_plan import (HapLayerPricer, boundary_forms, data_parallel_program, microbatch_graph,
                                        pipeline_cost, plan_stage, stage_options, stage_price, with_hap_stages)
from engine.pipeline.stages import StageGraph
from engine.planner import load_plan
from engine.spmd.baselines import proportional_ratios
from engine.spmd.iteration import plan_of
from engine.spmd.plan import Plan
from engine.spmd.program import COMM, LOAD
from engine.theory.core import FULL

GIB = 2**30
GPT = dict(layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=12)


def _two_machines(inter_Bps: float = 1e8, flops=(2e12, 1e12)) -> Cluster:
    devices = [{"name": f"m{m}", "gpu_model": f"gpu{m}", "machine": f"m{m}", "flops_per_gpu": flops[m],
                "memory_bytes_per_gpu": 16 * GIB, "count": 2} for m in range(2)]
    return Cluster.from_dict({"schema_version": 1, "name": "two", "description": "test", "sources": ["tests"],
                              "devices": devices, "network": {"latency_s": 1e-5, "bandwidth_Bps": {
                                  "intra_machine": 1e11, "inter_machine": inter_Bps}}})


@pytest.fixture(scope="module")
def gpt():
    return engine.load_model("zoo:gpt", **GPT)


@pytest.fixture(scope="module")
def uneven4() -> Cluster:
    return engine.load_cluster(cluster_dict([4e10, 3e10, 2e10, 1e10], name="uneven4"))


@pytest.fixture(scope="module")
def gpt_pipe(gpt, uneven4):
    L = StageGraph(gpt).num_layers
    return fixed_pipeline(gpt, uneven4, [(0, L // 2, (0, 2)), (L // 2, L, (1, 3))], 2, "1f1b", options=PlanOptions(optimizer="sgd"))


def test_a_stage_graph_receives_in_boundary_forms_and_ends_in_what_it_sends(gpt):
    mb = microbatch_graph(gpt, 2)
    assert mb.placeholders[0].shape[0] == GPT["batch"] // 2
    sg, forms = StageGraph(mb), boundary_forms(mb)
    cut = sg.cut(1)
    first, second = sg.subgraph(0, 1, forms), sg.subgraph(1, sg.num_layers, forms)
    sink = first[first.loss]
    assert sink.op == "stage_output" and sink.attrs["forms"] == [forms[t] for t in cut.tensors]
    nodes = first.origin["pipeline_stage"]["model_nodes"]
    assert [nodes[t] for t in sink.inputs] == list(cut.tensors)
    received = [n for n in second.nodes if "cut" in n.attrs]
    assert [n.attrs["cut"] for n in received] == list(cut.tensors)
    for n in received:  # the residual stream, split on the batch, with a gradient to send back
        assert n.op == "placeholder" and n.attrs["form"] == 0 and n.attrs["requires_grad"]
        copy_ = next(m for m in second.nodes if n.id in m.inputs)
        assert copy_.op == "identity" and copy_.name == f"{n.name}.received"
    assert second.origin["pipeline_stage"]["model_nodes"][second.loss] == mb.loss
    assert engine.theory.leaf_forms(received[0]) == [0]  # it arrives in one form only


def test_the_data_parallel_program_of_a_stage_is_priced_as_the_partitioner_prices_it(gpt, uneven4):
    """The stage's own graph at one microbatch's size, priced by the cost model, gives the data-parallel
    pricer's forward, backward, sync and memory (a check on both): 6 samples split 4/2 in whole samples
    as the pricer's FLOP/s shares 2/3 and 1/3 do. Only the replicated work differs a little: the pricer
    charges every microbatch the whole batch's count of targets, the stage its own microbatch's."""
    B, devices = 2, (0, 2)
    sg_model = StageGraph(gpt)
    mb = microbatch_graph(gpt, B)
    sg, forms = StageGraph(mb), boundary_forms(mb)
    for k, e in ((0, 1), (1, sg.num_layers)):
        sub = sg.subgraph(k, e, forms)
        group = group_cluster(uneven4, devices)
        mine = stage_price(plan_of(data_parallel_program(sub), sub, group, proportional_ratios(group)), group, PlanOptions(optimizer="adam"))
        theirs = DataParallelPricer(uneven4)(sg_model, k, e, devices, B)
        for a, b in ((mine.forward_s, theirs.forward_s), (mine.backward_s, theirs.backward_s),
                     (mine.sync_s, theirs.sync_s)):
            assert a == pytest.approx(b, rel=1e-3)
        assert mine.state_bytes == pytest.approx(theirs.state_bytes, rel=1e-3)
        assert mine.activation_bytes == pytest.approx(theirs.activation_bytes, rel=1e-3)


def test_every_stage_gets_a_plan_that_round_trips_and_is_validated(gpt_pipe, uneven4):
    pipe = with_hap_stages(gpt_pipe, uneven4, PlanOptions(optimizer="sgd", time_budget_s=5))
    assert "hap_stages_skipped" not in pipe.search
    assert all(isinstance(s.plan, Plan) for s in pipe.stages)
    assert [s.plan.device_names for s in pipe.stages] == [["dev-0", "dev-2"], ["dev-1", "dev-3"]]
    assert all(s.ratios == tuple(s.plan.ratio_rows[0]) for s in pipe.stages)
    assert pipe.search["data_parallel_stages_s"] == gpt_pipe.predicted_s
    back = load_plan(json.loads(json.dumps(pipe.to_dict())))
    assert back == pipe


def test_the_stage_plan_is_never_worse_for_the_pipeline_than_data_parallelism(gpt, uneven4):
    mb = microbatch_graph(gpt, 2)
    sg, forms = StageGraph(mb), boundary_forms(mb)
    sub = sg.subgraph(0, 1, forms)
    group = group_cluster(uneven4, (0, 1))
    for B in (1, 2, 16):
        plan = plan_stage(sub, group, stage_options(PlanOptions(optimizer="adam"), 5), B)
        dp = plan_of(data_parallel_program(sub), sub, group, proportional_ratios(group))
        assert pipeline_cost(stage_price(plan, group, PlanOptions(optimizer="adam")), B) <= pipeline_cost(stage_price(dp, group, PlanOptions(optimizer="adam")), B)


def test_hap_shards_a_stage_where_its_gradient_sync_would_dominate():
    """Wide layers and a small batch, each stage on the two GPUs of one machine: HAP shards the stages'
    weights instead of all-reducing their gradients, and the pipeline is predicted faster for it."""
    graph = engine.load_model("zoo:mlp", layers=4, in_features=512, hidden=2048, classes=8, batch=8)
    cluster = _two_machines()
    L = StageGraph(graph).num_layers
    dp = fixed_pipeline(graph, cluster, [(0, L // 2, (0, 1)), (L // 2, L, (2, 3))], 2, "1f1b", options=PlanOptions(optimizer="sgd"))
    pipe = with_hap_stages(dp, cluster, PlanOptions(optimizer="sgd", time_budget_s=10))
    for s in pipe.stages:
        weights = [ins for ins in s.plan.program if ins.kind == LOAD and s.plan.graph[ins.node].op == "parameter"]
        sharded = sum(ins.post >= 0 for ins in weights)
        assert sharded >= 2 and s.program_summary().startswith(f"HAP: {sharded} of {len(weights)} weights sharded")
        assert any(ins.kind == COMM for ins in s.plan.program)
    assert pipe.predicted_s < dp.predicted_s == pipe.search["data_parallel_stages_s"]
    assert dp.stages[0].program_summary() == "data parallel"


def test_a_model_file_keeps_data_parallel_stages_and_says_why(uneven4):
    pytest.importorskip("transformers")
    graph = engine.load_model(str(ROOT / "examples" / "llama_tiny.py"))
    L = StageGraph(graph).num_layers
    pipe = fixed_pipeline(graph, uneven4, [(0, L // 2, (0, 1)), (L // 2, L, (2, 3))], 2, "1f1b")
    out = with_hap_stages(pipe, uneven4)
    assert out.stages == pipe.stages and "batch is fixed by its file" in out.search["hap_stages_skipped"]


# ----------------------------------------------------------------------------- validation of stage plans


@pytest.fixture(scope="module")
def planned(gpt_pipe, uneven4) -> dict:
    return with_hap_stages(gpt_pipe, uneven4, PlanOptions(optimizer="sgd", time_budget_s=5)).to_dict()


def _edit(d: dict, fn) -> dict:
    d = copy.deepcopy(d)
    fn(d)
    return d


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["stages"][1].update(plan=None), "either every stage has a HAP plan or none"),
    (lambda d: d["stages"][0]["plan"]["cluster"].update(devices=["dev-1", "dev-2"]), "are not the stage's devices"),
    (lambda d: d["stages"][1]["plan"]["graph"]["origin"]["pipeline_stage"].update(layers=[0, 1]),
     "does not describe layers"),
    (lambda d: d["stages"][0]["plan"].update(program=d["stages"][0]["plan"]["program"][:-1]), "stages[0].plan"),
])
def test_a_tampered_stage_plan_is_refused_naming_it(planned, edit, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_plan(_edit(planned, edit))


def test_a_stage_receiving_in_another_form_than_sent_is_refused(planned):
    def other_form(d):
        sink = d["stages"][0]["plan"]["graph"]["nodes"][-1]
        sink["attrs"]["forms"] = [-1 for _ in sink["attrs"]["forms"]]

    with pytest.raises(PlanError, match="stages"):
        load_plan(_edit(planned, other_form))


def test_old_pipeline_plans_without_stage_plans_still_load(gpt_pipe):
    d = gpt_pipe.to_dict()
    for s in d["stages"]:
        del s["plan"]
    assert load_plan(d) == gpt_pipe


def test_a_stage_plan_is_checked_against_the_theory_like_any_plan(planned):
    def unsound(d):
        program = d["stages"][1]["plan"]["program"]
        load = next(i for i in program if i["kind"] == "load" and i["rule"] == "placeholder")
        load["post"] = FULL  # a received tensor loaded in a form it does not arrive in

    with pytest.raises(PlanError, match="stages\\[1\\].plan"):
        load_plan(_edit(planned, unsound))


def test_the_partitioner_finds_groups_that_sharding_inside_a_stage_pays_for():
    """Priced data-parallel, a 2-GPU stage of these wide layers pays a large gradient sync, so the
    partitioner keeps one GPU per stage; priced by its layers' HAP plans (`HapLayerPricer`), the
    machine's two GPUs shard the weights and the pipeline is predicted faster."""
    from engine.pipeline.partition import best_pipeline

    graph = engine.load_model("zoo:mlp", layers=6, in_features=512, hidden=4096, classes=8, batch=32)
    cluster = _two_machines()
    dp = with_hap_stages(best_pipeline(graph, cluster, options=PlanOptions(optimizer="sgd")), cluster, PlanOptions(optimizer="sgd", time_budget_s=5))
    assert all(len(s.devices) == 1 for s in dp.stages)
    pricer = HapLayerPricer(graph, cluster, PlanOptions(optimizer="sgd", time_budget_s=5))
    sg = StageGraph(graph)
    two = pricer(sg, 0, sg.num_layers, (0, 1), 4)
    assert pipeline_cost(two, 4) < pipeline_cost(DataParallelPricer(cluster, PlanOptions(optimizer="sgd"))(sg, 0, sg.num_layers, (0, 1), 4), 4)
    pipe = engine.plan(graph, cluster, parallelism="pipeline", optimizer="sgd")
    assert pipe.predicted_s < dp.predicted_s
    stage = max(pipe.stages, key=lambda s: len(s.devices))
    assert len(stage.devices) == 2 and "weights sharded" in stage.program_summary()


def test_no_stage_boundary_separates_the_uses_of_a_tied_weight(uneven4):
    """GPT's output layer tied to its embedding: every cut separates them, so the partitioner keeps one
    stage and a hand-given cut is refused (the stages would train two copies of the weight)."""
    from engine.pipeline.partition import best_pipeline

    graph = engine.load_model("zoo:gpt", **{**GPT, "tie_weights": True})
    L = StageGraph(graph).num_layers
    with pytest.raises(PlanError, match="separates the uses of parameter .* tied"):
        fixed_pipeline(graph, uneven4, [(0, L // 2, (0, 2)), (L // 2, L, (1, 3))], 2, "1f1b", options=PlanOptions(optimizer="sgd"))
    assert len(best_pipeline(graph, uneven4, options=PlanOptions(optimizer="sgd")).stages) == 1


def test_the_runner_refuses_stage_plans_that_load_one_parameter_twice(gpt_pipe, uneven4):
    from runner.stage_program import check_untied

    plans = [s.plan for s in with_hap_stages(gpt_pipe, uneven4, PlanOptions(optimizer="sgd", time_budget_s=5)).stages]
    check_untied(plans)
    with pytest.raises(PlanError, match="used by stages 0 and 1"):
        check_untied([plans[0], plans[0]])
