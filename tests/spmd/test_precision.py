"""Mixed precision in the cost model (engine.spmd.precision): matmuls at the dtype's rate, 2-byte
activations, fp32 state plus autocast's cast cache, a bf16 gradient bucket, and the refusal of a dtype
some devices give no rate for."""
from __future__ import annotations

import pytest
from conftest import ce_graph, cluster_dict, sample_path

import engine
from engine.cli import main
from engine.cluster.spec import Cluster
from engine.errors import ClusterError
from engine.options import PlanOptions
from engine.spmd.baselines import data_parallel_space
from engine.spmd.cost import STATE_BYTES_PER_PARAM_BYTE, CostModel, evaluate
from engine.spmd.saved import requires_grad
from engine.spmd.precision import AUTOCAST_OPS
from engine.spmd.program import COMPUTE, LOAD
from engine.spmd.saved import OUTPUT, saves_by_node
from engine.spmd.synthesis import synthesize

H100 = sample_path("h100x8_node")
GPT = dict(layers=2, hidden=1024, heads=16, ffn=4096, vocab=1024, seq_len=256, batch=64)
"""Wide enough that the matmuls dominate a step on 8 H100s (27.6M parameters, 16k tokens a step)."""


@pytest.fixture(scope="module")
def gpt():
    return engine.load_model("zoo:gpt", **GPT)


@pytest.fixture(scope="module")
def plans(gpt):
    return {p: engine.plan(gpt, H100, precision=p, time_budget_s=1) for p in ("fp32", "bf16")}


def test_a_compute_bound_gpt_in_bf16_is_predicted_at_least_twice_as_fast_on_h100(plans):
    fp32, bf16 = plans["fp32"].predicted_time_s, plans["bf16"].predicted_time_s
    assert bf16 * 2 <= fp32, f"bf16 {bf16 * 1e3:.2f} ms vs fp32 {fp32 * 1e3:.2f} ms"
    assert plans["bf16"].options.precision == "bf16" and plans["bf16"].search["options"]["precision"] == "bf16"


def test_bf16_memory_is_fp32_state_and_cast_cache_plus_two_byte_activations(plans, gpt):
    """Per device: 16 B per local parameter (Adam: weight, gradient, m, v in fp32), 2 B more per
    parameter an autocast op reads (its cached bf16 copy), and every kept activation (what autograd
    saves, engine.spmd.saved) at 2 B an element when it is a float32 one."""
    plan = plans["bf16"]
    g, grad = plan.graph, requires_grad(plan.graph)
    two_bytes = [n.numel * 2 if n.dtype == "float32" and not n.is_leaf else n.nbytes for n in g.nodes]
    saves = saves_by_node(g, grad, two_bytes)
    cast = {i for n in g.nodes if n.op in AUTOCAST_OPS for i in n.inputs if g[i].op == "parameter"}
    assert cast and len(cast) < len(g.parameters), "the embeddings and norms are not cast, the linear weights are"
    for j, ratio in enumerate(plan.ratios["0"]):
        expected = 0.0
        for ins in plan.program:
            n = g[ins.node]
            local = ratio if ins.post >= 0 or any(f >= 0 for _, f in ins.pre) else 1.0
            if ins.kind == LOAD and n.op == "parameter":
                per_param = 4 * STATE_BYTES_PER_PARAM_BYTE["adam"] + (2 if n.id in cast else 0)
                expected += n.numel * per_param * local
            elif ins.kind == COMPUTE:
                for pos, nbytes in saves[n.id]:
                    form = ins.post if pos == OUTPUT else ins.pre[pos][1]
                    expected += nbytes * (ratio if form >= 0 else 1.0)
        assert plan.memory_bytes[j] == pytest.approx(expected, rel=1e-9)
    assert plan.memory_bytes[0] < plans["fp32"].memory_bytes[0]


def test_matmuls_run_at_the_dtype_rate_and_other_operators_at_the_fp32_rate():
    graph = ce_graph()
    d = cluster_dict([1e12, 1e12])
    for dev in d["devices"]:
        dev["flops_per_gpu"] = {"fp32": 1e12, "bf16": 1e13}
    cm = CostModel(graph, Cluster.from_dict(d), [0.5, 0.5], PlanOptions(precision="bf16"))
    (c,) = cm.classes
    for n in graph.nodes:
        if n.is_leaf or not n.flops:
            continue
        fwd, _, _ = cm.compute_delta(n.id, False)
        rate = 1e13 if n.op in AUTOCAST_OPS else 1e12
        assert cm.stage_time(fwd) == pytest.approx(n.flops / rate), n.op


