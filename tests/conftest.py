"""Shared fixtures: small graphs (captured from the zoo and hand-built) and cluster factories.

Captures go through torch.export and cost a second or two each, so every captured model is
session-scoped and shared by all test files.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

import engine
from engine.cluster.spec import Cluster
from engine.model.graph import Graph, Node

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: the workers share the cores; one thread each, set before
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # any test module imports torch, which reads it then

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_clusters"
GIB = 2**30

TWO_VIRTUAL_MACHINES = {
    "schema_version": 1, "name": "two_machines",
    "devices": [
        {"name": "fast", "gpu_model": "A100-SXM4-40GB", "machine": "m0", "num_gpus": 2, "flops_per_gpu": 4e10,
         "memory_bytes_per_gpu": 8 * 2**30, "intra_bandwidth_Bps": 3e10},
        {"name": "slow", "gpu_model": "P100-PCIE-16GB", "machine": "m1", "num_gpus": 2, "flops_per_gpu": 2e10,
         "memory_bytes_per_gpu": 8 * 2**30, "intra_bandwidth_Bps": 1e10},
    ],
    "network": {"latency_s": 5e-5, "bandwidth_Bps": {"inter_machine": 2e9}},
}
"""Two machines of 2 GPUs each as virtual devices (like hap_paper_testbed_machines, smaller): plans on them
are expanded to one rank per GPU (engine.expand_to_gpus)."""

SERIAL_FILES = ("tests/runner/test_runner_timing.py", "tests/runner/test_slurm.py")
"""Where the `serial` tests live, which `make test` keeps out of its parallel pass: the real Slurm, whose daemons
are one per machine (a process of its own, beside the parallel pass), and wall-clock measurements (alone, after it)."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random(f"{os.getpid()}-{time.time_ns()}")
"""Each test process draws its own sequence, so two xdist workers (or the Slurm pass beside them) rarely meet."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous or a server).

    Drawn below the kernel's ephemeral range: a port bind(0) returned is free only until the kernel hands it
    to the next connection or bind(0) of any process, and a rank's TCPStore binding it moments later then
    fails with EADDRINUSE (seen with several tests' ranks and stores busy at once)."""
    low = min(_ephemeral_low(), 32768)
    for _ in range(200):
        port = _PORTS.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low range is crowded: fall back on the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a `serial` test outside SERIAL_FILES, which `make test` would never run alone."""
    stray = [i.nodeid for i in items if i.get_closest_marker("serial") and i.nodeid.split("::")[0] not in SERIAL_FILES]
    if stray:
        raise pytest.UsageError(f"serial tests must live in {', '.join(SERIAL_FILES)} (make test runs those alone): "
                                f"{stray}")


# ----------------------------------------------------------------------------- hand-built graphs


def build_graph(spec: Sequence[tuple], name: str = "hand") -> Graph:
    """A Graph from rows (name, op, inputs, shape[, flops[, attrs[, dtype]]]); the last row is the loss."""
    nodes = []
    for i, row in enumerate(spec):
        nm, op, inputs, shape, *rest = row
        flops = float(rest[0]) if len(rest) > 0 else 0.0
        attrs = dict(rest[1]) if len(rest) > 1 else {}
        dtype = rest[2] if len(rest) > 2 else "float32"
        nodes.append(Node(id=i, name=nm, op=op, inputs=tuple(inputs), shape=tuple(shape), dtype=dtype,
                          attrs=attrs, flops=flops))
    return Graph(nodes=tuple(nodes), loss=len(nodes) - 1, name=name)


def mse_graph(B: int = 64, I: int = 256, H: int = 512, O: int = 16) -> Graph:
    """x @ W1^T -> relu -> @ W2^T -> mse_loss(., y): 4 compute nodes."""
    return build_graph([
        ("x", "placeholder", (), (B, I)),
        ("w1", "parameter", (), (H, I)),
        ("h", "linear", (0, 1), (B, H), 2 * B * I * H),
        ("r", "relu", (2,), (B, H), B * H),
        ("w2", "parameter", (), (O, H)),
        ("o", "linear", (3, 4), (B, O), 2 * B * H * O),
        ("y", "placeholder", (), (B, O)),
        ("loss", "mse_loss", (5, 6), (), 3 * B * O, {"count": B * O}),
    ], name="hand_mse")


def ce_graph(B: int = 64, I: int = 256, H: int = 512, O: int = 16) -> Graph:
    """Two hidden layers without bias and a cross-entropy loss: 6 compute nodes."""
    return build_graph([
        ("x", "placeholder", (), (B, I)),
        ("w1", "parameter", (), (H, I)),
        ("h", "linear", (0, 1), (B, H), 2 * B * I * H),
        ("r", "relu", (2,), (B, H), B * H),
        ("w2", "parameter", (), (H, H)),
        ("h2", "linear", (3, 4), (B, H), 2 * B * H * H),
        ("r2", "relu", (5,), (B, H), B * H),
        ("w3", "parameter", (), (O, H)),
        ("o", "linear", (6, 7), (B, O), 2 * B * H * O),
        ("y", "placeholder", (), (B,), 0.0, {}, "int64"),
        ("loss", "cross_entropy", (8, 9), (), 6 * B * O, {"count": B}),
    ], name="hand_ce")


def residual_graph(B: int = 64, H: int = 256) -> Graph:
    """h = x W1; o = relu(h) W2 + h; mse_loss(o, y): a non-leaf tensor (h) with two consumers."""
    return build_graph([
        ("x", "placeholder", (), (B, H)),
        ("w1", "parameter", (), (H, H)),
        ("h", "linear", (0, 1), (B, H), 2 * B * H * H),
        ("r", "relu", (2,), (B, H), B * H),
        ("w2", "parameter", (), (H, H)),
        ("o", "linear", (3, 4), (B, H), 2 * B * H * H),
        ("s", "add", (5, 2), (B, H), B * H),
        ("y", "placeholder", (), (B, H)),
        ("loss", "mse_loss", (6, 7), (), 3 * B * H, {"count": B * H}),
    ], name="hand_residual")


# ----------------------------------------------------------------------------- clusters


def sample_path(name: str) -> str:
    return str(SAMPLES / f"{name}.json")


ZOO_SMALL = {
    "mlp": {"layers": 2, "in_features": 32, "hidden": 64, "classes": 4, "batch": 8},
    "gpt": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq_len": 8, "batch": 8},
    "vit": {"layers": 1, "hidden": 32, "heads": 2, "mlp": 64, "image_size": 16, "patch": 8, "batch": 8},
    "bert": {"layers": 1, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq_len": 8, "predictions": 2, "batch": 8},
    "bert_moe": {"layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab": 64, "seq_len": 8, "predictions": 2,
                 "batch": 8, "experts": 2},
    "vgg19": {"batch": 8, "image_size": 32, "width": 0.125, "hidden": 32, "pool_size": 1, "classes": 4, "batch_norm": True},
}
"""Every zoo family at a size whose data-parallel search takes milliseconds (the hf_* entries need
transformers and are the same families)."""


def load_bench(stem: str):
    """bench/<stem>.py as a fresh module, registered in sys.modules first (its dataclasses look their module up
    by name)."""
    spec = importlib.util.spec_from_file_location(f"{stem}_bench", ROOT / "bench" / f"{stem}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_dict(name: str) -> dict[str, Any]:
    """A sample cluster's JSON as a dict (a fresh copy to modify)."""
    return json.loads((SAMPLES / f"{name}.json").read_text())


