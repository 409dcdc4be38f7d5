"""Values a meta capture can know, so that Python branches on them need no data (issue 29, item 3).

A model captured on `meta` has no tensor values, so torch.export stops at any Python branch on one ("Could not
guard on data-dependent expression"). Two kinds of such branch are decided here by a general rule:

- **Inputs that are the same in every batch** (the all-ones attention masks `engine.model.source` makes). Their
  values are given to `KnownValues`, which follows every tensor computed from them alone (and from Python
  numbers and small constant factories) with a CPU twin computed alongside. A branch (`bool`, `.item()`,
  `.tolist()`) on such a tensor takes the twin's value, a boolean-mask index by one becomes the index of its
  True entries (an all-True mask: a reshape), and a write by an all-True (all-False) one a whole copy (nothing).
  Every batch of a run has the same values, so the program holds for
  each of them (Longformer's `is_global_attn`, a loss that drops the masked positions).
- **Assertions on tensor values** (`assert not x.isnan().any()`): a model that runs passes them, so the
  capture takes them as true, as `torch._check` would.

A branch on anything else (activations, parameters, random token ids) still fails, and capture names its line.
"""
from __future__ import annotations

import dis
import functools
import sys
import types
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

VALUE_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__"}
"""Tensor methods that hand a value to Python: where a branch on a tensor's data begins."""
FACTORIES = {"tensor", "as_tensor", "scalar_tensor", "ones", "zeros", "full", "arange", "ones_like", "zeros_like",
             "full_like"}
"""Makers whose output is known from their arguments alone (no random or uninitialised ones): their results get
twins (a `*_like` one takes only its operand's shape and dtype)."""
MAX_TWIN_ELEMENTS = 1 << 22
"""Twins larger than this are not kept (a mask is b x t; a twin of an activation-sized tensor is not needed)."""
_LIBRARY = (str(Path(torch.__file__).parent), str(Path(__file__)))


