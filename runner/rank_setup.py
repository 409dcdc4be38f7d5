"""What a rank does before its first step: its inputs opened and checked, its device picked, the process group joined.

Shared by the SPMD entry (`runner.launch`), the pipeline entry (`runner.pipeline`), the profiler and the
elastic supervisor (which checks inputs before it starts torchrun).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from engine.bundle import archive as bundle
from engine.bundle.unpack import is_bundle, safe_extract
from engine.cluster.spec import Cluster
from engine.errors import BundleError
from engine.model import source
from engine.planner import load_plan
from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from runner import checkpoint, reshard
from runner.batches import Batches, batch_source, check_source
from runner.optim import OptimConfig
from runner.rebuild import build_module
from runner.weights import check_state, read_state
from runner.config import NODE_ENV, DistEnv, RunConfig
from runner.duplex import check_duplex
from runner.scratch import scratch_folder, sigterm_exits
from runner.timing import EmulatedLink, Pacer, parse_speeds


def load_spmd_plan(path: str, world_size: int, model_file: str | Path | None = None) -> Plan:
    """The plan, refused unless it was made for exactly `world_size` devices and its model can be
    rebuilt (its file unchanged); `model_file` is a bundle's copy of the plan's model file."""
    plan = load_plan(path)
    if not isinstance(plan, Plan):
        raise ValueError(f"'{path}' is a {plan.parallelism} plan; runner.pipeline runs it")
    if model_file is not None:
        origin = source.with_model_file(plan.graph.origin, model_file)
        plan = dataclasses.replace(plan, graph=dataclasses.replace(plan.graph, origin=origin))
    if plan.world_size != world_size:
        devices = ", ".join(plan.device_names)
        raise ValueError(f"plan '{path}' is for {plan.world_size} devices ({devices}) but this launch has "
                         f"WORLD_SIZE={world_size}; launch {plan.world_size} processes "
                         f"(e.g. torchrun --nproc-per-node={plan.world_size}) or plan for {world_size} devices")
    source.check_rebuildable(plan.graph.origin)
    if plan.overlap == "duplex":
        check_duplex(plan)
    return plan


@dataclass
class Inputs:
    """The checked inputs of one rank."""

    plan: Plan
    env: DistEnv
    """This process's place in the launch, its rank being the plan device it runs."""
    cluster: Cluster | None = None
    """The bundle's cluster (GPU type of every rank); None for a bare plan file."""
    start_step: int = 0
    """Steps already done by the checkpoint `--resume` continues from."""
    reshard_from: dict | None = None
    """The COMPLETE marker of that checkpoint when another plan wrote it (resharded on load, runner.reshard)."""
    scratch: str | None = None
    """Temporary folder a bundle zip was extracted to (removed at the end)."""
    batches: Batches | None = None
    """The run's global batches (runner.batches: --data, the model file's batches(step), or drawn)."""
    eval_batches: Batches | None = None
    """--eval-data's batches."""


def extracts(path: str) -> bool:
    """Whether opening `path` extracts a bundle zip into a scratch folder (which must then be removed)."""
    return os.path.isfile(path) and is_bundle(path)


def open_source(path: str, scratch_prefix: str = "hap-bundle-",
                digest: str | None = None) -> tuple[str, bundle.OpenedBundle | None, str | None]:
    """(plan path, opened bundle, scratch folder) of a plan file or a checked bundle (a zip is extracted safely);
    with `digest` (`--digest`), only the bundle whose manifest.json has that sha256. The caller removes the
    scratch folder, guarding its block with `runner.scratch.sigterm_exits`."""
    if not is_bundle(path):
        if digest is not None:
            raise BundleError(f"--digest checks a launch bundle, but {path} is a plan file: run the bundle "
                              "`hap export` made from it, or leave --digest out")
        return path, None, None
    if not os.path.isfile(path):
        return checked_bundle(path, None, digest)
    with sigterm_exits():
        scratch = tempfile.mkdtemp(prefix=scratch_prefix)
        try:
            return checked_bundle(safe_extract(path, scratch), scratch, digest)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise


@contextmanager
def opened_source(path: str, scratch_prefix: str = "hap-bundle-", digest: str | None = None
                  ) -> Iterator[tuple[str, bundle.OpenedBundle | None, str | None]]:
    """`open_source` for the block: a zip's scratch folder is removed on every way out of it, SIGTERM included."""
    if not extracts(path):
        yield open_source(path, scratch_prefix, digest)
        return
    with scratch_folder(scratch_prefix) as scratch:
        yield checked_bundle(safe_extract(path, scratch), scratch, digest)


def checked_bundle(folder: str | Path, scratch: str | None,
                   digest: str | None = None) -> tuple[str, bundle.OpenedBundle, str | None]:
    """(plan path, opened bundle, scratch folder) of a bundle folder checked against its manifest (and `digest`)."""
    opened = bundle.open_bundle(folder, digest)
    return str(opened.plan_path), opened, scratch


def bundle_rank(env: DistEnv, opened: bundle.OpenedBundle | None, environ: Mapping[str, str] = os.environ) -> DistEnv:
    """`env` with the rank the bundle gives this process (rank r runs plan device r, whatever node
    order torchrun's rendezvous chose); unchanged without a bundle node (HAP_NODE_RANK) or when rank 0
    must host the process group's store (no torchrun agent store), where renumbering is unsafe."""
    if opened is None or NODE_ENV not in environ or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return env
    try:
        node_rank = int(environ[NODE_ENV])
    except ValueError:
        raise ValueError(f"{NODE_ENV}={environ[NODE_ENV]!r} is not a node number") from None
    rank = bundle.plan_rank(opened.nodes, node_rank, env.local_rank, env.local_world_size)
    return DistEnv(rank, env.world_size, env.local_rank, env.local_world_size)


