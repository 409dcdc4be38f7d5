"""Sane bounds on every number a user can hand the engine, checked before anything is allocated or expanded.

A cluster file, a graph JSON, a zoo knob or a command-line option is text someone edits by hand
or generates with another tool. Without bounds a device ``"count": 1e308`` expands forever, a
knob ``layers=10**12`` allocates a list of 10**12 blocks, and a flop count of 1e308 turns the cost
model's sums into infinities that the LP solver refuses with an untyped error. Every bound here is
far beyond any real system (the HAP paper's largest cluster has 64 GPUs) yet small enough that all
the cost model's products and sums stay finite floats:

* times are at most flops / FLOP/s = MAX_FLOPS / MIN_RATE = 1e24 s per node, and
* bytes are at most MAX_NUMEL * 8 = 2.3e15 per tensor,

so no cost, memory figure or LP coefficient overflows. This module imports nothing heavy (no torch,
no PuLP), so the command line checks its inputs in milliseconds.
"""
from __future__ import annotations

import math
from typing import Any, Callable

MAX_DEVICES = 4096
"""(Virtual) devices in one cluster after `count` expansion; the paper's largest testbed has 64."""
MAX_GPUS_PER_DEVICE = 65536
"""GPUs inside one virtual device (`num_gpus`)."""
MIN_RATE = 1.0
"""Smallest FLOP/s or bytes/s accepted: a rate of 1e-300 makes every time infinite."""
MAX_FLOPS_PER_GPU = 1e18
"""Sustained FLOP/s of one GPU; an H100 does about 1e15 on dense bf16."""
MAX_BANDWIDTH_BPS = 1e30
"""Bytes/s of a link or a memory; 1e30 is the 'free' figure written for one-device clusters."""
MAX_MEMORY_BYTES = 2**62
"""Bytes of memory of one GPU (4 EiB; the planner's 'unlimited memory' what-if uses this)."""
MAX_LATENCY_S = 3600.0
"""Seconds of latency of one hop or one collective."""
MAX_OP_OVERHEAD_S = 1.0
"""Seconds of fixed cost of one operator run (`Device.op_overhead_s`): real ones are microseconds."""

MAX_NODES = 1_000_000
"""Nodes of a graph JSON."""
MAX_RANK = 16
"""Dimensions of one tensor."""
MAX_NUMEL = 2**48
"""Elements of one tensor (2**48 fp32 elements are 1 PiB)."""
MAX_NODE_FLOPS = 1e24
"""Forward flops of one node (a GPT-3 training step is about 3e23 flops in all)."""
MAX_ATTR_NUMBER = 2**53
"""Magnitude of a number in a node's attrs (exact as a float), e.g. a dim, a size or a count."""
MAX_ATTR_DEPTH = 8
"""Nesting of lists and objects in a node's attrs."""

MAX_KNOB_INT = 2**20
"""An integer zoo knob (batch, hidden, vocab, seq_len, ...) unless `KNOB_INT_LIMITS` says otherwise."""
KNOB_INT_LIMITS: dict[str, int] = {"layers": 1024, "heads": 4096, "experts": 4096}
"""Tighter bounds on knobs that multiply the graph's size (1024 layers is ten times GPT-3's 96)."""
MAX_KNOB_FLOAT = 2.0**20
"""Magnitude of a float zoo knob (dropout, width, capacity_factor)."""

MAX_BUNDLE_FILES = 10_000
"""Entries in a launch bundle (zip or folder); an export writes about ten."""
MAX_BUNDLE_BYTES = 2**28
"""Unpacked bytes of a whole launch bundle (256 MiB), checked from the zip's directory or the folder's lstat before
anything is read: a bundle is read into memory, and the plan JSON of a 96-layer GPT on 8 devices is 3 MB."""
MAX_BUNDLE_ENTRY_BYTES = 2**27
"""Unpacked bytes of one bundle file (128 MiB): forty times the largest plan JSON measured, yet a 3 GiB entry of
zeros (issue 24's zip bomb) is refused from the directory without inflating a byte."""
MAX_BUNDLE_RATIO = 200
"""Largest uncompressed/compressed ratio of a zip entry above `BUNDLE_RATIO_FLOOR_BYTES`: real bundle files
measure 1.5-23 (the plan JSON the most), while deflated zeros reach about 1000, the mark of a zip bomb."""
BUNDLE_RATIO_FLOOR_BYTES = 2**20
"""Entries smaller than this (1 MiB unpacked) may compress by any ratio: they cannot cost memory."""

