"""Your own training loop on a HAP plan: your optimiser, your scheduler, your logging.

    hap plan --model examples/llama_tiny.py --cluster sample_clusters/cpu_3_uneven.json --out plan.json
    hap data prepare examples/data/*.txt --out tokens.parquet
    torchrun --standalone --nproc-per-node=3 examples/own_loop.py plan.json --data tokens.parquet --steps 50

`runner.parallelize` turns the plan into this rank's model: `model.local_batch` slices a global batch by the
plan's uneven ratios, `loss.backward()` synchronises gradients as the plan says, and `model.optimizer`
builds any torch optimiser over this rank's shards (ZeRO slices included). Everything else here is
ordinary PyTorch. With the same plan, data, seed and settings, `hap run plan.json --optimizer adamw
--lr-schedule cosine ...` gives the same losses to the bit: it runs the same API (runner.loop).

`--verify` checks every step on one device (rank 0): the loss and gradients at the run's own parameters,
and the final weights from the optimiser fed the run's gradients (runner.verify).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os

import torch
import torch.distributed as dist

import runner
from runner.batches import batch_source
from runner.train import Trace


def warmup_cosine(warmup: int, steps: int, floor: float):
    """The learning-rate multiplier of step s: linear warm-up, then cosine decay to `floor` x the peak."""
    def factor(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        done = min(1.0, (s - warmup) / max(1, steps - warmup))
        return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * done))
    return factor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan")
    p.add_argument("--data", help="token dataset (hap data prepare); default: the model's example inputs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--accum", type=int, default=1, help="microbatches per optimiser step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--losses", help="rank 0 writes the losses here (JSON)")
    p.add_argument("--verify", action="store_true", help="compare with single-device training on rank 0")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = runner.parallelize(args.plan, seed=args.seed)
    batches = batch_source(model.plan.graph, args.seed, args.data)  # or your own: any global batch, same on every rank
    opt = model.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps, args.min_lr / args.lr))

    losses, trace = [], Trace()
    for step in range(args.steps):
        if args.verify:  # every rank takes part; rank 0 checks each step from these (runner.verify)
            trace.params.append({k: v.detach().cpu().clone() for k, v in model.full_state_dict().items()})
        model.zero_grad()
        total = 0.0
        for j in range(args.accum):
            index = step * args.accum + j
            # the first microsteps keep their gradients local; the last backward synchronises the sum
            with model.no_sync() if j < args.accum - 1 else contextlib.nullcontext():
                loss = model(model.local_batch(batches(index)), step=index)  # step= keys the dropout masks
                (loss if args.accum == 1 else loss / args.accum).backward()
            total += float(loss.detach())
        norm = model.clip_grad_norm_(args.clip) if args.clip else None
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        losses.append(total / args.accum)
        if args.verify:
            trace.grads.append(model.full_grad_dict())
        if model.rank == 0:
            extra = f"  grad norm {float(norm):.3g}" if norm is not None else ""
            print(f"step {step:4d}  loss {losses[-1]:.6f}  lr {lr:.3g}{extra}", flush=True)

    state = model.full_state_dict()  # every rank takes part
    if model.rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    status = 0
    if args.verify and model.rank == 0:
        status = verify(model, args, batches, losses, state, trace)
    dist.destroy_process_group()
    raise SystemExit(status)


def verify(model, args, batches, losses: list[float], state: dict, trace: Trace) -> int:
    """Each step against one device with the same settings; 0 when losses, gradients and weights match
    within tolerance (runner.verify says how)."""
    from runner.optim import OptimConfig
    from runner.verify import check_steps, tolerance_for

    optim = OptimConfig(name="adamw", lr=args.lr, weight_decay=args.weight_decay, schedule="cosine",
                        warmup=args.warmup, min_lr=args.min_lr, steps=args.steps, clip_grad_norm=args.clip,
                        grad_accum=args.accum)
    result = check_steps(model.plan, losses, state, trace, args.seed, optim, batches=batches)
    tolerance = tolerance_for(model.plan.options.precision)
    print(result.render(tolerance), flush=True)
    return 0 if result.ok(tolerance) else 1


if __name__ == "__main__":
    main()
