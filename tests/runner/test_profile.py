"""`hap profile` (issue 6 item 4): the fit, the summaries, and a real profile on 2 gloo ranks whose spec plans and runs."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from conftest import load_bench
from hap_inprocess import run_hap
from warm_run import warm_hap

import engine
from engine.cluster.spec import FREE_BANDWIDTH_BPS, fit_collective
from runner.profile import (COLLECTIVE_SAMPLES, COLLECTIVES, PARQUET_COLUMNS, SMALL_PAYLOAD, UPDATE_MIN_BYTES,
                            ProfileConfig, _byte_size, collective_points, collective_repeats, device_compute,
                            device_flops, low_precision_fit, model_config, model_linear_shapes, one_device_plan,
                            parse_args, rank_rates, roofline_fit, typical_seconds, update_tensors, with_low_precision)


TINY_MLP = ["--set", "layers=1", "--set", "in_features=32", "--set", "hidden=64", "--set", "batch=16"]
TINY_GPT = ["--set", "layers=1", "--set", "hidden=32", "--set", "heads=4", "--set", "ffn=64", "--set", "vocab=64",
            "--set", "seq_len=8", "--set", "batch=8"]


# ----------------------------------------------------------------------------- the fit (pure)


def test_fit_passes_through_the_smallest_payload_and_takes_the_large_payloads_slope():
    # a host whose bandwidth drops above 1 MB: small collectives keep their latency, buckets their bandwidth
    sizes = [16e3, 128e3, 1e6, 4e6, 16e6]
    times = [400e-6, 450e-6, 900e-6, 12e-3, 41e-3]
    fit = fit_collective(sizes, times)
    assert fit.time(16e3) == pytest.approx(400e-6, rel=1e-9)
    assert fit.time(16e6) == pytest.approx(41e-3, rel=0.25) and fit.time(4e6) == pytest.approx(12e-3, rel=0.25)


def test_fit_recovers_latency_and_bandwidth_from_exact_points():
    sizes = [4e3, 3.2e4, 2.56e5, 1e6, 4e6]
    fit = fit_collective(sizes, [50e-6 + b / 2e9 for b in sizes])
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(2e9, rel=1e-6)


def test_fit_recovers_known_figures_within_5_percent_from_noisy_medians():
    rng = random.Random(7)
    sizes = [2.0**k for k in range(10, 24, 2)]
    medians = []
    for b in sizes:  # 9 noisy repeats per payload, then the median, as the profiler does
        samples = sorted((300e-6 + b / 7e8) * (1 + rng.uniform(-0.1, 0.1)) for _ in range(9))
        medians.append(samples[4])
    fit = fit_collective(sizes, medians)
    assert fit.latency_s == pytest.approx(300e-6, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(7e8, rel=0.05)


def test_fit_clamps_a_negative_intercept_to_zero_latency():
    sizes = [1e5, 1e6, 1e7]
    fit = fit_collective(sizes, [b / 1e9 - 10e-6 for b in sizes])
    assert fit.latency_s == 0.0 and 0.95e9 < fit.bandwidth_Bps < 1.1e9


def test_fit_of_times_that_do_not_grow_gives_free_bandwidth_and_the_level_as_latency():
    fit = fit_collective([1e3, 1e6], [2e-4, 1.9e-4])
    assert fit.bandwidth_Bps == FREE_BANDWIDTH_BPS and 1.9e-4 <= fit.latency_s <= 2e-4


def test_fit_rejects_too_few_or_non_positive_points():
    with pytest.raises(ValueError, match=">= 2"):
        fit_collective([1e3], [1e-4])
    with pytest.raises(ValueError, match="positive times"):
        fit_collective([1e3, 1e4], [1e-4, 0.0])


# ----------------------------------------------------------------------------- summaries (pure)


def _row(kind, op, rank, size, repeat, seconds, **kw):
    return {"kind": kind, "op": op, "rank": rank, "size": size, "repeat": repeat, "seconds": seconds,
            "payload_bytes": kw.get("payload"), "calls": kw.get("calls", 1), "flops": kw.get("flops"),
            "arrival_delay_s": kw.get("delay", 0.0)}


def test_collective_points_take_the_late_ranks_time_per_repeat_then_the_typical_time_per_call():
    # repeat i: rank i % 2 arrives late; the early rank's time includes its wait and is not used
    times = [(2.0, 9.0), (9.0, 6.0), (20.0, 9.0)]
    rows = [_row("collective", "broadcast", r, 1024, i, t, payload=1024, calls=2, delay=0.002 if i % 2 == r else 0.0)
            for i, pair in enumerate(times) for r, t in enumerate(pair)]
    rows.append(_row("collective", "all_reduce", 0, 1024, 0, 99.0, payload=1024, delay=0.002))
    assert collective_points(rows, "broadcast") == ([1024.0], [3.0])  # late: 2, 6, 20 -> /2 calls -> middle 3


def test_the_typical_time_keeps_a_collectives_tail_but_drops_a_stall():
    # 16 repeats of a right-skewed collective: its median hides the tail, its mean counts the one 30 ms stall
    samples = [0.5] * 8 + [0.6, 0.7, 0.8, 1.0, 1.5, 2.0, 2.5, 30.0]
    kept = sorted(samples)[2:-2]
    assert typical_seconds(samples) == pytest.approx(sum(kept) / len(kept))
    assert statistics.median(samples) < typical_seconds(samples) < statistics.mean(samples)
    assert typical_seconds([1.0, 5.0]) == 3.0 and typical_seconds([2.0]) == 2.0


def test_small_collectives_take_more_repeats():
    cfg = ProfileConfig(out="x.json", repeats=5)
    assert collective_repeats(cfg, SMALL_PAYLOAD) == COLLECTIVE_SAMPLES > 5
    assert collective_repeats(cfg, 4 * SMALL_PAYLOAD) == 5
    assert collective_repeats(ProfileConfig(out="x.json", repeats=40), 1024) == 40


def test_rank_rates_sum_flops_over_the_median_times_and_the_spec_takes_the_model_rate():
    rows = [_row("compute", "zoo:gpt", 0, 16, i, t, flops=4e9) for i, t in enumerate([1.0, 2.0, 3.0])]
    rows += [_row("compute", "zoo:gpt", 0, 8, i, t, flops=2e9) for i, t in enumerate([0.5, 0.5, 9.0])]
    rows += [_row("compute", "matmul", 0, 64, i, 1e-3, flops=1e8) for i in range(3)]
    rows += [_row("compute", "zoo:gpt", 1, 16, 0, 100.0, flops=4e9)]
    rates = rank_rates(rows, 0)
    assert rates["zoo:gpt"] == pytest.approx(6e9 / 2.5)
    assert rates["matmul 64"] == pytest.approx(1e11)
    assert device_flops(rates) == pytest.approx(6e9 / 2.5)
    assert device_flops({"matmul 64": 1e11, "matmul 128": 2e11}) == 2e11


def _model_rows(rank, times, flops_bound, traffic):
    """Model rows at batch 16 and 8 (the 8 rows do half the work) with the cost model's split."""
    rows = []
    for size, share in ((16, 1.0), (8, 0.5)):
        rows += [{**_row("compute", "zoo:gpt", rank, size, i, t * share, flops=(flops_bound + 1e6) * share),
                  "flops_bound": flops_bound * share, "traffic_bytes": traffic * share} for i, t in enumerate(times)]
    return rows


