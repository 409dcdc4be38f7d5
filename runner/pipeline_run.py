"""`hap run` on a pipeline plan: each torchrun rank's entry, a thin loop over the library API.

The rank checks its inputs before any process group starts (the options a pipeline takes,
runner.pipeline.PIPELINE_OPTIONS; the bundle; the data, evaluation data and weights to start from,
runner.rank_setup.checked_sources), then trains `runner.parallelize(plan)` (runner.pipeline_api) with
the same step as SPMD plans (runner.loop.train_step: the optimiser settings of runner.optim, accumulation,
clipping, the schedule), writes the same metrics and progress line (runner.run_report), evaluates,
saves the model, and on rank 0 verifies against single-device microbatch accumulation with the same
settings (runner.pipeline.microbatch_reference).

runner.launch hands pipeline plans and bundles here (`main`), and `hap run` starts this module under
torchrun for them.
"""
from __future__ import annotations

import shutil
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from engine.errors import HapError
from engine.pipeline.plan import PipelinePlan
from runner.batches import Batches
from runner.config import RunConfig, parse_args
from runner.loop import train_step
from runner.pipeline import microbatch_reference, pipeline_inputs
from runner.pipeline_api import PipelineModel, parallelize_pipeline
from runner.precision import precision_of
from runner.rank_setup import checked_sources, extracts, init_distributed, pick_device
from runner.run_report import MetricsFile, Progress, announce, evaluate, run_settings
from runner.scratch import sigterm_exits
from runner.timing import Pacer, mfu_line, parse_speeds
from runner.verify import compare, tolerance_for


def run_rank(plan: PipelinePlan, rank: int, cfg: RunConfig, device: torch.device | str = "cpu",
             batches: Batches | None = None, evals: Batches | None = None) -> int:
    """One rank of `hap run PIPELINE_PLAN` on `device`: train, report, save, verify on rank 0 if asked;
    the rank's exit status (1: verification failed)."""
    torch.set_num_threads(1)
    if batches is None:
        batches, evals = checked_sources(plan, cfg)
    optim = cfg.optim(plan.options.optimizer)
    pacer = Pacer(parse_speeds(cfg.speeds, plan.world_size)[rank]) if cfg.speeds else Pacer()
    model = parallelize_pipeline(plan, rank, seed=cfg.seed, init=cfg.init_from, device=device,
                                 emulate_links=cfg.emulate_links, pacer=pacer)
    opt = model.optimizer(optim.optimizer_class(), **optim.kwargs())
    metrics = MetricsFile(cfg.metrics, rank)
    pacer.install()
    try:
        dist.barrier()  # rank 0 has truncated the metrics file before anyone appends
        if rank == 0:
            announce(f"pipeline plan of {plan.graph.name} on {plan.world_size} ranks, {len(plan.stages)} stages", plan,
                     cfg, batches.describe)
        progress = Progress(cfg.steps, 0, batches.tokens, optim.grad_accum, plan, rank == 0)
        if evals is not None:
            evaluate(model, evals, cfg, 0, metrics, rank)
        for step in range(cfg.steps):
            result = train_step(model, opt, batches, optim, step, want_norm=bool(cfg.metrics))
            metrics.write({"step": step, "rank": rank, "loss": result.loss, "step_time_s": result.seconds,
                           "lr": result.lr, "grad_norm": result.grad_norm, "grad_accum": optim.grad_accum,
                           "stage": model.stage, "speed": pacer.speed, **pacer.last, **progress.figures(result.seconds),
                           **({"run": run_settings(plan, cfg, batches)} if rank == 0 and step == 0 else {})})
            progress.show(step, result)
            if evals is not None and (step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                evaluate(model, evals, cfg, step + 1, metrics, rank)
    finally:
        pacer.uninstall()
        metrics.close()
    if cfg.save_model:
        model.save_pretrained(cfg.save_model, batches.tokenizer)
    return finish(model, cfg, batches, device)


def finish(model: PipelineModel, cfg: RunConfig, batches: Batches, device: torch.device | str) -> int:
    """Gather the parameters (every rank takes part); on rank 0 the summary, --save-params and --verify."""
    plan, rank = model.plan, model.rank
    params = model.full_state_dict()
    if rank != 0:
        return 0
    if cfg.save_model:
        print(f"hap run: saved the trained model to {cfg.save_model}", flush=True)
    print(f"pipeline: {len(plan.stages)} stages, {plan.schedule}, {plan.microbatches} microbatches; "
          f"predicted {plan.predicted_s * 1e3:.3f} ms per step", flush=True)
    print(mfu_line(plan, model.state.step_times), flush=True)  # measured MFU beside the predicted one
    if cfg.save_params:
        torch.save({k: v.cpu() for k, v in params.items()}, cfg.save_params)
    if not cfg.verify:
        return 0
    optim = cfg.optim(plan.options.optimizer)
    ref_losses, ref_params = microbatch_reference(plan, cfg.steps, cfg.seed, device=device, batches=batches,
                                                  optim=optim, init=cfg.init_from)
    result = compare(model.state.losses, params, ref_losses, ref_params)
    print(f"verify: {cfg.steps} steps against single-device microbatch accumulation "
          f"({optim.name}, lr {optim.lr:g}, seed {cfg.seed})")
    tolerance = tolerance_for(precision_of(plan))
    print(result.render(tolerance), flush=True)
    return 0 if result.ok(tolerance) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of each torchrun rank (`python -m runner.pipeline_run PLAN|BUNDLE ...`; runner.launch hands
    pipeline plans here). A bundle is checked against its manifest on every rank (a zip extracted
    to the rank's own scratch folder) and the rank joins as the plan device its bundle node gives it."""
    cfg = parse_args(argv)
    with sigterm_exits(extracts(cfg.plan)):  # a zip's scratch folder goes however the rank ends, SIGTERM included
        try:
            plan, env, scratch = pipeline_inputs(cfg)
        except (HapError, ValueError) as e:
            print(f"hap run: error: {e}", file=sys.stderr)
            return 2
        try:
            batches, evals = checked_sources(plan, cfg)
            backend, device = pick_device(env.local_rank)
            init_distributed(env, backend, cfg.timeout_s, device=device)
            status = run_rank(plan, env.rank, cfg, device, batches, evals)
        except (HapError, ValueError, OSError) as e:  # ValueError: more ranks on this machine than GPUs
            print(f"hap run: error: {e}", file=sys.stderr)
            status = 2
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
