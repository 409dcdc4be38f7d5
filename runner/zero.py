"""Sharded states of Full weights (ZeRO stages 1-3, uneven): the plan's `shard_states` on one rank.

For every staged weight (`engine.spmd.zero`) the rank keeps a flat slice of its flattened elements,
`sizes[rank]` of them from offset `sum(sizes[:rank])` (the plan's integer sizes), and the optimizer
steps that slice only, so Adam's moments exist for the slice only:

- stage 1: the full gradient is kept until backward ends, then reduce-scattered (uneven, padded by the
  list reduce-scatter) into the slice's gradient; after the step the updated slices are all-gathered
  into the full weight the program uses. The same bytes as the all-reduce it replaces, and like it
  in one bucket (`RankBucket`): one reduce-scatter for every such gradient, one all-gather for
  every updated weight (stages 1 and 2), not a collective's latency per weight.
- stage 2: the same, but the gradients are reduce-scattered during backward as autograd finishes them
  (a post-accumulate-grad hook), in buckets sent as soon as they hold `STAGE2_BUCKET_BYTES`, and
  the full gradients freed; what is left joins the bucket after backward.
- stage 3: the slice is the parameter at rest. Before the forward pass all are all-gathered in one
  bucket by an autograd Function whose backward reduce-scatters their gradients into the slices in
  one bucket; the gathered weights are not kept for backward: saved-tensor hooks pack them as a
  reference, and when backward first reads a weight of a layer (the graph's `segment`), every stage-3
  weight of that layer is all-gathered again in one bucket, as FSDP gathers a wrapped module. (They stay
  alive until the forward pass ends, and the backward ones until backward ends, a CPU-runner
  simplification; the engine prices FSDP's per-layer transient.)

Adam is element-wise, so stepping slices of the summed gradient is exactly stepping the whole
weight: `hap run --verify` matches single-device training to fp32 tolerance. Checkpoints keep the
stage-0 format (`full_view`: weights and optimizer state gathered whole), so resume and resharding
onto another plan (another device count, other stages) work unchanged.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from engine.spmd.plan import Plan
from engine.spmd.zero import STAGE2_BUCKET_BYTES
from engine.theory.core import FULL

from .collectives import FlatBuffer, gather_padded, reduce_scatter_uneven, run_collective


@dataclass
class StagedParam:
    """One staged weight on this rank."""

    index: int
    """Its position in the rank's parameter list."""
    stage: int
    sizes: list[int]
    """Flattened elements on every rank."""
    shape: torch.Size
    """The whole weight's shape."""
    slice: torch.nn.Parameter
    """This rank's flat slice: what the optimizer steps (stage 3: the weight at rest)."""
    full: torch.nn.Parameter | None = None
    """Stages 1 and 2: the whole weight the program reads."""
    name: str = ""
    layer: int = 0
    """The graph's segment of the weight: stage 3 gathers a layer's weights again together in backward."""

    @property
    def offset(self) -> int:
        return sum(self.sizes[:dist.get_rank()])

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole tensor of every rank's flat slice `flat` (padded all-gather), in the weight's shape."""
        return run_collective("all_gather", self.name, gather_padded, flat.detach().contiguous(), 0,
                              self.sizes).view(self.shape)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's flat slice of a whole tensor (no communication)."""
        return whole.reshape(-1)[self.offset:self.offset + self.sizes[dist.get_rank()]].clone()