def test_roofline_fit_gives_the_matmul_rate_and_the_bandwidth_that_fills_the_rest_of_the_step():
    # 1.5 s for 4 GFLOP of matmuls at 4 GFLOP/s (1 s) and 1 GB of memory-bound bytes: 2 GB/s
    assert roofline_fit(4e9, (1.5, 5e9, 4e9, 1e9, 0.0)) == {"flops_per_gpu": 4e9, "activation_bandwidth_Bps": pytest.approx(2e9)}
    assert roofline_fit(2e9, (1.5, 5e9, 4e9, 1e9, 0.0)) is None  # the matmuls alone would take 2 s
    assert roofline_fit(4e9, (1.5, 5e9, 4e9, 0.0, 0.0)) is None  # nothing memory-bound to fit


def test_roofline_fit_takes_the_measured_overhead_of_every_run_before_fitting_the_bandwidth():
    """Issue 28: a fixed cost per operator run. The same 0.5 s beyond the matmuls: 100 runs of a measured 1 ms
    take 0.1 s, and 1 GB fills the 0.4 s left (2.5 GB/s). An overhead that would take the whole rest (10 ms a
    run) is left out, and so is one with no runs counted (rows written before they were)."""
    assert roofline_fit(4e9, (1.5, 5e9, 4e9, 1e9, 100.0), 1e-3) == {
        "flops_per_gpu": 4e9, "activation_bandwidth_Bps": pytest.approx(2.5e9), "op_overhead_s": 1e-3}
    assert roofline_fit(4e9, (1.5, 5e9, 4e9, 1e9, 100.0), 1e-2) == {"flops_per_gpu": 4e9,
                                                                   "activation_bandwidth_Bps": pytest.approx(2e9)}
    assert "op_overhead_s" not in roofline_fit(4e9, (1.5, 5e9, 4e9, 1e9, 0.0), 1e-3)
    assert "op_overhead_s" not in roofline_fit(4e9, (1.5, 5e9, 4e9, 1e9, 100.0))


