"""`hap profile --out cluster.json [--parquet raw.parquet] [--nproc N] [--speeds 1,0.5] ...`

Measures the cluster this job runs on and writes a cluster spec the planner reads directly
(HAP §3.2: "run each collective operation on the cluster with tensors of different sizes and
fit the latency and bandwidth in a linear model"):

* **compute**: each rank's achieved FLOP/s on square matmuls at several sizes, and one forward
  plus backward of a zoo model at its batch and at half of it, run as `hap run` runs it (the
  rank program of the model's one-device plan, `runner.program`), its work counted exactly as
  the cost model counts it (`engine.spmd.cost.CostModel`). The spec records the roofline split the cost
  model prices: `flops_per_gpu`, the best matmul rate, for the matmul-class operators, and
  `activation_bandwidth_Bps`, the memory-bound operators' bytes (element-wise ops, norms,
  losses) over the rest of the model's step time. A model whose matmuls alone take its whole
  step (or `--model none`) gets one rate instead (the model's, or the best matmul). Emulated speeds
  (`--speeds`) use the runner's own emulation (`runner.timing.Pacer`), so a rank of speed 0.5
  measures half the rate; CPU thread settings are the runner's (`runner.rank_setup.apply_cpu_threads`).
* **memory**: the memory-bound tail of a step on each rank — copying the summed gradient bucket
  back and one SGD step over the model's parameters — as the bytes they move per second
  (`memory_bandwidth_Bps`, which prices the optimizer update in `engine.spmd.cost`);
* **communication**: every collective the cost model prices, with the runner's implementations
  and the payload conventions of `engine.cluster`: `all_reduce` (into a fresh tensor, as the
  runner reduces activations and the gradient bucket; payload: the whole tensor),
  `all_gather` (the padded implementation; payload: one shard), `reduce_scatter` and
  `all_to_all` (payload: one shard), and `broadcast` timed as the grouped all-gather (one
  broadcast per rank; its time divided by the number of ranks, payload: one shard). Each
  payload runs `--warmup` times untimed, then `--repeats` times after a barrier, one rank in
  turn arriving ARRIVAL_DELAY_S late so that the others wait inside the collective as they do
  in training; a repeat's time is the late rank's (from the last arrival to the end), a
  payload's time the median over repeats, and `engine.cluster.spec.fit_collective` fits latency +
  bandwidth per collective. One rank has no one to talk to: its spec has no collectives (a one-device
  cluster communicates nothing) rather than fits of local copies.

The matmul sizes and the profiling model's config default by device type (DEFAULT_MATMUL,
PROFILE_KNOBS): small on a CPU, large enough on a GPU that it is not launch-bound.

Under an existing launch (torchrun or Slurm setting RANK and WORLD_SIZE) this process is one
rank; otherwise `hap profile` starts

    python -m torch.distributed.run --standalone --nproc-per-node=N -m runner.profile ...

on this machine. Several machines: run on each node, e.g.

    torchrun --nnodes=2 --nproc-per-node=4 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 -m runner.profile --out cluster.json

Rank 0 shows progress on stderr, prints a summary, and writes the spec (devices `rank-0`,
`rank-1`, ... on machines named by host) and the raw measurements as Parquet (`--parquet`).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from engine import limits
from engine.errors import HapError
from engine.model.graph import Graph
from engine.options import PlanOptions

PROFILE_KNOBS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {"gpt": dict(layers=2, hidden=128, heads=4, ffn=512, vocab=512, seq_len=64, batch=16),
            "mlp": dict(layers=2, in_features=256, hidden=1024, classes=16, batch=64)},
    "cuda": {"gpt": dict(layers=4, hidden=1024, heads=16, ffn=4096, vocab=8192, seq_len=512, batch=16),
             "mlp": dict(layers=4, in_features=2048, hidden=8192, classes=1024, batch=1024)},
}
"""Configs of the zoo models per device type, with `--set` knobs on top: ~0.1 s per step on one CPU
thread; on a GPU large enough to keep it busy (the CPU configs run launch-bound on an H100: 0.6
TFLOP/s instead of the 46 this gpt config gives)."""
DEFAULT_SIZES = (16 * 2**10, 128 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
"""Collective payloads: latency-bound activations up to the multi-MiB gradient buckets of the zoo models."""
DEFAULT_MATMUL: dict[str, tuple[int, ...]] = {"cpu": (128, 256, 512), "cuda": (2048, 4096, 8192)}
"""Square matmul sizes per device type when --matmul is not given (an H100 reaches 5 of its 52 fp32
TFLOP/s at 512, all of them at 4096 and up)."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
IMPL = {"all_reduce": "all_reduce", "all_gather": "all_gather.padded", "reduce_scatter": "reduce_scatter",
        "all_to_all": "all_to_all", "broadcast": "all_gather.grouped"}
