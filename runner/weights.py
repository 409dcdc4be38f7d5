"""Weights in and out (issue 27): pretrained safetensors into the plan's model, the trained model out.

In: `read_state(path)` is a lazy, read-only view of a safetensors file or a `save_pretrained`
directory (`model.safetensors`, or `model.safetensors.index.json` and its shards): the headers are
read and checked up front (a truncated file is named with the bytes its header promises), the
tensors one at a time when asked (`safetensors.safe_open`, memory-mapped). Pickles
(`pytorch_model.bin`, `torch.save` files) are never loaded. `load_pretrained(module, path)` checks
the file against `module.state_dict()` and copies it into the module's own tensors; the rules:

- names: every tensor of the model must be in the file, except
  - an alias of a tied tensor (`lm_head.weight` shares `model.embed_tokens.weight`;
    `save_pretrained` writes one of them): filled through the tie, reported as tied. Two aliases both
    in the file must hold equal values (the model keeps one tensor);
  - a persistent buffer (running statistics, position ids): it keeps the value the model was built
    with, reported as kept; transformers' `from_pretrained` does the same (it initialises missing
    keys and warns). Buffers are not trained; a missing *parameter* is refused.
- a tensor of the file the model lacks is refused by name, except those transformers itself skips:
  names matching the model class's `_keys_to_ignore_on_load_unexpected`, and leftovers of buffers
  the model now rebuilds (the last name part is a non-persistent buffer of the model, and no
  parameter has that part, e.g. old Llama files' `...self_attn.rotary_emb.inv_freq`): ignored, reported.
- shapes must be equal; dtypes equal or widened without loss (bf16 or fp16 into fp32, fp32 into
  fp64, int32 into int64): cast and reported. A narrowing cast (fp32 into bf16, bf16 <-> fp16) or a
  change between integer and floating point is refused.

Every check runs before the first copy, so a refused file leaves the module as it was. Copies go
into the existing tensors under `torch.no_grad()`, so tied parameters stay one tensor.

Out: `save_model(out_dir, module)` writes a transformers model with its own `save_pretrained`
(`config.json` + safetensors: `AutoModelForCausalLM.from_pretrained(out_dir)` loads it), any other
module as `model.safetensors` with each shared tensor once (safetensors refuses aliases; the first
name is kept, the others recorded in the header's `hap.aliases` so `load_pretrained` fills them).
The directory is written as `out_dir.tmp-<pid>` and renamed into place when complete, so a crash
mid-save leaves the previous save intact and no half-written model under the final name.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import HapError
from engine.spmd.plan import Plan

from .rebuild import build_module

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ALIASES_KEY = "hap.aliases"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
HINT = "the weights are for another model? plan the model the weights belong to"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
SAVED_MARKERS = ("config.json", SINGLE, INDEX)
"""A directory holding one of these is a previous save that `save_model` may replace."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}
"""The safetensors dtype codes (its header's `dtype`) and the torch dtypes they read as."""


