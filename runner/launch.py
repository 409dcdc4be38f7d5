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
bundle's launch files; see engine.bundle.archive.plan_rank), and compares its GPU with the type the
plan's device has (engine.bundle.archive.gpu_type_check). A pipeline plan, bare or in a bundle, is handed
to its own entry, runner.pipeline_run (`main`, by engine.bundle.archive.plan_parallelism).

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

import os
import shutil
import signal
import sys
import time
import traceback
from typing import Sequence

import torch
import torch.distributed as dist

from engine.bundle import archive as bundle
from engine.errors import HapError
from engine.spmd.plan import Plan
from runner import checkpoint, elastic, reshard
from runner.config import FAULT_ENV, DistEnv, RunConfig, parse_args
from runner.failure import record_failure
from runner.rank_setup import (Inputs, apply_cpu_threads, check_inputs, device_report, exit_process, extracts,
                               init_distributed, make_pacer, pick_device, run_key)
from runner.scratch import sigterm_exits
from runner.api import parallelize
from runner.batches import batch_source
from runner.loop import train_step
from runner.run_report import MetricsFile, Progress, announce, evaluate, run_settings
from runner.train import RankState, Trace, gathered_grads, gathered_params
from runner.timing import mfu_line
from runner.verify import verify


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


def agree_on_start(start: int, rank: int, device: torch.device) -> None:
    """Every rank must resume from the same checkpoint (they read it independently before the process group)."""
    mine = torch.tensor([start], dtype=torch.int64, device=device)  # on the GPU under NCCL
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    starts = [int(t) for t in every]
    if len(set(starts)) > 1:
        raise checkpoint.CheckpointError(f"ranks found different checkpoints to resume from (steps done per rank: "
                                         f"{starts}); --checkpoint-dir must be one folder every rank sees")


def record(st: RankState, keep: bool, params: dict, grads: dict) -> None:
    """Verify mode: rank 0 keeps the step's parameters before it and the gradients its optimiser got."""
    if keep:
        st.trace = st.trace or Trace()
        st.trace.params.append(params)
        st.trace.grads.append(grads)


def snapshot(params: dict) -> dict:
    """Copies on the CPU, taken before the step: a Full parameter is the live tensor the optimiser steps in place."""
    return {k: v.detach().cpu().clone() for k, v in params.items()}


def checkpoint_due(cfg: RunConfig, steps_done: int) -> bool:
    if not cfg.checkpoint_dir:
        return False
    return steps_done == cfg.steps or (cfg.checkpoint_every > 0 and steps_done % cfg.checkpoint_every == 0)


def train(plan: Plan, cfg: RunConfig, env: DistEnv, device: torch.device, metrics: MetricsFile,
          start: int = 0, reshard_from: dict | None = None, inputs: Inputs | None = None) -> RankState:
    """The run on this rank: `hap run`'s loop over the library API (runner.api, runner.loop)."""
    optim = cfg.optim(plan.options.optimizer)
    batches = inputs.batches if inputs and inputs.batches else batch_source(plan.graph, cfg.seed, cfg.data)
    evals = inputs.eval_batches if inputs else None
    pacer = make_pacer(cfg, env, device)
    model = parallelize(plan, env.rank, seed=cfg.seed, init=cfg.init_from, device=device, pacer=pacer,
                        probes=cfg.timing, grad_sync=cfg.grad_sync)
    opt = model.optimizer(optim.optimizer_class(), **optim.kwargs())
    st = model.state
    if cfg.resume:
        agree_on_start(start, env.rank, device)
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
    launched = run_settings(plan, cfg, batches)
    progress = Progress(cfg.steps, start, batches.tokens, optim.grad_accum, plan, env.rank == 0)
    pacer.install()
    try:
        if evals is not None and start == 0:
            evaluate(model, evals, cfg, 0, metrics, env.rank)
        for step in range(start, cfg.steps):
            maybe_inject_fault(env.rank, step)
            before = gathered_params(plan, st) if cfg.verify else None  # collectives: every rank takes part
            before = snapshot(before) if before is not None and env.rank == 0 else before
            result = train_step(model, opt, batches, optim, step, want_norm=bool(cfg.metrics))
            if cfg.verify:
                record(st, env.rank == 0, before, gathered_grads(plan, st))
            metrics.write({"step": step, "rank": env.rank, "loss": result.loss, "step_time_s": result.seconds,
                           "lr": result.lr, "grad_norm": result.grad_norm, "grad_accum": optim.grad_accum,
                           **progress.figures(result.seconds),
                           "speed": pacer.speed, **pacer.last,
                           **({"run": launched} if env.rank == 0 and step == start else {})})
            progress.show(step, result)
            if evals is not None and (step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                evaluate(model, evals, cfg, step + 1, metrics, env.rank)
            if checkpoint_due(cfg, step + 1):
                checkpoint.save(cfg.checkpoint_dir, key, st, env.rank, step + 1, dist.barrier,
                                layout=reshard.layout_of(plan, st) if env.rank == 0 else None)
                if cfg.save_model:
                    model.save_pretrained(cfg.save_model, batches.tokenizer)
    finally:
        pacer.uninstall()
    if cfg.save_model and not checkpoint_due(cfg, cfg.steps):
        model.save_pretrained(cfg.save_model, batches.tokenizer)
    if cfg.save_model and env.rank == 0:
        print(f"hap run: saved the trained model to {cfg.save_model}", flush=True)
    if cfg.timing and env.rank == 0 and st.step_times:
        print(mfu_line(plan, st.step_times), flush=True)
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
    """Train (and verify) on this rank; the exit status (0 ok, 1 verification failed, 2 bad input).
    A bundle zip's scratch folder is removed however the rank ends, SIGTERM from torchrun included."""
    with sigterm_exits(extracts(cfg.plan)):
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
    init_distributed(env, backend, cfg.timeout_s, init_method, device)
    try:
        dist.barrier()  # rank 0 has truncated the metrics file before anyone appends
        if env.rank == 0:
            announce(f"{plan.strategy} plan of {plan.graph.name} on {env.world_size} ranks ({backend})", plan, cfg,
                     inputs.batches.describe if inputs.batches else "drawn")
        st = train(plan, cfg, env, device, metrics, inputs.start_step, inputs.reshard_from, inputs)
        return verify(plan, cfg, st, env.rank, device, inputs.batches)
    except (checkpoint.CheckpointError, HapError) as e:
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
        from .pipeline_run import main as pipeline_main

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


if __name__ == "__main__":
    exit_process(main())