def cluster_dict(flops: Sequence[float], memory: Sequence[int] | int = 8 * GIB, *, latency_s: float = 5e-5,
                 bandwidth_Bps: float = 2e9, name: str = "test") -> dict[str, Any]:
    """One machine holding one device per entry of `flops` (cpu-0, cpu-1, ...)."""
    mem = list(memory) if isinstance(memory, (list, tuple)) else [memory] * len(flops)
    devices = [{"name": f"dev-{j}", "gpu_model": f"model-{f:g}", "machine": "m0", "flops_per_gpu": f,
                "memory_bytes_per_gpu": int(m)} for j, (f, m) in enumerate(zip(flops, mem))]
    return {"schema_version": 1, "name": name, "description": "made up for tests", "sources": ["tests"],
            "devices": devices,
            "network": {"latency_s": latency_s, "bandwidth_Bps": {"intra_machine": bandwidth_Bps}}}


def measured_collectives(scale_bytes: float, *, bumpy: bool, latency_s: float = 2e-4,
                         bandwidth_Bps: float = 1e9) -> dict[str, Any]:
    """`network.collectives` of all five fits with measured points up to `scale_bytes`, as `hap profile`
    writes them: a bump (steep, then flatter: not convex) when `bumpy`, else a convex curve; both above
    the fitted line, as gloo's points are."""
    fractions = (0.1, 0.3, 0.6, 1.0)
    above = (1.0, 3.0, 2.0, 1.6) if bumpy else (1.0, 1.2, 1.6, 2.2)  # times the line's time over the latency
    points = [[f * scale_bytes, latency_s + f * scale_bytes / bandwidth_Bps * a] for f, a in zip(fractions, above)]
    fit = {"latency_s": latency_s, "bandwidth_Bps": bandwidth_Bps, "points": points}
    return {name: dict(fit) for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}


def with_memory(d: dict[str, Any], memory_bytes_per_gpu: int | Sequence[int]) -> Cluster:
    """Cluster of dict `d` with every device entry's memory_bytes_per_gpu replaced."""
    d = copy.deepcopy(d)
    mems = memory_bytes_per_gpu if isinstance(memory_bytes_per_gpu, (list, tuple)) else [memory_bytes_per_gpu] * len(d["devices"])
    for dev, m in zip(d["devices"], mems):
        dev["memory_bytes_per_gpu"] = int(m)
    return Cluster.from_dict(d)


@pytest.fixture(scope="session")
def load_sample() -> Callable[[str], Cluster]:
    return lambda name: engine.load_cluster(sample_path(name))


# ----------------------------------------------------------------------------- captured models


@pytest.fixture(scope="session")
def tiny_mlp() -> Graph:
    """zoo:mlp with one hidden layer and tiny widths (bias adds included)."""
    return engine.load_model("zoo:mlp", layers=1, in_features=6, hidden=8, classes=3, batch=4)


@pytest.fixture(scope="session")
def mlp1() -> Graph:
    """zoo:mlp with one hidden layer, widths where compute and communication compete."""
    return engine.load_model("zoo:mlp", layers=1, in_features=256, hidden=512, classes=16, batch=64)


@pytest.fixture(scope="session")
def mlp2() -> Graph:
    """zoo:mlp with two hidden layers; parameters small next to the batch (data parallel wins)."""
    return engine.load_model("zoo:mlp", layers=2, in_features=128, hidden=512, classes=16, batch=1024)


@pytest.fixture(scope="session")
def small_gpt() -> Graph:
    """A one-layer GPT with tiny widths: hidden 64 = 4 heads x 16."""
    return engine.load_model("zoo:gpt", layers=1, hidden=64, heads=4, ffn=128, vocab=256, seq_len=16, batch=8)


@pytest.fixture(scope="session")
def gpt4() -> Graph:
    """A four-layer GPT with tiny widths (large enough that exact A* takes a while)."""
    return engine.load_model("zoo:gpt", layers=4, hidden=64, heads=4, ffn=128, vocab=256, seq_len=16, batch=8)
