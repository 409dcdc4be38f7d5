"""`as_strided` as a chain of ruled views (issue 29: Longformer's and LED's overlapping attention chunks).

`x.as_strided(size, stride, offset)` reads x's storage at `offset + sum_k i_k * stride_k`. Where x's elements are
its whole storage laid out densely in some order (a contiguous tensor, or a permutation of one) and every read
lands in x, the same reads are a chain of operators the theory has rules for:

1. x viewed without its unit dims and permuted into storage order: a contiguous tensor x';
2. the output's dims of size 1 and of stride 0 set aside (a view and an expand put them back at the end), the
   others sorted by decreasing stride;
3. leading output dims equal to x''s leading dims (size and stride) are x''s dims as they are, so are trailing
   ones (the "block" of P elements every other stride is a multiple of); x''s middle dims, flattened to one of M
   elements, are read as windows: `narrow` to the reads' extent, one `unfold` per output dim but the last (its
   step the dim's stride, its size the extent of the dims after it), and the last dim a `narrow` with its stride
   as the step;
4. one `permute` into the output's order, a `view` for the unit dims, an `expand` for the stride-0 dims.

Longformer's `_chunk` (chunks of 2w overlapping by w) becomes `unfold(seq, 2w, w)` and a permute, which keeps the
batch and head dims shardable (theory/shape.py); anything else this cannot express is refused by name.
"""
from __future__ import annotations

import math
from typing import Any

Step = tuple[str, dict[str, Any], tuple[int, ...]]
"""One canonical operator of the chain: (op, attrs, output shape)."""


class NotAView(ValueError):
    """The as_strided reads are not a view of x's own elements that the chain expresses; the message says why."""


def as_strided_steps(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, size: tuple[int, ...],
                     out_stride: tuple[int, ...], out_offset: int) -> list[Step]:
    """The chain of ruled operators that reads what `as_strided(x, size, out_stride, out_offset)` reads, for x of
    `shape` / `stride` at storage `offset`; raises NotAView when there is none."""
    if len(size) != len(out_stride) or any(s < 0 for s in out_stride):
        raise NotAView("sizes and strides of different lengths, or a negative stride")
    if math.prod(size) == 0 or math.prod(shape) == 0:
        raise NotAView("an empty tensor")
    steps: list[Step] = []
    dims = _storage_order(shape, stride)
    x_shape = tuple(shape[d] for d in dims)
    _emit_view(steps, shape, tuple(s for s in shape if s != 1))
    kept = [d for d in range(len(shape)) if shape[d] != 1]
    order = [kept.index(d) for d in dims]
    if order != list(range(len(order))):
        steps.append(("permute", {"dims": order}, x_shape))
    start = out_offset - offset
    real = [j for j in range(len(size)) if size[j] != 1 and out_stride[j] != 0]
    last = start + sum((size[j] - 1) * out_stride[j] for j in real)
    if start < 0 or last >= math.prod(x_shape):
        raise NotAView(f"reads storage elements {start}..{last}, outside its operand's {math.prod(x_shape)}")
    by_stride = sorted(real, key=lambda j: -out_stride[j])
    labels, got = _windows(steps, x_shape, [(size[j], out_stride[j]) for j in by_stride], start)
    _arrange(steps, got, [None if k is None else by_stride[k] for k in labels], size, out_stride)
    return _fused(steps, shape)


def _storage_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int]:
    """x's non-unit dims in storage order (decreasing stride); NotAView unless they cover the storage densely."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(dims):
        if stride[d] != expected:
            raise NotAView(f"its operand (shape {list(shape)}, strides {list(stride)}) is not dense in memory")
        expected *= shape[d]
    return dims


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _split(x_shape: tuple[int, ...], reads: list[tuple[int, int]], start: int) -> tuple[int, int]:
    """How many leading and trailing dims of x' the reads (size, stride by decreasing stride) take as they are."""
    strides, total = _contiguous(x_shape), math.prod(x_shape)
    best = (0, 0)
    for a in range(min(len(x_shape), len(reads)) + 1):
        if any(reads[k] != (x_shape[k], strides[k]) for k in range(a)):
            break
        rest = reads[a:]
        block = strides[a - 1] if a else total
        if start + sum((n - 1) * s for n, s in rest) >= block:
            continue
        t = _trailing(x_shape[a:], rest, start)
        best = (a, t)
    return best


