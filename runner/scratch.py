"""Scratch folders that never outlive their run: a bundle zip's extracted copy (`hap-bundle-*`, `hap-pipeline-*`).

A `finally` block removes a folder on a normal return, on an exception and on Ctrl-C, but SIGTERM (a
scheduler cancelling the job, torchrun stopping its ranks) kills a process that has no handler
before any `finally` runs. `sigterm_exits` closes that gap for the block it guards: SIGTERM raises
`Terminated` (a SystemExit of status 128 + 15) in the main thread, so the `finally` blocks inside it
remove their folders; on leaving, the previous handler comes back, and a process that had none
then dies by SIGTERM after all, as it would have (torchrun counts a rank killed by SIGTERM as one
it stopped, not as a failure). `hap run` relays SIGTERM to torchrun with its own handler while
torchrun runs (runner.torchrun), and removes the folder once torchrun has exited.

Torch-free, so `hap run` can guard its folder before the runner imports torch.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

STATUS = 128 + signal.SIGTERM
"""Exit status of a process that SIGTERM stopped through `Terminated` (the shell's convention)."""


class Terminated(SystemExit):
    """SIGTERM arrived while a `sigterm_exits` block ran; unwinds it like `sys.exit(143)` so `finally` blocks run."""


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM handler: unwind the main thread (see the module doc)."""
    raise Terminated(STATUS)


@contextmanager
def sigterm_exits(enabled: bool = True) -> Iterator[None]:
    """While the block runs in the main thread, SIGTERM raises `Terminated` instead of killing the process
    (`enabled=False`: the block runs unguarded, SIGTERM kills at once as before)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a worker thread's caller guards it
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield  # SIGTERM is ignored here: nothing to turn into an exit
        return
    previous = signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, previous)
        if previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # die by SIGTERM as before, now that the finally blocks ran
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def scratch_folder(prefix: str = "hap-bundle-") -> Iterator[str]:
    """A new temporary folder for the block, removed on every way out of it (SIGTERM included)."""
    with sigterm_exits():
        folder = tempfile.mkdtemp(prefix=prefix)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