MAX_TIME_BUDGET_S = 86400.0
"""A search time budget of more than a day is a typo."""
MAX_SEGMENTS = 1024
"""Per-segment ratio vectors (HAP §5.2); at most one per layer in practice."""
MAX_STEPS = 10**9
"""Training steps of one run."""

MAX_INPUT_BYTES = 256 * 2**20
"""Bytes of one JSON input (plan, graph, cluster, config) read by engine.readers: the graph JSON of
zoo:gpt at GPT-3 XL size (24 layers, hidden 2048) is 0.26 MB and a pipeline plan of zoo:gpt 0.6 MB
(graphs grow with layers, not width), so 256 MiB is hundreds of times any real one, yet /dev/zero or
a sparse file stops here."""
MAX_MODEL_FILE_BYTES = 16 * 2**20
"""Bytes of a user's Python model file (the zoo's largest module is about 20 kB)."""
MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects in a JSON input: measured, clusters nest 3 levels, graphs 5, SPMD
plans 6 and a pipeline plan of zoo:gpt 9 (a node's attrs may add MAX_ATTR_DEPTH = 8); Python's json
recurses into a RecursionError near 1000."""
MAX_JSON_NUMBER_CHARS = 100
"""Characters of one number in a JSON input: a float's repr has at most 24 and a 2**64 count 20,
while Python's int() refuses more than 4300 digits with a ValueError."""


def is_number(value: Any) -> bool:
    """True for a finite int/float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def in_range(value: Any, low: float, high: float) -> bool:
    """True for a finite number with low <= value <= high."""
    return is_number(value) and low <= value <= high


def knob_int_limit(name: str) -> int:
    """The largest value an integer knob called `name` may take."""
    return KNOB_INT_LIMITS.get(name, MAX_KNOB_INT)


def knob_problem(name: str, value: Any) -> str | None:
    """Why a zoo knob value is out of bounds (a one-line reason), or None when it is within them.

    Strings are read as numbers when they look like one, so the command line can check `--set
    layers=1000000000000` before the model zoo (and torch) is even imported."""
    number = _as_number(value)
    if number is None:
        return None  # not numeric: the zoo's type check explains it
    if not math.isfinite(number):
        return f"knob '{name}': must be a finite number, got {value!r}"
    if isinstance(number, int):
        top = knob_int_limit(name)
        if number > top:
            return f"knob '{name}': {number} is above the limit {top}; use a value in 1..{top}"
        return None
    if abs(number) > MAX_KNOB_FLOAT:
        return f"knob '{name}': {number!r} is outside [-{MAX_KNOB_FLOAT:g}, {MAX_KNOB_FLOAT:g}]"
    return None


def _as_number(value: Any) -> int | float | None:
    """The number a knob value denotes (an int when integral text or int), or None when it is no number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) <= 2**63 else value
    if isinstance(value, str):
        text = value.strip()
        for parse in (int, float):
            try:
                return _as_number(parse(text))
            except (ValueError, OverflowError):
                continue
    return None


def time_budget_problem(value: Any, label: str = "time budget") -> str | None:
    """Why a search time budget is unusable (None is 'no budget' and fine)."""
    if value is None:
        return None
    if not is_number(value) or not 0 < value <= MAX_TIME_BUDGET_S:
        return f"{label}: must be a number of seconds in (0, {MAX_TIME_BUDGET_S:g}], got {value!r}"
    return None


def bounded_int(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse `type` for an integer option in [low, high] (plain digits only)."""
    import argparse

    def parse(text: str) -> int:
        digits = text.strip()
        if not digits.lstrip("-").isdigit() or len(digits) > 30 or not low <= int(digits) <= high:
            raise argparse.ArgumentTypeError(f"expected {what} in {low}..{high}, got '{text}'")
        return int(digits)

    return parse


def bounded_float(low: float, high: float, what: str, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse `type` for a finite float option in [low, high] ((low, high] when low_open)."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            span = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"expected {what} in {span}, got '{text}'")
        return value

    return parse
