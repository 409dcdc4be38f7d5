"""Forced duplex on every zoo model at tiny sizes and every sample cluster (issue 28, item 6).

For each (model, cluster) it runs `engine.plan(..., overlap="duplex")` at the default options and
prints whether it planned (with the predicted time and whether a weight is sharded) or the one-line
reason it was refused; with `--run`, every plan on a `cpu_*` cluster is also trained for two steps
by `hap run --verify` (real torchrun, gloo) and its verdict printed. The test suite checks the same
with a small budget and runs one plan (tests/runner/test_runner_duplex_forced.py); this is the whole
enumeration, for people.

    PYTHONPATH=. python bench/duplex_forced.py                 # plan everything (a few minutes)
    PYTHONPATH=. python bench/duplex_forced.py --run           # and verify the CPU ones (~20 min on 2 cores)
    PYTHONPATH=. python bench/duplex_forced.py --clusters cpu_4_uneven --models gpt,mlp --run

It reports; it never asserts.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import engine
from engine.errors import InfeasibleError, PlanError

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "mlp": dict(layers=2, in_features=8, hidden=24, classes=6, batch=20),
    "gpt": dict(layers=1, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, batch=10),
    "vgg19": dict(batch=4, image_size=32, width=0.0625, hidden=16, classes=3),
    "vit": dict(batch=6, image_size=16, patch=4, hidden=24, layers=2, heads=4, mlp=48, classes=5),
    "bert": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, predictions=3, batch=10),
    "bert_moe": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, predictions=3, batch=10, experts=5),
    "hf_bert": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, batch=10),
    "hf_gpt2": dict(layers=2, hidden=16, heads=2, ffn=32, vocab=40, seq_len=8, batch=10),
    "hf_llama": dict(layers=2, hidden=16, heads=4, ffn=32, vocab=40, seq_len=8, batch=10),
}
"""Tiny sizes of every zoo model (the runner tests' configs, and the vision models')."""
ISSUE_GPT = dict(layers=2, hidden=64, heads=4, vocab=256, seq_len=16, batch=16)
"""Issue 28's GPT, refused on cpu_4_uneven before duplex became a search constraint."""


def verify(plan_path: Path) -> str:
    """`hap run PLAN --steps 2 --verify`'s verdict line (or its last line of error)."""
    r = subprocess.run([sys.executable, "-m", "runner.hap", "run", str(plan_path), "--steps", "2", "--verify"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    ok = next((ln for ln in lines if ln.startswith("verify: OK")), None)
    return ok if r.returncode == 0 and ok else f"FAILED (exit {r.returncode}): {lines[-1] if lines else ''}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="", help="comma-separated sample cluster names (default: all)")
    ap.add_argument("--models", default="", help="comma-separated zoo models (default: all, and the issue's GPT)")
    ap.add_argument("--run", action="store_true", help="hap run --verify every plan on a cpu_* cluster")
    args = ap.parse_args(argv)
    clusters = args.clusters.split(",") if args.clusters else sorted(p.stem for p in (ROOT / "sample_clusters").glob("*.json"))
    cases = {m: TINY[m] for m in args.models.split(",")} if args.models else {**TINY, "gpt (issue 28)": ISSUE_GPT}
    out = Path(tempfile.mkdtemp(prefix="duplex_forced_"))
    for name, knobs in cases.items():
        graph = engine.load_model(f"zoo:{name.split()[0]}", **knobs)
        for cluster in clusters:
            start = time.perf_counter()
            try:
                plan = engine.plan(graph, ROOT / "sample_clusters" / f"{cluster}.json", overlap="duplex")
            except (PlanError, InfeasibleError) as e:
                print(f"{name:16s} {cluster:32s} refused: {e}", flush=True)
                continue
            weights = sum(1 for k in plan.shard_sizes if k.startswith("p_"))
            line = (f"{name:16s} {cluster:32s} planned {plan.predicted_time_s * 1e3:9.3f} ms, "
                    f"{weights} weight dims sharded, {time.perf_counter() - start:5.1f} s")
            if args.run and cluster.startswith("cpu_"):
                path = out / f"{name.split()[0]}_{cluster}.json"
                plan.save(path)
                line += f"; {verify(path)}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
