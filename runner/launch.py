"""Per-rank entry: train one plan over torch.distributed (HAP §3: every device runs the same program Q).

Run under `torchrun` (or let `hap run PLAN.json` start it for you):

    torchrun --standalone --nproc-per-node=4 -m runner.launch plan.json --steps 5 --verify
    torchrun --standalone --nproc-per-node=2 -m runner.launch plan.json --steps 20 \\
        --speeds 1,0.5 --timing --metrics metrics.jsonl

Two nodes (run on each, `--node-rank` 0 and 1):

    torchrun --nnodes=2 --nproc-per-node=4 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 -m runner.launch plan.json --steps 100

A launch bundle (`hap export`, a folder or a zip) runs the same way, e.g. from its
`launch_node.sh`: `torchrun ... -m runner.launch BUNDLE --steps 100`. Every rank then checks the
bundle against its manifest before anything else, extracts a zip safely (its own temporary
folder), joins as the rank the bundle gives its node and local rank (HAP_NODE_RANK, set by the
bundle's launch files; see engine.bundle.plan_rank), and compares its GPU with the type the
plan's device has (engine.bundle.gpu_type_check). A pipeline plan, bare or in a bundle, is handed
to its own entry, runner.pipeline (`main`, by engine.bundle.plan_parallelism).

Order of work in `run`: read the launch environment, check the inputs (bundle, plan for this
world size, options, checkpoint to resume), check the GPU type, start the process group (NCCL on
CUDA with device cuda:LOCAL_RANK, gloo on CPU, always with a timeout), build the rank's program and
parameter slices, restore a checkpoint (`--resume`), train (saving sharded checkpoints with
`--checkpoint-dir/--checkpoint-every`, see runner.checkpoint), write metrics, optionally verify
against single-device training on rank 0.

A rank that fails writes its exception (type, message, traceback) to the folder `hap run` gives it
(runner.failure) before it leaves the process group, so `hap run` can name the first failure.

Fault injection (for tests of failure handling): `HAP_RUNNER_FAULT=RANK:STEP` makes rank RANK
exit with status 1 at the start of step STEP, without any cleanup, as a crashed process would;
`HAP_RUNNER_FAULT=RANK:STEP:kill` makes it SIGKILL itself instead, and `RANK:STEP:raise` raise
a RuntimeError (an exception in the training code).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from engine import bundle, limits, source
from engine.cluster import Cluster
from engine.errors import HapError
from engine.plan import Plan

from . import checkpoint, elastic, reshard
from .failure import record_failure
from .duplex import check_duplex
from .timing import EmulatedLink, Pacer, parse_speeds
from .train import GRAD_SYNC, RankState, make_batch, setup_rank, train_step
from .verify import verify

FAULT_ENV = "HAP_RUNNER_FAULT"
NODE_ENV = "HAP_NODE_RANK"
"""Set by a bundle's launch files: the bundle node this torchrun runs (see engine.bundle.plan_rank)."""
DEVICE_CHECK = ("warn", "error", "off")


