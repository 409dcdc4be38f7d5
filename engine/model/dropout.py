"""Exact dropout: every device draws, for its shard, the mask single-device training draws.

A dropout *site* is one dropout call with p > 0 in training mode (an `nn.Dropout`, `F.dropout`, or
the attention dropout of `scaled_dot_product_attention`), or one draw of `torch.rand`, `rand_like`,
`bernoulli` (stochastic depth's per-sample keep, `rand` below), `Tensor.uniform_` (MoE jitter) or `torch.randn`
(LSH attention's random rotations, normal numbers by Box-Muller: `randn` below); capture
numbers the sites in forward order (`rng_site`, assigned before pruning) and the single-device reference
counts its dropout calls the same way (`SiteKeyedDropout`). The mask of a site is a function of the
*global* element index:

    keep[i] = u(seed, step, site, i) >= p,    u = a counter-based hash of (key, i) in [0, 1)

so a device computes exactly the elements of its own region (a box of the global tensor: whole
for Full, a range of rows along d for Shard(d), uneven sizes included) and nothing else. This is
the idea of DTensor's offset-based RNG (each shard advances a counter-based generator to its
offset), done with a hash of the flat index instead of Philox offsets: integer operations give the
same bits on every device type (a CPU reference, a mix of GPU models), where the Philox stream
of `torch.rand` depends on the launch configuration of the device.

Why not "generate the global mask with a seeded generator and slice it"? It is exact too, but
every rank would draw the whole global mask at every site and step (for BERT-Base's attention
dropout, 512 x 12 x 128 x 128 floats per layer) and on CPU. The hash costs, per device and site,
a few int64 element-wise operations over the *local* region only: about 8 bytes per local element
of temporaries, freed after the mask is built; the boolean mask (1 byte per local element) is
what autograd keeps for backward, as torch's own dropout does. Attention dropout makes the
attention probabilities explicit (B, heads, Tq, Tk) (the math form of attention, as torch's own
`sdpa` does on CPU with dropout), which the cost model counts as kept activations; the hashing
is counted in a site's flops (`MASK_OPS_PER_ELEMENT`).

`Partial` inputs: with one mask shared by all devices, dropout would distribute over addends,
but no rule offers it (engine/theory/pointwise.py): a device would draw the whole mask.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
_M32 = 0xFFFFFFFF
MASK_OPS_PER_ELEMENT = 24
"""Integer operations per mask element (flat index, two mixing rounds of 9 operations, the
conversion and the comparison): what capture adds to a dropout site's flops."""
RANDN_OPS_PER_ELEMENT = 8
"""Floating-point operations per normal number besides its two uniform ones (Box-Muller: log1p, sqrt, cos, the
scalings and the casts)."""


@dataclass(frozen=True)
class RngKey:
    """What a training step's masks depend on besides the site: the run's seed and the step number."""

    seed: int
    step: int
    train: bool = True
    """False for an evaluation pass: every site passes its input through, as `module.eval()` does."""