@dataclass
class RankBucket:
    """Several staged weights' flat tensors in one collective: laid out rank-major (every weight's
    slice of rank 0, then of rank 1, ...), so rank r's part of the bucket is its slices end to end
    and one uneven reduce-scatter or all-gather moves them all. Kept across steps (`FlatBuffer`)."""

    buffer: FlatBuffer = field(default_factory=FlatBuffer)

    @staticmethod
    def totals(staged: list[StagedParam]) -> list[int]:
        """Each rank's part of the bucket: its slices of every weight."""
        return [sum(sp.sizes[r] for sp in staged) for r in range(len(staged[0].sizes))]

    def scatter(self, staged: list[StagedParam], wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's slice of the sum over ranks of each whole tensor, with one reduce-scatter."""
        ranks = range(len(staged[0].sizes))
        pieces = [w.reshape(-1).split(sp.sizes)[r] for r in ranks for sp, w in zip(staged, wholes)]
        mine = run_collective("reduce_scatter", "states", reduce_scatter_uneven, self.buffer.cat(pieces), 0,
                              self.totals(staged))
        return list(mine.split([sp.sizes[dist.get_rank()] for sp in staged]))

    @staticmethod
    def gather(staged: list[StagedParam], flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every weight whole, in its shape, from this rank's flat slices `flats`, with one all-gather."""
        totals = RankBucket.totals(staged)
        mine = torch.cat([f.detach().reshape(-1) for f in flats])
        every = run_collective("all_gather", "states", gather_padded, mine, 0, totals).split(totals)
        per_rank = [part.split([sp.sizes[r] for sp in staged]) for r, part in enumerate(every)]
        return [torch.cat([per_rank[r][i] for r in range(len(totals))]).view(sp.shape)
                for i, sp in enumerate(staged)]


class _GatherAll(torch.autograd.Function):
    """The stage-3 weights before forward: every one gathered whole from its slices in one bucket;
    backward reduce-scatters their gradients into the slices in one bucket (the dual)."""

    @staticmethod
    def forward(ctx, staged: list[StagedParam], states: "RankStates", *flats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.staged, ctx.states = staged, states
        return tuple(RankBucket.gather(staged, list(flats)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.states.regathered.clear()  # backward is done with every weight
        wholes = [sp.slice.new_zeros(sp.shape) if g is None else g for sp, g in zip(ctx.staged, grads)]
        return (None, None, *ctx.states.bucket3.scatter(ctx.staged, wholes))


@dataclass
class RankStates:
    """The staged weights of one rank and how to run them."""

    staged: list[StagedParam]
    build_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    """The run's optimizer class and settings over given tensors (set by `runner.api.ParallelModel.optimizer`;
    `runner.optim.build` until then)."""
    live: dict[int, tuple[torch.Tensor, StagedParam]] = field(default_factory=dict)
    """Stage-3 weights gathered in the running forward pass, by storage address."""
    bucket: RankBucket = field(default_factory=RankBucket)
    """The gradients reduce-scattered after backward, kept from step to step."""
    bucket3: RankBucket = field(default_factory=RankBucket)
    """The stage-3 gradients, reduce-scattered when backward reaches the gather."""
    pending: list[tuple[StagedParam, torch.Tensor]] = field(default_factory=list)
    """Stage-2 gradients finished in this backward and not yet sent."""
    backward_buckets: list[RankBucket] = field(default_factory=list)
    """The buckets of stage-2 gradients sent during backward, in order (each kept from step to step)."""
    sent: int = 0
    """Buckets sent in this backward so far."""
    regathered: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Stage-3 weights gathered again in the running backward pass, by layer and then parameter index."""

    def by_index(self) -> dict[int, StagedParam]:
        return {sp.index: sp for sp in self.staged}

    # --- forward and backward ---------------------------------------------------------------
    def program_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors the program reads: stage-3 weights gathered (and remembered for `saving`)."""
        out = list(params)
        three = [sp for sp in self.staged if sp.stage == 3]
        if not three:
            return out
        self.regathered.clear()  # a backward that did not end (an error, a forward without one) keeps none
        for sp, whole in zip(three, _GatherAll.apply(three, self, *[sp.slice for sp in three])):
            self.live[whole.untyped_storage().data_ptr()] = (whole, sp)
            out[sp.index] = whole
        return out

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """While forward runs: gathered stage-3 weights that autograd saves are kept as a reference and
        gathered again when backward unpacks them; they are freed when forward ends."""
        if not any(sp.stage == 3 for sp in self.staged):
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.live.clear()

    def _pack(self, t: torch.Tensor) -> Any:
        hit = self.live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if hit is None:
            return t
        return hit[1], tuple(t.size()), tuple(t.stride()), t.storage_offset()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        sp, size, stride, offset = packed
        return self._regathered(sp).as_strided(size, stride, offset)

    def _regathered(self, sp: StagedParam) -> torch.Tensor:
        """`sp` whole again in backward: its layer's stage-3 weights are all gathered in one bucket the first
        time backward reads one of them, and kept until backward ends (`regathered`)."""
        if sp.layer not in self.regathered:
            layer = [s for s in self.staged if s.stage == 3 and s.layer == sp.layer]
            wholes = RankBucket.gather(layer, [s.slice for s in layer])
            self.regathered[sp.layer] = {s.index: w for s, w in zip(layer, wholes)}
        return self.regathered[sp.layer][sp.index]

    def _stage2_hook(self, sp: StagedParam):
        def hook(p: torch.Tensor) -> None:  # every rank runs the same program: the same order of hooks
            self.pending.append((sp, p.grad))
            p.grad = None
            if sum(g.numel() * g.element_size() for _, g in self.pending) >= STAGE2_BUCKET_BYTES:
                if self.sent == len(self.backward_buckets):
                    self.backward_buckets.append(RankBucket())
                self._send(self.backward_buckets[self.sent], self.pending)
                self.sent, self.pending = self.sent + 1, []
        return hook

    def _send(self, bucket: RankBucket, items: list[tuple[StagedParam, torch.Tensor]]) -> None:
        """Reduce-scatter whole gradients in one bucket and add this rank's slices to the slices' gradients."""
        staged = [sp for sp, _ in items]
        for sp, g in zip(staged, bucket.scatter(staged, [g for _, g in items])):
            self._accumulate(sp, g)

    @staticmethod
    def _accumulate(sp: StagedParam, g: torch.Tensor) -> None:
        sp.slice.grad = g if sp.slice.grad is None else sp.slice.grad + g

    def reduce_gradients(self) -> None:
        """After backward: reduce-scatter the gradients still whole (stage 1, the stage-2 ones not sent yet;
        stage 2 set by duplex) into the slices, in one bucket; a weight unused on this rank contributes zeros."""
        todo = [sp for sp in self.staged if sp.stage != 3 and (sp.full.grad is not None or sp.stage == 1)]
        items = self.pending + [(sp, sp.full.grad if sp.full.grad is not None else torch.zeros_like(sp.full))
                                for sp in todo]
        self.pending, self.sent = [], 0
        if items:
            self._send(self.bucket, items)
        for sp in todo:
            sp.full.grad = None

    def gather_updated(self) -> None:
        """After the step: every rank's updated slices all-gathered into the whole weights (stages 1, 2),
        in one bucket."""
        todo = [sp for sp in self.staged if sp.full is not None]
        if not todo:
            return
        with torch.no_grad():
            for sp, whole in zip(todo, RankBucket.gather(todo, [sp.slice for sp in todo])):
                sp.full.copy_(whole)

    # --- whole values (verify, checkpoints) -------------------------------------------------
    def whole(self, index: int, p: torch.Tensor) -> torch.Tensor:
        """The whole weight at `index` (a collective for stage 3: call it on every rank)."""
        sp = self.by_index().get(index)
        return sp.gather(sp.slice) if sp is not None and sp.stage == 3 else p.detach()


def apply_states(plan: Plan, st: Any, build_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 ) -> RankStates | None:
    """Stage the plan's staged weights on this rank: slices, hooks, and an optimizer over the slices
    (in the order of `st.params`, so its state dict indexes match a stage-0 run's). None without any."""
    record = plan.shard_states
    if not record:
        return None
    if plan.overlap == "duplex" and 3 in record["stages"].values():
        raise ValueError("shard_states 3 does not run with overlap duplex (two streams over one gathered weight); "
                         "re-plan with --overlap ddp")
    states = RankStates([], build_optimizer)
    for i, (node, form) in enumerate(st.program.params):
        name = plan.graph[node].name
        if form != FULL or name not in record["stages"]:
            continue
        full = st.params[i]
        sizes = [int(x) for x in record["sizes"][name]]
        sp = StagedParam(i, int(record["stages"][name]), sizes, full.shape, None, name=name,  # type: ignore[arg-type]
                         layer=plan.graph[node].segment)
        sp.slice = torch.nn.Parameter(sp.mine(full.detach()))
        if sp.stage == 3:
            st.params[i] = sp.slice
        else:
            sp.full = full
            if sp.stage == 2:
                full.register_post_accumulate_grad_hook(states._stage2_hook(sp))
        st.full_params[i] = False  # not in the all-reduce bucket: reduce-scattered instead
        states.staged.append(sp)
    by = states.by_index()
    st.optimizer = build_optimizer([by[i].slice if i in by else p for i, p in enumerate(st.params)])
    return states


def optimizer_params(st: Any) -> list[torch.Tensor]:
    """The tensors the rank's optimizer steps, in the order of `st.params`."""
    if st.zero is None:
        return list(st.params)
    by = st.zero.by_index()
    return [by[i].slice if i in by else p for i, p in enumerate(st.params)]


def layout_state(st: Any, index: int, p: torch.Tensor) -> tuple[dict[str, Any], torch.Size]:
    """(optimizer state of parameter `index` as a stage-0 run keeps it, only shapes meaningful; the whole
    weight's local shape): what `runner.reshard.layout_of` records, without communication."""
    sp = None if st.zero is None else st.zero.by_index().get(index)
    if sp is None:
        return st.optimizer.state.get(p, {}), p.shape
    state = st.optimizer.state.get(sp.slice, {})
    return {k: torch.empty(sp.shape, device="meta") if torch.is_tensor(v) and v.dim() >= 1 else v
            for k, v in state.items()}, sp.shape


@contextlib.contextmanager
def full_view(st: Any) -> Iterator[Any]:
    """The rank state as a stage-0 run holds it (whole weights, an optimizer over them with whole state),
    for saving and loading checkpoints; what is loaded into it is sliced back on exit. Collective:
    every rank enters it."""
    if st.zero is None:
        yield st
        return
    z: RankStates = st.zero
    by = z.by_index()
    params = [torch.nn.Parameter(z.whole(i, p)) if i in by and by[i].stage == 3 else p for i, p in enumerate(st.params)]
    opt = z.build_optimizer(params)
    sd = st.optimizer.state_dict()
    opt.load_state_dict({"state": {i: _map(v, by.get(i), whole=True) for i, v in sd["state"].items()},
                         "param_groups": sd["param_groups"]})
    yield replace(st, params=params, optimizer=opt)
    sd = opt.state_dict()
    st.optimizer.load_state_dict({"state": {i: _map(v, by.get(i), whole=False) for i, v in sd["state"].items()},
                                  "param_groups": sd["param_groups"]})
    with torch.no_grad():
        for sp in z.staged:
            sp.slice.copy_(sp.mine(params[sp.index].detach()))


def _map(state: dict[str, Any], sp: StagedParam | None, *, whole: bool) -> dict[str, Any]:
    """One parameter's optimizer state gathered whole (`whole`) or sliced back; unchanged if not staged."""
    if sp is None:
        return state
    out = {}
    for k, v in state.items():
        if torch.is_tensor(v) and v.dim() >= 1:
            v = sp.gather(v) if whole else sp.mine(v)
        out[k] = v
    return out
