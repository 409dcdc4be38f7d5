"""Bounded readers for every file a user hands the tools (a cluster, a graph, a plan, a config, a model file).

A path on a command line or an upload can be anything: `/dev/zero` (endless), a FIFO with no writer
(a read blocks forever), a directory, a sparse file of terabytes, 100 000 nested brackets (Python's
json recurses into a RecursionError) or a number of 5 000 digits (past Python's 4 300-digit limit for
`int()`, a ValueError). Every reader here refuses all of them in one line, raised as the caller's own
typed error (ClusterError, ModelError, PlanError, ...), and never blocks:

* `read_bytes` opens without blocking (O_NONBLOCK), refuses anything but a regular file by what it
  is, and reads at most `max_bytes` + 1 bytes;
* `parse_json` refuses text that is not UTF-8, nests deeper than `limits.MAX_JSON_DEPTH` or holds a
  number longer than `limits.MAX_JSON_NUMBER_CHARS` before `json.loads` sees it, so neither its
  recursion nor `int()` can fail. NaN and Infinity tokens still parse: the validators downstream
  refuse non-finite numbers naming the field.

`what` in every function is the label a user reads at the start of the message, e.g.
"cluster file 'x.json'" or "plan file 'p.json'": each message is `{what} <problem>; <what to do>`.
"""
from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import Any

from engine import limits
from engine.errors import HapError

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
"""What a non-regular file is, as the refusal names it."""
_CHUNK = 1 << 20
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
"""A JSON string literal (escapes included), removed before brackets and numbers are counted."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LONG_NUMBER = re.compile(r"(?<![-+0-9.eE])[-+0-9.eE]{%d,}" % (limits.MAX_JSON_NUMBER_CHARS + 1))
"""A run of number characters longer than the bound, matched from the run's start only (linear time)."""
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


# ----------------------------------------------------------------------------- files


def read_bytes(path: str | Path, what: str, error: type[HapError], *, max_bytes: int | None = None,
               expect: str = "a JSON file") -> bytes:
    """The bytes of a regular file, refused with `error` when missing, unreadable, not a regular
    file (`expect` says what to give instead) or larger than `max_bytes` (default MAX_INPUT_BYTES); never blocks."""
    max_bytes = _cap(max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} not found") from None
    except OSError as e:  # e.g. a socket (ENXIO) or no permission
        raise error(_open_problem(path, what, e, expect)) from None
    try:
        info = os.fstat(fd)
        _check_regular(info.st_mode, what, error, expect)
        check_size(info.st_size, what, error, max_bytes)
        data = _read_at_most(fd, max_bytes + 1, what, error)
    finally:
        os.close(fd)
    check_size(len(data), what, error, max_bytes)
    return data


def _open_problem(path: str | Path, what: str, e: OSError, expect: str) -> str:
    """Why a path cannot be opened: what it is when it is no regular file, else the system's reason."""
    try:
        kind = _kind(os.stat(path).st_mode)
    except OSError:
        kind = None
    if kind:
        return f"{what} is not a regular file ({kind}); give {expect}"
    return f"{what} cannot be read: {e.strerror or e}"


def _kind(mode: int) -> str | None:
    """'a directory', 'a FIFO (named pipe)', ... for a non-regular file's mode; None for a regular file."""
    return next((name for test, name in _NOT_REGULAR if test(mode)), None if stat.S_ISREG(mode) else "an unknown kind")


def _check_regular(mode: int, what: str, error: type[HapError], expect: str) -> None:
    """Refuse a non-regular file by what it is (it may never end, or block forever)."""
    kind = _kind(mode)
    if kind:
        raise error(f"{what} is not a regular file ({kind}); give {expect}")


def _read_at_most(fd: int, limit: int, what: str, error: type[HapError]) -> bytes:
    """Up to `limit` bytes of an open file (fewer at its end)."""
    parts, left = [], limit
    while left > 0:
        try:
            part = os.read(fd, min(_CHUNK, left))
        except OSError as e:
            raise error(f"{what} cannot be read: {e.strerror or e}") from None
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def check_size(size: int, what: str, error: type[HapError], max_bytes: int | None = None) -> None:
    """Refuse an input of more than `max_bytes` bytes or characters (default MAX_INPUT_BYTES), far above any real one."""
    max_bytes = _cap(max_bytes)
    if size > max_bytes:
        raise error(f"{what} is larger than {_size(max_bytes)}, far more than any real one; check that it is the "
                    "right file")


def _cap(max_bytes: int | None) -> int:
    """`max_bytes`, or MAX_INPUT_BYTES read now (so a test can lower it)."""
    return limits.MAX_INPUT_BYTES if max_bytes is None else max_bytes


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"


# ----------------------------------------------------------------------------- JSON


def read_json(path: str | Path, what: str, error: type[HapError], *, max_bytes: int | None = None) -> Any:
    """The JSON value of a file, read and parsed within every bound (see the module docstring)."""
    return parse_json(read_bytes(path, what, error, max_bytes=max_bytes), what, error, max_bytes=max_bytes)


def parse_json(data: bytes | str, what: str, error: type[HapError], *, max_bytes: int | None = None) -> Any:
    """The JSON value of `data` (bytes must be UTF-8; a leading BOM is skipped), refused with `error`
    in one line when too large, not UTF-8, not JSON, nested too deep or holding an over-long number."""
    check_size(len(data), what, error, max_bytes)
    text = decode_utf8(data, what, error) if isinstance(data, (bytes, bytearray)) else data
    check_shape(text, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except (RecursionError, ValueError) as e:  # check_shape should have caught it: still one line
        raise error(f"{what} cannot be parsed: {type(e).__name__}: {str(e)[:200]}") from None


def decode_utf8(data: bytes, what: str, error: type[HapError]) -> str:
    """UTF-8 text of `data` without a leading byte-order mark; `error` names the first bad byte."""
    try:
        return bytes(data).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                    "save it as UTF-8 JSON") from None


def check_shape(text: str, what: str, error: type[HapError]) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and numbers longer than MAX_JSON_NUMBER_CHARS.

    Strings are cut out first (a bracket or digits inside one count for nothing); the rest is scanned
    with regular expressions and `accumulate`, so the check never recurses and runs at C speed."""
    bare = _STRING.sub('""', text)
    long = _LONG_NUMBER.search(bare)
    if long:
        raise error(f"{what} holds a number of {len(long.group())} characters (at most "
                    f"{limits.MAX_JSON_NUMBER_CHARS}, far longer than any real value); check that it is the right file")
    depth = json_depth(bare)
    if depth > limits.MAX_JSON_DEPTH:
        raise error(f"{what} is nested {depth} levels deep (at most {limits.MAX_JSON_DEPTH}, far deeper than any "
                    "real input); check that it is the right file")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text whose strings were cut out (see check_shape)."""
    brackets = _NOT_BRACKET.sub("", text)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
