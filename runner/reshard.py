"""Offline resharding: resume a checkpoint written by another plan of the same model.

A checkpoint's COMPLETE marker records the layout of every parameter under the plan that wrote it
(`layout_of`: Full or Shard(dim) with its integer sizes, and which optimizer state entries are
shaped like the parameter) and the SHA-256 of every rank file. A rank of the new plan builds the
resharding table of engine.elastic.reshard over every parameter and every sharded optimizer state tensor
(Adam's exp_avg and exp_avg_sq, SGD's momentum buffer), takes its own rows, opens only the old
rank files those rows name (hash checked, `torch.load(weights_only=True, mmap=True)`: nothing is
unpickled, only the pages of the slices read are touched) and assembles its local parameters and
optimizer state. State that is not shaped like its parameter (Adam's `step`) is the same on every
rank and is copied. The losses so far come along; the step counter continues, and since batches
are a function of (seed, step) and the global batch, training continues exactly as before.

A marker of another model, a layout inconsistent with itself or with this plan's model, a rank
file whose hash or slice shapes do not match the marker: refused with one line (CheckpointError).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.elastic.reshard import Box, Layout, ReshardTable, TensorMove, numel, reshard_table
from engine.errors import PlanError
from engine.spmd.plan import Plan

from .checkpoint import CheckpointError, hash_file, rank_file
from .program import sizes_of
from .train import RankState
from .zero import full_view, layout_state

STATE_SEP = "#"
"""Table name of an optimizer state tensor: `<parameter>#<state key>`."""


def layout_of(plan: Plan, st: RankState) -> dict[str, Any]:
    """The layout record a checkpoint marker keeps: every parameter's shape and split, and its state keys."""
    params = []
    for i, ((node, form), p) in enumerate(zip(st.program.params, st.params)):
        state, shape = layout_state(st, i, p)  # a staged weight's state as a stage-0 run keeps it (runner.zero)
        sharded = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape == shape)
        params.append({"name": plan.graph[node].attrs["target"], "shape": list(plan.graph[node].shape), "dim": form,
                       "sizes": list(sizes_of(plan, node, form)) if form >= 0 else [], "itemsize": p.element_size(),
                       "sharded_state": sharded, "replicated_state": sorted(k for k in state if k not in sharded)})
    return {"world_size": plan.world_size, "devices": list(plan.device_names), "params": params}


@dataclass(frozen=True)
class OldParam:
    """One parameter as the old plan held it: its index in the old rank files and its layout."""

    index: int
    shape: tuple[int, ...]
    layout: Layout
    itemsize: int
    sharded_state: tuple[str, ...]
    replicated_state: tuple[str, ...]


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise CheckpointError(f"checkpoint layout: {what} is not a list of integers (tampered marker?)")
    return value


def _keys(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise CheckpointError(f"checkpoint layout: {what} is not a list of names (tampered marker?)")
    return tuple(value)


def old_params(marker: dict[str, Any], plan: Plan) -> dict[str, OldParam]:
    """The old plan's parameters by name, checked against themselves and against this plan's model."""
    layout = marker.get("layout")
    if not isinstance(layout, dict) or not isinstance(layout.get("params"), list):
        raise CheckpointError("checkpoint marker has no layout to reshard from; resume it with the plan that wrote it")
    world = layout.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"checkpoint layout: world_size {world!r} is not a positive integer (tampered marker?)")
    out: dict[str, OldParam] = {}
    for i, rec in enumerate(layout["params"]):
        if not isinstance(rec, dict) or not isinstance(rec.get("name"), str) or rec["name"] in out:
            raise CheckpointError(f"checkpoint layout: parameter {i} has no name or a repeated one (tampered marker?)")
        name = rec["name"]
        shape = tuple(_ints(rec.get("shape"), f"{name} shape"))
        dim = rec.get("dim")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise CheckpointError(f"checkpoint layout: {name} dim {dim!r} is not an integer (tampered marker?)")
        lay = Layout(world, dim, tuple(_ints(rec.get("sizes"), f"{name} sizes")) if dim >= 0 else ())
        try:
            lay.check(name, shape)
        except PlanError as e:
            raise CheckpointError(f"checkpoint layout: {e} (tampered marker?)") from None
        itemsize = rec.get("itemsize", 4)
        out[name] = OldParam(i, shape, lay, itemsize if isinstance(itemsize, int) and itemsize > 0 else 4,
                             _keys(rec.get("sharded_state", []), f"{name} sharded_state"),
                             _keys(rec.get("replicated_state", []), f"{name} replicated_state"))
    mine = {plan.graph[n].attrs["target"]: tuple(plan.graph[n].shape) for n, _ in _param_leaves(plan)}
    if set(mine) != set(out):
        extra, lacking = sorted(set(out) - set(mine)), sorted(set(mine) - set(out))
        raise CheckpointError(f"checkpoint holds other parameters than this plan's model (only in the checkpoint: "
                              f"{extra[:3]}, only in the plan: {lacking[:3]})")
    for name, shape in mine.items():
        if out[name].shape != shape:
            raise CheckpointError(f"checkpoint layout: {name} has shape {list(out[name].shape)}, this plan's model "
                                  f"{list(shape)} (tampered marker?)")
    return out


