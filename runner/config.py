"""A run's configuration: the runner's options (`RunConfig`, parsed once) and the launch environment (`DistEnv`).

Plain data read by every rank entry (`runner.launch`, `runner.pipeline`) and by the supervisors.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from engine import limits
from engine.bundle.grammar import digest_arg
from runner.optim import DEFAULT_LR, OPTIMIZERS, SCHEDULES, OptimConfig
from runner.train import GRAD_SYNC

FAULT_ENV = "HAP_RUNNER_FAULT"


NODE_ENV = "HAP_NODE_RANK"
"""Set by a bundle's launch files: the bundle node this torchrun runs (see engine.bundle.archive.plan_rank)."""


DEVICE_CHECK = ("warn", "error", "off")


MAX_LR = 1e6
"""A learning rate above this is a typo."""


PRICED = {"adamw": "adam"}
"""The optimiser the cost model prices for each of the runner's (AdamW keeps Adam's state)."""


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
    optimizer: str | None = None
    """`sgd`, `adam` or `adamw`; None: the one the plan was priced for (`optimizer_for`)."""
    lr: float | None = None
    """Peak learning rate; None: runner.optim.DEFAULT_LR of the optimiser."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on matrices only (runner.optim)."""
    lr_schedule: str = "constant"
    """`constant`, `cosine` or `linear` decay after the warm-up."""
    warmup: int = 0
    """Optimiser steps of linear warm-up."""
    min_lr: float = 0.0
    """Where cosine and linear decay end, at the last step."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this (0: off)."""
    grad_accum: int = 1
    """Microsteps per optimiser step (each one plan batch)."""
    data: str | None = None
    """Token dataset (Parquet / Arrow file or folder, runner.data) the batches come from."""
    eval_data: str | None = None
    """Token dataset whose first `eval_batches` batches give the evaluation loss."""
    eval_every: int = 0
    """Evaluate every N optimiser steps (and before the first and after the last); 0: only with --eval-data, at the start and end."""
    eval_batches: int = 4
    """Batches of --eval-data per evaluation."""
    init_from: str | None = None
    """Pretrained weights to start from: a safetensors file or a save_pretrained directory (runner.weights)."""
    save_model: str | None = None
    """Directory the trained model is written to (safetensors, from_pretrained-loadable for transformers models),
    at the end and at every checkpoint."""
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
    digest: str | None = None
    """Bundles: run only the bundle whose manifest.json has this sha256 (the digest `hap export` printed)."""
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
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{self.optimizer}'")
        if self.lr is not None and (not limits.in_range(self.lr, 0, MAX_LR) or self.lr == 0):
            raise ValueError(f"--lr must be a positive number up to {MAX_LR:g}, got {self.lr}")
        self.optim("adam")  # the optimiser settings, checked together (runner.optim.OptimConfig)
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"--eval-every must be >= 0 and --eval-batches >= 1, got {self.eval_every} and {self.eval_batches}")
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data PATH (the evaluation dataset)")
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


    def optimizer_for(self, planned: str) -> str:
        """The optimiser this run uses: --optimizer, else the one the plan was priced for."""
        if self.optimizer:
            return self.optimizer
        return planned if planned in OPTIMIZERS else "sgd"

    def optim(self, planned: str) -> OptimConfig:
        """The run's optimiser settings (`planned`: the optimiser the plan was priced for)."""
        name = self.optimizer_for(planned)
        return OptimConfig(name=name, lr=self.lr if self.lr is not None else DEFAULT_LR[name],
                           weight_decay=self.weight_decay, schedule=self.lr_schedule, warmup=self.warmup,
                           min_lr=self.min_lr, steps=self.steps, clip_grad_norm=self.clip_grad_norm,
                           grad_accum=self.grad_accum)

    def optimizer_warning(self, planned: str) -> str | None:
        """A line when --optimizer differs from what the plan's memory and time were priced for."""
        name = self.optimizer_for(planned)
        if PRICED.get(name, name) == planned or planned == "none":
            return None
        return (f"--optimizer {name} but the plan was priced for {planned} (its state per parameter and update "
                f"time); re-plan with `hap plan --optimizer {PRICED.get(name, name)}` for a true prediction")


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
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default=None,
                   help="default: the optimizer the plan was priced for (adam unless planned otherwise)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                   help="AdamW's decoupled weight decay on matrices (not biases or norms); default 0")
    p.add_argument("--lr-schedule", choices=list(SCHEDULES), default="constant",
                   help="learning rate after the warm-up: constant (default), cosine or linear decay to --min-lr")
    p.add_argument("--warmup", type=int, default=0, metavar="N", help="optimizer steps of linear warm-up (default 0)")
    p.add_argument("--min-lr", type=float, default=0.0, metavar="R", help="learning rate at the last step (default 0)")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, metavar="C",
                   help="clip the global gradient norm to C (default 0: no clipping)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="microsteps per optimizer step, each one plan batch (default 1)")
    p.add_argument("--data", metavar="PATH",
                   help="token dataset: a Parquet or Arrow file, or a folder of them, with an input_ids column "
                        "(`hap data prepare` makes one); default: random batches of the model's example inputs")
    p.add_argument("--eval-data", metavar="PATH", help="token dataset for the evaluation loss")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="evaluate every N steps (default 0: at the start and the end only, with --eval-data)")
    p.add_argument("--eval-batches", type=int, default=4, metavar="N", help="batches per evaluation (default 4)")
    p.add_argument("--init-from", metavar="PATH",
                   help="start from these weights: a safetensors file or a save_pretrained directory")
    p.add_argument("--save-model", metavar="DIR",
                   help="write the trained model here (safetensors; from_pretrained loads transformers models), "
                        "at the end and at every checkpoint")
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
    p.add_argument("--digest", metavar="SHA256", type=digest_arg,
                   help="bundles: refuse any bundle but the one `hap export` printed this digest for")
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
