"""Issue 27's acceptance run: examples/llama_tiny.py trained on the shipped text on 3 uneven gloo ranks.

    python bench/train_real.py [--steps 200] [--kill-at 120] [--svg docs/loss_curve.svg] [--out DIR]

1. `hap data prepare` packs examples/data/kjv_genesis_exodus.txt (byte-level), 5% held out for evaluation;
2. `hap plan` plans the model on sample_clusters/cpu_3_uneven.json;
3. `hap run` trains it: AdamW (decay 0.1), cosine schedule with warm-up, clipping at 1.0, accumulation 2,
   evaluation every 50 steps, `--verify` against single-device training on the same batches;
4. with `--kill-at K`: the same run with checkpoints, killed at the start of step K (SIGKILL on rank 1),
   then resumed; the steps after K must give the same losses to the bit;
5. prints the evaluation loss at step 0 and at the end (the drop in %), the verify lines, the resume
   comparison, and with `--svg` draws the loss curve (bench/plot_metrics.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAP = [sys.executable, "-m", "runner.hap"]
SETTINGS = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--warmup", "20", "--clip-grad-norm", "1.0", "--grad-accum", "2", "--eval-every", "50"]


def hap(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    import os

    r = subprocess.run([*HAP, *args], cwd=ROOT, text=True, capture_output=True, env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        sys.exit(f"train_real: `hap {' '.join(args[:2])} ...` failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(path) if r.get("rank") == 0 and "loss" in r}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=0, help="also check kill-and-resume at this step (0: skip)")
    p.add_argument("--svg", help="write the loss curve here (e.g. docs/loss_curve.svg)")
    p.add_argument("--out", help="keep the files here (default: a temporary folder)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="hap-train-real-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"
    print(hap("data", "prepare", str(text), "--out", str(out / "tokens.parquet"), "--eval-fraction", "0.05",
              "--eval-out", str(out / "eval.parquet")).stdout.strip())
    hap("plan", "--model", "examples/llama_tiny.py", "--cluster", "sample_clusters/cpu_3_uneven.json",
        "--out", str(out / "plan.json"))
    data = ["--data", str(out / "tokens.parquet"), "--eval-data", str(out / "eval.parquet")]
    began = time.perf_counter()
    r = hap("run", str(out / "plan.json"), "--steps", str(args.steps), *SETTINGS, *data, "--verify",
            "--metrics", str(out / "metrics.jsonl"), check=False)
    took = time.perf_counter() - began
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith(("hap run:", "eval", "verify"))))
    evals = [(x["step"], x["eval_loss"]) for x in records(out / "metrics.jsonl") if "eval_loss" in x]
    first, last = evals[0][1], evals[-1][1]
    print(f"train_real: {args.steps} steps in {took:.0f} s; eval loss {first:.4f} at step 0 -> {last:.4f} at step "
          f"{evals[-1][0]}: {100 * (first - last) / first:.1f}% lower; verify exit status {r.returncode}")
    status = r.returncode
    if args.kill_at:
        status |= kill_and_resume(out, args, data)
    if args.svg:
        subprocess.run([sys.executable, str(ROOT / "bench" / "plot_metrics.py"), str(out / "metrics.jsonl"),
                        "--out", args.svg, "--title", f"examples/llama_tiny.py on 3 uneven gloo ranks, {args.steps} steps"],
                       check=True, cwd=ROOT)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return status


def kill_and_resume(out: Path, args: argparse.Namespace, data: list[str]) -> int:
    """The run with checkpoints killed at `--kill-at`, resumed: 0 when every loss equals the uninterrupted run's."""
    ck = ["--checkpoint-dir", str(out / "ck"), "--checkpoint-every", "20", "--metrics", str(out / "resumed.jsonl")]
    run = ["run", str(out / "plan.json"), "--steps", str(args.steps), *SETTINGS, *data, *ck]
    killed = hap(*run, env={"HAP_RUNNER_FAULT": f"1:{args.kill_at}:kill"}, check=False)
    assert killed.returncode != 0, "the fault should have stopped the run"
    hap(*run, "--resume")
    a, b = losses(out / "metrics.jsonl"), losses(out / "resumed.jsonl")
    after = range(args.kill_at, args.steps)
    same = all(a[s] == b[s] for s in after)
    print(f"train_real: killed at step {args.kill_at}, resumed from the newest checkpoint: steps {args.kill_at}.."
          f"{args.steps - 1} {'bit-identical' if same else 'DIFFER'} to the uninterrupted run "
          f"({sum(a[s] == b[s] for s in after)} of {len(after)} losses equal)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