def _bucket_s(cm: CostModel) -> float:
    b = evaluate(synthesize(cm.graph, cm, space=data_parallel_space(cm.graph)).program, cm)
    return next(t for s, t in zip(b.stages, b.stage_comm_s) if s.comm == "grad_all_reduce")


def test_grad_dtype_bf16_prices_half_the_gradient_all_reduce_and_fewer_bucket_copies():
    graph = ce_graph()
    d = cluster_dict([1e12, 1e12, 5e11], latency_s=1e-3, bandwidth_Bps=1e9)
    for dev in d["devices"]:
        dev["memory_bandwidth_Bps"] = 1e11
    cluster = Cluster.from_dict(d)
    fp32 = CostModel(graph, cluster, [0.4, 0.4, 0.2], PlanOptions())
    bf16 = CostModel(graph, cluster, [0.4, 0.4, 0.2], PlanOptions(grad_dtype="bf16"))
    latency = cluster.collectives["all_reduce"].latency_s
    assert _bucket_s(bf16) - latency == pytest.approx((_bucket_s(fp32) - latency) / 2)
    assert bf16.classes[0].full_param_s_per_byte < fp32.classes[0].full_param_s_per_byte
    assert bf16.classes[0].sharded_param_s_per_byte == fp32.classes[0].sharded_param_s_per_byte


def test_a_dtype_some_devices_lack_is_refused_naming_them_and_suggesting_one_they_rate():
    with pytest.raises(ClusterError, match=r"v100-0 \.\. v100-7 \(V100-SXM2-32GB\).*--precision fp16"):
        engine.plan("zoo:mlp", sample_path("a100x8_v100x8_5gbps"), precision="bf16")
    cpu = cluster_dict([1e10, 1e10])
    with pytest.raises(ClusterError, match="dev-0, dev-1 \\(model-1e\\+10\\).*give the devices' fp16 rate") as e:
        CostModel(ce_graph(), Cluster.from_dict(cpu), [0.5, 0.5], PlanOptions(precision="fp16"))
    assert "--precision" not in str(e.value), "no dtype to suggest: no device rates bf16 either"


def test_hap_plan_refuses_a_dtype_the_cluster_lacks_with_exit_status_2(capsys):
    code = main(["plan", "--model", "zoo:mlp", "--cluster", sample_path("hap_paper_testbed"), "--precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and "v100-m0-0 .. v100-m1-7 (V100-SXM2-16GB); p100-m2-0 .. p100-m7-7 (P100-PCIE-16GB)" in err
    assert "--precision fp16" in err


def test_pipeline_stages_are_priced_in_the_plans_precision(gpt):
    """A pipeline prices its stages with the same cost model (`DataParallelPricer`) and its boundary
    activations at 2 bytes an element."""
    from engine.pipeline.partition import Partitioner
    from engine.pipeline.stages import StageGraph

    cluster = engine.load_cluster(H100)
    stages = StageGraph(gpt)
    parts = {p: Partitioner(stages, cluster, options=PlanOptions(precision=p)) for p in ("fp32", "bf16")}
    price = {p: part.price(0, stages.num_layers, 0, 0, 4, 2) for p, part in parts.items()}
    assert price["bf16"].forward_s * 2 < price["fp32"].forward_s
    assert price["bf16"].activation_bytes[0] < price["fp32"].activation_bytes[0]
    assert price["bf16"].state_bytes[0] > price["fp32"].state_bytes[0], "autocast's cast cache"
    latency = cluster.network.latency_s
    cut = stages.num_layers // 2
    assert parts["bf16"].transfer(cut, 0, 0, 2) - latency == pytest.approx((parts["fp32"].transfer(cut, 0, 0, 2) - latency) / 2)


def test_hap_plan_reports_a_mixed_precision_plan(capsys):
    code = main(["plan", "--model", "zoo:mlp", "--cluster", sample_path("cpu_2"), "--precision", "bf16",
                 "--grad-dtype", "bf16", "--time-budget", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "precision: bf16 under autocast" in out and "gradients all-reduced in bf16" in out
