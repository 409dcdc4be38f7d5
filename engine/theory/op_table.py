"""The Core ATen operator set, operator by operator: what capture makes of each, and the rules it then has.

`torch.export` decomposes programs to the Core ATen IR (the operators tagged `torch.Tag.core`); capture
reads the training IR, which holds these and some composites (`linear`, `layer_norm`, `sdpa`), and
lowers every ATen operator to the canonical operators the theory has rules for. `TABLE` says, for each
core overload of the installed torch, one of:

- `lowered`: to one canonical operator, or decomposed into several (`addmm` -> `matmul` + `add`),
  whose rules come from the family module named by `rule_family` (engine/theory/<family>.py) and are
  checked numerically by the theory's checker (tests/theory/test_coverage.py);
- `replicated`: no rule; kept as an opaque all-Full node (theory/opaque.py) when the fallback allows
  it (under the default `auto` only as side arithmetic), refused with its name otherwise;
- `refused`: never kept opaque (a random draw with no site-keyed numbers), or never captured (a
  data-dependent shape or value stops torch.export);
- `backward`: a backward operator, never in a captured forward graph;
- `metadata`: no tensor result in a capture with static shapes (sizes, strides), or an `out=` variant
  that export never records.

`python -m engine.theory.op_table --write docs/core_aten_ops.md` writes the table; a test keeps it complete
(every core overload of the installed torch has a row) and the committed file up to date.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.theory.core import rule_family

KINDS = ("lowered", "replicated", "refused", "backward", "metadata")


@dataclass(frozen=True)
class CoreOp:
    """How capture treats one core overload."""

    kind: str
    """One of `KINDS`."""
    canonical: tuple[str, ...] = ()
    """The canonical operators a lowered overload becomes (all of them, or one by dtype when `by_dtype`)."""
    note: str = ""
    """Why (the reason of a replicated or refused row), or what the lowering does."""
    by_dtype: bool = False
    """The canonical operator depends on the dtype (bitwise ops: `logical_*` of booleans, `bitwise_*` of integers)."""


def lowered(*canonical: str, note: str = "") -> CoreOp:
    return CoreOp("lowered", canonical, note)


def _rows(entry: CoreOp, *overloads: str) -> dict[str, CoreOp]:
    return dict.fromkeys(overloads, entry)


def _same(*overloads: str) -> dict[str, CoreOp]:
    """Overloads lowered to the canonical operator of their own name (`floor.default` -> `floor`)."""
    return {o: lowered(o.split(".")[0]) for o in overloads}


def _reasons(kind: str, text: str) -> dict[str, CoreOp]:
    """Rows of one kind from `overload: reason` lines."""
    pairs = (line.strip().split(": ", 1) for line in text.strip().splitlines())
    return {name: CoreOp(kind, note=note) for name, note in pairs}


_REPLICATED = """
    _cdist_forward.default: pairwise distances; no rule written yet (the batch dim could split)
    _pdist_forward.default: each output pairs two rows of the whole input
    _embedding_bag.default: bags of data-dependent lengths (offsets); no rule written yet
    _fft_c2r.default: the inverse of a one-sided transform (irfft) reads the spectrum's missing half by symmetry; not lowered yet
    diagonal.default: no rule written yet (the dims other than the two could split)
    grid_sampler_2d.default: sampling positions are data; no rule written yet (the batch could split)
    masked_scatter.default: the k-th selected entry takes source entry k: a shard's positions depend on the counts before it
    scatter_reduce.two: product, max, min or mean into data-dependent positions
    _native_batch_norm_legit_no_training.default: batch norm in eval mode: plan the model in training mode
"""
"""No rule (yet): kept opaque when the fallback allows it."""
_REFUSED = """
    randperm.default: a random draw with no site-keyed numbers (each device would draw its own)
    nonzero.default: its shape depends on the data: torch.export stops at its users
    _local_scalar_dense.default: `.item()`: a value read into Python, which export cannot guard on