def test_device_compute_splits_every_rank_or_falls_back_to_one_rate_for_all():
    matmul = [_row("compute", "matmul", j, 64, 0, 1e-3, flops=4e6) for j in (0, 1)]  # 4 GFLOP/s on both
    split = matmul + _model_rows(0, [1.0, 1.0, 9.0], 2e9, 1e9) + _model_rows(1, [2.0, 2.0, 2.0], 2e9, 1e9)
    # rank 0: 1.5 s for both batches, 0.75 s of matmuls -> 1.5 GB / 0.75 s; rank 1: 3 s -> 1.5 GB / 2.25 s
    assert device_compute(split, [0, 1]) == [{"flops_per_gpu": 4e9, "activation_bandwidth_Bps": pytest.approx(2e9)},
                                             {"flops_per_gpu": 4e9, "activation_bandwidth_Bps": pytest.approx(1.5e9 / 2.25)}]
    slow_matmul = [_row("compute", "matmul", 1, 64, 0, 1.0, flops=4e6)]  # rank 1's matmuls could not fit its step
    mixed = matmul[:1] + slow_matmul + _model_rows(0, [1.0], 2e9, 1e9) + _model_rows(1, [2.0], 2e9, 1e9)
    assert device_compute(mixed, [0, 1]) == [{"flops_per_gpu": pytest.approx(3.0015e9 / 1.5)},
                                             {"flops_per_gpu": pytest.approx(3.0015e9 / 3.0)}]


def test_device_compute_prices_the_measured_overhead_of_the_models_operator_runs():
    """Rank 0 of the test above (1.5 s over both batches, 0.75 s of matmuls, 1.5 GB) with 10 + 5 runs and a
    chain of 130 empty runs in 0.13 s: 1 ms a run, 15 ms of the rest, the bytes fill 0.735 s."""
    matmul = [_row("compute", "matmul", 0, 64, 0, 1e-3, flops=4e6)]
    model = [{**r, "op_runs": 10.0 if r["size"] == 16 else 5.0} for r in _model_rows(0, [1.0], 2e9, 1e9)]
    chain = [_row("overhead", "op_overhead", 0, 130, i, t) for i, t in enumerate((0.13, 0.13, 9.0))]
    assert device_compute(matmul + model + chain, [0]) == [
        {"flops_per_gpu": 4e9, "activation_bandwidth_Bps": pytest.approx(1.5e9 / 0.735), "op_overhead_s": pytest.approx(1e-3)}]


def test_a_low_precision_rate_is_the_fp32_rate_times_that_dtypes_speed_on_the_models_own_matmuls():
    """Issue 28: a square matmul's bf16 speed-up is not the model's (1.2x fp32 at n = 128 and 2.4x at 512 on a CPU
    with bf16 instructions). Where the model's linear layers were timed in each dtype, bf16 is the fp32 rate times
    their bf16 speed over fp32 (here 1.5x), whatever the square bf16 matmul ran at; without them, the square
    matmul's speed over fp32 at the same size."""
    fields = {"flops_per_gpu": 4e9, "activation_bandwidth_Bps": 2e9}
    square = {"matmul 64": 1e9, "matmul 128": 2e9, "matmul_bf16": 5e9, "matmul_fp16": 1e8}
    model = {"model_matmuls_fp32": 1e9, "model_matmuls_bf16": 1.5e9, "model_matmuls_fp16": 0.5e8}
    assert with_low_precision(fields, {**square, **model})["flops_per_gpu"] == {
        "fp32": 4e9, "bf16": pytest.approx(6e9), "fp16": pytest.approx(2e8)}
    assert with_low_precision(fields, square)["flops_per_gpu"] == {
        "fp32": 4e9, "bf16": pytest.approx(10e9), "fp16": pytest.approx(2e8)}
    assert with_low_precision(fields, {"matmul 64": 1e9}) == fields