MAX_LR = 1e6
"""A learning rate above this is a typo."""
MAX_TIMEOUT_S = 7 * 86400.0
"""Process-group timeout: a week (timedelta overflows on 1e308 seconds)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What to run; one per launch, identical on every rank."""

    plan: str
    """Path of the plan JSON (from `hap plan --out`)."""
    steps: int = 5
    """Optimizer steps to run."""
    verify: bool = False
    """Rank 0 re-runs the steps on one device and compares losses and final parameters."""
    metrics: str | None = None
    """JSON-lines file: one record per step and rank."""
    seed: int = 0
    """Seed of the model initialisation and of the batches (the same on every rank)."""
    optimizer: str = "sgd"
    """`sgd` or `adam`."""
    lr: float = 0.05
    """Learning rate."""
    speeds: str | None = None
    """Emulated speed factor per rank, e.g. `1,1,0.5,0.5` (see runner.timing)."""
    timing: bool = False
    """Record per-instruction compute and communication seconds in the metrics."""
    grad_sync: str = "bucket"
    """`bucket` (one all-reduce of all Full parameters' gradients) or `per-param` (see runner.train.GRAD_SYNC)."""
    emulate_link: str | None = None
    """A cluster JSON whose collective fits every collective is padded to (runner.timing.EmulatedLink):
    a slower network emulated on one box, for benches."""
    timeout_s: float = 120.0
    """Process-group timeout: a collective waiting longer than this fails instead of hanging."""
    save_params: str | None = None
    """Rank 0 writes the final parameters, gathered to full shape, here (`torch.save`)."""
    checkpoint_dir: str | None = None
    """Folder of sharded checkpoints (see runner.checkpoint), on a file system every rank sees."""
    checkpoint_every: int = 0
    """Save a checkpoint after every N steps (0: only after the last step, when --checkpoint-dir is set)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in checkpoint_dir (from step 0 when there is none)."""
    device_check: str = "warn"
    """Bundles: a rank on another GPU type than its plan device is reported (`warn`), fatal (`error`) or not checked (`off`)."""
    elastic: str | None = None
    """Cluster spec JSON of the plan's devices: when a rank fails, `hap run` re-plans without its device and
    continues from the newest complete checkpoint (runner.elastic); the ranks themselves ignore it."""
    emulate_links: bool = False
    """Pipeline plans: each stage-to-stage transfer takes at least its predicted time (runner.pipeline)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.steps > limits.MAX_STEPS:
            raise ValueError(f"--steps must be at most {limits.MAX_STEPS}, got {self.steps}")
        if not -2**63 <= self.seed < 2**64:  # the range torch.manual_seed accepts
            raise ValueError(f"--seed must be in -2**63..2**64-1, got {self.seed}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"--optimizer must be sgd or adam, got '{self.optimizer}'")
        if not limits.in_range(self.lr, 0, MAX_LR) or self.lr == 0:
            raise ValueError(f"--lr must be a positive number up to {MAX_LR:g}, got {self.lr}")
        if self.grad_sync not in GRAD_SYNC:
            raise ValueError(f"--grad-sync must be {' or '.join(GRAD_SYNC)}, got '{self.grad_sync}'")
        if not limits.in_range(self.timeout_s, 0, MAX_TIMEOUT_S) or self.timeout_s == 0:
            raise ValueError(f"--timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, got {self.timeout_s}")
        if not 0 <= self.checkpoint_every <= limits.MAX_STEPS:
            raise ValueError(f"--checkpoint-every must be in 0..{limits.MAX_STEPS}, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            what = "--resume" if self.resume else "--checkpoint-every"
            raise ValueError(f"{what} needs --checkpoint-dir DIR (where the checkpoints are)")
        if self.elastic and not self.checkpoint_dir:
            raise ValueError("--elastic needs --checkpoint-dir DIR (a failed job continues from its checkpoints)")
        if self.device_check not in DEVICE_CHECK:
            raise ValueError(f"--device-check must be {', '.join(DEVICE_CHECK)}, got '{self.device_check}'")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the launch, as torchrun (or a Slurm script) sets it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @staticmethod
    def from_environ(env: Mapping[str, str] = os.environ) -> "DistEnv":
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ValueError(f"{' and '.join(missing)} not set: runner.launch runs under torchrun; "
                             "start it with `hap run PLAN.json` or `torchrun --nproc-per-node=N -m runner.launch PLAN.json`")
        world = int(env["WORLD_SIZE"])
        return DistEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])),
                       int(env.get("LOCAL_WORLD_SIZE", world)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hap run", description="Train a plan over torch.distributed "
                                "(starts torchrun on this machine unless RANK and WORLD_SIZE are already set by torchrun or a Slurm script).")
    p.add_argument("plan", help="plan JSON from `hap plan --out`, or a launch bundle (folder or zip) from `hap export`")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--verify", action="store_true", help="compare losses and final parameters with single-device training")
    p.add_argument("--metrics", metavar="FILE", help="write JSON-lines metrics, one record per step and rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--speeds", metavar="F,F,..", help="emulated speed factor per rank in (0, 1], e.g. 1,1,0.5,0.5")
    p.add_argument("--timing", action="store_true", help="record per-instruction compute and communication times")
    p.add_argument("--grad-sync", choices=list(GRAD_SYNC), default="bucket",
                   help="all-reduce Full parameters' gradients in one bucket after backward (default) or one per parameter during backward")
    p.add_argument("--emulate-link", metavar="CLUSTER",
                   help="pad every collective to its time under this cluster JSON's collective fits (emulates a slower network)")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=120.0, metavar="S",
                   help="fail a collective that waits longer than S seconds (default 120)")
    p.add_argument("--save-params", metavar="FILE", help="rank 0 saves the final gathered parameters (torch.save)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="sharded checkpoints go here (one file per rank and checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps (default 0: after the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (step 0 if none)")
    p.add_argument("--device-check", choices=list(DEVICE_CHECK), default="warn",
                   help="bundles: report (warn, default), refuse (error) or ignore (off) a rank on another GPU type than planned")
    p.add_argument("--elastic", metavar="CLUSTER.json",
                   help="when a rank fails, re-plan on this cluster without its device and continue from the newest checkpoint")
    p.add_argument("--emulate-links", action="store_true",
                   help="pipeline plans: sleep each transfer between stages to its predicted time (slow links on one box)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return RunConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def load_plan(path: str, world_size: int, model_file: str | Path | None = None) -> Plan:
    """The plan, refused unless it was made for exactly `world_size` devices and its model can be
    rebuilt (its file unchanged); `model_file` is a bundle's copy of the plan's model file."""
    plan = Plan.from_json(path)
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


def open_source(path: str, scratch_prefix: str = "hap-bundle-") -> tuple[str, bundle.OpenedBundle | None, str | None]:
    """(plan path, opened bundle, scratch folder) of a plan file or a checked bundle (a zip is extracted safely)."""
    if not bundle.is_bundle(path):
        return path, None, None
    scratch = None
    folder = path
    if os.path.isfile(path):
        scratch = tempfile.mkdtemp(prefix=scratch_prefix)
        try:
            folder = str(bundle.safe_extract(path, scratch))
        except HapError:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    try:
        opened = bundle.open_bundle(folder)
    except HapError:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
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
    plan_path, opened, scratch = open_source(cfg.plan)
    try:
        env = bundle_rank(env or DistEnv(0, world_size, 0, world_size), opened)
        plan = load_plan(plan_path, world_size, bundle.model_file_of(opened) if opened else None)
        if cfg.speeds:
            parse_speeds(cfg.speeds, world_size)
        if cfg.grad_sync != "bucket" and plan.overlap != "none":
            raise ValueError(f"--grad-sync {cfg.grad_sync} is for plans without overlap; this plan's overlap is "
                             f"'{plan.overlap}', which sets how gradients are all-reduced")
        if cfg.emulate_link:
            EmulatedLink(cfg.emulate_link)  # a bad cluster file stops here, not in every rank
        for what, path in (("--metrics", cfg.metrics), ("--save-params", cfg.save_params)):
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{what} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist")
        start, marker = 0, None
        if cfg.resume:
            key = run_key(plan, cfg)
            start = checkpoint.latest_complete(cfg.checkpoint_dir, key, env.rank, other_plans=True) or 0
            marker = checkpoint.read_marker(cfg.checkpoint_dir, start) if start else None
            if marker is not None and checkpoint.same_plan(marker, key):
                marker = None
            if marker is not None:
                reshard.table_of(marker, plan)  # a layout unfit for this model: refused before any process group
        return Inputs(plan, env, opened.cluster if opened else None, start, reshard_from=marker, scratch=scratch)
    except BaseException:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def run_key(plan: Plan, cfg: RunConfig) -> dict:
    return checkpoint.run_key(plan, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr)


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


def init_distributed(env: DistEnv, backend: str, timeout_s: float, init_method: str | None = None) -> None:
    dist.init_process_group(backend, init_method=init_method or "env://", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s))


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


class MetricsFile:
    """JSON lines appended by every rank; each record is one `write` on an O_APPEND descriptor.

    Rank 0 empties the file at start; a resumed run keeps the records of the steps before
    `keep_before` (rewritten in place, so every rank appends to the same file).
    """

    def __init__(self, path: str | None, rank: int, keep_before: int = 0) -> None:
        self.fd = None
        if path:
            kept = self._kept(path, keep_before) if rank == 0 and keep_before else b""
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if rank == 0 else 0)
            self.fd = os.open(path, flags, 0o644)
            if kept:
                os.write(self.fd, kept)

    @staticmethod
    def _kept(path: str, keep_before: int) -> bytes:
        if not os.path.isfile(path):
            return b""
        lines = Path(path).read_bytes().splitlines(keepends=True)
        return b"".join(ln for ln in lines if ln.strip() and MetricsFile._keep(json.loads(ln), keep_before))

    @staticmethod
    def _keep(record: dict, keep_before: int) -> bool:
        """Step records of the steps before `keep_before`, and every event (an elastic switch)."""
        return "event" in record or record.get("step", keep_before) < keep_before

    def write(self, record: dict) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if not spec or parts[:2] != [str(rank), str(step)]:
        return
    how = parts[2] if len(parts) > 2 else "exit"
    if how == "raise":
        raise RuntimeError(f"{FAULT_ENV}={spec}: injected fault in rank {rank} at step {step}")
    print(f"rank {rank}: {FAULT_ENV}={spec}: {'SIGKILL' if how == 'kill' else 'exit(1)'} at step {step}", file=sys.stderr, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def agree_on_start(start: int, rank: int) -> None:
    """Every rank must resume from the same checkpoint (they read it independently before the process group)."""
    mine = torch.tensor([start], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    starts = [int(t) for t in every]
    if len(set(starts)) > 1:
        raise checkpoint.CheckpointError(f"ranks found different checkpoints to resume from (steps done per rank: "
                                         f"{starts}); --checkpoint-dir must be one folder every rank sees")


def checkpoint_due(cfg: RunConfig, steps_done: int) -> bool:
    if not cfg.checkpoint_dir:
        return False
    return steps_done == cfg.steps or (cfg.checkpoint_every > 0 and steps_done % cfg.checkpoint_every == 0)


def train(plan: Plan, cfg: RunConfig, env: DistEnv, device: torch.device, metrics: MetricsFile,
          start: int = 0, reshard_from: dict | None = None) -> RankState:
    st = setup_rank(plan, env.rank, cfg.seed, cfg.optimizer, cfg.lr, device=device, probes=cfg.timing,
                    grad_sync=cfg.grad_sync)
    if cfg.resume:
        agree_on_start(start, env.rank)
    began = time.perf_counter()
    if start and reshard_from is not None:
        table = reshard.load_resharded(cfg.checkpoint_dir, start, reshard_from, plan, env.rank, st)
        if env.rank == 0:
            print(f"hap run: resharded the checkpoint after step {start} in {cfg.checkpoint_dir} from "
                  f"{table.old_world} to {table.new_world} ranks ({table.moved_bytes} bytes between ranks)", flush=True)
    elif start:
        checkpoint.load(cfg.checkpoint_dir, start, env.rank, st)
        if env.rank == 0:
            print(f"hap run: resuming from the checkpoint after step {start} in {cfg.checkpoint_dir}", flush=True)
    if elastic.switching():
        dist.barrier()  # the switch's reshard time is the slowest rank's
        if env.rank == 0:
            elastic.report_switch(metrics.write, time.perf_counter() - began)
    key = run_key(plan, cfg)
    pacer = make_pacer(cfg, env, device).install()
    try:
        for step in range(start, cfg.steps):
            maybe_inject_fault(env.rank, step)
            loss = train_step(plan, st, env.rank, make_batch(plan, step, cfg.seed, device), pacer, step=step)
            record = {"step": step, "rank": env.rank, "loss": loss, "step_time_s": st.step_times[-1],
                      "speed": pacer.speed, **pacer.last}
            metrics.write(record)
            if env.rank == 0:
                print(f"step {step:4d}  loss {loss:.6f}  {st.step_times[-1] * 1e3:8.2f} ms", flush=True)
            if checkpoint_due(cfg, step + 1):
                checkpoint.save(cfg.checkpoint_dir, key, st, env.rank, step + 1, dist.barrier,
                                layout=reshard.layout_of(plan, st) if env.rank == 0 else None)
    finally:
        pacer.uninstall()
    return st


def report_device(inputs: Inputs, cfg: RunConfig, env: DistEnv, device: torch.device) -> bool:
    """Print this rank's GPU-type check; False when a mismatch must stop the run (--device-check error)."""
    found = device_report(inputs, env.rank, device) if cfg.device_check != "off" else None
    if found is None:
        return True
    status, message = found
    if status == "mismatch":
        level = "error" if cfg.device_check == "error" else "warning"
        print(f"hap run: {level}: {message}", file=sys.stderr, flush=True)
        return cfg.device_check != "error"
    print(f"hap run: device check {status}: {message}", flush=True)
    return True