def site_words(key: RngKey, site: int, stream: int = 0) -> tuple[int, int]:
    """Two 32-bit words derived from (seed, step, site): every site of every step gets its own stream (and a
    site that needs a second number per element, `randn`, a second stream)."""
    tag = f"hap-dropout:{key.seed}:{key.step}:{site}" + (f":{stream}" if stream else "")
    digest = hashlib.blake2b(tag.encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for 32-bit words held in int64, without ever overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer (xor-shift-multiply rounds, Wellons' lowbias32 constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def flat_index(global_shape: Sequence[int], starts: Sequence[int], local_shape: Sequence[int],
               device: torch.device | str = "cpu") -> Tensor:
    """Row-major flat indices in the global tensor of the box `starts + [0, local_shape)` (int64)."""
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (start, size, stride) in enumerate(zip(starts, local_shape, strides)):
        axis = torch.arange(start, start + size, dtype=torch.int64, device=device) * stride
        index = index + axis.reshape([size if e == d else 1 for e in range(len(global_shape))])
    return index.expand(tuple(local_shape)) if len(global_shape) else index


def uniform(key: RngKey, site: int, global_shape: Sequence[int], starts: Sequence[int],
            local_shape: Sequence[int], device: torch.device | str = "cpu", stream: int = 0) -> Tensor:
    """u in [0, 1) (float32, 24 random bits) for the box of the global tensor; a pure function of the global index."""
    w0, w1 = site_words(key, site, stream)
    index = flat_index(global_shape, starts, local_shape, device)
    h = _mix32((index & _M32) ^ w0)
    h = _mix32(h ^ (index >> 32) ^ w1)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def keep_mask(p: float, key: RngKey, site: int, global_shape: Sequence[int], starts: Sequence[int],
              local_shape: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """The boolean keep-mask of a site on the box `starts + [0, local_shape)` of its global tensor."""
    return uniform(key, site, global_shape, starts, local_shape, device) >= p


def dropout(x: Tensor, p: float, key: RngKey, site: int, global_shape: Sequence[int], starts: Sequence[int]) -> Tensor:
    """Dropout of a local region `x` (starting at `starts` of the global tensor) with the site's mask."""
    if not key.train:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = keep_mask(p, key, site, global_shape, starts, x.shape, x.device)
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)  # backward keeps the boolean mask only


def below_one(u: Tensor, dtype: torch.dtype) -> Tensor:
    """`u` in [0, 1) as `dtype`, still below 1: cut to the bits the dtype holds below 1 (a bfloat16 or
    half value would otherwise round 0.999... up to 1.0, which torch.rand never returns)."""
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # the spacing of [0.5, 1) is eps / 2
    if bits < 24:
        u = torch.floor(u * float(1 << bits)) * (1.0 / (1 << bits))
    return u.to(dtype)


def rand(key: RngKey, site: int, global_shape: Sequence[int], starts: Sequence[int], local_shape: Sequence[int],
         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, low: float = 0.0,
         high: float = 1.0) -> Tensor:
    """`torch.rand` at a random site (stochastic depth, `bernoulli`), or `uniform_(low, high)` with a range (MoE
    jitter): the box `starts + [0, local_shape)` of the site's uniform numbers (on the default device unless
    `device`), scaled to [low, high) in float32 before the cast; a device draws only its block."""
    u = uniform(key, site, global_shape, starts, local_shape, torch.get_default_device() if device is None else device)
    if (low, high) == (0.0, 1.0):
        return below_one(u, dtype)
    return (u * (high - low) + low).to(dtype)


def randn(key: RngKey, site: int, global_shape: Sequence[int], starts: Sequence[int], local_shape: Sequence[int],
          dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, mean: float = 0.0,
          std: float = 1.0) -> Tensor:
    """`torch.randn` / `normal_(mean, std)` at a random site (LSH attention's random rotations): the box
    `starts + [0, local_shape)` of the site's normal numbers, a device drawing only its block.

    Box-Muller on two uniform numbers of the same global index (streams 0 and 1 of the site), in float64 before
    the cast, so every element is a function of its index alone; 1 - u1 lies in (0, 1], so the log is finite."""
    device = torch.get_default_device() if device is None else device
    u1 = uniform(key, site, global_shape, starts, local_shape, device).to(torch.float64)
    u2 = uniform(key, site, global_shape, starts, local_shape, device, stream=1).to(torch.float64)
    z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos((2.0 * math.pi) * u2)
    return (z * std + mean).to(dtype)


def attention_dropout(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None,
                      p: float, key: RngKey, site: int, weights_shape: Sequence[int], starts: Sequence[int],
                      enable_gqa: bool = False) -> Tensor:
    """softmax(q k^T * scale + mask) with the site's dropout, times v: attention in math form.

    `weights_shape` is the global shape of the attention probabilities (..., Tq, Tk); `starts` is
    where this device's (..., tq, Tk) block begins in it (queries, batch or heads may be split)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        tq, tk = scores.shape[-2:]
        causal = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a query that may attend to no key
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)  # 0, not NaN, as torch's sdpa
    return dropout(probs, p, key, site, weights_shape, starts) @ v


def attention_weights_shape(q_shape: Sequence[int], k_shape: Sequence[int], enable_gqa: bool = False) -> tuple[int, ...]:
    """Global shape (..., Tq, Tk) of the attention probabilities of `sdpa(q, k, v)` (with grouped
    query attention, the key heads are repeated up to the query heads first)."""
    k_lead = tuple(k_shape[:-2])
    if enable_gqa and len(k_lead) and len(q_shape) > 2:
        k_lead = k_lead[:-1] + (q_shape[-3],)
    lead = torch.broadcast_shapes(tuple(q_shape[:-2]), k_lead)
    return tuple(lead) + (q_shape[-2], k_shape[-2])


# --- the single-device side: the same masks in eager PyTorch ------------------------------------
_DROPOUT_SIG = inspect.signature(lambda input, p=0.5, training=True, inplace=False: None)
_TORCH_DROPOUT_SIG = inspect.signature(lambda input, p, train: None)
_SDPA_SIG = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False: None)
_F_DROPOUT, _F_SDPA = F.dropout, F.scaled_dot_product_attention
"""torch's own functions (the composites' globals are rebound while they run, see `_keyed_globals`)."""
_RANDOM_FUNCS = (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                 torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout)


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a dropout variant draws random numbers (training mode and p > 0)."""
    try:
        a = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin: (input, p, train)
        a = _TORCH_DROPOUT_SIG.bind(*args, **kwargs)
    a.apply_defaults()
    values = a.arguments
    return bool(values.get("training", values.get("train", True))) and float(values.get("p", 0.5)) > 0.0