def _param_leaves(plan: Plan) -> list[tuple[int, int]]:
    """(node, form) of every parameter LOAD of the plan, in program order (the order of RankProgram.params)."""
    from engine.spmd.program import LOAD

    return [(i.node, i.post) for i in plan.program if i.kind == LOAD and plan.graph[i.node].op == "parameter"]


def new_layout(plan: Plan, node: int, form: int) -> Layout:
    return Layout(plan.world_size, form, tuple(sizes_of(plan, node, form)) if form >= 0 else ())


def table_of(marker: dict[str, Any], plan: Plan) -> tuple[ReshardTable, dict[str, OldParam]]:
    """The fused table from the checkpoint's plan to `plan`, over parameters and sharded optimizer state."""
    old = old_params(marker, plan)
    moves = []
    for node, form in _param_leaves(plan):
        rec = old[plan.graph[node].attrs["target"]]
        lay = new_layout(plan, node, form)
        name = plan.graph[node].attrs["target"]
        for suffix in ("", *(STATE_SEP + k for k in rec.sharded_state)):
            moves.append(TensorMove(name + suffix, rec.shape, rec.layout, lay, rec.itemsize))
    try:
        return reshard_table(moves), old
    except PlanError as e:
        raise CheckpointError(f"checkpoint layout: {e} (tampered marker?)") from None


class OldFiles:
    """The old ranks' files, each opened on first use: hash checked, memory-mapped, never unpickled."""

    def __init__(self, root: str | Path, steps: int, marker: dict[str, Any], old: dict[str, OldParam]) -> None:
        self.root, self.steps, self.old = root, steps, old
        self.hashes = marker.get("files") if isinstance(marker.get("files"), dict) else {}
        self.count = len(old)
        self.opened: dict[int, dict[str, Any]] = {}

    def state(self, rank: int) -> dict[str, Any]:
        if rank not in self.opened:
            path = rank_file(self.root, self.steps, rank)
            if not path.is_file():
                raise CheckpointError(f"{path} missing: the checkpoint to reshard from is incomplete")
            expected = self.hashes.get(str(rank))
            if expected is None or hash_file(path) != expected:
                why = "no hash is recorded for it" if expected is None else "its SHA-256 differs from the marker's"
                raise CheckpointError(f"{path}: {why} (tampered or corrupt checkpoint); resume from another one")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
                raise CheckpointError(f"{path}: not a tensors-only rank file, refused without unpickling it "
                                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
            if not _well_formed(state, self.steps, self.count):
                raise CheckpointError(f"{path}: not the rank file of step {self.steps} with {self.count} parameters, "
                                      "their optimizer state, the losses so far and an RNG state")
            self.opened[rank] = state
        return self.opened[rank]

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        """Old rank `rank`'s local piece of table tensor `name` (a parameter or `<parameter>#<state key>`)."""
        param, _, key = name.partition(STATE_SEP)
        rec = self.old[param]
        state = self.state(rank)
        if key:
            t = state["optimizer"]["state"].get(rec.index, {}).get(key)
        else:
            t = state["params"][rec.index]
        want = tuple(b - a for a, b in rec.layout.region(rank, rec.shape))
        if not torch.is_tensor(t) or tuple(t.shape) != want:
            got = list(t.shape) if torch.is_tensor(t) else type(t).__name__
            raise CheckpointError(f"{rank_file(self.root, self.steps, rank)}: {name} is {got}, its layout says "
                                  f"{list(want)} (tampered checkpoint)")
        return t


def _well_formed(state: Any, steps: int, count: int) -> bool:
    """Whether a loaded rank file has the fields resharding reads, of the right kinds."""
    if not isinstance(state, dict) or state.get("steps_done") != steps:
        return False
    params, opt, losses = state.get("params"), state.get("optimizer"), state.get("losses")
    return (isinstance(params, list) and len(params) == count and isinstance(opt, dict)
            and isinstance(opt.get("state"), dict) and all(isinstance(v, dict) for v in opt["state"].values())
            and isinstance(losses, list) and len(losses) == steps and torch.is_tensor(state.get("rng")))


def _within(box: Box, region: Box) -> tuple[slice, ...]:
    """`box` as slices of the local piece that holds `region`."""
    return tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(box, region))


def load_resharded(root: str | Path, steps: int, marker: dict[str, Any], plan: Plan, rank: int,
                   st: RankState) -> ReshardTable:
    """Fill `st` (this rank of `plan`) from another plan's checkpoint; returns the table it followed
    (sharded states sliced from the whole ones, runner.zero.full_view)."""
    with full_view(st) as st:
        return _load_resharded(root, steps, marker, plan, rank, st)


