"""Model sources: where a model comes from, so the planner can capture it and the runner rebuild it.

A model spec (the `--model` of `hap plan`, the first argument of `engine.load_model`) is one of

    zoo:NAME                    a zoo model and its knobs               origin {"zoo", "config"}
    path/to/model.py            a Python file (the contract below)      origin {"file", "sha256", "inputs"}
    hf:ClassName                a transformers class built from its     origin {"hf", "config", "inputs"}
                                config only (never a download)
    graph.json                  a saved graph IR (its own origin)

and the captured graph records its origin, so `hap run` rebuilds the same module on every rank
from the same seed and makes the same batch of every step (`build_module`, `make_batch`).

The file contract (the same as the workbench's upload):

    def build_model() -> torch.nn.Module   # forward returns the scalar loss (or an output with .loss)
    def example_inputs() -> tuple | dict   # the forward's arguments

Both create their tensors on the default device: the engine calls them under `torch.device("meta")`
to plan (no weight is allocated; a model that cannot be built on meta is built on the CPU), the
runner on the CPU. `example_inputs()` must draw its random data from torch's global RNG
(`torch.randn`, `torch.randint` without a generator): the runner seeds that RNG with (seed, step)
before each call, so every step has a new batch, the same on every rank and in the reference run.
The plan holds no code: it names the file and its sha256, and a changed file is refused.

The `hf:` form takes the class's default config, then a JSON config file, then `key=value`
overrides (keys of the transformers config), plus the input knobs `batch`, `seq_len` and, for
vision models whose config has no `image_size`, `image_size`. Inputs follow the class's task:
token ids, an all-ones attention mask and labels for language models (decoder ids too for
encoder-decoders), pixel values and class labels for image classifiers. A class whose name has no
known suffix gets its task from what its forward takes (`task_by_signature`), and each input goes
only where the forward takes it (no attention mask for FNet, no decoder ids for a decoder-only VLM).
Where the forward's docstring gives ids or labels a shape with a size of the config among its dims
(MusicGen's row of ids and label per codebook), the batch has that shape (`config_layout`). A
language model that merges an image or audio with its tokens by position, not at placeholder ids
(GIT's image before the text, Voxtral Realtime's audio added to every token), gets pixels sized by its
vision config or audio frames by its config's audio length per token (`merged_by_position`); a
model that takes its image already cut into patches (a vision config with num_patches, no
image_size: SigLIP 2) gets them on a grid, with its all-ones patch mask and grid shape; and a masked
LM whose head predicts a fixed number of positions (Perceiver) gets that many tokens.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import inspect
import json
import math
import re
import sys
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from engine import limits
from engine.errors import BuildError, MissingInputError, ModelError, UnsupportedOpError
from engine.model.capture import ValuedScalars, capture
from engine.model.capture import load_model as _load_other
from engine.model.capture import loss_of, model_line
from engine.model.graph import Graph
from engine.model.values import KnownValues
from engine.readers import check_size, read_bytes, read_json

HF_PREFIX = "hf:"
BATCH_SEED = 100003
"""Step batches are seeded with seed * BATCH_SEED + step (the zoo's rule)."""


def load_model(model: Any, example_inputs: tuple | dict | None = None, *, fallback: str | None = None,
               config: str | Path | dict | None = None, **knobs: Any) -> Graph:
    """The one entry to get a Graph: `"zoo:NAME"` + knobs, `"path/model.py"`, `"hf:Class"` + config
    and knobs, a graph JSON path, a Graph, or a module + example inputs (see engine.model.capture.load_model)."""
    if isinstance(model, (str, Path)) and str(model).startswith(HF_PREFIX):
        return capture_hf(hf_spec(str(model), config, knobs), fallback=fallback)
    if config is not None:
        raise ModelError("config= (--config) applies to Hugging Face models only ('hf:ClassName')")
    if isinstance(model, (str, Path)) and str(model).endswith(".py"):
        if knobs:
            raise ModelError(f"knobs {sorted(knobs)} do not apply to a model file: set sizes in its build_model()")
        return capture_file(model, fallback=fallback)
    return _load_other(model, example_inputs, fallback=fallback, **knobs)


# ----------------------------------------------------------------------------- batches as data


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class CallShape:
    """How a flat tuple of tensors (capture's input order) becomes the forward's args and kwargs."""

    spec: pytree.TreeSpec
    tensor_at: tuple[bool, ...]
    """Which leaves are tensors (the others are constants kept from the example)."""
    constants: tuple[Any, ...]

    @staticmethod
    def of(inputs: tuple | dict) -> "CallShape":
        leaves, spec = pytree.tree_flatten(call_args(inputs))
        at = tuple(isinstance(x, torch.Tensor) for x in leaves)
        return CallShape(spec, at, tuple(None if t else x for x, t in zip(leaves, at)))

    def call(self, flat: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        tensors = iter(flat)
        leaves = [next(tensors) if t else c for t, c in zip(self.tensor_at, self.constants)]
        return pytree.tree_unflatten(leaves, self.spec)


def call_args(inputs: tuple | dict) -> tuple[tuple, dict]:
    """(args, kwargs) of example inputs: a dict is keywords, anything else positional (as capture does)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}


def flat_tensors(inputs: tuple | dict) -> tuple[torch.Tensor, ...]:
    """The tensors of example inputs in capture's order (placeholder `index` 0, 1, ...)."""
    return tuple(x for x in pytree.tree_leaves(call_args(inputs)) if isinstance(x, torch.Tensor))


def input_spec(inputs: tuple | dict) -> list[dict[str, Any]]:
    """Name, shape and dtype of every input tensor, as the plan records them."""
    out = []
    for path, x in pytree.tree_flatten_with_path(call_args(inputs))[0]:
        if isinstance(x, torch.Tensor):
            out.append({"name": pytree.keystr(path[1:]), "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")})
    return out


def flat_forward(model: torch.nn.Module, shape: CallShape) -> torch.nn.Module:
    """`model` itself (parameter names unchanged) with a forward that takes the flat batch and returns the loss."""
    inner = model.forward

    def forward(*flat: torch.Tensor) -> torch.Tensor:
        args, kwargs = shape.call(flat)
        return loss_of(inner(*args, **kwargs))

    model.forward = forward  # an instance attribute: nn.Module.__call__ runs it with the hooks as usual
    return model


# ----------------------------------------------------------------------------- model files


def read_model_file(path: str | Path) -> bytes:
    """A model file's bytes, bounded by MAX_MODEL_FILE_BYTES; ModelError when missing or no regular file."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file '{p}' not found: give a Python file defining build_model() and example_inputs()")
    return _read_source(p, f"model file '{p}'")


def _read_source(path: Path, what: str) -> bytes:
    """Python source read within engine.readers' bounds (no FIFO, device or oversized file)."""
    return read_bytes(path, what, ModelError, max_bytes=limits.MAX_MODEL_FILE_BYTES, expect="a Python file (.py)")


_LOADED: dict[str, ModuleType] = {}
"""Model files already executed in this process, by sha256 (the runner asks for batches every step)."""


def exec_model_file(source: bytes, filename: str) -> ModuleType:
    """Execute a model file's code (the caller has the user's consent) and check its two functions."""
    digest = sha256_of(source)
    if digest in _LOADED:
        return _LOADED[digest]
    name = f"hap_model_{digest[:12]}"
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    try:
        exec(compile(source.decode("utf-8"), filename, "exec"), module.__dict__)  # noqa: S102 (consent: see docstring)
    except Exception as e:  # user code may raise anything; one line
        del sys.modules[name]
        raise ModelError(f"model file {filename}: {type(e).__name__}: {first_line(e)}") from None
    for fn in ("build_model", "example_inputs"):
        if not callable(module.__dict__.get(fn)):
            del sys.modules[name]
            raise ModelError(f"model file {filename}: no function {fn}() defined (the file must define build_model() "
                             "and example_inputs())")
    _LOADED[digest] = module
    return module


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def call_file_function(filename: str, what: str, fn: Callable[[], Any]) -> Any:
    """`fn()` of a model file, its exception turned into one ModelError line naming the file and function."""
    try:
        return fn()
    except Exception as e:
        raise ModelError(f"model file {filename}: {what}() failed: {type(e).__name__}: {first_line(e)}") from None


def build_on_meta(module: ModuleType, filename: str) -> tuple[torch.nn.Module, tuple | dict]:
    """The file's model and example inputs on `meta` (nothing allocated), or on the CPU when meta fails."""
    try:
        with torch.device("meta"):
            return module.build_model(), module.example_inputs()
    except Exception:  # e.g. .item() or numpy at build time: meta tensors hold no data
        return call_file_function(filename, "build_model", module.build_model), call_file_function(filename, "example_inputs", module.example_inputs)


def capture_file(path: str | Path, *, fallback: str | None = None) -> Graph:
    """Capture the model of a Python file; the graph's origin names the file and its sha256."""
    p = Path(path)
    return capture_source(read_model_file(p), p.name, fallback=fallback, path=str(p.resolve()))


def capture_source(source: bytes, filename: str, *, fallback: str | None = None, path: str | None = None) -> Graph:
    """Capture the model of a model file's text (an upload has no `path`: its origin names the file only)."""
    check_size(len(source), f"model file {filename}", ModelError, limits.MAX_MODEL_FILE_BYTES)
    module = exec_model_file(source, filename)
    model, inputs = build_on_meta(module, filename)
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model file {filename}: build_model() returned {type(model).__name__}, not a torch.nn.Module")
    origin = {"file": path or filename, "sha256": sha256_of(source), "inputs": input_spec(inputs)}
    return capture(model, inputs, name=Path(filename).stem, origin=origin, fallback=fallback)


def checked_file(origin: dict[str, Any]) -> tuple[bytes, str]:
    """The plan's model file (bytes, name), refused when it changed since the plan was made."""
    path = Path(origin["file"])
    if not path.exists():
        raise ModelError(f"model file '{path}' of this plan not found: put it back there, or plan again with "
                         f"`hap plan --model FILE.py`")
    data = _read_source(path, f"model file '{path}' of this plan")
    if sha256_of(data) != origin.get("sha256"):
        raise ModelError(f"model file '{path}' changed since the plan was made (sha256 {sha256_of(data)[:12]}... "
                         f"!= {str(origin.get('sha256'))[:12]}... in the plan): plan again with `hap plan --model {path}`")
    return data, path.name


def file_inputs(module: ModuleType, filename: str, seed: int) -> tuple | dict:
    """The file's example inputs on the CPU, drawn from torch's global RNG seeded with `seed` (restored after)."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        inputs = call_file_function(filename, "example_inputs", module.example_inputs)
    if any(t.is_meta for t in flat_tensors(inputs)):
        raise ModelError(f"model file {filename}: example_inputs() returned meta tensors; the runner needs data: create "
                         "them without device= (the engine plans them on meta itself)")
    return inputs


# ----------------------------------------------------------------------------- Hugging Face


TASKS = (("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"), ("ForMaskedLM", "masked_lm"),
         ("ForConditionalGeneration", "seq2seq_lm"), ("ForSeq2SeqLM", "seq2seq_lm"),
         ("ForSequenceClassification", "sequence_classification"), ("ForImageClassification", "image_classification"))
"""Class-name suffix -> the task whose inputs and labels the runner draws."""
HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "GPT2LMHeadModel",
              "GPTNeoXForCausalLM", "OPTForCausalLM", "PhiForCausalLM", "GemmaForCausalLM", "BertForMaskedLM",
              "RobertaForMaskedLM", "DistilBertForMaskedLM", "BertForSequenceClassification", "T5ForConditionalGeneration",
              "BartForConditionalGeneration", "ViTForImageClassification", "ResNetForImageClassification",
              "ConvNextForImageClassification", "SwinForImageClassification")
"""Classes offered by the workbench's picker (any class of a task above works from the CLI)."""
INPUT_KNOBS = ("batch", "seq_len", "image_size")
DEFAULT_BATCH = 8
DEFAULT_SEQ_LEN = 128
DEFAULT_IMAGE_SIZE = 224


@dataclass(frozen=True)
class HFSpec:
    """A transformers class, its full config and the input sizes: everything to rebuild model and batches."""

    cls: str
    config: dict[str, Any]
    """The full config (`to_dict()`), as the plan records it."""
    task: str
    inputs: dict[str, int] = field(default_factory=dict)
    """batch, seq_len (token ids), image_size or patches (pixels), audio_frames (audio features): the sizes of
    every batch, which `hf_inputs` makes from them and the config alone."""
    implementation: dict[str, str] = field(default_factory=dict)
    """The kernels picked where transformers offers several ({"experts": "hap_dense"}): not part of a
    config's `to_dict()`, so recorded beside it for the runner to rebuild the same model."""
    adjusted: dict[str, Any] = field(default_factory=dict)
    """Config keys the capture changed from the class's default (key -> the default), e.g. LayerDrop off."""

    def origin(self) -> dict[str, Any]:
        out = {"hf": self.cls, "config": self.config, "task": self.task, "inputs": dict(self.inputs)}
        if self.implementation:
            out["implementation"] = dict(self.implementation)
        if self.adjusted:
            out["adjusted"] = dict(self.adjusted)
        return out


def transformers_module() -> ModuleType:
    from engine.model.zoo.hf import _transformers  # HF_HUB_OFFLINE=1 and a one-line error without transformers

    return _transformers()


def hf_class(name: str) -> type:
    """The transformers class `name` (one of a supported task); ModelError otherwise."""
    t = transformers_module()
    cls = getattr(t, name, None) if name.isidentifier() else None
    if not isinstance(cls, type) or not hasattr(cls, "config_class"):
        near = difflib.get_close_matches(name, HF_CLASSES, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else f" (e.g. {', '.join(HF_CLASSES[:4])})"
        raise ModelError(f"hf:{name}: transformers has no model class '{name}'{hint}")
    task_of(name)
    return cls


def task_of(name: str) -> str:
    """The task whose inputs and labels the class gets: by its name's suffix (TASKS), else by what its forward
    takes (`task_by_signature`: BertGenerationDecoder, ReformerModelWithLMHead, EncoderDecoderModel, ...)."""
    for suffix, task in TASKS:
        if name.endswith(suffix):
            return task
    task = task_by_signature(forward_params(name))
    if task is None:
        raise ModelError(f"hf:{name}: no inputs known for this class (its forward takes no labels with input_ids or "
                         f"pixel_values); use a class ending in {', '.join(s for s, _ in TASKS)}, or write a model file")
    return task


@functools.cache
def forward_params(name: str) -> frozenset[str]:
    """The keyword parameters of the transformers class's forward (empty when it has none by name); read once
    per class, as the task, the input sizes, every batch and the build all ask."""
    forward = getattr(getattr(transformers_module(), name, None), "forward", None)
    try:
        return frozenset(inspect.signature(forward).parameters) if callable(forward) else frozenset()
    except (TypeError, ValueError):  # no signature to read
        return frozenset()


def task_by_signature(params: frozenset[str]) -> str | None:
    """A training head named by no TASKS suffix, told by its forward's parameters: labels with decoder ids is a
    sequence-to-sequence LM, labels with token ids a causal LM, labels with pixels an image classifier."""
    if "labels" not in params:
        return None
    if "decoder_input_ids" in params:
        return "seq2seq_lm"
    if "input_ids" in params:
        return "causal_lm"
    return "image_classification" if "pixel_values" in params else None


IMPLEMENTATIONS = {"experts": ("hap_dense", "batched_mm", "grouped_mm", "eager"), "attn": ("eager", "sdpa")}
"""The implementation knobs (`--set experts_implementation=...`, `attn_implementation=...`) and the values the
capture can take: the first of "experts" is the default for a mixture-of-experts class."""
CAPTURABLE_EXPERTS = "hap_dense"
"""transformers' default experts kernel (`grouped_mm`) sizes its groups with `histc` and `eager` loops over the
`nonzero()` experts: both data-dependent shapes; `batched_mm` captures but gathers a weight copy per routed token.
`hap_dense` (engine.model.zoo.experts) runs every expert on every token, weighted: it captures at real sizes."""


def implementation_of(name: str, values: dict[str, Any]) -> dict[str, str]:
    """Pop the implementation knobs from `values`, checked; a class whose experts can be switched gets
    CAPTURABLE_EXPERTS unless the user named another, so MoE families capture without a hand-set option."""
    picked = {}
    for kind, allowed in IMPLEMENTATIONS.items():
        value = values.pop(f"{kind}_implementation", None)
        if value is None:
            continue
        if value not in allowed:
            raise ModelError(f"hf:{name}: {kind}_implementation must be one of {', '.join(allowed)} "
                             f"(the ones the capture can take), got {value!r}")
        picked[kind] = value
    if "experts" not in picked and _switchable_experts(name):
        picked["experts"] = CAPTURABLE_EXPERTS
    return picked


def _switchable_experts(name: str) -> bool:
    """Whether the transformers class has experts whose kernel can be chosen (`@use_experts_implementation`), in
    its own module or, for a composite model (a speech model around a MoE decoder), in a sub-config's model's:
    transformers sets the implementation on every sub-config."""
    can = getattr(hf_class(name), "_can_set_experts_implementation", None)
    try:
        if callable(can) and can():
            return True
        return any(_experts_in_module(type(sub).__module__) for sub in _sub_configs(default_config(name)))
    except Exception:  # transformers reads the class's source file: a missing file means "cannot tell": leave it
        return False


def _sub_configs(cfg: Any) -> list[Any]:
    """The config's sub-configs, theirs in turn, and so on."""
    subs = [s for key in getattr(cfg, "sub_configs", {}) if (s := getattr(cfg, key, None)) is not None]
    return subs + [deeper for s in subs for deeper in _sub_configs(s)]


def _experts_in_module(config_module: str) -> bool:
    """Whether the modeling module beside a configuration module has switchable experts."""
    modeling = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    return "@use_experts_implementation" in inspect.getsource(modeling)


DATA_DEPENDENT_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
"""Config keys whose non-zero default makes forward branch on a random draw (LayerDrop skips whole layers
with `if torch.rand([]) < p`), which no static capture can hold: set to 0 unless the user set them."""


def without_data_dependent_defaults(default: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Set each DATA_DEPENDENT_KEYS key whose default is non-zero and that the user left unset to 0.0 in
    `values`; returns {key: default} of what was changed (recorded in the origin and said by `hap plan`)."""
    changed = {}
    for key in DATA_DEPENDENT_KEYS:
        value = getattr(default, key, None)
        if key not in values and isinstance(value, (int, float)) and value:
            values[key], changed[key] = 0.0, value
    return changed


READS_IS_DECODER = re.compile(r"\bconfig\.is_decoder\b(?!\s*=(?!=))")
"""A read of the config's is_decoder (not an assignment, as in GPT-NeoX's docstring example)."""


def as_decoder(name: str, default: Any, values: dict[str, Any]) -> dict[str, Any]:
    """A causal LM whose modeling code reads `is_decoder` (BertLMHeadModel, BertGenerationDecoder, Reformer's LM
    head, which refuses to build without it) gets is_decoder=True unless the user set it: with the default False
    its layers attend to later tokens, which a next-token loss must not see. Returns {key: default} if changed."""
    if "is_decoder" in values or getattr(default, "is_decoder", None) is not False or task_of(name) != "causal_lm":
        return {}
    cls = hf_class(name)
    try:
        reads = READS_IS_DECODER.search(inspect.getsource(inspect.getmodule(cls))) is not None
    except (OSError, TypeError):  # no source to read: leave the config as it is
        return {}
    if reads:
        values["is_decoder"] = True
        return {"is_decoder": False}
    return {}


def adjusted_note(key: str, default: Any) -> str:
    """What `hap plan` says of a config key the capture changed from the class's default, and why."""
    if key == "is_decoder":
        return (f"note: is_decoder set to true (the default {json.dumps(default)} lets this causal LM's layers attend "
                "to later tokens, which its next-token loss must not see; --set is_decoder=false keeps it)")
    return (f"note: {key} set to 0 (the default {default} skips layers at random in forward, which no captured "
            "program can hold; the run trains with 0 too)")


def parse_value(text: Any) -> Any:
    """A --set value: JSON when it parses (numbers, true/false, null, lists), else the string itself."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, an int past 4300 digits, deep brackets: the knob checks say why
        return text


def read_config(config: str | Path | dict | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    p = Path(config)
    if not p.exists():
        raise ModelError(f"--config {p}: file not found")
    d = read_json(p, f"--config {p}", ModelError)
    if not isinstance(d, dict):
        raise ModelError(f"--config {p}: expected a JSON object of config keys, got {type(d).__name__}")
    return d


def hf_spec(model: str, config: str | Path | dict | None = None, knobs: dict[str, Any] | None = None) -> HFSpec:
    """Parse `hf:Class` + config file/dict + key=value knobs into a full config and input sizes."""
    name = model[len(HF_PREFIX):].strip()
    if not name:
        raise ModelError("hf: needs a class name, e.g. hf:LlamaForCausalLM")
    values = {**read_config(config), **{k: parse_value(v) for k, v in (knobs or {}).items()}}  # before transformers loads
    cls = hf_class(name)
    implementation = implementation_of(name, values)
    default = default_config(name)
    known = set(default.to_dict()) | {"num_labels"}
    inputs = {k: values.pop(k) for k in INPUT_KNOBS if k in values and not (k == "image_size" and k in known)}
    bad = sorted(k for k in values if k not in known and not hasattr(default, k))
    if bad:
        near = difflib.get_close_matches(bad[0], sorted(known), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ModelError(f"hf:{name}: '{bad[0]}' is not a key of {type(default).__name__} nor an input knob "
                         f"({', '.join(INPUT_KNOBS)}){hint}")
    adjusted = without_data_dependent_defaults(default, values) | as_decoder(name, default, values)
    if "use_cache" not in values and getattr(default, "use_cache", False) is True:
        values["use_cache"] = False  # training keeps no KV cache; hybrid models' caches also refuse capture
    try:
        cfg = cls.config_class(**values)
    except Exception as e:  # transformers validates in many ways
        raise ModelError(f"hf:{name}: bad config: {root_cause(e)}") from None
    task = task_of(name)
    spec = HFSpec(name, json.loads(cfg.to_json_string(use_diff=False)), task, input_sizes(name, cfg, task, inputs),
                  implementation, adjusted)
    return at_head_positions(spec, chosen="seq_len" in inputs)


def at_head_positions(spec: HFSpec, chosen: bool) -> HFSpec:
    """A masked LM whose head predicts a fixed number of positions whatever the input's length (Perceiver's decoder
    queries its config's max_position_embeddings positions) gets that many tokens, as its labels must be one per
    predicted position; a seq_len the user chose otherwise is refused, naming the number."""
    if spec.task != "masked_lm" or "seq_len" not in spec.inputs:
        return spec
    positions, seq = predicted_positions(spec), spec.inputs["seq_len"]
    if positions is None or positions == seq:
        return spec
    keys = sorted(k for k, v in spec.config.items() if v == positions and not isinstance(v, bool))
    why = f"hf:{spec.cls} predicts {positions} positions whatever its input's length"
    if chosen:
        raise ModelError(f"{why} ({', '.join(keys) or 'fixed by its code'}): its labels are one per predicted "
                         f"position, so seq_len must be {positions}, not {seq}")
    limit = max_positions(hf_config(spec))
    if limit is not None and positions > limit:
        raise ModelError(f"{why}, more than its {limit} positions (max_position_embeddings): no seq_len fits both")
    return replace(spec, inputs={**spec.inputs, "seq_len": positions})


def predicted_positions(spec: HFSpec) -> int | None:
    """The positions the model's logits cover on the spec's batch without labels, from a forward on meta (nothing
    allocated) that decides branches on the all-ones masks as the capture does (`KnownValues`); None where that
    forward fails or gives no per-position logits."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]), torch.no_grad():
            model, batch = all_on_meta(hf_build(spec)), hf_inputs(spec)
            batch.pop("labels")
            known = {k: torch.ones(tuple(v.shape), dtype=v.dtype, device="cpu") for k, v in batch.items()
                     if k in ALL_ONES_INPUTS}
            with ValuedScalars(), KnownValues(known) as values:
                values.seed(batch)
                out = model(**batch)
    except Exception:  # a forward that needs data (or the known-values capture) says nothing here: keep seq_len
        return None
    logits = getattr(out, "logits", None)
    return logits.shape[1] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None


def default_config(name: str) -> Any:
    """The class's default config (the spec checks the user's keys against it); ModelError when transformers'
    own default does not validate (Gemma4Assistant's default text config)."""
    try:
        return hf_class(name).config_class()
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"hf:{name}: transformers' default config does not validate: {root_cause(e)}; pass a "
                         "config that does (--config FILE, or --set the keys it names)") from None


def root_cause(e: BaseException) -> str:
    """Type and first line of the innermost cause: a strict config's validation error says only which validator
    failed ('Class validation error for validator ...'), its cause says why."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {first_line(e)}"


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
"""Plain RoPE at the base transformers itself falls back to (`RotaryEmbeddingConfigMixin.default_theta`)."""


def default_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Rotary parameters for a config that leaves them empty: DEFAULT_ROPE, one copy per kind of layer where the
    config has layer kinds (a rotary embedding built per layer type looks its own up; Cohere Compass's default)."""
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        return {kind: dict(DEFAULT_ROPE) for kind in dict.fromkeys(kinds)}
    return dict(DEFAULT_ROPE)


SIZE_RELATIONS: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "head_dim": ("hidden_size // num_attention_heads", lambda c: c["hidden_size"] // c["num_attention_heads"]),
    "num_key_value_heads": ("num_attention_heads", lambda c: c["num_attention_heads"]),
    "layer_types": ('["full_attention"] * num_hidden_layers', lambda c: ["full_attention"] * c["num_hidden_layers"]),
    "rope_parameters": ("plain RoPE, rope_theta 10000, per layer type", default_rope),
    "indexer_n_heads": ("num_attention_heads", lambda c: c["num_attention_heads"]),
    "indexer_head_dim": ("head_dim", lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
    "indexer_kv_heads": ("1: the indexer's one key head, shared by its queries", lambda c: 1),
    "default_language": ("the first of languages", lambda c: list(c["languages"])[0]),
}
"""Sizes a config may leave None that most configs derive by a standard relation: key -> (the relation, its value)."""
UNSET_SIZE = re.compile(r"^(vocab_size|(\w+_)?head_dim|(\w+_)?(n|kv)_heads|num_key_value_heads|(\w+_)?intermediate_size|"
                        r"layer_types|(n|num)_(routed_|shared_|local_)?experts|num_experts_per_tok(en)?|top_k_experts|"
                        r"moe_topk|rope_parameters|(\w+_)?budget|(\w+_)?compress_ratio|default_language)$")
"""Keys of sizes a model needs when its default config leaves them None (the others' None means 'off'; a sparse
attention's token indexer, Qwen4-Exp's, is built on its layers whatever its sizes say, its budget of tokens and
the keys it pools into a block among them; X-MOD's default language, whose adapters a batch without language ids
runs, X-MOD refusing such a batch otherwise). An empty
`rope_parameters` is unset too: transformers turns None into {} (no rotary parameters at all), which a model with
rotary embeddings cannot build from."""


def is_unset(key: str, value: Any) -> bool:
    """Whether a config value leaves a needed size unset: None, or an empty dict of rotary parameters."""
    return value is None or (key == "rope_parameters" and value == {})


def unset_sizes(config: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The config's UNSET_SIZE keys left unset (`is_unset`): key -> (the standard relation, its value here), or
    ("", None) where there is none."""
    out: dict[str, tuple[str, Any]] = {}
    for key in sorted(k for k, v in config.items() if is_unset(k, v) and UNSET_SIZE.match(k)):
        relation, value = SIZE_RELATIONS.get(key, ("", None))
        try:
            out[key] = (relation, value(config) if value else None)
        except (KeyError, TypeError, ZeroDivisionError):  # its operands are unset too
            out[key] = ("", None)
    return out


def unset_size_hint(config: dict[str, Any]) -> str:
    """What to pass for each size the config leaves None ("" when none is): appended to a build or capture error."""
    unset = unset_sizes(config)
    if not unset:
        return ""
    sets = " ".join(f"--set {k}={json.dumps(v, separators=(',', ':'))} ({rel})" if v is not None else f"--set {k}=N"
                     for k, (rel, v) in unset.items())
    left = ", ".join(f"{k} {'empty' if config.get(k) == {} else 'None'}" for k in unset)
    return f"; the config leaves {left} (transformers' default gives no value): pass {sets}"


def _positive(name: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"hf:{name}: {key} must be a positive integer, got {value!r}")
    return value


def max_positions(cfg: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def takes_tokens(name: str, task: str) -> bool:
    """Whether the class's batch has token ids: every language task, and image classifiers whose forward takes
    them (ImageGPT classifies pixel tokens; ShieldGemma2 reads a prompt beside the image)."""
    return task != "image_classification" or "input_ids" in forward_params(name)


def takes_pixels(name: str, task: str, cfg: Any = None) -> bool:
    """Whether the class's batch has pixel values: image classifiers whose forward takes them, and language models
    that merge an image with the tokens by position (`merged_by_position`)."""
    if task == "image_classification":
        return "pixel_values" in forward_params(name)
    return cfg is not None and merged_by_position(name, cfg, "pixel_values")


MODALITIES = {"pixel_values": ("vision_config", re.compile(r"^(image|img|video)_token_(id|index)$")),
              "input_features": ("audio_config", re.compile(r"^audio_token_(id|index)$"))}
"""A modality's input -> the sub-config of its tower and the config keys of its placeholder token."""
AUDIO_PER_TOKEN = re.compile(r"^audio_length_per_tok(en)?$")
"""Config keys giving the audio frames of one token position (Voxtral Realtime's 8: a stride-2 convolution, then
4 frames stacked per position)."""


def merged_by_position(name: str, cfg: Any, arg: str) -> bool:
    """Whether a language model takes `arg` (pixels, audio features) beside its ids in every batch: its forward
    takes it, its config has that modality's tower and names no placeholder token for it, so the model merges it
    by position (GIT puts the image's patches before the text, Voxtral Realtime adds audio frames to every
    token's embedding) and its loss counts on it. A model with placeholder ids splices the modality in where they
    are; a random batch holds none, so its batch stays text only."""
    tower, placeholder = MODALITIES[arg]
    if arg not in forward_params(name) or getattr(cfg, tower, None) is None:
        return False
    return not any(placeholder.match(k) for c in (cfg, _text(cfg)) for k in c.to_dict())


def image_patches(cfg: Any) -> int | None:
    """The patches of a model that takes its image already cut into patches (SigLIP 2's pixel_values are (batch,
    patches, channels * patch * patch)): its config or vision config gives patch_size and num_patches, no
    image_size; None for a model that takes an image."""
    for c in (cfg, getattr(cfg, "vision_config", None)):
        patches = getattr(c, "num_patches", None)
        if (c is not None and getattr(c, "image_size", None) is None and isinstance(patches, int) and patches > 0
                and _config_int(c, "patch_size")):
            return patches
    return None


def patch_grid(patches: int) -> tuple[int, int]:
    """Rows and columns of an image of exactly `patches` patches, as square as they divide (16 x 16 for 256)."""
    rows = max(r for r in range(1, math.isqrt(patches) + 1) if patches % r == 0)
    return rows, patches // rows


def audio_frames(name: str, cfg: Any, seq_len: int) -> int | None:
    """The audio frames of a batch whose model adds audio to every token position: seq_len times the config's
    audio length per token; None where the batch has no audio (or the config gives no such length)."""
    if not merged_by_position(name, cfg, "input_features"):
        return None
    per_token = next((v for k, v in cfg.to_dict().items() if AUDIO_PER_TOKEN.match(k) and isinstance(v, int)), None)
    return seq_len * per_token if per_token else None


SEQUENCE_RELATIONS: dict[str, tuple[str, Callable[[Any], int | None]]] = {
    "axial_pos_shape": ("the product of axial_pos_shape (axial position embeddings)",
                        lambda c: product(c.axial_pos_shape) if getattr(c, "axial_pos_embds", True) else None),
}
"""Config keys that fix the training sequence length: key -> (the relation, the length it gives, None when off)."""


def product(values: Any) -> int | None:
    """The product of a list of positive ints (None for anything else)."""
    if not isinstance(values, (list, tuple)) or not values or not all(type(v) is int and v > 0 for v in values):
        return None
    out = 1
    for v in values:
        out *= v
    return out


def dictated_seq_len(cfg: Any) -> tuple[str, str, int] | None:
    """(key, relation, length) where the config fixes the training sequence length (Reformer's axial position
    embeddings cover exactly prod(axial_pos_shape) positions in training), else None."""
    for key, (relation, length) in SEQUENCE_RELATIONS.items():
        value = length(cfg) if getattr(cfg, key, None) is not None else None
        if value is not None:
            return key, relation, value
    return None


def input_sizes(name: str, cfg: Any, task: str, knobs: dict[str, Any]) -> dict[str, int]:
    """batch, seq_len (bounded by the model's positions; by default the length the config dictates, if any) where
    the batch has token ids, image_size where it has pixels, audio_frames where it has audio features."""
    out = {"batch": _positive(name, "batch", knobs.get("batch", DEFAULT_BATCH))}
    patches = image_patches(cfg) if takes_pixels(name, task, cfg) else None
    if patches:
        if "image_size" in knobs:
            raise ModelError(f"hf:{name}: this model takes its image cut into {patches} patches, not an image_size: "
                             "set the vision config's num_patches instead")
        out["patches"] = patches
    elif takes_pixels(name, task, cfg):
        size = (getattr(cfg, "image_size", None) or getattr(getattr(cfg, "vision_config", None), "image_size", None)
                or knobs.get("image_size", DEFAULT_IMAGE_SIZE))
        out["image_size"] = _positive(name, "image_size", size[0] if isinstance(size, (list, tuple)) else size)
    elif "image_size" in knobs:
        raise ModelError(f"hf:{name}: image_size applies to models whose batch has pixels (image classifiers, "
                         "models that put an image before the text)")
    if not takes_tokens(name, task):
        return out
    limit, dictated = max_positions(cfg), dictated_seq_len(cfg)
    default = dictated[2] if dictated else min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)
    seq = _positive(name, "seq_len", knobs.get("seq_len", default))
    if dictated and seq != dictated[2]:
        key, relation, length = dictated
        raise ModelError(f"hf:{name}: seq_len {seq} does not fit the config: {relation} is {length}, the only length "
                         f"it trains on; pass seq_len={length}, or set {key} to fit {seq}")
    if limit is not None and seq > limit:
        raise ModelError(f"hf:{name}: seq_len {seq} exceeds the model's {limit} positions (max_position_embeddings)")
    out["seq_len"] = seq
    frames = audio_frames(name, cfg, seq)
    if frames:
        out["audio_frames"] = frames
    return out


def hf_config(spec: HFSpec) -> Any:
    """The spec's config, with its recorded kernel choices set (they are not part of `to_dict()`)."""
    cls = hf_class(spec.cls)
    cfg = cls.config_class.from_dict(special_floats(dict(spec.config)))
    for kind, value in spec.implementation.items():
        if value not in IMPLEMENTATIONS.get(kind, ()):
            raise ModelError(f"hf:{spec.cls}: origin.implementation.{kind} = {value!r} is not one of "
                             f"{', '.join(IMPLEMENTATIONS.get(kind, ()) or ('experts', 'attn'))}; plan the model again")
        setattr(cfg, f"_{kind}_implementation", value)
    with_legacy_rope_theta(cfg)
    return cfg


def with_legacy_rope_theta(cfg: Any, theta: Any = None) -> None:
    """Give each sub-config that declares no `rope_theta` the rotary base of the nearest config above it that has
    one in its `rope_parameters`: transformers 5 moved the base there, but some modeling code still reads the old
    attribute from a sub-config (DBRX's attention from `attn_config`), which then fails to build. Set on the config
    object only, not recorded: every build (capture and runner) sets it alike."""
    rope = getattr(cfg, "rope_parameters", None)
    theta = rope.get("rope_theta", theta) if isinstance(rope, dict) else theta
    for key in getattr(cfg, "sub_configs", {}):
        sub = getattr(cfg, key, None)
        if sub is None or isinstance(sub, (dict, list)):
            continue
        if theta is not None and not hasattr(sub, "rope_theta") and not getattr(sub, "rope_parameters", None):
            sub.rope_theta = theta
        with_legacy_rope_theta(sub, theta)


def special_floats(value: Any) -> Any:
    """The config as recorded, with transformers' JSON spelling of non-finite floats (`{"__float__": "Infinity"}`,
    Mamba2's `time_step_limit`) read back as floats: its strict configs refuse the dict."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and isinstance(value["__float__"], str):
            return float(value["__float__"])
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def _text(cfg: Any) -> Any:
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


SEQUENCE_DIMS = frozenset({"sequence_length", "target_sequence_length", "seq_len", "input_ids_length"})
"""The names transformers' docstrings give the token positions of a documented shape."""


@functools.cache
def documented_shape(name: str, arg: str) -> tuple[str, ...] | None:
    """The shape the class's forward docstring gives `arg` (`labels (`torch.LongTensor` of shape `(batch_size,
    sequence_length, num_codebooks)`)`), as its dims' text; None where it gives none."""
    forward = getattr(getattr(transformers_module(), name, None), "forward", None)
    doc = (forward.__doc__ if callable(forward) else None) or ""
    found = re.search(rf"^\s*{re.escape(arg)} \(`[^`]*` of shape `\(([^)]*)\)`", doc, re.M)
    return tuple(d.strip() for d in found.group(1).split(",") if d.strip()) if found else None


def config_layout(name: str, arg: str, cfg: Any, batch: int, seq_len: int) -> tuple[int, ...] | None:
    """`arg`'s shape where the forward documents it with a size of the config among its dims (MusicGen: input_ids
    `(batch_size * num_codebooks, sequence_length)`, labels `(batch_size, sequence_length, num_codebooks)`); None
    where it documents the plain layout or a dim the config does not size (a docstring copied from another model
    may name sizes its model has not: those are not trusted)."""
    dims, named = documented_shape(name, arg), False
    out = []
    for dim in dims or ():
        size = 1
        for factor in (f.strip().removeprefix("config.") for f in dim.split("*")):
            value = batch if factor == "batch_size" else seq_len if factor in SEQUENCE_DIMS else _config_int(cfg, factor)
            if value is None:
                return None
            named |= factor != "batch_size" and factor not in SEQUENCE_DIMS
            size *= value
        out.append(size)
    return tuple(out) if named else None


def _tower_int(cfg: Any, tower: str, key: str) -> int | None:
    """A size of the config, else of its `tower` sub-config (an image's channels, an audio frame's mel bins)."""
    return _config_int(cfg, key) or _config_int(getattr(cfg, tower, None), key)


def _config_int(cfg: Any, key: str) -> int | None:
    """A positive integer size of the config (or of its text config) named `key`; None when it has none."""
    for c in (cfg, _text(cfg)):
        value = getattr(c, key, None) if key.isidentifier() else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


ALL_ONES_INPUTS = ("attention_mask", "decoder_attention_mask", "pixel_attention_mask")
"""Inputs that `hf_inputs` makes all ones in every batch (no padding): the capture knows their values, so a
Python branch on them (Longformer's global attention, a loss that drops masked positions) is decided."""


def hf_inputs(spec: HFSpec, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The keyword batch of the spec's task (on the current default device; meta for capture): pixels and token
    ids as the sizes say, the attention masks (all ones) where the forward takes them, decoder ids for a
    sequence-to-sequence LM, and labels: a class per sample for classifiers, a token per position for language
    models; ids and labels in the layout the forward documents where it names a config size (`config_layout`)."""
    cfg = hf_config(spec)
    b, takes = spec.inputs["batch"], forward_params(spec.cls)
    out: dict[str, torch.Tensor] = {}
    if "image_size" in spec.inputs:
        s, c = spec.inputs["image_size"], _tower_int(cfg, "vision_config", "num_channels") or 3
        out["pixel_values"] = torch.randn(b, c, s, s, generator=generator)
    if "patches" in spec.inputs:  # cut into patches, all of them the image's (no padding), on a rows x cols grid
        n, c = spec.inputs["patches"], _tower_int(cfg, "vision_config", "num_channels") or 3
        p = _tower_int(cfg, "vision_config", "patch_size")
        out["pixel_values"] = torch.randn(b, n, c * p * p, generator=generator)
        if "pixel_attention_mask" in takes:
            out["pixel_attention_mask"] = torch.ones(b, n, dtype=torch.long)
        if "spatial_shapes" in takes:
            out["spatial_shapes"] = torch.tensor([patch_grid(n)] * b, dtype=torch.long)
    if "audio_frames" in spec.inputs:  # log-mel features as transformers' extractors give them: (batch, bins, frames)
        bins = _tower_int(cfg, "audio_config", "num_mel_bins") or _tower_int(cfg, "audio_config", "feature_size")
        out["input_features"] = torch.randn(b, bins, spec.inputs["audio_frames"], generator=generator)
    vocab = getattr(_text(cfg), "vocab_size", None) or BYTE_IDS  # CANINE reads code points: it has no vocabulary
    if "seq_len" in spec.inputs:
        t = spec.inputs["seq_len"]
        ids = config_layout(spec.cls, "input_ids", cfg, b, t) or (b, t)
        out["input_ids"] = torch.randint(0, vocab, ids, generator=generator)
        if "attention_mask" in takes:
            out["attention_mask"] = torch.ones(b, t, dtype=torch.long)
        if spec.task == "seq2seq_lm" and "decoder_input_ids" in takes:  # not a decoder-only VLM's
            out["decoder_input_ids"] = torch.randint(0, vocab, (b, t), generator=generator)
            if "decoder_attention_mask" in takes:  # else FSMT infers padding from the ids' values (a random pad id)
                out["decoder_attention_mask"] = torch.ones(b, t, dtype=torch.long)
    if spec.task in CLASSIFIERS:
        out["labels"] = torch.randint(0, cfg.num_labels, (b,), generator=generator)
    else:
        t = spec.inputs["seq_len"]
        out["labels"] = torch.randint(0, vocab, config_layout(spec.cls, "labels", cfg, b, t) or (b, t), generator=generator)
    return out


def hf_build(spec: HFSpec) -> torch.nn.Module:
    """The model, built from its config on the current default device (its own init; never a download)."""
    try:
        model = hf_class(spec.cls)(hf_config(spec))
    except ModelError:
        raise
    except Exception as e:
        raise BuildError(f"hf:{spec.cls}: building from the config failed: {type(e).__name__}: {first_line(e)}"
                         f"{unset_size_hint(spec.config)}") from None
    if spec.task in CLASSIFIERS and "labels" not in forward_params(spec.cls):
        model.forward = with_class_loss(model.forward)  # an instance attribute, as flat_forward sets it
    return model


CLASSIFIERS = ("sequence_classification", "image_classification")
BYTE_IDS = 256
"""The token ids of a model whose config has no vocabulary size (tokenizer-free models read bytes or code points)."""


def with_class_loss(forward: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A classifier's forward that takes no labels (PPLCNet returns its class scores as `last_hidden_state`), given
    the loss transformers' classifiers compute: the cross-entropy of its scores against `labels`."""

    def forward_with_loss(*args: Any, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        scores = getattr(out, "logits", None)
        scores = out[0] if scores is None else scores
        return torch.nn.functional.cross_entropy(scores.reshape(labels.shape[0], -1), labels)

    return forward_with_loss


def capture_hf(spec: HFSpec, *, fallback: str | None = None) -> Graph:
    """Capture a transformers model on `meta`; the graph's origin holds the class, full config and input sizes."""
    with torch.device("meta"):
        model, inputs = all_on_meta(hf_build(spec)), hf_inputs(spec)
    known = {k: torch.ones(tuple(v.shape), dtype=v.dtype) for k, v in inputs.items() if k in ALL_ONES_INPUTS}
    try:
        return capture(model, inputs, name=spec.cls, origin=spec.origin(), fallback=fallback, known=known)
    except UnsupportedOpError:
        raise
    except ModelError as e:
        missing = inputs_refused(spec, inputs, e)
        if missing:
            raise MissingInputError(
                f"hf:{spec.cls}: its forward needs {' and '.join(missing)}, which the {spec.task} batch does not make; "
                f"the model raised: {first_line(e.__cause__)}{model_line(e.__cause__)}. Plan the model that computes "
                "them (a draft model's main model), or write a model file whose example_inputs() makes them") from e
        hint = unset_size_hint(spec.config)
        if not hint:
            raise
        raise ModelError(f"hf:{spec.cls}: {e}{hint}") from e


def inputs_refused(spec: HFSpec, inputs: dict[str, Any], e: ModelError) -> list[str]:
    """The forward's parameters the batch leaves out that the model's own `raise` names, where the capture failed
    on one (Gemma 4's assistant: "inputs_embeds and shared_kv_states cannot be None"); [] for any other failure."""
    cause = e.__cause__
    frames = traceback.extract_tb(cause.__traceback__) if cause is not None else []
    if not frames or not (frames[-1].line or "").lstrip().startswith("raise "):
        return []
    if Path(frames[-1].filename).resolve().parent.parent != Path(transformers_module().models.__file__).parent:
        return []  # raised by torch or by this package, not by a model's own code
    text = str(cause)
    return [p for p in sorted(forward_params(spec.cls) - set(inputs)) if re.search(rf"\b{p}\b", text)]


def all_on_meta(model: torch.nn.Module) -> torch.nn.Module:
    """A model built under `torch.device("meta")`, with the tensors a legacy constructor still made on the CPU
    (ImageGPT's `nn.Parameter(torch.Tensor(n))`) moved to meta too: the capture then mixes no devices."""
    if any(t.device.type != "meta" for t in (*model.parameters(), *model.buffers())):
        model.to("meta")
    return model


def spec_of(origin: dict[str, Any]) -> HFSpec:
    return HFSpec(origin["hf"], dict(origin["config"]), origin["task"], dict(origin["inputs"]),
                  dict(origin.get("implementation", {})), dict(origin.get("adjusted", {})))


# ----------------------------------------------------------------------------- the runner's side


def check_rebuildable(origin: dict[str, Any]) -> None:
    """Refuse, before any process starts, a plan whose model the runner cannot rebuild exactly."""
    if "zoo" in origin:
        zoo_config(origin)
    elif "file" in origin:
        checked_file(origin)
    elif "hf" in origin:
        hf_class(origin["hf"])
    else:
        what = f"a module object ({origin['module']})" if "module" in origin else "no recorded source"
        raise ModelError(f"the plan's model comes from {what}, which the runner cannot rebuild: plan a model file "
                         "(`hap plan --model FILE.py`), a Hugging Face class (`--model hf:Class`) or a zoo model")


def zoo_config(origin: dict[str, Any]) -> Any:
    """The config of a zoo origin, through the same knob checks and bounds as `hap plan --set`
    (a hand-edited `layers: 1e12` is refused here, not by a crashed rank)."""
    from engine.model import zoo

    config = origin.get("config", {})
    if not isinstance(config, dict):
        raise ModelError(f"model.origin.config must be an object of zoo knobs, got {type(config).__name__}")
    return zoo.make_config(str(origin["zoo"]), **config)


@functools.lru_cache(maxsize=4)
def checked_module(path: str, sha256: str | None) -> tuple[ModuleType, str]:
    """The plan's model file, checked against its sha256 and executed once per process (module,
    name): `make_batch` needs it every step, and reading, hashing and running the file each time
    was per-step work."""
    data, filename = checked_file({"file": path, "sha256": sha256})
    return exec_model_file(data, filename), filename


def build_module(origin: dict[str, Any], seed: int, device: str = "cpu") -> torch.nn.Module:
    """The single-device module of a file or hf origin on the CPU, initialised from `seed`; its
    forward takes the flat batch of `make_batch` and returns the loss. Every rank builds all of it
    (`device="meta"`: its structure only, names, shapes and dtypes, for checks before a run)."""
    if "file" in origin:
        module, filename = checked_module(origin["file"], origin.get("sha256"))
        torch.manual_seed(seed)
        with torch.device(device):
            model = call_file_function(filename, "build_model", module.build_model)
        return flat_forward(model, CallShape.of(file_inputs(module, filename, seed)))
    if "hf" in origin:
        spec = spec_of(origin)
        torch.manual_seed(seed)
        with torch.device(device):
            model = hf_build(spec)
            return flat_forward(model, CallShape.of(hf_inputs(spec)))
    check_rebuildable(origin)
    raise AssertionError("check_rebuildable refuses every other origin")


def make_batch(origin: dict[str, Any], seed: int, step: int) -> tuple[torch.Tensor, ...]:
    """The global batch of one step as capture orders it, a function of (seed, step) only."""
    step_seed = seed * BATCH_SEED + step
    if "file" in origin:
        module, filename = checked_module(origin["file"], origin.get("sha256"))
        tensors = flat_tensors(file_inputs(module, filename, step_seed))
    elif "hf" in origin:
        with torch.device("cpu"):
            tensors = flat_tensors(hf_inputs(spec_of(origin), torch.Generator().manual_seed(step_seed)))
    else:
        check_rebuildable(origin)
        raise AssertionError("check_rebuildable refuses every other origin")
    check_batch(origin, tensors)
    return tensors


def check_batch(origin: dict[str, Any], tensors: tuple[torch.Tensor, ...], what: str = "example_inputs()") -> None:
    """The batch (from the file's function `what`) must have the shapes and dtypes the plan was made for."""
    want = origin.get("inputs")
    if not isinstance(want, list):
        return
    got = input_spec(tensors)
    if len(got) != len(want):
        raise ModelError(f"{what} gave {len(got)} tensors but the plan was made for {len(want)}")
    for g, w in zip(got, want):
        if g["shape"] != list(w["shape"]) or g["dtype"] != w["dtype"]:
            raise ModelError(f"{what} gave input {w['name']} as {g['dtype']}{g['shape']} but the plan was made "
                             f"for {w['dtype']}{list(w['shape'])}: make {what} return the same shapes every call")


def with_model_file(origin: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The origin with its model file found at `path` (a bundle's copy); the sha256 still decides."""
    return {**origin, "file": str(path)}
