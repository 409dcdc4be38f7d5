"""What a `hap run` reports as it trains (SPMD and pipeline plans alike): the metrics file, the progress
line of rank 0, and the evaluation records.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from runner.batches import Batches
from runner.config import RunConfig
from runner.loop import eval_loss


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


def announce(what: str, plan: Plan | PipelinePlan, cfg: RunConfig, data: str) -> None:
    """Rank 0's first line (`what`: the plan and its ranks) and its warning on an optimiser the plan was not
    priced for."""
    optim = cfg.optim(plan.options.optimizer)
    print(f"hap run: {what}, {cfg.steps} steps, {optim.name} lr {optim.lr:g}"
          + (f" ({optim.schedule}, warm-up {optim.warmup})" if optim.schedule != "constant" or optim.warmup else "")
          + (f", {optim.grad_accum} microsteps a step" if optim.grad_accum > 1 else "")
          + f"; data: {data}", flush=True)
    warning = cfg.optimizer_warning(plan.options.optimizer)
    if warning:
        print(f"hap run: warning: {warning}", file=sys.stderr, flush=True)


def run_settings(plan: Plan | PipelinePlan, cfg: RunConfig, batches: Batches) -> dict:
    """What the steps of a launch were trained with: the `run` field of its first step record on rank 0
    (a resume is a launch of its own)."""
    return {"world_size": plan.world_size, "seed": cfg.seed, "optimizer": cfg.optim(plan.options.optimizer).record(),
            "data": batches.describe, "eval_data": cfg.eval_data, "init_from": cfg.init_from,
            "model": plan.model_fingerprint, "precision": plan.options.precision, "grad_dtype": plan.options.grad_dtype}


def evaluate(model, evals: Batches, cfg: RunConfig, step: int, metrics: MetricsFile, rank: int) -> None:
    """The evaluation loss after `step` optimiser steps: a record on rank 0, and a line."""
    loss = eval_loss(model, evals, cfg.eval_batches)
    if rank == 0:
        tokens = evals.tokens * cfg.eval_batches if evals.tokens else None
        metrics.write({"step": step, "rank": rank, "eval_loss": loss, "eval_tokens": tokens})
        print(f"eval after step {step:4d}  loss {loss:.6f}", flush=True)


class Progress:
    """The progress line of rank 0 (step, loss, tokens/s, ETA) and the throughput figures of the metrics."""

    def __init__(self, steps: int, start: int, tokens: int | None, accum: int, plan: Plan | PipelinePlan, show: bool) -> None:
        self.steps, self.start, self.show_lines = steps, start, show
        self.tokens = tokens * accum if tokens else None
        self.model_flops = plan.utilisation.model_flops * accum if plan.utilisation.model_flops else None
        self.peak = plan.utilisation.peak_flops
        self.times: list[float] = []

    def figures(self, seconds: float) -> dict:
        self.times.append(seconds)
        mfu = self.model_flops / seconds / self.peak if self.model_flops and self.peak and seconds > 0 else None
        return {"tokens": self.tokens, "tokens_per_s": self.tokens / seconds if self.tokens and seconds > 0 else None,
                "mfu": mfu}

    def show(self, step: int, result) -> None:
        if not self.show_lines:
            return
        recent = self.times[-10:]
        per_step = sum(recent) / len(recent)
        eta = per_step * (self.steps - step - 1)
        line = f"step {step:4d}/{self.steps}  loss {result.loss:.6f}  lr {result.lr:.3g}  {result.seconds * 1e3:8.2f} ms"
        if result.grad_norm is not None:
            line += f"  grad norm {result.grad_norm:.3g}"
        if self.tokens:
            line += f"  {self.tokens / result.seconds:,.0f} tokens/s"
        print(f"{line}  ETA {eta:,.0f} s", flush=True)
