"""Measured timeline of one rank, and emulated device speed (for heterogeneity on one CPU box).

**Timeline.** A `Pacer` splits each training step into segments, in the order they happen:
`compute` (attributed to the instruction that ran it), `comm` (one collective, forward or
backward, *including the time spent waiting for slower ranks*) and `emulated` (see below). Every
collective of `runner.collectives` reports to it; with `--timing` the rank's program also carries
a `probe` after each compute instruction, which attributes forward time to the instruction just
finished and backward time to the instruction whose gradient is being computed (the autograd
engine runs a CPU backward on the calling thread, highest sequence number first, so the backward
of one instruction runs between its probe and the next event). Phases: `fwd`, `bwd`, `step`
(gradient all-reduce and optimizer step). This is the measured counterpart of the plan's stage
records (HAP §3.2: a stage is a collective plus the computation up to the next one).

**Emulated speed.** A rank of speed factor f (0 < f <= 1) must take 1/f times as long for every
computation. The pacer measures the computation c the rank actually did since the last
collective (a *window*) and, just before the next collective (and at the end of the step),
sleeps until the window has lasted c / f. No communication happens inside a window, so this is
the same as stretching every compute instruction, forward and backward, but costs one sleep per
stage instead of one per instruction. Computation is measured as CPU time of the calling thread
(`time.thread_time`): on a CPU box shared by several ranks the wall time of a computation
includes waiting for a core, the CPU time does not. Padding the window to c / f (rather than
adding (1/f - 1) c) lets that waiting count toward the slow-down instead of adding to it, so
the emulation stays exact while no more than 1/f ranks share a core (4 ranks of speed <= 0.5 on
2 cores); sleeping leaves the cores to the other ranks. Hence the launcher pins one intra-op
thread per rank on CPU. On CUDA the pacer synchronises the device at each boundary and uses wall
time (c is then the window's wall time, and the pad (1/f - 1) c).

**Duplex.** The two half-batch streams of a rank (runner.duplex) each get a pacer of their own
(`half()`), on their own thread, sharing one lock that stands for the device: a stream computes
only while it holds it, so the halves' computations (and emulated pads) take turns while one's
collectives overlap the other's computation. Their summaries go into the rank's step record
under `halves`.

**Measured MFU.** With `--timing`, rank 0 ends with `mfu_line`: the steady step time (median of the
steps after the first) and the model FLOPs utilisation it gives against the same peaks the plan's
predicted MFU uses: model FLOPs per iteration / (measured step x the plan's summed peak FLOP/s),
`engine.spmd.utilisation`.

**Emulated link.** `EmulatedLink` pads each collective to its fitted time under a cluster's
collective fits: a slow network on one box, where gloo's links are almost free (benches).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from engine.spmd.utilisation import percent

from . import collectives

OTHER = "(other)"
_active: "Pacer | None" = None


class Pacer:
    """Timeline recorder and speed emulator of one rank for one run; `install()` it before training."""

    def __init__(self, speed: float = 1.0, *, record: bool = False, sync: Callable[[], None] | None = None,
                 device: "threading.Lock | None" = None, link: "EmulatedLink | None" = None) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"speed factor must be in (0, 1], got {speed}")
        self.speed, self.stretch, self.record = speed, 1.0 / speed - 1.0, record
        self.sync = sync if (record or self.stretch > 0) else None
        self.work_clock = time.thread_time if sync is None else time.perf_counter
        self.phase, self.segments = "fwd", []
        self.totals = {"compute": 0.0, "comm": 0.0, "emulated": 0.0, "aside": 0.0}
        """Seconds of this step by kind; `aside` is work outside the plan's step (`aside`)."""
        self._aside = False
        self._t0 = self._open = time.perf_counter()
        self._start_window()
        self._owner = OTHER
        self._halves: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        """The summary of the last finished step (`end_step`)."""
        self.device = device
        """Duplex: the rank's one device, shared by the pacers of its two half-batch streams. A
        stream holds it while it computes (and while it pays its emulated time) and lets it go
        for each collective, so the halves' computations take turns, as on one GPU, and one's
        communication overlaps the other's computation. Waiting for it counts as comm."""
        self._holding = False
        self.link = link
        """Emulated network (`EmulatedLink`): every collective lasts at least its fitted time."""

    def half(self) -> "Pacer":
        """A pacer for one duplex stream of this rank: same speed and recording, and the rank's
        device lock (made on the first call)."""
        if self.device is None:
            self.device = threading.Lock()
        return Pacer(self.speed, record=self.record, sync=self.sync, device=self.device, link=self.link)

    def install(self) -> "Pacer":
        global _active
        _active = self
        collectives.set_observer(self)
        return self

    def uninstall(self) -> None:
        global _active
        _active = None
        collectives.set_observer(None)

    # --- step structure ---------------------------------------------------------------------
    def begin_step(self) -> None:
        self._sync()
        self.phase, self.segments, self._owner = "fwd", [], OTHER
        self.totals = dict.fromkeys(self.totals, 0.0)
        self._halves = []
        self._t0 = self._open = time.perf_counter()
        self._start_window()

    def hold_device(self) -> None:
        """A duplex stream (re)starts computing: wait for the device (the wait counts as comm)."""
        self._close("compute", self._owner)
        self._acquire()
        self._close("comm", "(device busy)")
        self._start_window()

    def pause_device(self) -> None:
        """A duplex stream stops computing for a while: pay its emulated time, let the device go."""
        self._pay()
        self._close("compute", self._owner)
        self.release_device()

    def release_device(self) -> None:
        """Let the device go (a no-op when this stream does not hold it)."""
        if self._holding:
            self._holding = False
            self.device.release()

    def _acquire(self) -> None:
        if self.device is not None:
            self.device.acquire()
            self._holding = True

    def absorb(self, label: str, halves: "list[Pacer]") -> None:
        """The duplex halves just ran on other threads: record their wall time as one segment
        (their own totals go into this step's summary, `end_step`) and restart the window, so this
        thread pays no emulated time for computation it did not do."""
        self._close("compute", label)
        self._halves = [h.last for h in halves]
        self._start_window()

    def set_phase(self, phase: str) -> None:
        self._close("compute", self._owner)
        self.phase, self._owner = phase, OTHER

    def end_step(self) -> dict[str, Any]:
        """Pay the last stage's emulated time; the step's totals (and timeline with `record`)."""
        self._pay()
        self._close("compute", self._owner)
        out: dict[str, Any] = {f"{k}_s": v for k, v in self.totals.items()}
        if self.record:
            out["timeline"] = self.segments
        if self._halves:
            out["halves"] = self._halves
        self.last = out
        return out

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Work that is not part of the planned step (a gradient norm computed only to be reported):
        it pays no emulated slow-down, its collectives are not padded, and its time is counted
        apart (`aside_s`) so that the step's time is the one the plan predicts."""
        self._pay()
        self._close("compute", self._owner)
        self._aside = True
        try:
            yield
        finally:
            self._aside = False
            self._close("aside", "reported gradient norm")
            self._owner = OTHER
            self._start_window()

    # --- events -----------------------------------------------------------------------------
    @contextmanager
    def comm(self, name: str, tag: str, args: tuple = ()) -> Iterator[None]:
        """One collective (`args`: its arguments, which an emulated link prices)."""
        if self._aside:
            yield
            return
        self._pay()
        self._close("compute", self._owner)
        held = self._holding
        self.release_device()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.link is not None:
                self.link.pad(name, args, start)
            if held:
                self._acquire()
            self._close("comm", f"{name}({tag})" if tag else name)
            self._owner = OTHER
            self._start_window()

    def instruction_done(self, label: str) -> None:
        """Forward: the time since the last event was this instruction's."""
        self._close("compute", label)
        self._owner = OTHER

    def instruction_backward(self, label: str) -> None:
        """Backward: what runs from now until the next event is this instruction's backward."""
        self._close("compute", self._owner)
        self._owner = label

    # --- internals --------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.sync is not None:
            self.sync()

    def _pay(self) -> None:
        """Sleep until the window since the last collective has lasted 1/f x its computation."""
        if self.stretch <= 0:
            return
        self._sync()
        self._close("compute", self._owner)
        extra = (self.work_clock() - self._work0) / self.speed - (time.perf_counter() - self._wall0)
        if extra > 0:
            time.sleep(extra)
        self._close("emulated", "")
        self._start_window()

    def _start_window(self) -> None:
        self._work0, self._wall0 = self.work_clock(), time.perf_counter()

    def _close(self, kind: str, name: str) -> None:
        if self.record or kind != "compute":
            self._sync()
        now = time.perf_counter()
        dur = now - self._open
        self.totals[kind] += dur
        if self.record and (dur > 0 and (kind != "compute" or name != OTHER or dur > 1e-6)):
            self.segments.append({"phase": self.phase, "kind": kind, "name": name,
                                  "start_s": self._open - self._t0, "s": dur})
        self._open = now