"""
"""Never kept opaque, or never captured."""
_BITWISE = {f"bitwise_{k}.{o}": CoreOp("lowered", (f"logical_{k}", f"bitwise_{k}"), "booleans: logical, integers: bitwise", True)
            for k in ("and", "or", "xor") for o in ("Tensor", "Scalar")}

TABLE: dict[str, CoreOp] = {
    **_same("abs.default", "acos.default", "acosh.default", "asin.default", "asinh.default", "atan.default", "atanh.default",
            "ceil.default", "cos.default", "cosh.default", "erf.default", "exp.default", "expm1.default", "floor.default",
            "log.default", "log10.default", "log1p.default", "log2.default", "neg.default", "reciprocal.default",
            "relu.default", "round.default", "rsqrt.default", "sigmoid.default", "sign.default", "sin.default",
            "sinh.default", "sqrt.default", "tan.default", "tanh.default", "trunc.default", "isinf.default",
            "isnan.default", "gelu.default", "elu.default", "leaky_relu.default", "logical_not.default",
            "logical_and.default", "logical_or.default", "logical_xor.default", "maximum.default", "minimum.default",
            "atan2.default", "cumsum.default", "gather.default", "embedding.default", "expand.default",
            "permute.default", "flip.default", "cat.default", "where.self", "scatter_add.default",
            "slice_scatter.default", "select_scatter.default", "arange.start_step", "rand.default", "clamp.default",
            "amax.default", "amin.default", "argmax.default", "argmin.default", "any.default", "any.dim", "any.dims",
            "prod.default", "prod.dim_int", "var.correction", "var.dim", "index.Tensor", "mean.default", "mean.dim"),
    **{f"{op}.{o}": lowered(op) for op in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "fmod",
                                           "remainder") for o in ("Tensor", "Scalar")},
    **_rows(lowered("div_floor", "div_trunc", note="the rounding mode picks one"), "div.Tensor_mode", "div.Scalar_mode"),
    **_rows(lowered("pow"), "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor"),
    **_BITWISE,
    "bitwise_not.default": CoreOp("lowered", ("logical_not", "bitwise_not"), "booleans: logical, integers: bitwise", True),
    "sum.dim_IntList": lowered("sum"),
    "_softmax.default": lowered("softmax"),
    "_log_softmax.default": lowered("log_softmax"),
    **_rows(lowered("identity"), "_to_copy.default", "alias.default", "clone.default"),
    **_rows(lowered("view"), "view.default", "squeeze.dim", "squeeze.dims", "unsqueeze.default"),
    "slice.Tensor": lowered("narrow"),
    "select.int": lowered("select"),
    "split_with_sizes.default": lowered("narrow", note="one narrow per piece"),
    **_rows(lowered("matmul"), "mm.default", "bmm.default"),
    "addmm.default": lowered("matmul", "add"),
    "convolution.default": lowered("conv", "view", "add", note="the bias, when there is one, viewed per channel and added"),
    **_rows(lowered("adaptive_avg_pool"), "_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default",
            "adaptive_avg_pool1d.default"),
    **_rows(lowered("avg_pool"), "avg_pool1d.default", "avg_pool2d.default", "avg_pool3d.default"),
    **_rows(lowered("max_pool", note="the indices (for backward) are not modelled"), "max_pool2d_with_indices.default",
            "max_pool3d_with_indices.default"),
    **_rows(lowered("batch_norm", note="training mode; the saved statistics are not modelled"),
            "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats"),
    "native_layer_norm.default": lowered("layer_norm", note="mean and rstd (for backward) are not modelled"),
    "native_group_norm.default": lowered("group_norm", note="mean and rstd (for backward) are not modelled"),
    **_rows(lowered("upsample", note="the same ATen overload, sizes and scales on each block"), "upsample_bilinear2d.vec",
            "upsample_nearest2d.vec"),
    "native_dropout.default": lowered("dropout", note="a site-keyed mask (engine/model/dropout.py)"),
    "randn.default": lowered("rand", note="site-keyed normal numbers (Box-Muller on two of the site's uniform "
                             "numbers per global index, engine/model/dropout.py); LSH attention's rotations"),
    **_rows(lowered("full"), "full.default", "full_like.default", "empty.memory_format", "empty_strided.default",
            "scalar_tensor.default", "fill.Scalar"),
    "constant_pad_nd.default": lowered("pad"),
    **_rows(lowered("pad", note="a pad node with its mode"), "reflection_pad1d.default", "reflection_pad2d.default",
            "reflection_pad3d.default", "replication_pad2d.default", "replication_pad3d.default"),
    "hardtanh.default": lowered("clamp"),
    "clamp.Tensor": lowered("maximum", "minimum", note="tensor bounds: max with the lower, min with the upper"),
    **_rows(lowered("topk_values", "topk_indices", "view", note="topk with k = 1, viewed without the dim unless keepdim"),
            "max.dim", "min.dim"),
    "topk.default": lowered("topk_values", "topk_indices"),
    "sort.default": lowered("sort_values", "sort_indices"),
    "index_select.default": lowered("index", note="x[:, .., idx]"),
    "repeat.default": lowered("view", "expand", "view", note="tiles: a unit dim before each dim, expanded to the repeats"),
    "copy.default": lowered("expand", "identity", note="src broadcast to self's shape, cast to self's dtype"),
    **_rows(lowered("scatter", note="no Partial rule with src: duplicate indices write in an unspecified order"),
            "scatter.src", "scatter.value"),
    "as_strided.default": lowered("view", "permute", "narrow", "unfold", "expand",
                                  note="reads of a dense operand's own elements in windows (Longformer's overlapping "
                                  "chunks, engine/model/strided.py); other strides replicated"),
    "col2im.default": lowered("col2im", note="F.fold: the batch and whole channels split, the patches and the "
                              "image's dims do not (overlapping patches sum into the same pixels)"),
    "_fft_r2c.default": lowered("fft", "narrow", note="into a real (re, im) pair, as every complex tensor is held; "
                                "one-sided: the full transform narrowed to n // 2 + 1"),
    "index_put.default": lowered("view", "where", note="by one boolean mask over the leading dims, without accumulation: "
                                 "where(mask, values, x); integer indices and accumulation are replicated"),
    **_reasons("replicated", _REPLICATED),
    **_reasons("refused", _REFUSED),
    **_rows(CoreOp("backward", note="not in forward graphs"), "_adaptive_avg_pool2d_backward.default",
            "avg_pool2d_backward.default", "convolution_backward.default", "embedding_dense_backward.default",
            "max_pool2d_with_indices_backward.default", "native_group_norm_backward.default",
            "native_layer_norm_backward.default"),
    **_rows(CoreOp("metadata", note="a size or stride: a Python number in a capture with static shapes"),
            "sym_numel.default", "sym_size.int", "sym_storage_offset.default", "sym_stride.int",
            "sym_is_contiguous.default"),
    "resize_.default": CoreOp("metadata", note="an in-place storage resize: functionalization (capture's first step) rewrites it away"),
    "atan2.out": CoreOp("metadata", note="an out= variant: export records the functional atan2"),
}
"""Every core overload of torch 2.13 (`core_overloads()`), by `name.overload`."""


def core_overloads() -> list[str]:
    """`name.overload` of every ATen overload tagged `torch.Tag.core` in the installed torch (from every
    registered schema: `dir(torch.ops.aten)` lists only the operators some code has touched so far)."""
    names = {(s.name[len("aten::"):], s.overload_name or "default") for s in torch._C._jit_get_all_schemas()
             if s.name.startswith("aten::")}
    return sorted(f"{n}.{o}" for n, o in names if torch.Tag.core in getattr(getattr(torch.ops.aten, n), o).tags)


def _captured_as(row: CoreOp) -> str:
    ops = ", ".join(f"`{op}`" for op in row.canonical)
    if row.kind != "lowered":
        return row.kind
    if row.by_dtype:
        return f"by dtype: {' or '.join(f'`{op}`' for op in row.canonical)}"
    return f"`{row.canonical[0]}`" if len(row.canonical) == 1 else f"decomposed into {ops}"


def _families(row: CoreOp) -> str:
    return ", ".join(dict.fromkeys(rule_family(op) or "NO RULE" for op in row.canonical)) or "-"


def render() -> str:
    """The markdown table of `TABLE` (docs/core_aten_ops.md)."""
    counts = {k: sum(r.kind == k for r in TABLE.values()) for k in KINDS}
    lines = [
        "# Core ATen operators: what capture makes of each",
        "",
        f"Generated by `python -m engine.theory.op_table --write docs/core_aten_ops.md` from `engine/theory/op_table.py`"
        f" (torch {torch.__version__.split('+')[0]}); tests/theory/test_op_table.py keeps it complete and up to date.",
        "",
        f"{len(TABLE)} overloads: " + ", ".join(f"{counts[k]} {k}" for k in KINDS) + ".",
        "",
        "- **lowered**: to the canonical operator(s) shown, whose rules live in `engine/theory/<family>.py` and are "
        "checked numerically on uneven shards by the theory's checker.",
        "- **replicated**: no rule; an opaque all-Full node when the fallback allows it (under the default `auto` "
        "only as side arithmetic: no gradient, or no dependence on the batch), refused with its name otherwise.",
        "- **refused**: never replicated (a random draw every device would make differently) or never captured.",
        "- **backward**, **metadata**: not in a captured forward graph.",
        "",
        "| Operator | Captured as | Family | Note |",
        "|---|---|---|---|",
    ]
    for name in sorted(TABLE):
        row = TABLE[name]
        lines.append(f"| `{name}` | {_captured_as(row)} | {_families(row)} | {row.note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="write the markdown table there (else print it)")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
