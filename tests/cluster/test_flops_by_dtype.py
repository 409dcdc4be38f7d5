"""`flops_per_gpu` as one rate per dtype: a number is the fp32 rate, a map gives mixed-precision rates."""
import json

import pytest

from engine.cluster.spec import load_cluster
from engine.errors import ClusterError
from engine.options import PlanOptions
from engine.errors import PlanError

SPEC = "sample_clusters/a100x8_v100x8_5gbps.json"


def _spec(flops) -> dict:
    d = json.load(open(SPEC))
    d["devices"][0]["flops_per_gpu"] = flops
    return d


def test_a_map_gives_each_dtype_its_rate_and_round_trips():
    c = load_cluster(_spec({"fp32": 1.95e13, "bf16": 3.12e14}))
    a100 = c.devices[0]
    assert a100.flops_per_gpu == 1.95e13 and a100.flops_per_gpu_in("fp32") == 1.95e13
    assert a100.flops_per_gpu_in("bf16") == 3.12e14 and a100.flops_per_gpu_in("fp16") is None
    assert load_cluster(c.to_dict()).fingerprint() == c.fingerprint()


def test_a_number_is_the_fp32_rate_and_keeps_the_fingerprint():
    plain = load_cluster(_spec(1.95e13))
    assert plain.devices[0].flops_per_gpu_in("bf16") is None
    assert load_cluster(_spec({"fp32": plain.devices[0].flops_per_gpu})).fingerprint() == plain.fingerprint()


@pytest.mark.parametrize("flops, says", [({"bf16": 3e14}, "give the fp32 rate too"),
                                         ({"fp32": 1e13, "bf61": 3e14}, "did you mean 'bf16'"),
                                         ({"fp32": 1e13, "bf16": -1}, "flops_per_gpu.bf16: must be a positive number")])
def test_a_bad_map_is_refused_naming_the_field(flops, says):
    with pytest.raises(ClusterError, match=says):
        load_cluster(_spec(flops))


@pytest.mark.parametrize("field, value", [("precision", "fp8"), ("grad_dtype", "fp16"), ("recompute", "some"),
                                          ("shard_states", 4), ("shard_states", True)])
def test_plan_options_refuse_unknown_training_modes(field, value):
    with pytest.raises(PlanError, match=field):
        PlanOptions(**{field: value})


def test_shard_states_takes_the_cli_spelling():
    assert PlanOptions(shard_states="2").shard_states == 2
