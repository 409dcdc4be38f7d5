"""The fallback that always works (issue 13): side arithmetic is kept opaque without asking, and
data parallelism with the opaque ops replicated (all-gathers before them) is always a candidate."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import cluster_dict, sample_dict
from test_ecosystem import Unruly, interpret, unruly_inputs

import engine
from engine.errors import UnsupportedOpError
from engine.model.graph import Graph
from engine.spmd.program import COMM, COMPUTE


class MaskArithmetic(nn.Module):
    """Mask arithmetic on an integer input and a parameter-only op, both with no rule, around a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.table = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = torch.cummax(mask, dim=1).values  # (B, T) int64: no gradient
        keep = (torch.cumprod(step, dim=1) == 0).unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        bias = torch.cumprod(self.table, dim=0)  # parameters only: no batch
        return F.mse_loss(self.fc(x) * keep + bias, y)


def mask_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 5, dtype=torch.long)
    mask[:, 3:] = 0
    return torch.randn(8, 5, 6, generator=g), mask, torch.randn(8, 5, 6, generator=g)


@functools.cache
def mask_graph() -> Graph:
    torch.manual_seed(0)
    return engine.load_model(MaskArithmetic(), mask_inputs())


def test_side_arithmetic_is_opaque_by_default_and_exact() -> None:
    g = mask_graph()
    targets = sorted(n.attrs["target"].split(".")[0] for n in g.nodes if n.op == "opaque")
    assert targets == ["aten::cummax", "aten::cumprod", "aten::cumprod"], targets
    torch.manual_seed(0)
    module = MaskArithmetic()
    inputs = mask_inputs()
    assert torch.allclose(interpret(g, module, inputs), module(*inputs))


def test_strict_refuses_even_side_arithmetic() -> None:
    with pytest.raises(UnsupportedOpError, match=r"^3 unsupported operator\(s\).*aten.cummax.*aten.cumprod.*aten.cumprod"):
        engine.load_model(MaskArithmetic(), mask_inputs(), fallback="strict")


def test_an_op_on_activations_is_refused_by_default_and_named() -> None:
    with pytest.raises(UnsupportedOpError, match=r"fallback='replicate'.*aten.cumprod at node 'cumprod'"):
        engine.load_model(Unruly(), unruly_inputs())


def test_data_parallel_runs_opaque_ops_on_whole_operands() -> None:
    g = engine.load_model(Unruly(), unruly_inputs(), fallback="replicate")
    cluster = engine.load_cluster(sample_dict("cpu_4_uneven"))
    for strategy in ("dp-even", "dp-proportional"):  # plain data parallelism has no program: cumprod cannot split
        p = engine.evaluate(g, cluster, strategy)
        opaque = [ins for ins in p.program if ins.kind == COMPUTE and g[ins.node].op == "opaque"]
        assert len(opaque) == 3 and all(ins.post == -1 and all(f == -1 for _, f in ins.pre) for ins in opaque)
        assert any(ins.kind == COMPUTE and ins.post == 0 for ins in p.program), "the rest still splits the batch"
    p = engine.plan(g, cluster)
    assert p.predicted_time_s <= min(v for v in p.search["baselines_s"].values()) * (1 + 1e-9) + 1e-12


def test_model_that_fits_data_parallel_only_under_memory_aware_ratios_still_plans() -> None:
    g = mask_graph()  # plain data parallelism has no program (the mask's sort needs the whole mask)
    roomy = engine.evaluate(g, engine.load_cluster(cluster_dict([1e10, 5e11])), "dp-even").memory_bytes[0]
    # the fast device would get most of the batch in proportion to its speed, half of it evenly, but has
    # the least memory: only ratios that respect memory (the LP's) fit
    cluster = engine.load_cluster(cluster_dict([1e10, 5e11], [int(4 * roomy), int(0.85 * roomy)]))
    for strategy in ("dp-even", "dp-proportional"):
        with pytest.raises(engine.InfeasibleError, match="out of memory: device 'dev-1'"):
            engine.evaluate(g, cluster, strategy)
    p = engine.plan(g, cluster)
    assert all(m <= c.memory_bytes_per_gpu for m, c in zip(p.memory_bytes, cluster.devices))