def check_inputs(cfg: RunConfig, world_size: int, env: DistEnv | None = None) -> Inputs:
    """Everything about the inputs that can fail, checked before any process group starts."""
    plan_path, opened, scratch = open_source(cfg.plan, digest=cfg.digest)
    try:
        env = bundle_rank(env or DistEnv(0, world_size, 0, world_size), opened)
        plan = load_spmd_plan(plan_path, world_size, bundle.model_file_of(opened) if opened else None)
        if cfg.speeds:
            parse_speeds(cfg.speeds, world_size)
        if cfg.grad_sync != "bucket" and plan.overlap != "none":
            raise ValueError(f"--grad-sync {cfg.grad_sync} is for plans without overlap; this plan's overlap is "
                             f"'{plan.overlap}', which sets how gradients are all-reduced")
        if cfg.emulate_link:
            EmulatedLink(cfg.emulate_link)  # a bad cluster file stops here, not in every rank
        batches, evals = checked_sources(plan, cfg)
        start, marker = 0, None
        if cfg.resume:
            key = run_key(plan, cfg)
            start = checkpoint.latest_complete(cfg.checkpoint_dir, key, env.rank, other_plans=True) or 0
            marker = checkpoint.read_marker(cfg.checkpoint_dir, start) if start else None
            if marker is not None and checkpoint.same_plan(marker, key):
                marker = None
            if marker is not None:
                reshard.table_of(marker, plan)  # a layout unfit for this model: refused before any process group
        return Inputs(plan, env, opened.cluster if opened else None, start, reshard_from=marker, scratch=scratch,
                      batches=batches, eval_batches=evals)
    except BaseException:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def checked_sources(plan: Plan | PipelinePlan, cfg: RunConfig) -> tuple[Batches, Batches | None]:
    """The run's batches and evaluation batches, each drawn once, the weights to start from checked against
    the model's structure, and the output folders: what can fail in the inputs of any plan's run."""
    batches = batch_source(plan.graph, cfg.seed, cfg.data)
    check_source(batches)
    evals = batch_source(plan.graph, cfg.seed, cfg.eval_data, evaluation=True) if cfg.eval_data else None
    if evals is not None:
        check_source(evals)
        if evals.count is not None and evals.count < cfg.eval_batches:
            raise ValueError(f"--eval-data {cfg.eval_data} holds {evals.count} batches of the plan's size, fewer "
                             f"than --eval-batches {cfg.eval_batches}: lower --eval-batches or give more data")
    if cfg.init_from:  # a missing, truncated or foreign file stops here, checked against the model's structure
        check_state(build_module(plan, cfg.seed, "meta"), read_state(cfg.init_from))
    for what, path in (("--metrics", cfg.metrics), ("--save-params", cfg.save_params), ("--save-model", cfg.save_model)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{what} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist")
    return batches, evals


def run_key(plan: Plan, cfg: RunConfig) -> dict:
    """What a checkpoint must share with this run: the plan, the seed, every optimiser setting that
    changes the losses, and the data (by absolute path)."""
    optim = cfg.optim(plan.options.optimizer)
    plain = OptimConfig(name=optim.name, lr=optim.lr, steps=optim.steps).key()
    settings = {k: v for k, v in optim.key().items() if k not in ("name", "lr") and plain.get(k) != v}
    data = {k: os.path.abspath(v) for k, v in (("data", cfg.data), ("init_from", cfg.init_from)) if v}
    return checkpoint.run_key(plan, seed=cfg.seed, optimizer=optim.name, lr=optim.lr, settings={**settings, **data})


def device_report(inputs: Inputs, rank: int, device: torch.device) -> tuple[str, str] | None:
    """(status, message) of this rank's GPU type against its plan device; None without a bundle cluster."""
    if inputs.cluster is None:
        return None
    planned = inputs.cluster.devices[rank]
    actual = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return bundle.gpu_type_check(rank, planned.name, planned.gpu_model, actual)


def pick_device(local_rank: int) -> tuple[str, torch.device]:
    """NCCL on this rank's GPU when CUDA is present, else gloo on CPU."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this machine shows {torch.cuda.device_count()} GPUs; "
                             "launch at most one process per GPU (torchrun --nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return "nccl", device
    return "gloo", torch.device("cpu")


def init_distributed(env: DistEnv, backend: str, timeout_s: float, init_method: str | None = None,
                     device: torch.device | None = None) -> None:
    """The process group, bound to this rank's GPU under NCCL (`device_id`: NCCL need not guess the
    rank's GPU from its global rank, which hangs where ranks map to GPUs unevenly)."""
    bound = {"device_id": device} if backend == "nccl" and device is not None and device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method or "env://", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s), **bound)


def apply_cpu_threads(env: DistEnv, emulating: bool) -> None:
    """One intra-op thread per rank when emulating speeds (see runner.timing), else a fair share of cores."""
    if emulating:
        torch.set_num_threads(1)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


def make_pacer(cfg: RunConfig, env: DistEnv, device: torch.device) -> Pacer:
    speed = parse_speeds(cfg.speeds, env.world_size)[env.rank] if cfg.speeds else 1.0
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    link = EmulatedLink(cfg.emulate_link) if cfg.emulate_link else None
    return Pacer(speed, record=cfg.timing, sync=sync, link=link)


def exit_process(status: int) -> None:
    """Flush and leave without interpreter finalisation.

    gloo worker threads may still hold the last reference to a Python-owned tensor of the last
    collective; releasing it needs the GIL, and a thread that asks for the GIL during
    finalisation is cancelled, which aborts the process ("terminate called without an active
    exception", seen here on torch 2.13 under load). Nothing is left to finalise after `run`.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
