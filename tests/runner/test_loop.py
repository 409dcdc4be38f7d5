"""`runner.loop.train_step` times the planned step: a norm wanted only for the metrics is set aside."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from runner import loop, timing
from runner.optim import OptimConfig


class _Clock:
    """A fake `time` whose clocks move only when told (the step's timing, made exact)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    thread_time = perf_counter


class _Model:
    """Just what `train_step` calls: 1 s of forward and backward, 5 s of gradient norm."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.pacer = clock, timing.Pacer()
        self.state = SimpleNamespace(grad_sync="bucket", losses=[], step_times=[])
        self.weight = torch.nn.Parameter(torch.ones(3))

    def zero_grad(self) -> None:
        self.weight.grad = None

    def no_sync(self):
        return contextlib.nullcontext()

    def local_batch(self, batch):
        return batch

    def __call__(self, batch, step: int) -> torch.Tensor:
        self.clock.now += 1.0
        return (self.weight * batch).sum()

    def grad_norm(self) -> torch.Tensor:
        self.clock.now += 5.0
        return self.weight.grad.norm()


def test_a_norm_only_reported_is_not_in_the_step_time_and_a_clipping_norm_is(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock.perf_counter,
                                                        thread_time=clock.thread_time, sleep=lambda s: None))
    model = _Model(clock)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    batches = lambda i: torch.full((3,), 2.0)  # noqa: E731

    reported = loop.train_step(model, opt, batches, OptimConfig(lr=0.1), 0, want_norm=True)
    assert reported.grad_norm == float(torch.full((3,), 2.0).norm())
    assert reported.seconds == 1.0 and model.pacer.last["aside_s"] == 5.0

    model.clip_grad_norm_ = lambda max_norm: model.grad_norm()  # clipping is part of the step
    clipped = loop.train_step(model, opt, batches, OptimConfig(lr=0.1, clip_grad_norm=1.0), 1)
    assert clipped.seconds == 6.0 and model.pacer.last["aside_s"] == 0.0
