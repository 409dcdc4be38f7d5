"""Sharded checkpoints and resume: every rank saves and loads only its own slices.

Layout under `--checkpoint-dir D`, one folder per checkpoint, named by the steps done:

    D/step-00000006/rank-00000.pt ... rank-00003.pt   each rank's parameter slices, optimizer
                                                      state, losses so far, RNG state
    D/step-00000006/rank-00000.sha256 ...             SHA-256 of each rank file, by its writer
    D/step-00000006/COMPLETE                          JSON written by rank 0 after a barrier: steps,
                                                      run key, the plan's layout of every parameter
                                                      and the rank files' hashes (runner.reshard)

A rank file is written to a temporary name and renamed (atomic on POSIX), and a checkpoint
counts only once its `COMPLETE` marker exists: rank 0 writes it after every rank has renamed its
file, so a run killed while saving leaves an incomplete folder that resume skips. Resume takes the
newest complete checkpoint whose run key (model, program, shard sizes, seed, optimizer, lr, world
size) matches this run; a checkpoint of another plan of the same model (other world size, ratios
or shardings) is resharded on load (runner.reshard). Batches are a function of (seed, step)
(`runner.train.make_batch`), so the resumed steps see the same data and the run ends exactly
where an uninterrupted one would.

Files hold tensors and plain containers only (`torch.save`); they are loaded with
`weights_only=True`, never unpickled as arbitrary objects. `D` must be on a file system every
rank sees (rank 0 writes the marker for all).
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from engine.spmd.plan import Plan

from .train import RankState
from .zero import full_view

CHECKPOINT_SCHEMA_VERSION = 1
COMPLETE = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint cannot be used for this run (another run's, a missing rank file, wrong shapes)."""


def step_dir(root: str | Path, steps_done: int) -> Path:
    return Path(root) / f"step-{steps_done:08d}"


def rank_file(root: str | Path, steps_done: int, rank: int) -> Path:
    return step_dir(root, steps_done) / f"rank-{rank:05d}.pt"