def test_a_low_precision_rate_is_at_most_what_reproduces_the_models_autocast_step():
    """The fp32 fit (4 GFLOP/s, 2 GB/s); a bf16 step of 0.5 GB of memory-bound bytes (0.25 s at 2 GB/s) and
    2 GFLOP of matmuls in 1.25 s gives 2 GFLOP/s, below the linear layers' 6 GFLOP/s: autocast ran something
    else slower. A fast step (0.5 s: 8 GFLOP/s) leaves the linear layers' rate; one whose bytes fill it, too."""
    fields = {"flops_per_gpu": 4e9, "activation_bandwidth_Bps": 2e9}
    rates = {"model_matmuls_fp32": 1e9, "model_matmuls_bf16": 1.5e9, "model_matmuls_fp16": 0.5e8}
    slow, fast, full = (1.25, 2e9, 2e9, 0.5e9, 0.0), (0.5, 2e9, 2e9, 0.5e9, 0.0), (0.2, 2e9, 2e9, 0.5e9, 0.0)
    assert with_low_precision(fields, rates, {"bf16": slow, "fp16": slow})["flops_per_gpu"] == {
        "fp32": 4e9, "bf16": pytest.approx(2e9), "fp16": pytest.approx(2e8)}
    assert with_low_precision(fields, rates, {"bf16": fast, "fp16": full})["flops_per_gpu"]["bf16"] == pytest.approx(6e9)
    assert low_precision_fit(fields, full) is None and low_precision_fit({"flops_per_gpu": 4e9}, slow) is None
    # the fp32 fit's overhead per run is paid by the autocast step too: 100 runs of 2.5 ms leave 0.75 s for 2 GFLOP
    runs = (1.25, 2e9, 2e9, 0.5e9, 100.0)
    assert low_precision_fit({**fields, "op_overhead_s": 2.5e-3}, runs) == pytest.approx(2e9 / 0.75)


def test_the_profiled_models_linear_layers_are_counted_by_shape():
    assert sorted(model_linear_shapes("gpt", {"layers": 2, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 512,
                                              "seq_len": 64, "batch": 16})) == [
        (1024, 128, 128, 8), (1024, 128, 512, 3), (1024, 512, 128, 2)]  # q k v proj x 2 layers; fc x 2 + lm head; proj


@pytest.mark.parametrize("samples", [8, 1])
def test_the_profiled_model_step_is_the_runner_program_of_a_one_device_plan(samples: int):
    """hap profile times the model as `hap run` executes it: the rank program of its one-device plan
    (no collective), which computes the model's own loss and gradients, at any batch (1 is the half
    of `--set batch=2`)."""
    import torch

    from engine.spmd.program import COMM
    from runner.train import build_module, make_batch, program_args, setup_rank

    plan = one_device_plan("mlp", dict(layers=1, in_features=32, hidden=64, classes=4, batch=samples))
    assert plan.world_size == 1 and not [i for i in plan.program if i.kind == COMM and i.rule != "slice"]
    st = setup_rank(plan, 0, seed=0)
    batch = make_batch(plan, 0, 0)
    loss = st.program.module(*program_args(plan, st, 0, batch))
    loss.backward()
    module = build_module(plan, seed=0)
    want = module(*batch)
    want.backward()
    torch.testing.assert_close(loss, want)
    grads = [p.grad for _, p in module.named_parameters()]
    assert len(grads) == len(st.params) and all(g is not None for g in grads)
    assert sorted(g.norm().item() for g in grads) == pytest.approx(sorted(p.grad.norm().item() for p in st.params))


def test_overlap_slowdowns_are_each_modes_median_over_the_steps_alone():
    from runner.profile import overlap_slowdowns

    def row(op, rank, seconds):
        return {"kind": "overlap", "op": op, "rank": rank, "seconds": seconds}

    rows = [row("none", 0, s) for s in (1.0, 2.0, 9.0)] + [row("ddp", 0, s) for s in (2.2, 2.4, 2.6)]
    rows += [row("duplex", 0, 100.0), row("none", 1, 1.0), {"kind": "compute", "op": "zoo:mlp", "rank": 0, "seconds": 5}]
    assert overlap_slowdowns(rows, 0) == {"ddp": 1.2, "duplex": 20.0}  # clipped to the spec's sane range
    assert overlap_slowdowns(rows, 1) == {} and overlap_slowdowns([], 0) == {}
    faster = [row("none", 2, 2.0), row("ddp", 2, 1.5), row("duplex", 2, 1.5)]  # noise below 1 beside an all-reduce
    assert overlap_slowdowns(faster, 2) == {"ddp": 1.0, "duplex": 0.75}