class KnownValues(torch.overrides.TorchFunctionMode):
    """Keeps a CPU twin beside each traced tensor whose value is known (see the module's docstring)."""

    def __init__(self, known: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.known = {k: v.detach().to("cpu") for k, v in (known or {}).items()}
        self._twins: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.decided = False
        """Whether any branch or index was decided by a known value: the program then holds only for inputs of
        those values, which the capture records (origin `assumes_all_ones`) and the runner checks per batch."""

    # ------------------------------------------------------------------ the twins
    def seed(self, inputs: dict[str, Any]) -> None:
        """Give the traced inputs named in `known` their values (called with the forward's keyword inputs)."""
        for name, value in self.known.items():
            x = inputs.get(name)
            if isinstance(x, torch.Tensor) and x.shape == value.shape and x.dtype == value.dtype:
                self._set(x, value)

    def twin(self, x: Any) -> torch.Tensor | None:
        entry = self._twins.get(id(x))
        return entry[1] if entry is not None and entry[0]() is x else None

    def _set(self, x: torch.Tensor, value: torch.Tensor) -> None:
        key = id(x)
        try:
            ref = weakref.ref(x, lambda _r, key=key, twins=self._twins: twins.pop(key, None))
        except TypeError:
            return
        self._twins[key] = (ref, value)

    def _forget_storage(self, x: Any) -> None:
        """An in-place write by unknown values: drop every twin sharing x's twin's storage (its views too)."""
        t = self.twin(x)
        if t is None:
            return
        ptr = t.untyped_storage().data_ptr()
        for key, (_, v) in list(self._twins.items()):
            if v.untyped_storage().data_ptr() == ptr:
                self._twins.pop(key, None)

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in VALUE_READS and args and isinstance(args[0], torch.Tensor):
            return self._read(func, name, args, kwargs)
        if not self._twins and name not in FACTORIES:
            return func(*args, **kwargs)
        if name == "__getitem__" and len(args) == 2:
            masked = self._mask_index(args[0], args[1])
            if masked is not None:
                return masked
        if name == "__setitem__" and len(args) == 3 and self._mask_write(*args):
            return None
        out = func(*args, **kwargs)
        self._follow(func, name, args, kwargs, out)
        return out

    def _read(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        """A value handed to Python: the twin's when known, True for an assertion, else torch's own (which fails
        on a traced tensor with data-dependent values, and capture reports the line)."""
        t = self.twin(args[0])
        if t is not None:
            self.decided = True
            with _disable_current_modes():
                return func(t, *args[1:], **kwargs)
        asserted = asserted_value() if name == "__bool__" else None
        return asserted if asserted is not None else func(*args, **kwargs)

    def _mask_index(self, x: Any, index: Any) -> torch.Tensor | None:
        """`x[mask]` by a boolean mask of known value: all True is x with the mask's dims flattened, else the index
        of the True entries as constants; None when the index is no such mask."""
        mask = self.twin(index) if isinstance(index, torch.Tensor) else None
        if mask is None or mask.dtype != torch.bool or not isinstance(x, torch.Tensor) or mask.dim() == 0:
            return None
        k = mask.dim()
        if tuple(x.shape[:k]) != tuple(mask.shape):
            return None
        self.decided = True
        with _disable_current_modes():
            every = bool(mask.all())
            where = None if every else mask.nonzero(as_tuple=True)
        return x.reshape(-1, *x.shape[k:]).clone() if every else x[where]

    def _mask_write(self, x: Any, index: Any, value: Any) -> bool:
        """`x[mask] = value` by a boolean mask of known value that is all True (x written whole: a copy of the values
        laid out in x's shape) or all False (nothing written); False when the write is no such one (torch's own
        write follows: a mask with some True entries becomes an index_put). X-MOD writes each language's adapter
        output back by the language's mask."""
        mask = self.twin(index) if isinstance(index, torch.Tensor) else None
        if mask is None or mask.dtype != torch.bool or not isinstance(x, torch.Tensor) or mask.dim() == 0:
            return False
        k = mask.dim()
        if tuple(x.shape[:k]) != tuple(mask.shape):
            return False
        with _disable_current_modes():
            every, none = bool(mask.all()), not bool(mask.any())
        if not (every or none):
            return False
        self.decided = True
        if every:
            self._forget_storage(x)
            x.copy_(torch.broadcast_to(value, (mask.numel(), *x.shape[k:])).reshape(x.shape))
        return True

    def _follow(self, func: Callable, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """Give `out` the twin of func applied to the operands' twins, when every tensor operand has one."""
        operands = _tensors((args, kwargs))
        in_place = _in_place(name)
        if name not in FACTORIES and (not operands or any(self.twin(a) is None for a in operands)):
            if in_place and operands:
                self._forget_storage(operands[0])
            return
        if any(x.numel() > MAX_TWIN_ELEMENTS for x in _tensors(out)):
            if in_place and operands:
                self._forget_storage(operands[0])
            return
        try:
            with _disable_current_modes(), torch.no_grad():
                targs, tkwargs = _substitute((args, kwargs), self._stand_in)
                value = func(*targs, **tkwargs)
        except Exception:  # the twin is an aid: an op it cannot repeat on the CPU only leaves out unknown
            if in_place and operands:
                self._forget_storage(operands[0])
            return
        for x, v in zip(_tensors(out), _tensors(value)):
            if _fits(x, v):
                self._set(x, v)

    def _stand_in(self, x: Any) -> Any:
        """An operand as the twin computation takes it: a tensor's twin (an unknown one, for a `*_like` maker,
        an empty CPU tensor of its shape), the meta device as the CPU."""
        if isinstance(x, torch.Tensor):
            t = self.twin(x)
            return t if t is not None else torch.empty(tuple(x.shape), dtype=x.dtype)
        if isinstance(x, torch.device) and x.type == "meta" or isinstance(x, str) and x == "meta":
            return torch.device("cpu")
        return x


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _substitute(tree: Any, fn: Callable[[Any], Any]) -> Any:
    return torch.utils._pytree.tree_map(fn, tree)


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__") or name == "__setitem__" or (
        name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__"))


def _fits(x: torch.Tensor, v: torch.Tensor) -> bool:
    """A twin must be a CPU tensor of the traced one's shape and dtype, small enough to keep."""
    return (v.device.type == "cpu" and tuple(v.shape) == tuple(x.shape) and v.dtype == x.dtype
            and v.numel() <= MAX_TWIN_ELEMENTS)


# ---------------------------------------------------------------------------- assertions
_JUMPS = {"POP_JUMP_IF_TRUE": True, "POP_JUMP_IF_FALSE": False, "POP_JUMP_FORWARD_IF_TRUE": True,
          "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_BACKWARD_IF_TRUE": True, "POP_JUMP_BACKWARD_IF_FALSE": False,
          "JUMP_IF_TRUE_OR_POP": True, "JUMP_IF_FALSE_OR_POP": False}
"""Conditional jumps by the truth value that takes the jump (Python 3.11 to 3.13 spell them differently)."""


def asserted_value() -> bool | None:
    """The truth value the model's frame must get for its `assert` to pass, when it asks a tensor's truth for one
    (`assert not x.any()`: False); None for any other branch."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back
    return None if frame is None else _passing_value(frame.f_code, frame.f_lasti)


def _passing_value(code: types.CodeType, lasti: int) -> bool | None:
    """For a conditional jump at (or right after) `lasti` one of whose two ways leads straight to `AssertionError`:
    the truth value that takes the other way; None otherwise."""
    ins = _instructions(code)
    at = next((i for i, x in enumerate(ins) if x.offset >= lasti), None)
    if at is None:
        return None
    for j in range(at, min(at + 3, len(ins))):  # a TO_BOOL (3.13) may stand between the read and the jump
        jump = ins[j]
        if jump.opname in _JUMPS:
            taken, ahead = _JUMPS[jump.opname], ins[j + 1].offset if j + 1 < len(ins) else -1
            if _raises_assertion(ins, ahead):
                return taken
            if _raises_assertion(ins, jump.argval):
                return not taken
            return None
    return None


def _raises_assertion(ins: list[dis.Instruction], offset: int) -> bool:
    first = next((x for x in ins if x.offset >= offset and x.opname not in ("NOP", "EXTENDED_ARG", "CACHE")), None)
    return first is not None and first.opname == "LOAD_ASSERTION_ERROR"


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> list[dis.Instruction]:
    return list(dis.get_instructions(code))