def run_key(plan: Plan, *, seed: int, optimizer: str, lr: float, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """What must be equal for a checkpoint to continue this run (`settings`: the rest of the optimiser's
    settings and the data, runner.rank_setup.run_key)."""
    program = json.dumps([i.to_dict() for i in plan.program], sort_keys=True)
    sizes = json.dumps(plan.shard_sizes, sort_keys=True)
    # mixed precision changes the losses, so an fp32 checkpoint must not continue a bf16 run (fp32 adds no
    # field, so the keys of checkpoints written before this still match)
    mixed = {k: v for k, v in (("precision", plan.options.precision), ("grad_dtype", plan.options.grad_dtype))
             if v != "fp32"}
    return {"model": plan.model_fingerprint, "program": hashlib.sha256((program + sizes).encode()).hexdigest()[:16],
            "world_size": plan.world_size, "seed": seed, "optimizer": optimizer, "lr": lr, **mixed,
            **({"settings": settings} if settings else {})}


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write through `write(file)` to a temporary name, flush to disk, then rename over `path`."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_file(path: Path) -> str:
    """SHA-256 hex of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_path(root: str | Path, steps_done: int, rank: int) -> Path:
    return step_dir(root, steps_done) / f"rank-{rank:05d}.sha256"


def rank_state(st: RankState, rank: int, steps_done: int) -> dict[str, Any]:
    """This rank's share of a checkpoint: tensors and plain containers only (sharded states gathered
    whole, runner.zero.full_view: a collective, every rank saves)."""
    with full_view(st) as st:
        return _rank_state(st, rank, steps_done)


def _rank_state(st: RankState, rank: int, steps_done: int) -> dict[str, Any]:
    state: dict[str, Any] = {"schema_version": CHECKPOINT_SCHEMA_VERSION, "rank": rank, "steps_done": steps_done,
                             "params": [p.detach().cpu() for p in st.params],
                             "optimizer": st.optimizer.state_dict(), "losses": list(st.losses),
                             "rng": torch.get_rng_state()}
    if st.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(st.device)
    if st.scaler is not None:  # fp16: the loss scale and its growth counter, so a resumed run scales alike
        state["scaler"] = st.scaler.state_dict()
    return state


def save(root: str | Path, key: dict[str, Any], st: RankState, rank: int, steps_done: int,
         barrier: Callable[[], None], layout: dict[str, Any] | None = None) -> None:
    """Every rank writes its file and its hash; after `barrier`, rank 0 marks the checkpoint complete,
    recording the plan's `layout` (runner.reshard.layout_of) and every rank file's hash."""
    folder = step_dir(root, steps_done)
    folder.mkdir(parents=True, exist_ok=True)
    state = rank_state(st, rank, steps_done)
    path = rank_file(root, steps_done, rank)
    _write_atomic(path, lambda f: torch.save(state, f))
    digest = hash_file(path)
    _write_atomic(hash_path(root, steps_done, rank), lambda f: f.write(digest.encode()))
    barrier()
    if rank == 0:
        marker = {"steps_done": steps_done, "key": key,
                  "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        if layout is not None:
            hashes = {str(r): hash_path(root, steps_done, r) for r in range(int(layout["world_size"]))}
            marker["layout"] = layout
            marker["files"] = {r: p.read_text().strip() for r, p in hashes.items() if p.is_file()}
        _write_atomic(folder / COMPLETE, lambda f: f.write((json.dumps(marker, indent=1) + "\n").encode()))


PLAN_KEYS = ("program", "world_size")
"""Run-key fields a checkpoint of another plan of the same model may differ in (it is resharded)."""


def read_marker(root: str | Path, steps_done: int) -> dict[str, Any]:
    """The COMPLETE marker of a checkpoint (JSON)."""
    return json.loads((step_dir(root, steps_done) / COMPLETE).read_text())


def same_plan(marker: dict[str, Any], key: dict[str, Any]) -> bool:
    return marker.get("key") == key


def latest_complete(root: str | Path, key: dict[str, Any], rank: int, *, other_plans: bool = False) -> int | None:
    """Steps done by the newest complete checkpoint of this run under `root` (None: start afresh).

    With `other_plans`, a checkpoint written by another plan of the same model is accepted too (its
    key may differ in PLAN_KEYS only; runner.reshard loads it); another model's is refused."""
    folders = sorted(Path(root).glob("step-*"), reverse=True) if Path(root).is_dir() else []
    for folder in folders:
        marker = folder / COMPLETE
        if not marker.is_file():
            continue  # a save that did not finish on every rank
        try:
            info = json.loads(marker.read_text())
            steps = int(info["steps_done"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{marker}: unreadable marker ({e}); delete {folder} to resume from an older one") from None
        theirs = info.get("key") if isinstance(info.get("key"), dict) else {}
        if theirs.get("model") != key.get("model"):
            raise CheckpointError(f"{folder} was written for another model (fingerprint {theirs.get('model')!r} != "
                                  f"{key.get('model')!r}); use a new --checkpoint-dir or a plan of that model")
        ignored = PLAN_KEYS if other_plans else ()
        if any(theirs.get(k) != v for k, v in key.items() if k not in ignored):
            diff = ", ".join(f"{k} {theirs.get(k)!r} != {v!r}" for k, v in key.items()
                             if theirs.get(k) != v and k not in ignored)
            raise CheckpointError(f"{folder} was written by another run ({diff}); use a new --checkpoint-dir "
                                  "or the same plan and options")
        if theirs != key:  # another plan's: resharded, every rank reads the files it needs
            if "layout" not in info:
                diff = ", ".join(f"{k} {theirs.get(k)!r} != {key[k]!r}" for k in PLAN_KEYS if theirs.get(k) != key[k])
                raise CheckpointError(f"{folder} was written by another plan ({diff}) and records no layout to "
                                      "reshard from; resume it with its own plan")
            return steps
        if not rank_file(root, steps, rank).is_file():
            raise CheckpointError(f"{rank_file(root, steps, rank)} missing although {marker} exists: "
                                  "--checkpoint-dir must be a file system every rank sees")
        return steps
    return None


def load(root: str | Path, steps_done: int, rank: int, st: RankState) -> None:
    """Restore this rank's slices, optimizer state, losses and RNG state from a checkpoint (sharded
    states sliced from the whole ones saved, runner.zero.full_view)."""
    with full_view(st) as st:
        _load(root, steps_done, rank, st)


def _load(root: str | Path, steps_done: int, rank: int, st: RankState) -> None:
    path = rank_file(root, steps_done, rank)
    state = torch.load(path, map_location=st.device, weights_only=True)
    params = state["params"]
    if len(params) != len(st.params) or any(a.shape != p.shape for a, p in zip(params, st.params)):
        have = [tuple(p.shape) for p in st.params]
        got = [tuple(a.shape) for a in params]
        raise CheckpointError(f"{path}: parameter slices {got} do not match this rank's {have}")
    with torch.no_grad():
        for p, saved in zip(st.params, params):
            p.copy_(saved)
    st.optimizer.load_state_dict(state["optimizer"])
    st.losses[:] = [float(x) for x in state["losses"]]
    torch.set_rng_state(state["rng"].cpu())
    if "cuda_rng" in state and st.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), st.device)
    if "scaler" in state and st.scaler is not None:
        st.scaler.load_state_dict(state["scaler"])