def test_the_update_times_at_least_a_few_mib_of_the_models_own_tensors():
    """A tiny model's update lasts microseconds, lost in noise: its tensors are repeated up to
    UPDATE_MIN_BYTES; a model that is large enough is updated once, tensor for tensor."""
    import torch

    def shapes(cfg) -> list[tuple[int, ...]]:
        name, knobs = model_config(cfg)
        return [tuple(p.shape) for p in engine.model.zoo.entry(name).build(engine.model.zoo.make_config(name, **knobs)).parameters()]

    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    cfg = parse_args(["--out", "c.json", "--model", "zoo:mlp", *TINY_MLP])
    tiny, own = update_tensors(cfg, torch.device("cpu")), shapes(cfg)
    copies = len(tiny) // len(own)
    assert copies > 1 and [tuple(t.shape) for t in tiny] == own * copies and all(t.requires_grad for t in tiny)
    assert UPDATE_MIN_BYTES <= nbytes(tiny) < UPDATE_MIN_BYTES + nbytes(tiny) / copies
    assert len({t.data_ptr() for t in tiny}) == len(tiny)  # copies, not one tensor updated many times
    cfg = parse_args(["--out", "c.json", "--model", "zoo:mlp", "--set", "in_features=1024", "--set", "hidden=1024"])
    big = update_tensors(cfg, torch.device("cpu"))
    assert nbytes(big) >= UPDATE_MIN_BYTES and [tuple(t.shape) for t in big] == shapes(cfg)


def test_options_parse_units_and_reject_bad_values():
    cfg = parse_args(["--out", "c.json", "--sizes", "64K,4096,1M", "--matmul", "64,128", "--repeats", "3"])
    assert cfg.sizes == (4096, 65536, 2**20) and cfg.matmul == (64, 128) and cfg.repeats == 3
    assert _byte_size("2MiB") == 2 * 2**20
    with pytest.raises(ValueError, match="at least 2 payloads"):
        ProfileConfig(out="c.json", sizes=(4096,))
    with pytest.raises(ValueError, match="--repeats must be at least 1, got 0"):
        ProfileConfig(out="c.json", repeats=0)