def _load_resharded(root: str | Path, steps: int, marker: dict[str, Any], plan: Plan, rank: int,
                    st: RankState) -> ReshardTable:
    table, old = table_of(marker, plan)
    files = OldFiles(root, steps, marker, old)
    rows: dict[str, list] = {}
    for t in table.for_receiver(rank):
        rows.setdefault(t.tensor, []).append(t)
    senders = sorted({t.sender for rows_of in rows.values() for t in rows_of})
    home = senders[0] if senders else rank % table.old_world  # replicated state, losses, RNG: a file read anyway
    opt_state: dict[int, dict[str, Any]] = {}
    for i, ((node, form), p) in enumerate(zip(st.program.params, st.params)):
        name = plan.graph[node].attrs["target"]
        rec = old[name]
        region = new_layout(plan, node, form).region(rank, rec.shape)
        with torch.no_grad():
            p.copy_(_assemble(files, rows.get(name, []), region, p))
        entry = {k: _assemble(files, rows.get(name + STATE_SEP + k, []), region, p) for k in rec.sharded_state}
        replicated = files.state(home)["optimizer"]["state"].get(rec.index, {})
        entry.update({k: replicated[k] for k in rec.replicated_state if k in replicated})
        if entry:
            opt_state[i] = entry
    sd = st.optimizer.state_dict()
    st.optimizer.load_state_dict({"state": opt_state, "param_groups": sd["param_groups"]})
    st.losses[:] = [float(x) for x in files.state(home)["losses"]]
    torch.set_rng_state(files.state(home)["rng"].cpu())
    if "scaler" in files.state(home) and st.scaler is not None:  # fp16's loss scale: the same on every rank
        st.scaler.load_state_dict(files.state(home)["scaler"])
    return table


def _assemble(files: OldFiles, rows: list, region: Box, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of one tensor, from the table rows naming it (they tile `region` exactly)."""
    if sum(numel(t.box) for t in rows) != numel(region):
        raise CheckpointError("the resharding table does not cover this rank's piece (a layout bug): report it")
    out = torch.empty(like.shape, dtype=like.dtype, device="cpu")
    for t in rows:
        rec = files.old[t.tensor.partition(STATE_SEP)[0]]
        src = files.tensor(t.sender, t.tensor)
        out[_within(t.box, region)] = src[_within(t.box, rec.layout.region(t.sender, rec.shape))]
    return out.to(like.device)


# ----------------------------------------------------------------------------- online: point to point


def plan_moves(old: Plan, new: Plan, state_keys: tuple[str, ...] = ()) -> list[TensorMove]:
    """The table's tensors from `old` to `new` (same model): every parameter and, per key in
    `state_keys` (e.g. Adam's exp_avg, exp_avg_sq), its optimizer state `<parameter>#<key>`."""
    if old.model_fingerprint != new.model_fingerprint:
        raise PlanError("the two plans are of different models (their fingerprints differ): a switch keeps the model")
    before = {old.graph[n].attrs["target"]: new_layout(old, n, f) for n, f in _param_leaves(old)}
    moves = []
    for node, form in _param_leaves(new):
        name, shape = new.graph[node].attrs["target"], tuple(new.graph[node].shape)
        for suffix in ("", *(STATE_SEP + k for k in state_keys)):
            moves.append(TensorMove(name + suffix, shape, before[name], new_layout(new, node, form)))
    return moves


def exchange(table: ReshardTable, moves: list[TensorMove], old_pieces: dict[str, torch.Tensor] | None,
             rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Online resharding over the current process group, where process p is old rank p (p < old world)
    and new rank p (p < new world): each row of the table is sent once, point to point, by its
    sender to its receiver (a copy when they are one process). `old_pieces` are this process's
    pieces under the old plan (None: it is no old rank); returns its pieces under the new plan
    (empty: it is no new rank). Every process walks the table in the same order, so the messages
    between two processes pair up."""
    by_name = {m.name: m for m in moves}
    out = {m.name: torch.empty([b - a for a, b in m.new.region(rank, m.shape)], dtype=dtype)
           for m in moves} if rank < table.new_world else {}
    pending, received = [], []
    for t in table.transfers:
        m = by_name[t.tensor]
        if t.sender == rank:
            if old_pieces is None:
                raise PlanError(f"process {rank} is old rank {rank} of the table but holds no old pieces")
            piece = old_pieces[t.tensor][_within(t.box, m.old.region(rank, m.shape))]
            if t.receiver == rank:
                out[t.tensor][_within(t.box, m.new.region(rank, m.shape))] = piece
            else:
                sent = piece.contiguous()  # kept alive in `pending` until its send completes
                pending.append((dist.isend(sent, t.receiver), sent))
        elif t.receiver == rank:
            buf = torch.empty([b - a for a, b in t.box], dtype=dtype)
            pending.append((dist.irecv(buf, t.sender), buf))
            received.append((t, buf))
    for req, _ in pending:
        req.wait()
    for t, buf in received:
        m = by_name[t.tensor]
        out[t.tensor][_within(t.box, m.new.region(rank, m.shape))] = buf
    return out