def _trailing(x_shape: tuple[int, ...], reads: list[tuple[int, int]], start: int) -> int:
    """The most trailing dims of x' the reads take whole, every other read's stride (and the start) a multiple of
    their block."""
    strides = _contiguous(x_shape)
    for t in range(min(len(x_shape), len(reads)), 0, -1):
        if reads[len(reads) - t:] != [(x_shape[k], strides[k]) for k in range(len(x_shape) - t, len(x_shape))]:
            continue
        block = math.prod(x_shape[len(x_shape) - t:])
        if start % block == 0 and all(s % block == 0 for _, s in reads[:len(reads) - t]):
            return t
    return 0


def _windows(steps: list[Step], x_shape: tuple[int, ...], reads: list[tuple[int, int]],
             start: int) -> tuple[list[int | None], tuple[int, ...]]:
    """Step 3: x' read by `reads`; returns, per dim of the result, the index into `reads` it holds (None for a
    unit dim that holds no read), and the result's shape."""
    a, t = _split(x_shape, reads, start)
    lead, trail = x_shape[:a], x_shape[len(x_shape) - t:]
    block = math.prod(trail)
    middle = math.prod(x_shape[a:len(x_shape) - t])
    mid = [(n, s // block) for n, s in reads[a:len(reads) - t]]
    begin = start // block
    if not mid and middle == 1:  # the reads are x' whole
        return list(range(len(reads))), x_shape
    shape = lead + (middle,) + trail
    _emit_view(steps, x_shape, shape)
    extents = [sum((n - 1) * s for n, s in mid[k:]) + 1 for k in range(len(mid))] or [1]
    if (begin, extents[0]) != (0, middle):
        shape = lead + (extents[0],) + trail
        steps.append(("narrow", {"dim": a, "start": begin, "end": begin + extents[0], "step": 1}, shape))
    labels: list[int | None] = list(range(a)) + [a if mid else None] + list(range(len(reads) - t, len(reads)))
    dim = a
    for k in range(len(mid) - 1):
        n, s = mid[k]
        shape = shape[:dim] + (n,) + shape[dim + 1:] + (extents[k + 1],)
        steps.append(("unfold", {"dim": dim, "size": extents[k + 1], "step": s}, shape))
        dim = len(shape) - 1
        labels.append(a + k + 1)
    if mid and mid[-1][1] != 1:
        n, s = mid[-1]
        shape = shape[:dim] + (n,) + shape[dim + 1:]
        steps.append(("narrow", {"dim": dim, "start": 0, "end": extents[-1], "step": s}, shape))
    return labels, shape


def _arrange(steps: list[Step], shape: tuple[int, ...], labels: list[int | None], size: tuple[int, ...],
             out_stride: tuple[int, ...]) -> None:
    """Step 4: the result's dims (of `shape`, each holding output dim `labels[i]` or a unit dim) put in the
    output's order, with the output's unit and stride-0 dims."""
    real = sorted(j for j in labels if j is not None)
    order = [labels.index(j) for j in real] + [i for i, j in enumerate(labels) if j is None]
    if order != list(range(len(order))):
        shape = tuple(shape[i] for i in order)
        steps.append(("permute", {"dims": order}, shape))
    ones = tuple(n if out_stride[j] != 0 else 1 for j, n in enumerate(size))
    _emit_view(steps, shape, ones)
    if ones != tuple(size):
        steps.append(("expand", {"shape": list(size)}, tuple(size)))


def _emit_view(steps: list[Step], before: tuple[int, ...], after: tuple[int, ...]) -> None:
    if before != after:
        steps.append(("view", {"shape": list(after)}, after))


def _fused(steps: list[Step], shape: tuple[int, ...]) -> list[Step]:
    """The chain with consecutive views merged, consecutive permutes composed, and steps that change nothing
    dropped (a permute back, a view to the shape it has)."""
    out: list[Step] = []
    for op, attrs, after in steps:
        before = out[-1][2] if out else shape
        if op == "view" and out and out[-1][0] == "view":
            out.pop()
            before = out[-1][2] if out else shape
        elif op == "permute" and out and out[-1][0] == "permute":
            first = out.pop()[1]["dims"]
            attrs = {"dims": [first[d] for d in attrs["dims"]]}
            before = out[-1][2] if out else shape
        if op in ("view", "permute") and after == before and (op == "view" or attrs["dims"] == sorted(attrs["dims"])):
            continue
        out.append((op, attrs, after))
    return out