class SiteKeyedDropout(TorchFunctionMode):
    """Runs a module's dropout calls with the site-keyed masks of step `key.step` (site = call order).

    Used by the single-device reference (runner.train.reference_run): `F.dropout` / `nn.Dropout`,
    `torch.dropout` and `scaled_dot_product_attention` with `dropout_p > 0` draw exactly the masks
    a distributed run draws for the same sites, also inside the Python composites of
    torch.nn.functional (`multi_head_attention_forward`); so do `torch.rand`, `rand_like`, `bernoulli`
    (stochastic depth), `Tensor.uniform_` (MoE jitter), `torch.randn`, `randn_like`, `normal` and `Tensor.normal_`
    (LSH attention's rotations) (`_DRAWS`), each a site of its own. Other random dropout variants
    are refused (capture refuses them too)."""

    def __init__(self, key: RngKey) -> None:
        super().__init__()
        self.key = key
        self.sites = 0
        """Dropout sites met so far in this forward."""

    def _next_site(self) -> int:
        self.sites += 1
        return self.sites - 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_DROPOUT or func is torch.dropout:
            return self._dropout(func, args, kwargs)
        if func is _F_SDPA:
            return self._sdpa(func, args, kwargs)
        if func in _DRAWS and kwargs.get("generator") is None:
            return _DRAWS[func](self, args, kwargs)
        if func in _RANDOM_FUNCS and _draws(func, args, kwargs):
            raise NotImplementedError(f"{getattr(func, '__name__', func)} has no site-keyed mask (use nn.Dropout)")
        if inspect.isfunction(func) and getattr(func, "__module__", "") == F.__name__:
            with self._keyed_globals():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _keyed_globals(self) -> Iterator[None]:
        """Rebind torch.nn.functional's `dropout` and `scaled_dot_product_attention` to this mode's
        keyed versions while a Python composite of that module runs.

        A composite such as `F.multi_head_attention_forward` (nn.MultiheadAttention, hence
        nn.TransformerEncoderLayer) reaches the mode as one call, and torch turns the mode off while
        the mode handles it: the attention dropout inside would draw torch's own random mask and take
        no site number, so every later site of the reference would be off by one from capture's."""
        keyed = {"dropout": lambda *a, **k: self._dropout(_F_DROPOUT, a, k),
                 "scaled_dot_product_attention": lambda *a, **k: self._sdpa(_F_SDPA, a, k)}
        saved = {name: getattr(F, name) for name in keyed}
        for name, fn in keyed.items():
            setattr(F, name, fn)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(F, name, fn)

    def _dropout(self, func, args: tuple, kwargs: dict) -> Any:
        sig = _DROPOUT_SIG if func is _F_DROPOUT else _TORCH_DROPOUT_SIG
        a = sig.bind(*args, **kwargs).arguments
        x, p, training = a["input"], float(a.get("p", 0.5)), bool(a.get("training", a.get("train", True)))
        if not training or p == 0.0:
            return func(*args, **kwargs)
        out = dropout(x, p, self.key, self._next_site(), tuple(x.shape), [0] * x.dim())
        return x.copy_(out) if a.get("inplace") else out

    def _sdpa(self, func, args: tuple, kwargs: dict) -> Any:
        a = {**_SDPA_SIG.bind(*args, **kwargs).arguments}
        p = float(a.get("dropout_p", 0.0))
        if p == 0.0:
            return func(*args, **kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        shape = attention_weights_shape(q.shape, k.shape, bool(a.get("enable_gqa", False)))
        return attention_dropout(q, k, v, a.get("attn_mask"), bool(a.get("is_causal", False)), a.get("scale"), p,
                                 self.key, self._next_site(), shape, [0] * len(shape), bool(a.get("enable_gqa", False)))

    def _draw(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, normal: bool = False) -> Tensor:
        """The next site's uniform (or `normal`) numbers for a whole tensor (what `torch.rand` or `randn` draws at a site)."""
        shape = tuple(int(v) for v in shape)
        return (randn if normal else rand)(self.key, self._next_site(), shape, [0] * len(shape), shape, dtype, device)

    def _rand(self, args: tuple, kwargs: dict, normal: bool = False) -> Tensor:
        """`torch.rand(*size, dtype=, device=)` (or `torch.randn`, `normal`), the size as varargs, one sequence, or
        `size=`."""
        size = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
        out = self._draw(size, kwargs.get("dtype") or torch.get_default_dtype(),
                         kwargs.get("device") or torch.get_default_device(), normal)
        return out.requires_grad_(bool(kwargs.get("requires_grad", False)))

    def _rand_like(self, args: tuple, kwargs: dict, normal: bool = False) -> Tensor:
        x = args[0]
        return self._draw(x.shape, kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device, normal)

    def _normal_(self, args: tuple, kwargs: dict) -> Tensor:
        """`x.normal_(mean=0, std=1)`: x overwritten with the next site's normal numbers, as capture lowers it (a
        `rand` node with `normal`, `mean` and `std`)."""
        x = args[0]
        mean = float(args[1] if len(args) > 1 else kwargs.get("mean", 0.0))
        std = float(args[2] if len(args) > 2 else kwargs.get("std", 1.0))
        shape = tuple(int(v) for v in x.shape)
        return x.copy_(randn(self.key, self._next_site(), shape, [0] * len(shape), shape, x.dtype, x.device, mean, std))

    def _normal(self, args: tuple, kwargs: dict) -> Tensor:
        """`torch.normal(mean, std, size)` with float mean and std (what capture takes); tensor means and stds are
        refused, as capture refuses them."""
        a = inspect.signature(lambda mean, std, size=None, **_: None).bind(*args, **kwargs).arguments
        if a.get("size") is None or isinstance(a["mean"], Tensor) or isinstance(a["std"], Tensor):
            raise NotImplementedError("torch.normal with tensor mean or std has no site-keyed numbers "
                                      "(use torch.randn(...) * std + mean)")
        size = tuple(int(v) for v in a["size"])
        return randn(self.key, self._next_site(), size, [0] * len(size), size,
                     kwargs.get("dtype") or torch.get_default_dtype(), kwargs.get("device") or torch.get_default_device(),
                     float(a["mean"]), float(a["std"]))

    def _uniform_(self, args: tuple, kwargs: dict) -> Tensor:
        """`x.uniform_(from=0, to=1)`: x overwritten with the next site's numbers on [from, to), as capture lowers
        it (a `rand` node with the range)."""
        x = args[0]
        low = float(args[1] if len(args) > 1 else kwargs.get("from", 0.0))
        high = float(args[2] if len(args) > 2 else kwargs.get("to", 1.0))
        shape = tuple(int(v) for v in x.shape)
        return x.copy_(rand(self.key, self._next_site(), shape, [0] * len(shape), shape, x.dtype, x.device, low, high))

    def _bernoulli(self, args: tuple, kwargs: dict, inplace: bool = False) -> Tensor:
        """`bernoulli(probs)`, `bernoulli(x, p)` and `x.bernoulli_(p=0.5)`: 1 where the site's uniform
        number is below the probability, as capture lowers them (`rand`, `lt`, a cast)."""
        x = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5 if inplace else None)
        out = (self._draw(x.shape, torch.float32, x.device) < (x if p is None else p)).to(x.dtype)
        return x.copy_(out) if inplace else out


_DRAWS = {torch.rand: SiteKeyedDropout._rand, torch.rand_like: SiteKeyedDropout._rand_like,
          torch.bernoulli: SiteKeyedDropout._bernoulli, Tensor.bernoulli: SiteKeyedDropout._bernoulli,
          Tensor.bernoulli_: lambda mode, args, kwargs: mode._bernoulli(args, kwargs, inplace=True),
          Tensor.uniform_: SiteKeyedDropout._uniform_,
          torch.randn: lambda mode, args, kwargs: mode._rand(args, kwargs, normal=True),
          torch.randn_like: lambda mode, args, kwargs: mode._rand_like(args, kwargs, normal=True),
          Tensor.normal_: SiteKeyedDropout._normal_, torch.normal: SiteKeyedDropout._normal}
"""Random draws a forward may make besides dropout, by the function torch hands the mode: each is a
site, numbered in call order with the dropout sites. A draw with its own `generator` (inputs made inside the mode)
is no site: torch draws it (capture refuses such a draw in a forward)."""