"""The runner code path each fit is measured on (the cost model's collective keys)."""
ARRIVAL_DELAY_S = 0.002
"""In each timed repeat of a collective one rank (in turn) arrives this much later than the others,
which are by then blocked inside the collective, as ranks are in training; its time is the one
used. It so includes waking the waiting ranks, which on a loaded CPU host costs milliseconds."""
COLLECTIVE_SAMPLES = 12
"""Timed repeats of each collective payload up to SMALL_PAYLOAD at least (more when --repeats asks): a
small collective's time on a shared host has a long right tail (one 2-rank gloo profile's 128 KiB all-reduce:
median 0.73 ms, mean 1.29 ms over 15 repeats), and five repeats put its estimate anywhere in it."""
SMALL_PAYLOAD = 2**20
"""Payloads up to this many bytes take COLLECTIVE_SAMPLES repeats (a few ms each); larger ones --repeats."""
MIN_FLOPS_PER_SAMPLE = 1e8
"""A matmul sample repeats the product until it does at least this much work (~1 ms on a CPU core)."""
PARQUET_COLUMNS = ("kind", "op", "impl", "rank", "speed", "size", "payload_bytes", "calls", "flops", "flops_bound",
                   "traffic_bytes", "op_runs", "repeat", "arrival_delay_s", "seconds", "backend", "world_size")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What to measure; identical on every rank."""

    out: str
    """Path of the cluster spec JSON to write."""
    parquet: str | None = None
    """Path of the raw measurements (Parquet), or None."""
    nproc: int | None = None
    """Ranks to start when not under a launcher (default: one per --speeds factor, else per GPU, else 2)."""
    speeds: str | None = None
    """Emulated speed factor per rank, e.g. `1,0.5` (see runner.timing)."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Collective payloads in bytes."""
    matmul: tuple[int, ...] | None = None
    """Square matmul sizes n (n x n @ n x n); None: DEFAULT_MATMUL of the device type."""
    model: str = "zoo:gpt"
    """Zoo model whose operators set the recorded FLOP/s, or `none` for the best matmul rate."""
    knobs: tuple[str, ...] = ()
    """`KEY=VALUE` knobs on top of PROFILE_KNOBS."""
    repeats: int = 5
    """Timed repetitions per measurement (the median is used)."""
    warmup: int = 1
    """Untimed repetitions before each measurement."""
    name: str = "profiled"
    """Name of the cluster in the spec."""
    timeout_s: float = 120.0
    """Process-group timeout."""
    device_type: str = "cpu"
    """Where the ranks measure (`cuda` or `cpu`); it picks the defaults (`on_device`)."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if max(self.repeats, self.warmup) > MAX_REPEATS:
            raise ValueError(f"--repeats and --warmup must be at most {MAX_REPEATS}, got {self.repeats} and {self.warmup}")
        if self.nproc is not None and self.nproc > MAX_NPROC:
            raise ValueError(f"--nproc must be at most {MAX_NPROC} (ranks started on this machine), got {self.nproc}")
        if self.matmul is not None and any(n > MAX_MATMUL for n in self.matmul):
            raise ValueError(f"--matmul sizes must be at most {MAX_MATMUL} (an N x N fp32 matrix of 16 GiB), "
                             f"got {max(self.matmul)}")
        if not limits.in_range(self.timeout_s, 0, 7 * 86400.0) or self.timeout_s == 0:
            raise ValueError(f"--timeout must be a positive number of seconds up to a week, got {self.timeout_s}")
        if len(self.sizes) < 2:
            raise ValueError(f"--sizes needs at least 2 payloads to fit latency and bandwidth, got {len(self.sizes)}")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {self.nproc}")
        if self.matmul == () and self.model == "none":
            raise ValueError("--model none needs --matmul sizes to measure FLOP/s")


def on_device(cfg: ProfileConfig, device_type: str) -> ProfileConfig:
    """The config as the ranks of `device_type` run it: the default matmul sizes and model config of
    that device type where the user gave none."""
    return replace(cfg, device_type=device_type, matmul=cfg.matmul if cfg.matmul is not None
                   else DEFAULT_MATMUL.get(device_type, DEFAULT_MATMUL["cpu"]))


MAX_REPEATS = 10_000
"""Timed (or warm-up) repetitions of one measurement."""
MAX_NPROC = 1024
"""Ranks the profiler starts on one machine."""
MAX_MATMUL = 65536
"""Side of the largest square matmul timed for FLOP/s."""
MAX_PAYLOAD_BYTES = 2**34
"""Largest collective payload timed (16 GiB)."""


def _byte_size(text: str) -> int:
    """`4096`, `4K`, `1M`, `2G` (binary units) -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise ValueError(f"--sizes expects sizes such as 4096,64K,1M, got '{text}'") from None
    if not 64 <= value <= MAX_PAYLOAD_BYTES:  # also refuses nan and inf
        raise ValueError(f"--sizes: payloads must be 64 bytes to 16G, got '{text}'")
    return int(value)


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} expects comma-separated integers, got '{text}'") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what} values must be positive, got '{text}'")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hap profile", description="Measure FLOP/s and collective costs of this cluster "
                                "and write a cluster spec (starts torchrun on this machine unless RANK and WORLD_SIZE are set).")
    p.add_argument("--out", required=True, help="cluster spec JSON to write")
    p.add_argument("--parquet", help="also write the raw measurements here (Parquet, needs pyarrow)")
    p.add_argument("--nproc", type=int, help="ranks to start on this machine (default: one per --speeds factor, GPU, or 2)")
    p.add_argument("--speeds", metavar="F,F,..", help="emulated speed factor per rank in (0, 1], e.g. 1,0.5")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), metavar="B,B,..",
                   help="collective payloads in bytes (K, M, G suffixes; default 16K,128K,1M,4M,16M)")
    p.add_argument("--matmul", metavar="N,N,..", help="square matmul sizes (default 128,256,512 on CPU, "
                   "2048,4096,8192 on a GPU)")
    p.add_argument("--model", default="zoo:gpt", help="zoo model whose own operators set the FLOP/s (zoo:gpt, zoo:mlp) or 'none'")
    p.add_argument("--set", dest="knobs", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the profiling model, on top of its default config (small on CPU, GPU-sized on a GPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--name", default="profiled", help="cluster name in the spec")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=120.0, metavar="S", help="process-group timeout")
    return p


def parse_args(argv: Sequence[str] | None = None) -> ProfileConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        values = vars(args)
        values["sizes"] = tuple(sorted({_byte_size(s) for s in args.sizes.split(",") if s.strip()}))
        values["matmul"] = None if args.matmul is None else _int_list(args.matmul, "--matmul")
        values["knobs"] = tuple(args.knobs)
        return ProfileConfig(**values)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


# ----------------------------------------------------------------------------- checks before launch


def model_config(cfg: ProfileConfig) -> tuple[str, dict[str, Any]] | None:
    """(zoo name, knobs) of the profiling model, or None for `--model none`; raises HapError/ValueError."""
    from engine.model import zoo

    if cfg.model == "none":
        return None
    if not cfg.model.startswith("zoo:"):
        raise ValueError(f"--model must be zoo:NAME or none, got '{cfg.model}' (the profiler builds zoo models only)")
    name = cfg.model.removeprefix("zoo:")
    knobs = dict(PROFILE_KNOBS.get(cfg.device_type, PROFILE_KNOBS["cpu"]).get(name, {}))
    for pair in cfg.knobs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got '{pair}'")
        knobs[key.strip()] = value.strip()
    zoo.make_config(name, **knobs)  # validates name and knobs
    return name, knobs


def default_nproc(cfg: ProfileConfig) -> int:
    import torch

    if cfg.nproc:
        return cfg.nproc
    if cfg.speeds:
        return len(cfg.speeds.split(","))
    return torch.cuda.device_count() or 2


def check_inputs(cfg: ProfileConfig, world_size: int) -> None:
    """Everything about the inputs that can fail, checked before any process group starts."""
    from .timing import parse_speeds

    if cfg.speeds:
        parse_speeds(cfg.speeds, world_size, "this launch")
    model_config(cfg)
    for what, path in (("--out", cfg.out), ("--parquet", cfg.parquet)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ValueError(f"{what} {path}: directory {folder} does not exist")
    if cfg.parquet:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ValueError("--parquet needs pyarrow: pip install 'hap-workbench[profile]'") from None


# ----------------------------------------------------------------------------- progress


class Progress:
    """A bar on rank 0's stderr (one line per item when stderr is not a terminal); silent elsewhere."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(1, self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done:3d}/{self.total} "
                f"{time.perf_counter() - self.start:5.1f} s  {label}")
        sys.stderr.write(f"\r{line:<100}" if self.tty else f"hap profile: {line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ----------------------------------------------------------------------------- measuring


@dataclass
class Recorder:
    """Raw measurements of this rank, one dict per timed repetition (the Parquet rows)."""

    rank: int
    speed: float
    backend: str
    world_size: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, kind: str, op: str, impl: str, size: int, seconds: list[float], *, payload_bytes: int | None = None,
            calls: int = 1, flops: float | None = None, delays: list[float] | None = None) -> None:
        for i, s in enumerate(seconds):
            self.rows.append({"kind": kind, "op": op, "impl": impl, "rank": self.rank, "speed": self.speed,
                              "size": size, "payload_bytes": payload_bytes, "calls": calls, "flops": flops,
                              "repeat": i, "arrival_delay_s": delays[i] if delays else 0.0, "seconds": s,
                              "backend": self.backend, "world_size": self.world_size})


def time_repeats(fn: Callable[[], Any], repeats: int, warmup: int, *, barrier: Callable[[], Any],
                 sync: Callable[[], Any], pacer=None) -> list[float]:
    """Wall seconds of `fn` per repetition, each started after a barrier; the pacer (if any) stretches compute."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        barrier()
        if pacer is not None:
            pacer.begin_step()
        start = time.perf_counter()
        fn()
        if pacer is not None:
            pacer.end_step()
        sync()
        out.append(time.perf_counter() - start)
    return out


def time_collective(fn: Callable[[], Any], repeats: int, warmup: int, rank: int, world_size: int, *,
                    barrier: Callable[[], Any], sync: Callable[[], Any]) -> tuple[list[float], list[float]]:
    """(seconds, arrival delay) per repetition: after a barrier, rank (i mod world) waits ARRIVAL_DELAY_S
    first; every rank times from its own arrival, so the late rank's time runs from the last arrival."""
    for _ in range(warmup):
        fn()
    sync()
    times, delays = [], []
    for i in range(repeats):
        barrier()
        late = i % world_size == rank
        if late:
            time.sleep(ARRIVAL_DELAY_S)
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        delays.append(ARRIVAL_DELAY_S if late else 0.0)
    return times, delays


def measure_matmuls(cfg: ProfileConfig, rec: Recorder, pacer, device, barrier, sync, progress: Progress) -> None:
    """n x n @ n x n at each size, repeated within a sample to reach MIN_FLOPS_PER_SAMPLE."""
    import torch

    for n in cfg.matmul or ():
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        inner = max(1, math.ceil(MIN_FLOPS_PER_SAMPLE / (2.0 * n**3)))

        def fn() -> None:
            for _ in range(inner):
                torch.mm(a, b)

        times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
        rec.add("compute", "matmul", "mm", n, times, flops=2.0 * n**3 * inner)
        progress.step(f"matmul {n}x{n}")
    measure_low_precision_matmuls(cfg, rec, pacer, device, barrier, sync, progress)


LOW_PRECISION = ("bf16", "fp16")
"""Dtypes whose matmul rate `hap profile` measures too: the spec's `flops_per_gpu` map (what a plan in
mixed precision prices its matmul-class operators at, `engine.spmd.precision`)."""


def measure_low_precision_matmuls(cfg: ProfileConfig, rec: Recorder, pacer, device, barrier, sync,
                                  progress: Progress) -> None:
    """The matmuls again in each `LOW_PRECISION` dtype, as autocast runs them: the profiled model's own linear
    layers at its profiling batch, in fp32 too (ops `model_matmuls_<dtype>`), or without a model the largest
    square matmul (ops `matmul_<dtype>`). The spec keeps each dtype's speed over fp32 (`with_low_precision`)."""
    import torch

    from .precision import DTYPES

    spec = model_config(cfg)
    shapes = model_linear_shapes(*spec) if spec else []
    if shapes:
        for name in ("fp32", *LOW_PRECISION):
            fn, flops = _linears_fn(shapes, device, DTYPES.get(name, torch.float32))
            times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
            rec.add("compute", f"model_matmuls_{name}", "linear", model_batches(spec[1])[0] or 0, times, flops=flops)
            progress.step(f"the model's matmuls in {name}")
        return
    if not cfg.matmul:
        return
    n = max(cfg.matmul)
    for name in LOW_PRECISION:
        dtype = DTYPES[name]
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        inner = max(1, math.ceil(MIN_FLOPS_PER_SAMPLE / (2.0 * n**3)))

        def fn() -> None:
            for _ in range(inner):
                torch.mm(a, b)

        times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
        rec.add("compute", f"matmul_{name}", "mm", n, times, flops=2.0 * n**3 * inner)
        progress.step(f"matmul {n}x{n} {name}")


def low_precision_samples(cfg: ProfileConfig, spec: tuple[str, dict[str, Any]] | None) -> int:
    """How many samples `measure_low_precision_matmuls` takes (for the progress bar)."""
    if spec and model_linear_shapes(*spec):
        return 1 + len(LOW_PRECISION)
    return len(LOW_PRECISION) if cfg.matmul else 0


def model_linear_shapes(name: str, knobs: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """(rows m, inputs k, outputs n, how many) of each distinct linear layer of a zoo model at its knobs'
    batch: [m, k] @ [k, n]."""
    return list(_linear_shapes(name, tuple(sorted(knobs.items()))))


@functools.lru_cache(maxsize=4)
def _linear_shapes(name: str, knobs: tuple[tuple[str, Any], ...]) -> tuple[tuple[int, int, int, int], ...]:
    import engine

    graph = engine.load_model(f"zoo:{name}", **dict(knobs))
    counts: dict[tuple[int, int, int], int] = {}
    for node in graph.nodes:
        if node.op == "linear" and node.shape:
            k, n = graph[node.inputs[0]].shape[-1], node.shape[-1]
            key = (math.prod(node.shape) // n, k, n)
            counts[key] = counts.get(key, 0) + 1
    return tuple((*key, count) for key, count in counts.items())


def _linears_fn(shapes: list[tuple[int, int, int, int]], device, dtype) -> tuple[Callable[[], None], float]:
    """A sample that runs every linear layer of `shapes` as often as the model does, repeated to reach
    MIN_FLOPS_PER_SAMPLE; and its flops."""
    import torch

    operands = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype), count)
                for m, k, n, count in shapes]
    once = sum(2.0 * m * k * n * count for m, k, n, count in shapes)
    inner = max(1, math.ceil(MIN_FLOPS_PER_SAMPLE / once))

    def fn() -> None:
        for _ in range(inner):
            for x, w, count in operands:
                for _ in range(count):
                    torch.nn.functional.linear(x, w)

    return fn, once * inner


def model_batches(knobs: dict[str, Any]) -> list[int | None]:
    """The profiling model's batch and half of it (the shards a device runs are smaller than the batch)."""
    if "batch" not in knobs:
        return [None]
    batch = int(knobs["batch"])
    return [batch] + ([batch // 2] if batch >= 2 else [])


def measure_model(cfg: ProfileConfig, rec: Recorder, pacer, device, barrier, sync, progress: Progress) -> None:
    """Forward + backward of the zoo model at each batch, as the runner runs it: the rank program
    (`runner.program`) of the model's one-device plan, so the generated program's own overhead is
    in the measurement. Flops are filled in by rank 0 (`fill_model_flops`)."""
    spec = model_config(cfg)
    if spec is None:
        return
    name, knobs = spec
    for batch in model_batches(knobs):
        fn = _model_step_fn(name, knobs, batch, device)
        times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
        rec.add("compute", f"zoo:{name}", "forward+backward", batch or 0, times)
        progress.step(f"zoo:{name} batch {batch}")
    batch = model_batches(knobs)[0]
    for low in LOW_PRECISION:
        fn = _model_step_fn(name, knobs, batch, device, precision=low)
        times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
        rec.add("compute", f"autocast_{low}", f"zoo:{name}", batch or 0, times)
        progress.step(f"zoo:{name} batch {batch} under {low} autocast")


OP_CHAIN = 64
"""Tiny operators in `measure_op_overhead`'s chain: their work is nil, so the time is their runs' overhead."""


def measure_op_overhead(cfg: ProfileConfig, rec: Recorder, pacer, device, barrier, sync, progress: Progress) -> None:
    """A chain of OP_CHAIN element-wise products on an 8-element tensor, forward and backward through
    autograd: 2 x OP_CHAIN + 2 operator runs that do no work, so their time is the fixed cost of a run
    (dispatch, autograd, a kernel launch), the spec's `op_overhead_s` (`op_overhead`)."""
    import torch

    x = torch.ones(8, device=device, requires_grad=True)

    def fn() -> None:
        y = x
        for _ in range(OP_CHAIN):
            y = y * 1.0001
        y.sum().backward()
        x.grad = None

    times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
    rec.add("overhead", "op_overhead", "mul chain", 2 * OP_CHAIN + 2, times)
    progress.step("operator overhead")


def op_overhead(rows: list[dict[str, Any]], rank: int) -> float | None:
    """Seconds per operator run of one rank (`measure_op_overhead`: median over repeats); None when not measured."""
    mine = [r for r in rows if r["kind"] == "overhead" and r["rank"] == rank]
    return statistics.median(r["seconds"] for r in mine) / mine[0]["size"] if mine else None


def measure_overlap(cfg: ProfileConfig, rec: Recorder, device, barrier, sync, progress: Progress) -> None:
    """The model step's computation in each overlap mode, against the same step alone (rows
    `overlap`/`none`): `duplex`, its two half-batches on two threads taking turns on the device as
    `runner.duplex` runs them; `ddp`, the step while an all-reduce of its parameters' bytes runs
    on a process group of its own (the communication's work competing for the device). Unpaced:
    the spec keeps only the ratios (`overlap_slowdowns`)."""
    import threading

    import torch
    import torch.distributed as dist

    spec = model_config(cfg)
    if spec is None:
        return
    name, knobs = spec
    batch = model_batches(knobs)[0]
    full = _model_step_fn(name, knobs, batch, device)
    group = dist.new_group()
    nbytes = sum(p.numel() * p.element_size() for p in full.params)
    grads = torch.zeros(max(1, nbytes // 4), device=device)
    step_s: list[float] = []

    def with_all_reduce() -> None:
        work = dist.all_reduce(grads, group=group, async_op=True)
        start = time.perf_counter()
        full()
        sync()
        step_s.append(time.perf_counter() - start)
        work.wait()

    rec.add("overlap", "none", f"zoo:{name}", batch or 0, time_repeats(full, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync))
    time_repeats(with_all_reduce, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync)
    rec.add("overlap", "ddp", f"zoo:{name}", batch or 0, step_s[-cfg.repeats:], payload_bytes=nbytes)
    if batch and batch >= 2:
        halves = [_model_step_fn(name, knobs, batch // 2, device) for _ in range(2)]
        turn = threading.Lock()
        intra_op = torch.get_num_threads()

        def half(fn) -> None:
            torch.set_num_threads(intra_op)  # as runner.duplex: a new thread gets OpenMP's default
            with turn:
                fn()
                sync()

        def both() -> None:
            threads = [threading.Thread(target=half, args=(h,)) for h in halves]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        rec.add("overlap", "duplex", f"zoo:{name}", batch, time_repeats(both, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync))
    progress.step(f"zoo:{name} in the overlap modes")


def _model_step_fn(name: str, knobs: dict[str, Any], batch: int | None, device,
                   precision: str = "fp32") -> Callable[[], None]:
    """Forward + backward of the zoo model's one-device program at `batch` (`params`: its parameters), the
    forward under `precision`'s autocast as the runner runs a mixed-precision plan."""
    from .precision import autocast
    from .train import factory_device, make_batch, program_args, setup_rank

    plan = one_device_plan(name, {**knobs, **({"batch": batch} if batch else {})})
    st = setup_rank(plan, 0, seed=0, device=device)
    inputs = make_batch(plan, 0, 0, device)

    def fn() -> None:
        with factory_device(st.device), autocast(precision, st.device):
            loss = st.program.module(*program_args(plan, st, 0, inputs))
        loss.backward()
        for p in st.params:
            p.grad = None

    fn.params = st.params  # type: ignore[attr-defined]
    return fn


def overlap_slowdowns(rows: list[dict[str, Any]], rank: int) -> dict[str, float]:
    """Per overlap mode, the rank's median step in that mode over its median step alone (the spec's
    `overlap_slowdown`), within the range a cluster spec accepts, and at least 1 for ddp: an
    all-reduce running beside the step cannot speed it up, so a ratio below 1 is noise (seen on 4
    ranks sharing 2 cores). Two half-batches may run faster than one batch (a smaller working set)."""
    mine = [r for r in rows if r["kind"] == "overlap" and r["rank"] == rank]
    alone = [r["seconds"] for r in mine if r["op"] == "none"]
    out = {}
    for mode, floor in (("ddp", 1.0), ("duplex", 0.5)):
        times = [r["seconds"] for r in mine if r["op"] == mode]
        if alone and times:
            out[mode] = round(min(20.0, max(floor, statistics.median(times) / statistics.median(alone))), 3)
    return out


def one_device_cluster(activation_bandwidth: bool = False) -> dict[str, Any]:
    """A cluster spec of one unit-rate device (in every precision): the cost model's work counts come out in
    flops and bytes."""
    rates = {"fp32": 1.0, **{low: 1.0 for low in LOW_PRECISION}}
    device = {"name": "d", "gpu_model": "d", "machine": "m", "flops_per_gpu": rates, "memory_bytes_per_gpu": 2**60}
    if activation_bandwidth:
        device["activation_bandwidth_Bps"] = 1.0
    return {"schema_version": 1, "name": "one", "devices": [device], "network": {"latency_s": 0.0, "bandwidth_Bps": {}}}


def one_device_plan(name: str, knobs: dict[str, Any]):
    """The plan of a zoo model on one device with every tensor Full: its rank program is the whole
    model at any batch (a split batch dim would need 2 samples, and half of a batch of 2 is 1)."""
    import engine
    from engine.spmd.baselines import replicated_space
    from engine.spmd.cost import CostModel
    from engine.spmd.iteration import plan_of
    from engine.spmd.synthesis import synthesize

    graph, cluster = engine.load_model(f"zoo:{name}", **knobs), engine.load_cluster(one_device_cluster())
    program = synthesize(graph, CostModel(graph, cluster, [1.0], PlanOptions(optimizer="sgd")), space=replicated_space()).program
    return plan_of(program, graph, cluster, [1.0], options=PlanOptions(optimizer="sgd"))


UPDATE_BYTES_WITHOUT_MODEL = 16 * 2**20
"""Parameter bytes of the update measurement when no model is profiled (`--model none`)."""


UPDATE_MIN_BYTES = 4 * 2**20
"""Fewest parameter bytes the update measurement times: a small model's parameters are repeated up to
this, since an update of a few KiB lasts microseconds and its timing (and the emulated stretch of a
slow rank) is lost in scheduling noise."""


def update_tensors(cfg: ProfileConfig, device) -> list:
    """Parameters to update: copies of the profiled zoo model's (its own tensor sizes), as many as
    reach `UPDATE_MIN_BYTES`, else 16 tensors of 1 MiB."""
    import torch

    from engine.model import zoo

    spec = model_config(cfg)
    if spec is None:
        return [torch.zeros(UPDATE_BYTES_WITHOUT_MODEL // 64, device=device, requires_grad=True) for _ in range(16)]
    name, knobs = spec
    model = [p.detach().to(device) for p in zoo.entry(name).build(zoo.make_config(name, **knobs)).parameters()]
    nbytes = max(1, sum(p.numel() * p.element_size() for p in model))
    copies = max(1, -(-UPDATE_MIN_BYTES // nbytes))
    return [p.clone().requires_grad_() for _ in range(copies) for p in model]


def measure_update(cfg: ProfileConfig, rec: Recorder, pacer, device, barrier, sync, progress: Progress) -> None:
    """The memory-bound tail of a step, as the runner runs it around the gradient all-reduce (which is
    timed with the collectives): building the bucket (a flat copy of the gradients), copying it
    back into the gradients and one SGD step, over the parameters; the spec's `memory_bandwidth_Bps`
    is the bytes they move per second (`engine.spmd.cost.BUCKET_TRAFFIC` + `UPDATE_TRAFFIC`)."""
    import torch

    from engine.spmd.cost import BUCKET_TRAFFIC, UPDATE_TRAFFIC

    from .collectives import FlatBuffer
    from .train import make_optimizer

    params = update_tensors(cfg, device)
    for t in params:
        t.grad = torch.ones_like(t)
    optimizer = make_optimizer(params, "sgd", lr=1e-6)
    grads = [t.grad for t in params]
    bucket = FlatBuffer()  # kept across steps, as the runner keeps its buckets

    def fn() -> None:
        FlatBuffer.scatter(bucket.cat(grads), grads)
        optimizer.step()

    nbytes = sum(t.numel() * t.element_size() for t in params)
    times = time_repeats(fn, cfg.repeats, cfg.warmup, barrier=barrier, sync=sync, pacer=pacer)
    rec.add("memory", "update", "bucket+unbucket+sgd", nbytes, times, payload_bytes=int(nbytes * (BUCKET_TRAFFIC + UPDATE_TRAFFIC["sgd"])))
    progress.step("optimizer update")


def memory_bandwidth(rows: list[dict[str, Any]], rank: int) -> float:
    """Bytes per second of the update measurement of one rank (median over repeats)."""
    mine = [r for r in rows if r["kind"] == "memory" and r["rank"] == rank]
    return mine[0]["payload_bytes"] / statistics.median(r["seconds"] for r in mine)


EMULATED_FIELDS = {"flops_per_gpu": 1, "activation_bandwidth_Bps": 1, "memory_bandwidth_Bps": 1, "op_overhead_s": -1}
"""The device figures an emulated speed factor scales, and how (power of the factor): rates by it, the
per-run overhead by its inverse (`emulated_devices`)."""


def emulated_devices(devices: list[dict[str, Any]], speeds: Sequence[float]) -> list[dict[str, Any]]:
    """Devices whose ranks ran at emulated `speeds` (`--speeds`), with the figures an emulation defines: each
    rank's `EMULATED_FIELDS` are those of the fastest rank of the same device model on the same machine,
    times its speed over that rank's. The runner slows a rank by exactly that factor over long stretches of
    computation (`runner.timing.Pacer`); the short timed samples of a profile, run by both ranks at once,
    did not (a speed-0.5 rank's square matmuls came out at 0.57-0.65 of the other rank's, its model step at
    0.50), and every price on the slow rank was then too fast. Ranks at speed 1 keep what they measured."""
    out = [dict(d) for d in devices]
    groups: dict[tuple[str, str], list[int]] = {}
    for j, d in enumerate(devices):
        groups.setdefault((d["machine"], d["gpu_model"].split(" x")[0]), []).append(j)
    for members in groups.values():
        ref = max(members, key=lambda j: (speeds[j], -j))
        for j in members:
            factor = speeds[j] / speeds[ref]
            if j == ref or factor == 1.0:
                continue
            for key, power in EMULATED_FIELDS.items():
                value = devices[ref].get(key)
                if isinstance(value, dict):
                    out[j][key] = {k: v * factor**power for k, v in value.items()}
                elif value is not None:
                    out[j][key] = value * factor**power
    return out


def rank_speeds(rows: list[dict[str, Any]], ranks: Sequence[int]) -> list[float]:
    """Each rank's emulated speed factor, as its rows record it (1.0 where it ran unpaced)."""
    speed = {r["rank"]: r["speed"] for r in rows}
    return [float(speed.get(j, 1.0)) for j in ranks]


def collective_op(name: str, nbytes: int, m: int, device) -> tuple[Callable[[], Any], int, int]:
    """(run it once, payload bytes in the cost model's convention, backend calls per run) on the runner's code path."""
    import torch
    import torch.distributed as dist

    from . import collectives as C

    n = max(m, (nbytes // 4) // m * m)  # fp32 elements, a multiple of m
    x = torch.ones(n, device=device)
    if name == "all_reduce":  # into a fresh copy, as activations (and the gradient bucket, built by torch.cat) are
        return (lambda: C.all_reduce_copy(x)), 4 * n, 1
    if name == "all_gather":
        return (lambda: C.gather_padded(x, 0, [n] * m)), 4 * n, 1
    if name == "reduce_scatter":
        full = torch.ones(n * m, device=device)
        return (lambda: C.reduce_scatter_uneven(full, 0, [n] * m)), 4 * n, 1
    if name == "all_to_all":
        local = x.view(1, n)
        return (lambda: C.all_to_all_uneven(local, 0, 1, [1] * m, [n // m] * m)), 4 * n, 1
    if name == "broadcast":
        return (lambda: C.gather_grouped(x, 0, [n] * m)), 4 * n, m
    raise ValueError(f"unknown collective '{name}'")


def measure_collectives(cfg: ProfileConfig, rec: Recorder, device, barrier, sync, progress: Progress) -> None:
    import torch.distributed as dist

    m, rank = dist.get_world_size(), dist.get_rank()
    for name in COLLECTIVES:
        for size in cfg.sizes:
            fn, payload, calls = collective_op(name, size, m, device)
            times, delays = time_collective(fn, collective_repeats(cfg, size), cfg.warmup, rank, m, barrier=barrier,
                                            sync=sync)
            rec.add("collective", name, IMPL[name], size, times, payload_bytes=payload, calls=calls, delays=delays)
            progress.step(f"{name} {_human(payload)}")


def collective_repeats(cfg: ProfileConfig, size: int) -> int:
    """Timed repeats of one collective payload: at least COLLECTIVE_SAMPLES up to SMALL_PAYLOAD bytes."""
    return max(cfg.repeats, COLLECTIVE_SAMPLES) if size <= SMALL_PAYLOAD else cfg.repeats


# ----------------------------------------------------------------------------- summarising (rank 0)


def typical_seconds(samples: Sequence[float]) -> float:
    """The mean of the samples without their largest and smallest eighth (at least one each, while more
    than two remain): what a training step pays for a collective on average, including its frequent
    tail, but not a rare stall of the host. A step sums several collectives, so their mean, not their
    median, adds up to its time; on a right-skewed distribution the median under-prices every one."""
    ordered = sorted(samples)
    k = min(math.ceil(len(ordered) / 8), (len(ordered) - 1) // 2)
    kept = ordered[k:len(ordered) - k]
    return sum(kept) / len(kept)


def collective_points(rows: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """(payload bytes, seconds per call) of one collective: per repeat the late rank's time, then their
    `typical_seconds` per payload."""
    per_repeat: dict[tuple[int, int], float] = {}
    for r in rows:
        if r["kind"] == "collective" and r["op"] == name and r["arrival_delay_s"] > 0:
            per_repeat[(r["payload_bytes"], r["repeat"])] = r["seconds"] / r["calls"]
    payloads = sorted({p for p, _ in per_repeat})
    return ([float(p) for p in payloads],
            [typical_seconds([t for (p, _), t in per_repeat.items() if p == q]) for q in payloads])


def fill_model_flops(rows: list[dict[str, Any]], cfg: ProfileConfig) -> None:
    """Put the cost model's forward + backward work of each profiled batch into the model rows: all
    flops, the matmul-class flops and the memory-bound operators' bytes (`engine.spmd.cost`'s roofline split)."""
    spec = model_config(cfg)
    if spec is None:
        return
    name, knobs = spec
    import engine

    graphs: dict[int, Graph] = {}  # one capture per batch, shared by its precisions
    work: dict[tuple[int, str], tuple[float, float, float, float]] = {}
    precisions = {f"zoo:{name}": "fp32", **{f"autocast_{low}": low for low in LOW_PRECISION}}
    for r in rows:
        precision = precisions.get(r["op"]) if r["kind"] == "compute" else None
        if precision is None or precision != "fp32" and r["impl"] != f"zoo:{name}":
            continue
        key = (r["size"], precision)
        if key not in work:
            if r["size"] not in graphs:
                at = {"batch": r["size"]} if r["size"] else {}
                graphs[r["size"]] = engine.load_model(f"zoo:{name}", **{**knobs, **at})
            work[key] = step_work(graphs[r["size"]], precision)
        r["flops"], r["flops_bound"], r["traffic_bytes"], r["op_runs"] = work[key]


def step_work(graph: Graph, precision: str = "fp32") -> tuple[float, float, float, float]:
    """(all flops, matmul-class flops, bytes, operator runs) of one forward + backward step of a zoo model's
    `graph` in `precision`, as engine.spmd.cost counts them with and without the roofline split: the bytes are
    the memory-bound operators' and the weights the matmul-class ones read, all priced at the fitted activation
    bandwidth (activations at 2 bytes under autocast); the runs are priced at the fitted `op_overhead_s`."""
    import engine
    from engine.spmd.cost import CostModel

    options = PlanOptions(optimizer="sgd", precision=precision)
    plain = CostModel(graph, engine.load_cluster(one_device_cluster()), [1.0], options)
    split = CostModel(graph, engine.load_cluster(one_device_cluster(activation_bandwidth=True)), [1.0], options)
    return (sum(plain.fwd_flops) + sum(plain.bwd_flops), sum(split.fwd_flops) + sum(split.bwd_flops),
            sum(split.traffic) + sum(split.bwd_traffic) + sum(split.weight_traffic) + sum(split.bwd_weight_traffic),
            sum(split.fwd_ops) + sum(split.bwd_ops))


def rank_rates(rows: list[dict[str, Any]], rank: int) -> dict[str, float]:
    """FLOP/s of one rank per compute op: total flops over the sum of per-size median times."""
    out: dict[str, float] = {}
    for op in dict.fromkeys(r["op"] for r in rows if r["kind"] == "compute"):
        mine = [r for r in rows if r["kind"] == "compute" and r["op"] == op and r["rank"] == rank]
        if op == "matmul":
            sizes = sorted({r["size"] for r in mine})
            out.update({f"matmul {n}": _rate([r for r in mine if r["size"] == n]) for n in sizes})
        else:
            out[op] = _rate(mine)
    return out


def _rate(rows: list[dict[str, Any]]) -> float:
    """sum over sizes of flops / sum over sizes of the median seconds."""
    flops, seconds = 0.0, 0.0
    for size in {r["size"] for r in rows}:
        mine = [r for r in rows if r["size"] == size]
        flops += mine[0]["flops"]
        seconds += statistics.median(r["seconds"] for r in mine)
    return flops / seconds


def device_flops(rates: dict[str, float]) -> float:
    """The single rate of a spec without the roofline split: the model's own operators, else the best matmul."""
    model = [v for k, v in rates.items() if k.startswith("zoo:")]
    return model[0] if model else max(v for k, v in rates.items() if k.startswith("matmul "))


Step = tuple[float, float, float, float, float]
"""A profiled model step (`model_step`): seconds, all flops, matmul-class flops, memory-bound bytes, operator runs."""


def model_step(rows: list[dict[str, Any]], rank: int, op: str | None = None) -> Step | None:
    """(seconds, all flops, matmul-class flops, memory-bound bytes, operator runs) of the profiled model on
    one rank, summed over its batches (per batch the median time); None without a model. `op`: the rows of
    one precision's step (`autocast_bf16`); default the model's own (fp32) rows. Rows written before the
    runs were counted give 0 runs."""
    mine = [r for r in rows if r["kind"] == "compute" and r["rank"] == rank
            and (r["op"] == op if op else r["op"].startswith("zoo:"))]
    if not mine or any(r.get("traffic_bytes") is None for r in mine):
        return None
    out = [0.0, 0.0, 0.0, 0.0, 0.0]
    for size in {r["size"] for r in mine}:
        same = [r for r in mine if r["size"] == size]
        out[0] += statistics.median(r["seconds"] for r in same)
        out[1] += same[0]["flops"]
        out[2] += same[0]["flops_bound"]
        out[3] += same[0]["traffic_bytes"]
        out[4] += same[0].get("op_runs") or 0.0
    return out[0], out[1], out[2], out[3], out[4]


def roofline_fit(matmul_flops_per_s: float, step: Step, op_overhead_s: float | None = None) -> dict[str, float] | None:
    """The compute fields that reproduce the model's step time: `flops_per_gpu` the best matmul rate for the
    matmul-class flops, `op_overhead_s` the measured fixed cost of each of its operator runs (`op_overhead`),
    and `activation_bandwidth_Bps` the rate at which the memory-bound operators' bytes fill the rest. None
    when the matmuls alone take the whole step; the overhead is left out when it would take all the rest.

    The overhead is measured apart, on operators that do no work: the step's two batch sizes do not tell it
    from the bytes (on a CPU the half batch left more time beyond its matmuls than the whole one did, and a
    two-point fit put 160 us on each run where a chain of empty operators takes 4)."""
    seconds, _, flops_bound, traffic, runs = step
    rest = seconds - flops_bound / matmul_flops_per_s
    if traffic <= 0 or rest <= 0:
        return None
    fixed = runs * (op_overhead_s or 0.0)
    if op_overhead_s and 0 < fixed < rest:
        return {"flops_per_gpu": matmul_flops_per_s, "activation_bandwidth_Bps": traffic / (rest - fixed),
                "op_overhead_s": op_overhead_s}
    return {"flops_per_gpu": matmul_flops_per_s, "activation_bandwidth_Bps": traffic / rest}


def device_compute(rows: list[dict[str, Any]], ranks: Sequence[int]) -> list[dict[str, float]]:
    """Per rank the spec's compute fields from one profile's rows (see `compute_fields`)."""
    rates = [rank_rates(rows, j) for j in ranks]
    best = [max((v for k, v in r.items() if k.startswith("matmul ")), default=None) for r in rates]
    overheads = [op_overhead(rows, j) for j in ranks]
    fields = compute_fields(best, [model_step(rows, j) for j in ranks], [device_flops(r) for r in rates], overheads)
    steps = [{low: model_step(rows, j, f"autocast_{low}") for low in LOW_PRECISION} for j in ranks]
    return [with_low_precision(f, r, s) for f, r, s in zip(fields, rates, steps)]


def with_low_precision(fields: dict[str, float], rates: dict[str, float],
                       steps: dict[str, Step | None] | None = None) -> dict[str, Any]:
    """`flops_per_gpu` as a map {"fp32": ..., "bf16": ..., "fp16": ...} when the low-precision matmuls were
    timed (`measure_low_precision_matmuls`): the mixed-precision rate of the matmul-class operators.

    At most the fp32 rate times the dtype's speed over fp32 on the same matmuls (the model's own linear layers
    where they were timed: a square matmul's speed-up is not the model's; on a CPU with bf16 instructions bf16
    ran 1.2x fp32 at n = 128 and 2.4x at 512), and at most the rate that reproduces the model's step under the
    dtype's autocast (`low_precision_fit`, where the spec has the roofline split): autocast runs operators the
    matmuls leave out slower (on that CPU a bf16 attention backward took 8x fp32's, so the bf16 step was slower
    than the fp32 one although its linear layers ran 3x as fast)."""
    squares = [int(k.split()[1]) for k in rates if k.startswith("matmul ")]
    fp32 = rates.get("model_matmuls_fp32") or (rates[f"matmul {max(squares)}"] if squares else None)
    low = {}
    for name in LOW_PRECISION:
        rate = rates.get(f"model_matmuls_{name}") if "model_matmuls_fp32" in rates else rates.get(f"matmul_{name}")
        if rate is not None and fp32:
            fitted = low_precision_fit(fields, (steps or {}).get(name))
            low[name] = min(fields["flops_per_gpu"] * rate / fp32, math.inf if fitted is None else fitted)
    return {**fields, "flops_per_gpu": {"fp32": fields["flops_per_gpu"], **low}} if low else fields


def low_precision_fit(fields: dict[str, float], step: Step | None) -> float | None:
    """The matmul-class rate that reproduces the model's step under autocast, its memory-bound bytes (activations
    at 2 bytes) moved at the fp32 step's fitted activation bandwidth and its operator runs at the fitted
    overhead; None without the roofline split or when those alone fill the step (the matmuls then bound
    nothing below their own rate)."""
    bandwidth = fields.get("activation_bandwidth_Bps")
    if step is None or not bandwidth:
        return None
    seconds, _, flops_bound, traffic, runs = step
    rest = seconds - traffic / bandwidth - runs * fields.get("op_overhead_s", 0.0)
    return flops_bound / rest if rest > 0 and flops_bound > 0 else None


def compute_fields(best_matmul: Sequence[float | None], steps: Sequence[Step | None], one_rate: Sequence[float],
                   op_overheads: Sequence[float | None] | None = None) -> list[dict[str, float]]:
    """Per rank the spec's compute fields: the roofline split (flops_per_gpu at the best matmul rate, the
    measured op_overhead_s, activation_bandwidth_Bps fitted on the model step, `roofline_fit`) when every
    rank allows it, else `one_rate` (a cluster takes the split on every device or none)."""
    overheads = op_overheads or [None] * len(steps)
    fits = [roofline_fit(f, s, c) if f and s else None for f, s, c in zip(best_matmul, steps, overheads)]
    if fits and all(fits):
        return fits  # type: ignore[return-value]
    return [{"flops_per_gpu": r} for r in one_rate]


def cluster_spec(cfg: ProfileConfig, rows: list[dict[str, Any]], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The cluster spec JSON (schema_version 1): one device per rank, the fitted collectives."""
    from engine.cluster.spec import Device, fit_collective

    talks = len(infos) > 1
    fits = {name: fit_collective(*collective_points(rows, name)) for name in COLLECTIVES} if talks else {}
    devices = []
    for info, compute in zip(infos, device_compute(rows, [info["rank"] for info in infos])):
        devices.append({"name": f"rank-{info['rank']}", "gpu_model": info["gpu_model"], "machine": info["host"],
                        **compute, "memory_bytes_per_gpu": info["memory_bytes"],
                        "memory_bandwidth_Bps": memory_bandwidth(rows, info["rank"]),
                        **({"overlap_slowdown": slow} if (slow := overlap_slowdowns(rows, info["rank"])) else {})})
    devices = emulated_devices(devices, rank_speeds(rows, [info["rank"] for info in infos]))
    layout = tuple(Device(name=d["name"], gpu_model="", machine=d["machine"], flops_per_gpu=1.0,
                          memory_bytes_per_gpu=1) for d in devices)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    model = cfg.model if cfg.model == "none" else f"{cfg.model} {json.dumps(model_config(cfg)[1])}"  # type: ignore[index]
    return {
        "schema_version": 1, "name": cfg.name,
        "description": f"Measured by hap profile on {len(infos)} ranks ({infos[0]['backend']}) at {when}"
                       + (f", emulated speeds {cfg.speeds} (an emulated rank's compute and memory figures: the "
                          "fastest rank's times its speed factor)" if cfg.speeds else "") + ".",
        "sources": [f"flops_per_gpu: the best square matmul (bf16 and fp16: the largest matmul in that dtype); op_overhead_s: "
                    f"a chain of {OP_CHAIN} empty element-wise operators forward and backward, per run; "
                    f"activation_bandwidth_Bps: the bytes of the memory-bound operators of {model} (forward+backward "
                    f"at batch and half batch) over the rest of its step time beyond its matmuls and its runs' overhead "
                    f"(without them, one rate: the model's, or the best matmul when the model is 'none'); median of "
                    f"{cfg.repeats} repeats after {cfg.warmup} warm-ups",
                    f"memory_bandwidth_Bps: bytes moved by building the gradient bucket, copying it back and one SGD step over the "
                    f"{'model' if cfg.model != 'none' else 'synthetic'} parameters, per second (median of {cfg.repeats} repeats)",
                    *([f"collectives: latency + bandwidth fitted over payloads {[_human(s) for s in cfg.sizes]}, "
                       f"per payload the mean, without the largest and smallest eighth, over repeats ({COLLECTIVE_SAMPLES} or "
                       f"more up to {_human(SMALL_PAYLOAD)}) of the time from the last rank's arrival",
                       "network: latency and bandwidth of the broadcast fit (point to point)"] if talks else
                      ["collectives, network: none measured (one rank communicates with no one)"]),
                    "overlap_slowdown: the model step with an all-reduce of its parameters' bytes running beside it "
                    "(ddp), and as two half-batches on two threads taking turns (duplex), over the step alone "
                    f"(median of {cfg.repeats} repeats, unpaced)"],
        "devices": devices,
        "network": network_section(fits, layout),
    }


def network_section(fits: dict[str, Any], layout: tuple) -> dict[str, Any]:
    """The spec's network: the broadcast fit as point-to-point latency and bandwidth on every link
    level the devices use, and the collective fits; empty for one rank (no fits)."""
    from engine.cluster.spec import required_link_levels

    if not fits:
        return {"latency_s": 0.0, "bandwidth_Bps": {}, "collectives": {}}
    bcast = fits["broadcast"]
    return {"latency_s": bcast.latency_s,
            "bandwidth_Bps": {level: bcast.bandwidth_Bps for level in required_link_levels(layout)},
            "collectives": {k: f.to_dict() for k, f in fits.items()}}


def write_parquet(path: str, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("kind", pa.string()), ("op", pa.string()), ("impl", pa.string()), ("rank", pa.int32()),
                        ("speed", pa.float64()), ("size", pa.int64()), ("payload_bytes", pa.int64()),
                        ("calls", pa.int32()), ("flops", pa.float64()), ("flops_bound", pa.float64()),
                        ("traffic_bytes", pa.float64()), ("op_runs", pa.float64()), ("repeat", pa.int32()),
                        ("arrival_delay_s", pa.float64()), ("seconds", pa.float64()), ("backend", pa.string()),
                        ("world_size", pa.int32())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def fp32_rate(flops: float | dict[str, float]) -> float:
    """The fp32 rate of a written `flops_per_gpu` (a number, or a map of dtypes to rates)."""
    return flops["fp32"] if isinstance(flops, dict) else flops


def summary(spec: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"{'device':<10} {'machine':<16} {'model':<16} {'GFLOP/s (spec)':>14} {'model GFLOP/s':>13} "
             f"{'activation GB/s':>15} {'us per op':>9} {'memory':>10} {'update GB/s':>12}"]
    for j, d in enumerate(spec["devices"]):
        rate = next((v for k, v in rank_rates(rows, j).items() if not k.startswith("matmul")), float("nan"))
        act = d.get("activation_bandwidth_Bps", float("nan"))
        lines.append(f"{d['name']:<10} {d['machine'][:16]:<16} {d['gpu_model'][:16]:<16} {fp32_rate(d['flops_per_gpu']) / 1e9:14.2f} "
                     f"{rate / 1e9:13.2f} {act / 1e9:15.2f} {d.get('op_overhead_s', 0.0) * 1e6:9.1f} "
                     f"{d['memory_bytes_per_gpu'] / 2**30:7.1f} GiB "
                     f"{d['memory_bandwidth_Bps'] / 1e9:12.2f}")
    if not spec["network"]["collectives"]:
        return "\n".join(lines + ["", "collectives: none measured on one rank"])
    lines += ["", f"{'collective':<16} {'latency':>10} {'bandwidth':>12}"]
    for k, f in spec["network"]["collectives"].items():
        lines.append(f"{k:<16} {f['latency_s'] * 1e6:7.1f} us {f['bandwidth_Bps'] / 1e9:8.3f} GB/s")
    return "\n".join(lines)


def _human(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


# ----------------------------------------------------------------------------- one rank


def rank_info(rank: int, local_world_size: int, speed: float, backend: str, device) -> dict[str, Any]:
    """Host, device model and memory of this rank (CPU ranks on one host share its memory)."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        model, memory = props.name, int(props.total_memory)
    else:
        model = "cpu"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world_size)
    if speed != 1.0:
        model = f"{model} x{speed:g}"
    return {"rank": rank, "host": socket.gethostname(), "gpu_model": model, "memory_bytes": int(memory),
            "backend": backend}


def profile_rank(cfg: ProfileConfig, env, init_method: str | None = None) -> int:
    """Measure on this rank; rank 0 writes the spec and the Parquet file. Exit status (0 ok, 2 bad input)."""
    import torch
    import torch.distributed as dist

    from .rank_setup import apply_cpu_threads, init_distributed, pick_device
    from .timing import Pacer, parse_speeds

    try:
        check_inputs(cfg, env.world_size)
        backend, device = pick_device(env.local_rank)
        cfg = on_device(cfg, device.type)
    except (HapError, ValueError) as e:
        print(f"hap profile: error: {e}", file=sys.stderr)
        return 2
    speed = parse_speeds(cfg.speeds, env.world_size)[env.rank] if cfg.speeds else 1.0
    if device.type == "cpu":
        apply_cpu_threads(env, emulating=bool(cfg.speeds))
    init_distributed(env, backend, cfg.timeout_s, init_method, device)
    try:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        pacer = Pacer(speed, sync=sync if device.type == "cuda" else None)
        rec = Recorder(env.rank, speed, backend, env.world_size)
        spec = model_config(cfg)
        talks = env.world_size > 1
        model_samples = len(model_batches(spec[1])) + len(LOW_PRECISION) + 1 if spec else 0  # batches, autocast, overlap
        total = (len(cfg.matmul or ()) + low_precision_samples(cfg, spec) + model_samples + 2
                 + (len(COLLECTIVES) * len(cfg.sizes) if talks else 0))
        progress = Progress(total, enabled=env.rank == 0)
        measure_matmuls(cfg, rec, pacer, device, dist.barrier, sync, progress)
        measure_model(cfg, rec, pacer, device, dist.barrier, sync, progress)
        measure_op_overhead(cfg, rec, pacer, device, dist.barrier, sync, progress)
        measure_update(cfg, rec, pacer, device, dist.barrier, sync, progress)
        measure_overlap(cfg, rec, device, dist.barrier, sync, progress)
        if talks:
            measure_collectives(cfg, rec, device, dist.barrier, sync, progress)
        progress.close()
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, (rank_info(env.rank, env.local_world_size, speed, backend, device), rec.rows))
        if env.rank == 0:
            write_outputs(cfg, [g[0] for g in gathered], [r for g in gathered for r in g[1]])
        return 0
    finally:
        dist.destroy_process_group()


def write_outputs(cfg: ProfileConfig, infos: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    fill_model_flops(rows, cfg)
    spec = cluster_spec(cfg, rows, infos)
    Path(cfg.out).write_text(json.dumps(spec, indent=2) + "\n")
    if cfg.parquet:
        write_parquet(cfg.parquet, rows)
    print(summary(spec, rows))
    print(f"\ncluster spec written to {cfg.out}" + (f", raw measurements to {cfg.parquet}" if cfg.parquet else ""),
          flush=True)


# ----------------------------------------------------------------------------- entry


def main(argv: Sequence[str] | None = None) -> int:
    """`hap profile ...`: one rank under a launcher, else start torchrun on this machine."""
    from .config import DistEnv
    from .rank_setup import exit_process
    from .torchrun import run_torchrun, under_launcher

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    if under_launcher():
        try:
            env = DistEnv.from_environ()
        except ValueError as e:
            print(f"hap profile: error: {e}", file=sys.stderr)
            return 2
        exit_process(profile_rank(cfg, env))
    try:
        nproc = default_nproc(cfg)
        check_inputs(cfg, nproc)
    except (HapError, ValueError) as e:
        print(f"hap profile: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    return run_torchrun(nproc, rank_argv(argv), module="runner.profile", command="hap profile")


def rank_argv(argv: Sequence[str]) -> list[str]:
    """The options without `--nproc` (the ranks do not need it, and torchrun's own parser would take it
    for an ambiguous abbreviation of its --nproc-per-node even after the module name)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
