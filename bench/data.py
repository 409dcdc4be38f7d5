"""The data path of `hap run --data` (issue 27): tokens/s through `runner.data.global_batch`, and memory.

Generates a token dataset of `--size-gb` GB of int32 token ids (default 1 GB: 268M tokens, random ids below
`--vocab`) in a temporary folder, as Parquet (row groups of 64K tokens, as `hap data prepare` writes them) and
as Arrow IPC, with runner.prepare's writer. Nothing is stored. Then, per format, in this process:

1. opens it (`TokenDataset.open`, seq_len `--seq-len`), reads global batch 0 (timed apart: it draws the
   epoch's permutation, once per epoch) and then `--batches` more global batches of `--batch` samples
   (`global_batch`, the seeded order: random samples over the whole file, so nearly every sample of a Parquet
   file decodes its row group) and reports the data path's tokens/s and ms per batch;
2. the same in the shape of examples/llama_tiny.py (batch 6, seq_len 16);
3. `check_vocab` (Parquet: row-group statistics; Arrow: one pass over the mapped ids);

and prints the process's memory (/proc/self/status) at the start, after each open, every tenth of the
reading and at the end: VmRSS, split into RssAnon (the process's own heap: row-group cache, permutation,
batches) and RssFile (pages of the memory-mapped Arrow file, which belong to the kernel's page cache and
are dropped under memory pressure). Flat RssAnon while reading a dataset larger than it is the claim.

    PYTHONPATH=. python bench/data.py                      # 1 GB, Parquet and Arrow (about 2 minutes on 2 cores)
    PYTHONPATH=. python bench/data.py --size-gb 0.001 --batches 20    # seconds (tests/runner/test_data.py)

Writes `bench/results/data.json` (`--out`). It never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.data import TokenDataset, global_batch  # noqa: E402
from runner.prepare import ROW_GROUP_TOKENS, Tokenizer, TokenWriter  # noqa: E402

LLAMA_TINY = (6, 16)
"""(batch, seq_len) of examples/llama_tiny.py."""


def memory() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process in MB (Linux), else the peak RSS from `resource`."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
    except (OSError, KeyError):
        import resource
        return {"VmRSS": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def show(label: str, mem: dict[str, float]) -> None:
    print(f"  {label:<28} " + "  ".join(f"{k} {v:8.1f} MB" for k, v in mem.items()), flush=True)


def generate(folder: Path, size_gb: float, vocab: int, seed: int) -> dict[str, Path]:
    """The same random ids written as Parquet and as Arrow IPC, a MiB of ids at a time."""
    tokens = int(size_gb * 1e9) // 4
    tok = Tokenizer("synthetic", vocab, lambda block, _: np.empty(0, np.int32), None)
    paths = {"parquet": folder / "tokens.parquet", "arrow": folder / "tokens.arrow"}
    writers = {k: TokenWriter(p, tok) for k, p in paths.items()}
    rng = np.random.default_rng(seed)
    start, left = time.perf_counter(), tokens
    while left:
        ids = rng.integers(0, vocab, size=min(left, 1 << 20), dtype=np.int32)
        for w in writers.values():
            w.write(ids)
        left -= ids.size
    for k, w in writers.items():
        written = w.close()
        print(f"  wrote {written.path.name}: {written.tokens:,} tokens, {written.groups} groups, "
              f"{written.size / 1e9:.3f} GB", flush=True)
    print(f"  generated in {time.perf_counter() - start:.1f} s", flush=True)
    return paths


def read(path: Path, seq_len: int, batch: int, batches: int, seed: int, trace: list) -> dict[str, Any]:
    """Open, read `batches` global batches; tokens/s, ms per batch, memory every tenth of the way."""
    start = time.perf_counter()
    ds = TokenDataset.open(path, seq_len)
    opened = time.perf_counter() - start
    mem = memory()
    show(f"open (seq {seq_len})", mem)
    trace.append({"at": f"{path.suffix[1:]} open seq {seq_len}", **mem})
    start = time.perf_counter()
    global_batch(ds, 0, seed, batch)  # draws the epoch's permutation: once per epoch
    first = time.perf_counter() - start
    every = max(1, batches // 10)
    start = time.perf_counter()
    for k in range(1, batches + 1):
        global_batch(ds, k, seed, batch)
        if k % every == 0:
            mem = memory()
            trace.append({"at": f"{path.suffix[1:]} seq {seq_len} batch {k}", **mem})
    took = time.perf_counter() - start
    show(f"after {batches} batches", memory())
    return {"samples": len(ds), "seq_len": seq_len, "batch": batch, "batches": batches, "open_s": opened,
            "first_batch_s": first, "read_s": took, "ms_per_batch": 1e3 * took / batches,
            "tokens_per_s": batches * batch * seq_len / took}


def bench_format(name: str, path: Path, args: argparse.Namespace, trace: list) -> dict[str, Any]:
    print(f"{name}: {path.stat().st_size / 1e9:.3f} GB", flush=True)
    out = {"file_gb": path.stat().st_size / 1e9}
    out["shape"] = read(path, args.seq_len, args.batch, args.batches, args.seed, trace)
    out["llama_tiny"] = read(path, LLAMA_TINY[1], LLAMA_TINY[0], args.batches, args.seed, trace)
    ds = TokenDataset.open(path, args.seq_len)
    start = time.perf_counter()
    ds.check_vocab(args.vocab)
    out["check_vocab_s"] = time.perf_counter() - start
    mem = memory()
    show("after check_vocab", mem)
    trace.append({"at": f"{name} check_vocab", **mem})
    for key in ("shape", "llama_tiny"):
        r = out[key]
        print(f"  batch {r['batch']} x seq {r['seq_len']}: {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['ms_per_batch']:.2f} ms/batch (open {r['open_s']:.2f} s, first batch with the epoch's "
              f"permutation of {r['samples']:,} samples {r['first_batch_s']:.2f} s)", flush=True)
    print(f"  check_vocab: {out['check_vocab_s']:.2f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tokens/s and memory of the data path (runner.data)")
    p.add_argument("--size-gb", type=float, default=1.0, help="GB of int32 token ids to generate (default 1)")
    p.add_argument("--formats", default="parquet,arrow", help="parquet, arrow or both (default)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=500, help="global batches read per format and shape")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    args = p.parse_args(argv)
    start = memory()
    trace = [{"at": "start", **start}]
    print(f"data path: {args.size_gb} GB of int32 ids, row groups of {ROW_GROUP_TOKENS} tokens, "
          f"{os.cpu_count()} CPUs", flush=True)
    show("start", start)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hap-bench-data-") as tmp:
        paths = generate(Path(tmp), args.size_gb, args.vocab, args.seed)
        mem = memory()
        show("after generating", mem)
        trace.append({"at": "generated", **mem})
        for name in args.formats.split(","):
            results[name] = bench_format(name, paths[name], args, trace)
    end = memory()
    trace.append({"at": "end", **end})
    show("end", end)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "python": platform.python_version(),
                               "results": results, "memory_mb": trace}, indent=1))
    print(f"figures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