class EmulatedLink:
    """A slower network on one box (benches): each collective is padded by sleeping until it has
    lasted `latency + payload / bandwidth` of the cluster's fit for it (engine.cluster payloads:
    the whole tensor for all-reduce, the largest shard for all-gather, reduce-scatter and
    all-to-all, one broadcast per shard for a grouped all-gather). A gradient bucket launched
    asynchronously is padded when it is waited for: it ends no earlier than its launch, or the
    end of the bucket before it on the link, plus its time."""

    def __init__(self, cluster: Any) -> None:
        from engine import load_cluster

        self.cluster = load_cluster(cluster)
        self.bucket_end = 0.0

    def seconds(self, name: str, args: tuple) -> float:
        """The fitted time of the collective `name` on these arguments (runner.collectives' calls)."""
        fits = self.cluster.collectives
        x = args[0]
        if name == "all_reduce":
            return fits["all_reduce"].time(x.numel() * x.element_size())
        kind = name.split(".")[0]
        dim, sizes = args[1], (args[3] if kind == "all_to_all" else args[2])
        row = x.element_size() * math.prod(s for d, s in enumerate(x.shape) if d != dim)
        if name == "all_gather.grouped":
            return sum(fits["broadcast"].time(row * s) for s in sizes if s > 0)
        return fits["all_to_all" if kind == "resplit" else kind].time(row * max(sizes))

    def pad(self, name: str, args: tuple, start: float) -> None:
        now = time.perf_counter()
        if name.endswith(".launch"):
            return
        if name.endswith(".wait"):  # (work, flat bucket, launch time)
            end = max(args[2], self.bucket_end) + self.seconds("all_reduce", (args[1],))
            self.bucket_end = end
        else:
            end = start + self.seconds(name, args)
        if end > now:
            time.sleep(end - now)