# ----------------------------------------------------------------------------- a real profile on 2 gloo ranks


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, Path, str]:
    """`hap profile` on 2 gloo ranks with small sizes and few repeats: (spec, parquet, stderr)."""
    folder = tmp_path_factory.mktemp("profile")
    spec, raw = folder / "cluster.json", folder / "raw.parquet"
    r = warm_hap("profile", "--out", str(spec), "--parquet", str(raw), "--nproc", "2", "--speeds", "1,0.5",
            "--sizes", "4K,64K,256K", "--matmul", "64,128", "--repeats", "3", "--warmup", "1",
            "--model", "zoo:mlp", *TINY_MLP, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "cluster spec written to" in r.stdout
    return spec, raw, r.stderr


def test_the_accuracy_bench_fits_its_profiles_together_as_the_profiler_fits_one(profiled, tmp_path):
    """bench/accuracy.py fits the rows of all its profiles together: a profile pooled with a copy
    of itself gives back its own figures, and pooled with one three times slower it gives slower
    figures, at most the slow one's (taking each figure's best across profiles would keep the fast one)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    spec, raw, _ = profiled
    bench = load_bench("accuracy")
    same, slow = tmp_path / "same.json", tmp_path / "slow.json"
    for copy in (same, slow):  # the bench keeps each profile's rows beside its spec
        shutil.copy(spec, copy)
    shutil.copy(raw, same.with_suffix(".parquet"))
    table = pq.read_table(raw)
    tripled = pa.array([v * 3.0 for v in table.column("seconds").to_pylist()])
    pq.write_table(table.set_column(table.column_names.index("seconds"), "seconds", tripled), slow.with_suffix(".parquet"))
    alone = json.loads(spec.read_text())
    twice, mixed = bench.combine_profiles([same, same]), bench.combine_profiles([same, slow])
    for one, two, mix in zip(alone["devices"], twice["devices"], mixed["devices"]):
        for key in ("flops_per_gpu", "activation_bandwidth_Bps", "memory_bandwidth_Bps"):
            if one.get(key) is not None:
                assert two[key] == pytest.approx(one[key], rel=1e-9), key
                by_dtype = lambda d: d[key] if isinstance(d[key], dict) else {"": d[key]}  # noqa: E731  a flops map
                for dtype, rate in by_dtype(one).items():
                    if dtype not in ("", "fp32"):
                        continue  # a ratio of medians (bf16 over fp32 linears) need not move with the pool's speed
                    assert rate / 3 * (1 - 1e-9) <= by_dtype(mix)[dtype] < rate * (1 - 1e-6), (key, dtype)
    for name, fit in alone["network"]["collectives"].items():
        flat = lambda f: [f["latency_s"], f["bandwidth_Bps"], *(v for p in f.get("points", []) for v in p)]  # noqa: E731
        assert flat(twice["network"]["collectives"][name]) == pytest.approx(flat(fit), rel=1e-9), name
        t = lambda f: f["latency_s"] + 2**16 / f["bandwidth_Bps"]  # noqa: E731
        assert t(fit) * (1 + 1e-6) < t(mixed["network"]["collectives"][name]) <= 3 * t(fit) * (1 + 1e-9), name


def test_an_emulated_rank_gets_the_fastest_ranks_figures_times_its_speed(profiled):
    """Issue 28: a rank at emulated speed 0.5 is rank 0's device slowed by exactly that factor (what the runner's
    pacer does over a step), not what its short samples measured beside the other rank."""
    spec, _, _ = profiled
    fast, slow = json.loads(spec.read_text())["devices"]
    flat = lambda d: d if isinstance(d, dict) else {"": d}  # noqa: E731  a flops map by dtype
    assert flat(slow["flops_per_gpu"]) == pytest.approx({k: v / 2 for k, v in flat(fast["flops_per_gpu"]).items()}, rel=1e-12)
    assert slow["memory_bandwidth_Bps"] == pytest.approx(fast["memory_bandwidth_Bps"] / 2, rel=1e-12)
    if fast.get("activation_bandwidth_Bps"):
        assert slow["activation_bandwidth_Bps"] == pytest.approx(fast["activation_bandwidth_Bps"] / 2, rel=1e-12)
        assert slow["op_overhead_s"] == pytest.approx(fast["op_overhead_s"] * 2, rel=1e-12)


def test_emulation_scales_only_ranks_of_one_device_model_on_one_machine():
    from runner.profile import emulated_devices

    def dev(name, model, machine, flops):
        return {"name": name, "gpu_model": model, "machine": machine, "flops_per_gpu": {"fp32": flops, "bf16": 4 * flops},
                "memory_bandwidth_Bps": 10 * flops, "op_overhead_s": 1e-5}

    devices = [dev("a", "cpu", "m0", 100.0), dev("b", "cpu x0.5", "m0", 61.0), dev("c", "gpu x0.25", "m0", 1e3),
               dev("d", "cpu x0.5", "m1", 40.0)]
    out = emulated_devices(devices, [1.0, 0.5, 0.25, 0.5])
    assert out[0] == devices[0] and out[2] == devices[2] and out[3] == devices[3]  # the fastest of each group, or alone
    assert out[1]["flops_per_gpu"] == {"fp32": 50.0, "bf16": 200.0}
    assert out[1]["memory_bandwidth_Bps"] == 500.0 and out[1]["op_overhead_s"] == pytest.approx(2e-5)
    assert emulated_devices(devices[:2], [1.0, 1.0]) == devices[:2]  # unpaced ranks keep what they measured


def test_hap_profile_writes_a_spec_that_load_cluster_accepts_with_positive_fits(profiled):
    spec, _, stderr = profiled
    cluster = engine.load_cluster(spec)
    assert [d.name for d in cluster.devices] == ["rank-0", "rank-1"]
    assert [d.gpu_model for d in cluster.devices] == ["cpu", "cpu x0.5"]
    assert all(d.flops_per_gpu > 0 and d.memory_bytes_per_gpu > 0 for d in cluster.devices)
    acts = [d.activation_bandwidth_Bps for d in cluster.devices]
    assert acts == [None, None] or all(a > 0 for a in acts), acts  # the roofline split on every rank or none
    assert acts == [None, None] or all(0 < d.op_overhead_s < 1e-2 for d in cluster.devices)  # microseconds per run
    assert all(d.memory_bandwidth_Bps > 0 for d in cluster.devices)
    written = json.loads(spec.read_text())["network"]["collectives"]
    assert set(written) == set(COLLECTIVES)  # every fit measured, none nominal
    for name, fit in cluster.collectives.items():
        assert fit.latency_s >= 0 and fit.bandwidth_Bps > 0 and fit.time(4096) > 0, (name, fit)
    assert "27/27" in stderr  # progress: 2 matmuls + the model's linears in fp32, bf16 and fp16 + 2 model batches + its bf16 and fp16 autocast steps + the operator overhead + the overlap modes + the update + 5 x 3 payloads
    for d in cluster.devices:  # the largest matmul timed in bf16 and fp16 too: the rates mixed precision prices
        assert d.flops_per_gpu_in("bf16") > 0 and d.flops_per_gpu_in("fp16") > 0
    for d in cluster.devices:  # the step beside an all-reduce, and as two half-batches taking turns, over the step alone
        assert {m for m, _ in d.overlap_slowdown} == {"ddp", "duplex"}
        assert all(0.5 <= f <= 20 for _, f in d.overlap_slowdown) and dict(d.overlap_slowdown)["ddp"] >= 1


def test_the_update_is_timed_under_the_rank_s_pacer_so_an_emulated_slow_rank_is_stretched_too():
    """Every timed repeat of the update runs between the pacer's begin_step and end_step (the pacer's
    stretch itself is runner.timing's, tested there): checked with a counting pacer, since comparing
    two ranks' timings flaked on this 2-core host."""
    import torch

    from runner.profile import Progress, Recorder, measure_update

    class Counting:
        begins = ends = 0

        def begin_step(self) -> None:
            self.begins += 1

        def end_step(self) -> None:
            self.ends += 1

    pacer, rec = Counting(), Recorder(rank=1, speed=0.5, backend="gloo", world_size=2)
    cfg = parse_args(["--out", "c.json", "--model", "zoo:mlp", *TINY_MLP, "--repeats", "3", "--warmup", "2"])
    measure_update(cfg, rec, pacer, torch.device("cpu"), lambda: None, lambda: None, Progress(1, enabled=False))
    assert pacer.begins == pacer.ends == 3 and [r["repeat"] for r in rec.rows] == [0, 1, 2]
    assert all(r["kind"] == "memory" and r["speed"] == 0.5 and r["seconds"] > 0 for r in rec.rows)