def run(cfg: RunConfig, env: DistEnv, init_method: str | None = None) -> int:
    """Train (and verify) on this rank; the exit status (0 ok, 1 verification failed, 2 bad input)."""
    try:
        inputs = check_inputs(cfg, env.world_size, env)
    except (HapError, ValueError, OSError) as e:
        record_failure(env.rank, e)
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2
    try:
        return run_checked(cfg, inputs.env, inputs, init_method)
    finally:
        if inputs.scratch:
            shutil.rmtree(inputs.scratch, ignore_errors=True)


def run_checked(cfg: RunConfig, env: DistEnv, inputs: Inputs, init_method: str | None) -> int:
    plan = inputs.plan
    try:
        backend, device = pick_device(env.local_rank)
        if not report_device(inputs, cfg, env, device):
            return 2
        metrics = MetricsFile(cfg.metrics, env.rank, keep_before=inputs.start_step)
    except (HapError, ValueError, OSError) as e:
        record_failure(env.rank, e)
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        apply_cpu_threads(env, emulating=bool(cfg.speeds))
    init_distributed(env, backend, cfg.timeout_s, init_method)
    try:
        dist.barrier()  # rank 0 has truncated the metrics file before anyone appends
        if env.rank == 0:
            print(f"hap run: {plan.strategy} plan of {plan.graph.name} on {env.world_size} ranks ({backend}), "
                  f"{cfg.steps} steps, {cfg.optimizer} lr {cfg.lr}", flush=True)
        st = train(plan, cfg, env, device, metrics, inputs.start_step, inputs.reshard_from)
        return verify(plan, cfg, st, env.rank, device)
    except checkpoint.CheckpointError as e:
        record_failure(env.rank, e)
        print(f"hap run: error: rank {env.rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        record_failure(env.rank, e)  # before the process group goes: the other ranks fail after this one
        raise
    finally:
        metrics.close()
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if bundle.plan_parallelism(cfg.plan) == "pipeline":  # a pipeline plan or bundle has its own rank entry
        from .pipeline import main as pipeline_main

        return pipeline_main(argv)
    try:
        env = DistEnv.from_environ()
    except ValueError as e:
        print(f"hap run: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(cfg, env)
    except Exception as e:  # the rank's top-level handler: record it for `hap run`, print it, exit 1
        record_failure(env.rank, e)
        traceback.print_exc()
        return 1


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


if __name__ == "__main__":
    exit_process(main())