class _Probe(torch.autograd.Function):
    """Identity that tells the active pacer where an instruction ends (forward) or starts (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        pacer = collectives.current_observer() or _active
        if pacer is not None:
            pacer.instruction_done(label)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        pacer = collectives.current_observer() or _active
        if pacer is not None:
            pacer.instruction_backward(ctx.label)
        return g, None


def probe(x: torch.Tensor, label: str) -> torch.Tensor:
    return _Probe.apply(x, label)


def steady_step_s(step_times: list[float]) -> float:
    """The step time a run settles to: the median of the steps after the first (which pays allocation
    and warm-up), or the only step."""
    steady = step_times[1:] or step_times
    if not steady:
        raise ValueError("no step was timed")
    return statistics.median(steady)


def measured_mfu(model_flops: float, peak_flops: float | None, step_s: float) -> float | None:
    """Model FLOPs utilisation of a measured step: model FLOPs / (step seconds x summed peak FLOP/s);
    None when the peak is unknown (a plan written before plans recorded it)."""
    if not peak_flops or not step_s > 0:
        return None
    return model_flops / (step_s * peak_flops)


def mfu_line(plan: Any, step_times: list[float]) -> str:
    """What `hap run --timing` reports at the end: measured step and MFU beside the plan's predicted
    ones (`plan` of either kind: it has `utilisation` and `options`)."""
    u = plan.utilisation
    step = steady_step_s(step_times)
    which = {1: "one step", 2: "step 1"}.get(len(step_times), f"median of steps 1..{len(step_times) - 1}")
    measured = measured_mfu(u.model_flops, u.peak_flops, step)
    if measured is None:
        return (f"hap run: measured step {step * 1e3:.2f} ms ({which}); MFU unknown: the plan records no peak "
                "FLOP/s (plan it again with `hap plan`)")
    return (f"hap run: measured step {step * 1e3:.2f} ms ({which}) · MFU {percent(measured)} of "
            f"{u.peak_flops:.3g} FLOP/s summed {plan.options.precision} peak; predicted {u.iteration_s * 1e3:.2f} ms · "
            f"MFU {percent(u.mfu)}")


def speeds_from_cluster(cluster: Any) -> list[float]:
    """Speed factor of every device: its FLOP/s relative to the fastest (the fastest gets 1.0).

    `cluster` is a path, a dict or an `engine.Cluster`. A virtual device of k GPUs counts k times.
    """
    from engine import load_cluster

    c = load_cluster(cluster)
    rates = [d.flops_per_gpu * d.num_gpus for d in c.devices]
    top = max(rates)
    return [r / top for r in rates]


def parse_speeds(text: str, world_size: int, owner: str = "the plan") -> list[float]:
    """`"1,1,0.5,0.5"` -> one factor per rank (a single value applies to all ranks); `owner` has the ranks."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--speeds expects comma-separated numbers, got '{text}'") from None
    if len(values) == 1:
        values *= world_size
    if len(values) != world_size:
        raise ValueError(f"--speeds gives {len(values)} factors but {owner} has {world_size} ranks")
    bad = [v for v in values if not 0 < v <= 1]
    if bad:
        raise ValueError(f"--speeds factors must be in (0, 1] (1 = full speed, 0.5 = half), got {bad}")
    return values