def test_hap_profile_writes_the_raw_measurements_as_parquet(profiled):
    import pyarrow.parquet as pq

    _, raw, _ = profiled
    table = pq.read_table(raw)
    assert tuple(table.column_names) == PARQUET_COLUMNS
    rows = table.to_pylist()
    # ranks x repeats x (matmuls + the model's linears in fp32, bf16 and fp16 + model batches + its autocast steps + the empty
    # operators' chain + update + the step alone, beside an all-reduce, in halves), and every payload (all small) of
    # every collective COLLECTIVE_SAMPLES times
    assert len(rows) == 2 * (3 * (2 + 3 + 2 + 2 + 1 + 1 + 3) + 5 * 3 * COLLECTIVE_SAMPLES)
    overlap = [r for r in rows if r["kind"] == "overlap"]
    assert {(r["op"], r["impl"], r["size"]) for r in overlap} == {
        ("none", "zoo:mlp", 16), ("ddp", "zoo:mlp", 16), ("duplex", "zoo:mlp", 16)}
    assert all(r["payload_bytes"] > 0 for r in overlap if r["op"] == "ddp")
    assert {r["op"] for r in rows if r["kind"] == "collective"} == set(COLLECTIVES)
    assert {(r["op"], r["size"]) for r in rows if r["kind"] == "compute"} == {
        ("matmul", 64), ("matmul", 128), ("model_matmuls_fp32", 16), ("model_matmuls_bf16", 16),
        ("model_matmuls_fp16", 16), ("zoo:mlp", 16), ("zoo:mlp", 8), ("autocast_bf16", 16), ("autocast_fp16", 16)}
    assert {(r["op"], r["size"]) for r in rows if r["kind"] == "overhead"} == {("op_overhead", 130)}
    assert all(r["op_runs"] > 0 for r in rows if r["op"] in ("zoo:mlp", "autocast_bf16", "autocast_fp16"))
    autocast = [r for r in rows if r["op"].startswith("autocast_")]
    assert {r["impl"] for r in autocast} == {"zoo:mlp"} and all(r["flops_bound"] > 0 for r in autocast)
    assert all(r["flops"] > 0 for r in rows if r["kind"] == "compute")
    update = [r for r in rows if r["kind"] == "memory"]
    assert {(r["op"], r["impl"]) for r in update} == {("update", "bucket+unbucket+sgd")} and len({r["size"] for r in update}) == 1
    assert all(r["payload_bytes"] == 7 * r["size"] for r in update)  # bucket built and copied back (4) + SGD (3) per byte
    assert {r["speed"] for r in rows} == {1.0, 0.5} and all(r["seconds"] > 0 for r in rows)
    assert {r["calls"] for r in rows if r["op"] == "broadcast"} == {2}  # grouped all-gather: one broadcast per rank
    late = {}
    for r in rows:
        if r["kind"] == "collective" and r["arrival_delay_s"] > 0:
            key = (r["op"], r["size"], r["repeat"])
            assert key not in late, key  # exactly one late rank per repeat, taking turns
            late[key] = r["rank"]
    assert len(late) == 5 * 3 * COLLECTIVE_SAMPLES and {late[("all_reduce", 4096, i)] for i in range(3)} == {0, 1}