class WeightsError(HapError, ValueError):
    """A weights file or directory cannot be read, or does not fit the plan's model."""


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorSpec:
    """What a header says of one tensor, before any of its bytes are read."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path | None = None


class SafetensorsState(Mapping[str, torch.Tensor]):
    """A read-only name -> tensor view of safetensors files: `state[name]` reads that tensor only.

    `aliases` (from a `save_model` header) are names that read as another stored name."""

    def __init__(self, source: str, specs: dict[str, TensorSpec], aliases: dict[str, str] | None = None):
        self.source = source
        self.specs = specs
        self.aliases = {a: n for a, n in (aliases or {}).items() if n in specs and a not in specs}
        self._handles: dict[Path, object] = {}

    def stored(self, name: str) -> str:
        return self.aliases.get(name, name)

    def spec(self, name: str) -> TensorSpec:
        return self.specs[self.stored(name)]

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.spec(name)
        handle = self._handles.get(spec.file)
        if handle is None:
            handle = self._handles[spec.file] = safe_open(str(spec.file), framework="pt")
        return handle.get_tensor(self.stored(name))

    def __iter__(self) -> Iterator[str]:
        yield from self.specs
        yield from self.aliases

    def __len__(self) -> int:
        return len(self.specs) + len(self.aliases)

    def __contains__(self, name: object) -> bool:
        return name in self.specs or name in self.aliases


def read_state(path: str | Path) -> SafetensorsState:
    """The lazy view of a safetensors file or a `save_pretrained` directory; WeightsError when neither."""
    p = Path(path)
    if not p.exists():
        raise WeightsError(f"weights {p}: no such file or directory: give a .safetensors file or a directory "
                           f"written by save_pretrained (holding {SINGLE} or {INDEX})")
    if p.is_file():
        return single_file(p)
    if (p / SINGLE).is_file():
        return single_file(p / SINGLE)
    if (p / INDEX).is_file():
        return sharded(p / INDEX)
    raise WeightsError(f"weights {p}: the directory holds neither {SINGLE} nor {INDEX}{_found(p)}")


def _found(directory: Path) -> str:
    """What a directory without weights does hold, so the message says what to do instead."""
    names = sorted(f.name for f in directory.iterdir() if f.is_file())
    tensors = [n for n in names if n.endswith(".safetensors")]
    if tensors:
        return f"; it has {', '.join(tensors[:3])}: pass that file itself"
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        return (f"; it has {', '.join(pickles[:3])}, a pickle, which is never loaded (it can run code): "
                "re-save the model with save_pretrained (safetensors is its default)")
    return ": give a .safetensors file or a directory written by save_pretrained"


def single_file(path: Path) -> SafetensorsState:
    specs, metadata = read_header(path)
    aliases = _aliases(path, metadata.get(ALIASES_KEY))
    return SafetensorsState(str(path), specs, aliases)


def _aliases(path: Path, text: str | None) -> dict[str, str]:
    if text is None:
        return {}
    try:
        aliases = json.loads(text)
    except json.JSONDecodeError:
        aliases = None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise WeightsError(f"{path}: header metadata {ALIASES_KEY} must be a JSON object of alias -> name")
    return aliases


def read_header(path: Path) -> tuple[dict[str, TensorSpec], dict[str, str]]:
    """The tensors a safetensors file declares and its metadata, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > size - 8 or length > MAX_HEADER_BYTES:
            raise WeightsError(f"{path} is truncated or not a safetensors file (its first 8 bytes give a "
                               f"{length}-byte header, the file has {size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise WeightsError(f"{path} is not a safetensors file (its {length}-byte header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    specs = {name: _spec(path, name, entry) for name, entry in header.items()}
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end != size - 8 - length:
        raise WeightsError(f"{path} is truncated or not a safetensors file (header says {end} bytes of data, "
                           f"the file has {size - 8 - length})")
    return specs, metadata


def _spec(path: Path, name: str, entry: object) -> TensorSpec:
    """One header entry, checked: a known dtype, a shape of naturals, offsets spanning its bytes."""
    ok = isinstance(entry, dict) and entry.get("dtype") in DTYPES and isinstance(entry.get("shape"), list) \
        and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2 \
        and all(isinstance(x, int) and x >= 0 for x in entry["shape"] + entry["data_offsets"])
    if not ok:
        raise WeightsError(f"{path} is not a safetensors file this runner reads: tensor {name!r} has header "
                           f"{json.dumps(entry)[:200]} (dtype one of {', '.join(DTYPES)}, shape, data_offsets)")
    dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
    start, stop = entry["data_offsets"]
    if stop - start != math.prod(shape) * dtype.itemsize:
        raise WeightsError(f"{path} is corrupt: tensor {name} of shape {list(shape)} {entry['dtype']} spans "
                           f"{stop - start} bytes, not {math.prod(shape) * dtype.itemsize}")
    return TensorSpec(shape, dtype, path)


def sharded(index: Path) -> SafetensorsState:
    """The shards of a `save_pretrained(max_shard_size=...)` directory, through its index."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index}: not a safetensors index (a JSON object whose weight_map maps names to shards)")
    headers: dict[str, dict[str, TensorSpec]] = {}
    specs = {}
    for name, shard in weight_map.items():
        if shard not in headers:
            headers[shard] = read_header(_shard_path(index, shard))[0]
        if name not in headers[shard]:
            raise WeightsError(f"{index} puts {name} in {shard}, which does not hold it: the save is incomplete "
                               "or mixed with another; save the model again")
        specs[name] = headers[shard][name]
    return SafetensorsState(str(index.parent), specs)


def _shard_path(index: Path, shard: str) -> Path:
    path = index.parent / shard
    if Path(shard).name != shard or not path.is_file():
        raise WeightsError(f"{index} names shard {shard!r}, which is not a file beside it: the save is incomplete")
    return path


# ----------------------------------------------------------------------------- loading


@dataclass
class LoadReport:
    """What `load_pretrained` did, for a one-line summary (`summary()`)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    """Names read from the file, in the model's order."""
    nbytes: int = 0
    cast: dict[str, str] = field(default_factory=dict)
    """name -> "bfloat16->float32" for tensors widened on the way in."""
    tied: dict[str, str] = field(default_factory=dict)
    """alias -> the name it was filled from (one tensor in the model, one in the file)."""
    kept: list[str] = field(default_factory=list)
    """Persistent buffers absent from the file, left as the model was built."""
    ignored: list[str] = field(default_factory=list)
    """Tensors of the file that transformers skips too (stale buffers, the class's ignore list)."""

    def summary(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors ({self.nbytes / 2**20:.1f} MiB) from {self.source}"]
        if self.cast:
            kinds = sorted(set(self.cast.values()))
            parts.append(f"cast {len(self.cast)} ({', '.join(kinds)})")
        if self.tied:
            parts.append(f"tied {', '.join(f'{a}={n}' for a, n in self.tied.items())}")
        if self.kept:
            parts.append(f"kept as built: {', '.join(self.kept)}")
        if self.ignored:
            parts.append(f"ignored: {', '.join(self.ignored)}")
        return "; ".join(parts)


def load_pretrained(module: torch.nn.Module, path: str | Path) -> LoadReport:
    """Fill `module` (the plan's single-device model) from a safetensors file or directory, checked first."""
    return load_state(module, read_state(path))


def load_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str | None = None) -> LoadReport:
    """Check `state` against `module.state_dict()` by the module docstring's rules, then copy it in."""
    targets, picks, report = _checked(module, state, source)
    _copy(targets, picks, state, report)
    return report


def check_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str | None = None) -> LoadReport:
    """The checks of `load_state` without the copy: `module` may live on the meta device (`hap run` checks
    `--init-from` this way before any rank starts, without building the model in memory)."""
    return _checked(module, state, source)[2]


def _checked(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str | None
             ) -> tuple[dict[str, torch.Tensor], dict[str, list[str]], LoadReport]:
    source = source or getattr(state, "source", "the state")
    targets = module.state_dict(keep_vars=True)
    groups = tie_groups(targets)
    params = {id(p) for p in module.parameters()}
    report = LoadReport(source)
    _check_names(module, targets, groups, params, state, report)
    picks = {group[0]: _present(group, state) for group in groups if _present(group, state)}
    for group in groups:
        if group[0] in picks:
            _check_ties(group, picks[group[0]], state, report)
            _check_tensor(picks[group[0]][0], targets[group[0]], state, report)
    return targets, picks, report


def tie_groups(targets: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names of a state dict grouped by the tensor they are (tied weights share one), in state-dict order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _present(group: list[str], state: Mapping[str, torch.Tensor]) -> list[str]:
    return [n for n in group if n in state]


def _check_names(module: torch.nn.Module, targets: dict[str, torch.Tensor], groups: list[list[str]],
                 params: set[int], state: Mapping[str, torch.Tensor], report: LoadReport) -> None:
    """Refuse a missing parameter or an unexpected tensor, naming the first; note kept buffers, ignored extras."""
    missing = []
    for group in groups:
        if not _present(group, state):
            (missing if id(targets[group[0]]) in params else report.kept).extend(group)
    extra = [n for n in state if n not in targets]
    skip = ignorable(module, set(targets))
    report.ignored = [n for n in extra if skip(n)]
    unexpected = [n for n in extra if not skip(n)]
    if missing:
        also = f", and it holds {len(unexpected)} tensors the model lacks, e.g. {unexpected[0]}" if unexpected else ""
        raise WeightsError(f"{report.source} has no tensor {missing[0]} ({len(missing)} of the model's "
                           f"{len(targets)} missing{also}): {HINT}")
    if unexpected:
        raise WeightsError(f"{report.source} holds {unexpected[0]}, which the model has no tensor for "
                           f"({len(unexpected)} such): {HINT}")


def ignorable(module: torch.nn.Module, persistent: set[str]) -> Callable[[str], bool]:
    """The test for file tensors transformers skips on load (the rules in the module docstring)."""
    patterns = [re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []]
    param_leaves = {n.rsplit(".", 1)[-1] for n, _ in module.named_parameters()}
    stale = {n.rsplit(".", 1)[-1] for n, _ in module.named_buffers() if n not in persistent} - param_leaves
    return lambda name: name.rsplit(".", 1)[-1] in stale or any(p.search(name) for p in patterns)


def _check_ties(group: list[str], present: list[str], state: Mapping[str, torch.Tensor], report: LoadReport) -> None:
    """Aliases of one tensor filled through the tie; two in the file must be equal (the model keeps one)."""
    first = present[0]
    stored = getattr(state, "stored", lambda n: n)
    for other in present[1:]:
        if stored(other) != stored(first) and not torch.equal(state[first], state[other]):
            raise WeightsError(f"{report.source} holds different {first} and {other}, which the model ties (one "
                               "tensor): the weights are for an untied model? plan it with the file's ties")
    report.tied.update({n: first for n in group if n not in present})


def _check_tensor(name: str, target: torch.Tensor, state: Mapping[str, torch.Tensor], report: LoadReport) -> None:
    shape, dtype = spec_of(state, name)
    if shape != tuple(target.shape) or not (dtype == target.dtype or widens(dtype, target.dtype)):
        hint = HINT if shape != tuple(target.shape) else _narrowing_hint(dtype, target.dtype)
        raise WeightsError(f"{report.source}: tensor {name} is {list(shape)} {_dt(dtype)} in the file, "
                           f"{list(target.shape)} {_dt(target.dtype)} in the model: {hint}")
    if dtype != target.dtype:
        report.cast[name] = f"{_dt(dtype)}->{_dt(target.dtype)}"


def _narrowing_hint(dtype: torch.dtype, into: torch.dtype) -> str:
    return (f"casting {_dt(dtype)} to {_dt(into)} would lose values; plan the model in {_dt(dtype)} "
            "or a wider dtype, or convert the file")


def spec_of(state: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a tensor of `state` without reading it when the state is a file."""
    if isinstance(state, SafetensorsState):
        spec = state.spec(name)
        return spec.shape, spec.dtype
    return tuple(state[name].shape), state[name].dtype


def widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of `source` is exactly a value of `target` of the same kind (float or integer)."""
    if source.is_floating_point and target.is_floating_point:
        return torch.promote_types(source, target) == target
    integer = not (source.is_floating_point or source.is_complex or source == torch.bool)
    integer_into = not (target.is_floating_point or target.is_complex or target == torch.bool)
    return integer and integer_into and torch.promote_types(source, target) == target


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _copy(targets: dict[str, torch.Tensor], picks: dict[str, list[str]], state: Mapping[str, torch.Tensor],
          report: LoadReport) -> None:
    """Copy one file tensor at a time into the model's own tensors (ties stay one tensor)."""
    with torch.no_grad():
        for first, present in picks.items():
            tensor = state[present[0]]
            targets[first].copy_(tensor)
            report.loaded.extend(present)
            report.nbytes += tensor.numel() * tensor.element_size()
            del tensor


# ----------------------------------------------------------------------------- the trained model


def module_with_state(plan: Plan, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The plan's single-device model holding a full state (gathered from the ranks), to save it.

    Built as `runner.train.build_module(plan, 0)` without touching the caller's RNG; `state` holds
    parameter names (`named_parameters(remove_duplicate=False)`); missing buffers keep their built
    values (they are not trained); any other missing or unknown name, shape or dtype is refused."""
    with torch.random.fork_rng(devices=[]):
        module = build_module(plan, 0)
    load_state(module, state, source="the gathered state")
    return module


def state_dict_for_save(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state with each shared tensor once (the first name kept), and alias -> kept name."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in module.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype) if tensor.numel() else ("empty", name)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor.detach().contiguous()
    return _unshare(tensors), aliases


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors that overlap another's storage without being it (views): safetensors refuses them."""
    owners: dict[int, str] = {}
    out = {}
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if tensor.numel() and ptr in owners else tensor
        owners.setdefault(ptr, name)
    return out


def is_transformers_model(module: torch.nn.Module) -> bool:
    """A transformers `PreTrainedModel` (without importing transformers when nothing has)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def save_model(out_dir: str | Path, module: torch.nn.Module, tokenizer_dir: str | Path | None = None) -> list[Path]:
    """Write `module` (and the tokenizer files of `tokenizer_dir`) to `out_dir`, replacing a previous save
    only once the new one is complete; the paths written, sorted."""
    out = Path(out_dir).absolute()  # "." has no name to put a temporary beside
    _check_replaceable(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_model(tmp, module)
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), tmp)
        _sync(tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p for p in out.iterdir() if p.is_file())


def write_model(directory: Path, module: torch.nn.Module) -> None:
    """`save_pretrained` for transformers models, else one model.safetensors with aliases in its header."""
    if is_transformers_model(module):
        module.save_pretrained(directory)
        return
    tensors, aliases = state_dict_for_save(module)
    save_file(tensors, str(directory / SINGLE), metadata={"format": "pt", ALIASES_KEY: json.dumps(aliases)})


def copy_tokenizer(tokenizer_dir: Path, directory: Path) -> None:
    """Copy the tokenizer files `transformers.AutoTokenizer.from_pretrained` reads."""
    found = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not found:
        raise WeightsError(f"tokenizer {tokenizer_dir}: no tokenizer files there (looked for "
                           f"{', '.join(TOKENIZER_FILES[:3])}, ...): give the directory a tokenizer was saved to")
    for path in found:
        shutil.copyfile(path, directory / path.name)


def _check_replaceable(out: Path) -> None:
    """Refuse to replace a file, or a directory that is not an earlier save (it would be deleted)."""
    if out.exists() and not out.is_dir():
        raise WeightsError(f"save model: {out} is a file: give a directory to save the model to")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in SAVED_MARKERS):
        raise WeightsError(f"save model: {out} holds other files and no saved model ({', '.join(SAVED_MARKERS)}); "
                           "it would be replaced: give a new or empty directory")


def _sync(directory: Path) -> None:
    """Flush the written files to disk before the rename makes them the save."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _replace(tmp: Path, out: Path) -> None:
    """Rename the complete `tmp` to `out`; a previous `out` moves aside first and is deleted after."""
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