def test_a_plan_made_from_the_profiled_spec_runs(profiled, tmp_path):
    spec, _, _ = profiled
    plan = tmp_path / "plan.json"
    r = run_hap("plan", "--model", "zoo:gpt", *TINY_GPT, "--cluster", str(spec), "--out", str(plan), "--optimizer", "sgd")
    assert r.returncode == 0, r.stderr
    r = warm_hap("run", str(plan), "--steps", "2", "--speeds", "1,0.5")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "step    1" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--speeds", "1,0.5,0.5", "--nproc", "2"], "--speeds gives 3 factors but this launch has 2 ranks"),
    (["--model", "zoo:gpt", "--set", "layerz=2"], "unknown knob 'layerz'"),
    (["--model", "graph.json"], "--model must be zoo:NAME or none"),
    (["--parquet", "no/such/dir/raw.parquet"], "--parquet no/such/dir/raw.parquet: directory"),
])
def test_hap_profile_refuses_bad_input_in_one_line_before_starting_ranks(args, message, tmp_path):
    r = warm_hap("profile", "--out", str(tmp_path / "c.json"), *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "torch.distributed" not in r.stderr


def test_hap_rejects_unknown_arguments_of_other_commands():
    r = run_hap("capture", "--model", "zoo:mlp", "--out", "x.json", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


def test_defaults_follow_the_device_type_and_explicit_values_win():
    """A GPU gets matmuls and a model large enough not to be launch-bound (an H100 ran the CPU
    defaults at a tenth of its rate); what the user sets is kept on either device."""
    from runner.profile import DEFAULT_MATMUL, PROFILE_KNOBS, model_config, on_device

    cfg = parse_args(["--out", "c.json"])
    assert cfg.matmul is None
    cpu, gpu = on_device(cfg, "cpu"), on_device(cfg, "cuda")
    assert cpu.matmul == DEFAULT_MATMUL["cpu"] and gpu.matmul == DEFAULT_MATMUL["cuda"]
    assert min(gpu.matmul) > max(cpu.matmul)
    assert model_config(cpu) == ("gpt", PROFILE_KNOBS["cpu"]["gpt"])
    assert model_config(gpu)[1]["hidden"] > model_config(cpu)[1]["hidden"]
    mine = on_device(parse_args(["--out", "c.json", "--matmul", "64", "--set", "hidden=256"]), "cuda")
    assert mine.matmul == (64,) and model_config(mine)[1]["hidden"] == "256"


def test_one_rank_writes_no_collectives_and_its_spec_plans(tmp_path):
    """One rank cannot measure a collective (the H100 run fitted 1e30 B/s to local copies): its spec
    has none, says so, and a one-device cluster still loads and plans."""
    spec = tmp_path / "one.json"
    r = warm_hap("profile", "--out", str(spec), "--nproc", "1", "--sizes", "4K,64K", "--matmul", "64", "--repeats", "2",
            "--model", "zoo:mlp", *TINY_MLP, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "collectives: none measured on one rank" in r.stdout
    data = json.loads(spec.read_text())
    assert data["network"]["collectives"] == {} and data["network"]["bandwidth_Bps"] == {}
    assert any("none measured" in s for s in data["sources"])
    cluster = engine.load_cluster(spec)
    assert len(cluster.devices) == 1
    plan = tmp_path / "plan.json"
    r = run_hap("plan", "--model", "zoo:mlp", *TINY_MLP, "--cluster", str(spec), "--out", str(plan))
    assert r.returncode == 0, r.stderr
    assert json.loads(plan.read_text())["predicted_time_s"] > 0
