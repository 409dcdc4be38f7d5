"""The coverage sweep (issue 29): every transformers model type with a training head, planned as a new user would.

`python bench/coverage.py --all` runs it. The denominator is fixed by `bench/coverage_types.json`: one class per
model type that transformers maps to a causal-LM, masked-LM, seq2seq-LM, sequence- or image-classification head
(in that order of preference), written from the pinned transformers by `--write-types`. Each type is built from
its default config shrunk to 2 layers (and at most 4 experts), dropout as the config has it, captured on meta
and planned with default options on `sample_clusters/a100x2_p100x2.json`, in its own process with a time cap,
several at once. Each row says: planned, refused (the operators or the reason), capture error, timeout or crash.

`--verify K --seed S` then trains K planned types drawn with that seed, each with small widths as well, for
two steps on 3 uneven gloo ranks (`hap run --steps 2 --verify`). `--verify-types a,b` trains those planned types
instead of a draw (to rerun the ones a draw failed on).
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TYPES = ROOT / "bench" / "coverage_types.json"
RESULTS = ROOT / "bench" / "results" / "coverage_all.json"
CLUSTER = ROOT / "sample_clusters" / "a100x2_p100x2.json"
VERIFY_CLUSTER = ROOT / "sample_clusters" / "cpu_3_uneven.json"
HEADS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
         "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES")
"""transformers' auto mappings, in the order a type's class is picked from them."""
LAYERS = 2
EXPERTS = 4
LAYER_KEY = re.compile(r"^(num_(hidden_|encoder_|decoder_)?layers|n_layers?|n_layer|(encoder|decoder)_layers|"
                       r"num_decoder_layers|num_encoder_layers|num_blocks|num_\w+_per_block)$")
"""Layer counts, shrunk to LAYERS: a block's layers too (Perceiver's 26 latent self-attentions per block)."""
SUBCOUNT_KEY = re.compile(r"^(num|n)_\w+_layers$")
"""Counts of some of the layers (num_kv_shared_layers, num_dense_layers): scaled down with the layers where they
would otherwise cover all of them (Gemma3n's 15 KV-sharing layers of 35 leave no layer to produce a cache)."""
EXPERT_KEY = re.compile(r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts)$")
TOP_K_KEY = re.compile(r"^(num_experts_per_tok(en)?|moe_topk|moe_k|top_k|top_k_experts|num_selected_experts)$")
GROUP_KEY = re.compile(r"^(n_group|num_expert_group|topk_group)$")
"""Expert groups and the groups routed to: 1 when the experts shrink (a group count must divide them)."""
CHUNK_KEY = re.compile(r"^\w*chunk_length$")
"""Lengths of the chunks a model splits its sequence into (Reformer's LSH and local attention)."""
SMALL_SEQ = 16
"""The sequence length of `--verify`; the sweep's own is engine.model.source.DEFAULT_SEQ_LEN."""
PER_TOKEN = 2
SHARED = 1
VOCAB = 32000
PAD = 0
BUDGET = 64
BLOCK = 4
"""Values the sweep fills where a default config leaves an expert count, top-k, shared-expert count, the
vocabulary, a token indexer's budget (a multiple of its block, half the sequence) or its block of pooled keys None
and no relation gives it (engine.model.source.SIZE_RELATIONS gives the others); a config that
leaves its vocabulary None leaves its padding token None too (both are the tokenizer's), and the sweep's
vocabulary gets PAD as its padding id (ESM numbers its positions from it)."""
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 256, "d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
         "n_embd": 64, "n_head": 4, "moe_intermediate_size": 64, "max_position_embeddings": 128}
"""Widths for `--verify` (CPU training), set where the default config has the key."""


@dataclass
class Outcome:
    """One model type's result."""

    type: str
    cls: str
    status: str
    """planned | refused | capture error | timeout | crash"""
    detail: str = ""
    seconds: float = 0.0
    filled: dict[str, Any] = field(default_factory=dict)
    """Sizes the default config left None that the sweep filled (`fills`)."""


# ----------------------------------------------------------------------------- the list of types


def current_types() -> dict[str, str]:
    """Model type -> the class of its first head in HEADS, from the installed transformers."""
    from transformers.models.auto import modeling_auto

    out: dict[str, str] = {}
    for mapping in HEADS:
        for model_type, cls in getattr(modeling_auto, mapping).items():
            out.setdefault(model_type, cls[0] if isinstance(cls, (tuple, list)) else cls)
    return dict(sorted(out.items()))


def write_types() -> dict[str, Any]:
    doc = {**running_versions(), "heads": list(HEADS), "types": current_types()}
    TYPES.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def read_types() -> dict[str, Any]:
    return json.loads(TYPES.read_text())


# ----------------------------------------------------------------------------- one type (in its own process)


def shrunk(cls: str, small: bool = False, per_kind: int = 1) -> dict[str, Any]:
    """Knobs shrinking the class's default config: 2 layers (more only where a per-layer list has more kinds of
    layer: each kind is kept), at most 4 experts (in one group, top-k at most as many), sizes the default leaves
    None filled (`fills`), and with `small` the widths of SMALL. A composite config's sub-configs (an audio
    model's `audio_config` and `text_config`) are shrunk alike, each given whole so its other defaults stay.
    `per_kind`: the layers kept of each kind of a per-layer list (2 where one does not build: `one`)."""
    from engine.model.source import default_config

    default = held(default_config(cls))
    knobs = shrunk_dict(default, small, per_kind)
    if small:
        knobs.update(batch=6, seq_len=SMALL_SEQ)
    return {**knobs, **fills({**default, **knobs})}


def held(config: Any) -> dict[str, Any]:
    """The config as a dict of the values it holds, where that dict builds the same config again: a config may
    store another layout than it holds (Dory stores each layer as an attention and an MLP block, its layer counts
    doubled, and halves them when built from that form), and the counts the model reads are the ones to shrink.
    Otherwise its `to_dict()`."""
    stored = config.to_dict()
    values = {k: v for k in stored if plain(v := held_value(config, k)) and v != stored[k]}
    if not values:
        return stored
    try:
        again = type(config).from_dict({**stored, **values}).to_dict()
    except Exception:  # transformers validates in many ways: keep the stored form
        return stored
    return {**stored, **values} if again == stored else stored


def held_value(config: Any, key: str) -> Any:
    """The config's attribute `key`, None where reading it raises (a per-layer attribute read globally)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def plain(value: Any) -> bool:
    """Whether a value is a count or a list of JSON scalars, the kinds of value `shrunk_dict` shrinks."""
    if isinstance(value, list):
        return all(isinstance(v, (int, float, str)) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def partition(default: dict[str, Any], layers: int) -> dict[str, int]:
    """Counts of parts of the layers that sum to all of them (Dory's input, recurrent and output layers): shrunk
    as a partition (`apportioned`), not each on its own, where there are two or more."""
    parts = {k: v for k, v in default.items() if SUBCOUNT_KEY.match(k) and not LAYER_KEY.match(k) and isinstance(v, int)
             and not isinstance(v, bool) and v >= 0}
    return parts if len(parts) > 1 and sum(parts.values()) == layers else {}


def apportioned(parts: dict[str, int], n: int) -> dict[str, int]:
    """A partition of n layers with a layer for each non-empty part (n is at least their number), each further
    layer to the part with the most default layers per layer given."""
    out = {k: int(v > 0) for k, v in parts.items()}
    for _ in range(n - sum(out.values()) if any(out.values()) else 0):
        k = max((k for k in parts if out[k]), key=lambda k: parts[k] / out[k])
        out[k] += 1
    return out


def shrunk_dict(default: dict[str, Any], small: bool = False, per_kind: int = 1) -> dict[str, Any]:
    """`shrunk`'s knobs for one config as a dict, and for each sub-config in it (recursively)."""
    knobs: dict[str, Any] = {}
    staged = isinstance(default.get("depths"), list)  # Swin-like: num_layers counts stages, depths their blocks
    layers = {k: v for k, v in default.items()
              if LAYER_KEY.match(k) and isinstance(v, int) and v > LAYERS and not (staged and k == "num_layers")}
    per_layer = {k: v for k, v in default.items() if isinstance(v, list) and v and len(v) in set(layers.values())
                 and not every_layer(v)}
    most = max(layers.values(), default=0)
    parts = partition(default, most)
    lists = {}  # the per-layer lists by their length: those of one length are cut to the same layers
    for v in per_layer.values():
        lists.setdefault(len(v), []).append(v)
    n = max([LAYERS, sum(v > 0 for v in parts.values()), *(len(kept_jointly(vs, 0, per_kind)) for vs in lists.values())])
    keeps = {length: kept_jointly(vs, n, per_kind) for length, vs in lists.items()}
    knobs.update({k: n for k, v in layers.items() if v > n})
    knobs.update({k: [v[i] for i in keeps[len(v)]] for k, v in per_layer.items() if len(v) > n})
    if most > n:
        knobs.update(apportioned(parts, n))
    if most > n:  # Gemma 4's per_layer_config {"05": {"head_dim": 512}, ...}: the kept layers' entries, renumbered
        keep = keeps.get(most, list(range(n)))
        knobs.update({k: renumbered(v, keep) for k, v in default.items() if by_layer(v, most)})
        knobs.update({k: list(range(len(keep))) for k, v in default.items() if every_layer(v) and len(v) == most})
    for k, v in default.items():
        if SUBCOUNT_KEY.match(k) and k not in layers and k not in parts and isinstance(v, int) and most > n and v >= n:
            knobs[k] = v * n // most
        if k == "depths" and isinstance(v, list):
            knobs[k] = [min(d, LAYERS) for d in v]
        if EXPERT_KEY.match(k) and isinstance(v, int) and v > EXPERTS:
            knobs[k] = EXPERTS
    if any(EXPERT_KEY.match(k) for k in knobs):
        knobs.update({k: 1 for k, v in default.items() if GROUP_KEY.match(k) and isinstance(v, int) and v > 1})
    for k, v in default.items():
        if TOP_K_KEY.match(k) and isinstance(v, int):
            knobs[k] = min(v, EXPERTS)
    if small:
        knobs.update({k: v for k, v in SMALL.items() if isinstance(default.get(k), int)})
        knobs.update(widths_summing(default, knobs))
    knobs.update(sequence_fitted(default, SMALL_SEQ if small else None))
    for k, v in default.items():  # sub-configs, and a per-layer dict's entries as renumbered above
        v = knobs.get(k, v) if isinstance(knobs.get(k), dict) else v
        sub = shrunk_dict(v, small, per_kind) if isinstance(v, dict) and all(isinstance(x, str) for x in v) else {}
        if sub:
            knobs[k] = {**v, **sub}
    return knobs


def sequence_fitted(default: dict[str, Any], seq: int | None) -> dict[str, Any]:
    """A config whose shape fixes the sequence length (engine.model.source.SEQUENCE_RELATIONS: Reformer's axial
    positions train on exactly prod(axial_pos_shape) = 4096 tokens) gets that shape refactored to the sweep's
    sequence, each axis a share of it, and its chunk lengths at most the sequence (training needs the sequence a
    multiple of them). `seq` None: the source's default length."""
    from engine.model.source import DEFAULT_SEQ_LEN, SEQUENCE_RELATIONS, product

    seq = seq or DEFAULT_SEQ_LEN
    out: dict[str, Any] = {}
    for key in SEQUENCE_RELATIONS:
        shape = default.get(key)
        if product(shape) is not None and product(shape) != seq:
            out[key] = factored(seq, len(shape))
    if out:
        out.update({k: seq for k, v in default.items() if CHUNK_KEY.match(k) and isinstance(v, int) and v > seq})
    return out


def widths_summing(default: dict[str, Any], knobs: dict[str, Any]) -> dict[str, list[int]]:
    """Lists of widths that split the hidden size (Reformer's axial_pos_embds_dim must sum to it), rescaled to the
    hidden size the knobs give, the last taking what rounding leaves."""
    old, new = default.get("hidden_size"), knobs.get("hidden_size")
    if not isinstance(old, int) or not isinstance(new, int) or old == new:
        return {}
    out = {}
    for k, v in default.items():
        if isinstance(v, list) and len(v) > 1 and all(type(x) is int and x > 0 for x in v) and sum(v) == old:
            scaled = [max(1, x * new // old) for x in v[:-1]]
            out[k] = [*scaled, new - sum(scaled)]
    return {k: v for k, v in out.items() if v[-1] > 0}


def factored(n: int, axes: int) -> list[int]:
    """n as a product of `axes` factors as even as its prime factors allow, smallest first ((8, 16) for 128)."""
    primes, p = [], 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    out = [1] * axes
    for q in sorted(primes, reverse=True):
        out[out.index(min(out))] *= q
    return sorted(out)


def kinds_of(values: list) -> dict[str, int]:
    """Each distinct entry of a per-layer list (by its JSON text: entries may be lists) -> its first index."""
    first: dict[str, int] = {}
    for i, v in enumerate(values):
        first.setdefault(json.dumps(v), i)
    return first


def cut(values: list, n: int, per_kind: int = 1) -> list:
    """A per-layer list cut to n layers that keeps a layer of each kind (configs check for one 'full_attention'
    layer, an attention layer among linear ones, ...)."""
    return [values[i] for i in kept_jointly([values], n, per_kind)]


def kept_jointly(lists: list[list], n: int, per_kind: int = 1) -> list[int]:
    """One set of layers for several per-layer lists of the same layers: the first `per_kind` of each kind of
    each list (reusing a layer already kept for another list), then the first others up to n. Cut apart, Dots3
    Note's `mlp_layer_types` kept layers 0 and 1 and its `layer_types` layers 0 and 2, so the sliding layer's
    entry of `per_layer_config` went with neither and the config did not validate."""
    keep: set[int] = set()
    for values in lists:
        for kind in kinds_of(values):
            of_kind = [j for j, v in enumerate(values) if json.dumps(v) == kind]
            missing = per_kind - sum(j in keep for j in of_kind)
            keep |= set([j for j in of_kind if j not in keep][:max(0, missing)])
    length = len(lists[0]) if lists else 0
    keep |= set([i for i in range(length) if i not in keep][:max(0, n - len(keep))])
    return sorted(keep)


def every_layer(value: Any) -> bool:
    """Whether a config value lists every layer's index (Llama 4's `moe_layers` when every layer is MoE): not a
    per-layer list of kinds (48 distinct entries kept 48 layers), but the kept layers' indices once shrunk."""
    return isinstance(value, list) and len(value) > 1 and value == list(range(len(value)))


def by_layer(value: Any, layers: int) -> bool:
    """Whether a config value is a dict of per-layer entries keyed by layer index ("05", "11", ...)."""
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(k, str) and k.isdigit() and int(k) < layers for k in value))


def renumbered(entries: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """A per-layer dict for the kept layers only, each keyed by its new index (zero-padded as before)."""
    width = len(next(iter(entries)))
    old = {int(k): v for k, v in entries.items()}
    return {str(new).zfill(width): old[i] for new, i in enumerate(keep) if i in old}


def fills(config: dict[str, Any]) -> dict[str, Any]:
    """Sizes the config leaves None, filled: by their standard relation (head_dim = hidden_size //
    num_attention_heads, ...), else expert counts EXPERTS, top-k PER_TOKEN, shared experts SHARED, vocabulary VOCAB
    (and with it the padding id PAD), an indexer's budget BUDGET and block BLOCK."""
    from engine.model.source import unset_sizes

    out: dict[str, Any] = {}
    for key, (_, value) in unset_sizes(config).items():
        if value is None:
            value = (EXPERTS if EXPERT_KEY.match(key) else min(PER_TOKEN, EXPERTS) if TOP_K_KEY.match(key)
                     else SHARED if key.startswith(("n_shared", "num_shared")) else VOCAB if key == "vocab_size"
                     else BUDGET if key.endswith("budget") else BLOCK if key.endswith("compress_ratio") else None)
        if value is not None:
            out[key] = value
    if "vocab_size" in out and "pad_token_id" in config and config["pad_token_id"] is None:
        out["pad_token_id"] = PAD
    return out


def one(model_type: str, cls: str) -> Outcome:
    """Capture and plan one type; every failure becomes a row."""
    import engine
    from engine.errors import BuildError, InfeasibleError, ModelError, PlanError, UnsupportedOpError

    from engine.model.source import default_config

    start = time.perf_counter()
    filled: dict[str, Any] = {}

    def row(status: str, detail: str = "") -> Outcome:
        return Outcome(model_type, cls, status, detail[:600], round(time.perf_counter() - start, 1), filled)

    try:
        knobs = shrunk(cls)
        default = default_config(cls).to_dict()
        filled = {k: v for k, v in knobs.items() if k in default and default[k] in (None, {})}
        try:
            graph = engine.load_model(f"hf:{cls}", **knobs)
        except BuildError:  # layers sharing weights (Zamba's hybrid layers) need a second of their kind to share with
            if shrunk(cls, per_kind=2) == knobs:
                raise
            graph = engine.load_model(f"hf:{cls}", **shrunk(cls, per_kind=2))
    except UnsupportedOpError as e:
        return row("refused", str(e))
    except ModelError as e:
        return row("capture error", str(e))
    except Exception as e:  # a raw exception is what the sweep exists to find
        return row("crash", _raw("capture", e))
    try:
        engine.plan(graph, engine.load_cluster(CLUSTER))
    except (UnsupportedOpError, InfeasibleError, PlanError, ModelError) as e:
        return row("refused", f"plan: {e}")
    except Exception as e:
        return row("crash", _raw("plan", e))
    return row("planned", f"{len(graph)} nodes")


def _raw(stage: str, e: BaseException) -> str:
    """A raw exception of one stage as a row's detail: its type and first line."""
    text = str(e).strip()
    return f"{stage}: {type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ----------------------------------------------------------------------------- the sweep


def _child(model_type: str, cls: str, cap_s: float) -> Outcome:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__)), "--one", model_type, cls], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=cap_s)
    except subprocess.TimeoutExpired:
        return Outcome(model_type, cls, "timeout", f"over {cap_s:.0f} s", round(time.perf_counter() - start, 1))
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not last:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome(model_type, cls, "crash", f"exit {proc.returncode}: {tail[:300]}",
                       round(time.perf_counter() - start, 1))
    return Outcome(**json.loads(last[-1]))


def sweep(types: dict[str, str], jobs: int, cap_s: float) -> list[Outcome]:
    """Every type in its own process, `jobs` at once; a line per type as it finishes."""
    done: list[Outcome] = []
    with ThreadPoolExecutor(jobs) as pool:
        for k, outcome in enumerate(pool.map(lambda kv: _child(kv[0], kv[1], cap_s), types.items()), 1):
            done.append(outcome)
            note = "filled " + ", ".join(f"{k}={v}" for k, v in outcome.filled.items()) + "; " if outcome.filled else ""
            print(f"[{k}/{len(types)}] {outcome.type:28s} {outcome.status:13s} {outcome.seconds:6.1f} s  "
                  f"{note}{outcome.detail[:140]}", flush=True)
    return done


def running_versions() -> dict[str, str]:
    """The torch and transformers this sweep ran on (the committed list names the ones it was written from)."""
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def summary(outcomes: list[Outcome], elapsed_s: float, meta: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    planned = counts.get("planned", 0)
    lines = [f"transformers {meta['transformers']}, torch {meta['torch']}: {planned} of {len(outcomes)} types planned "
             f"({100 * planned / max(1, len(outcomes)):.1f}%); " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())),
             f"total {elapsed_s / 60:.1f} min"]
    return "\n".join(lines)


def drawn_types(planned: list[str], k: int, seed: int, chosen: str | None = None) -> list[str]:
    """The types `--verify` trains: `chosen` (comma-separated, each among the planned), else K drawn with `seed`."""
    if chosen:
        names = chosen.split(",")
        unplanned = [t for t in names if t not in planned]
        if unplanned:
            raise SystemExit(f"--verify-types: not planned in this sweep: {', '.join(unplanned)}")
        return names
    return random.Random(seed).sample(sorted(planned), min(k, len(planned)))


def verify(planned: list[str], types: dict[str, str], k: int, seed: int, chosen: str | None = None
           ) -> list[tuple[str, str]]:
    """`hap run --steps 2 --verify` on 3 uneven ranks of the `drawn_types` (small widths)."""
    drawn = drawn_types(planned, k, seed, chosen)
    out = []
    for model_type in drawn:
        cls = types[model_type]
        with tempfile.TemporaryDirectory() as tmp:
            sets = [a for key, v in shrunk(cls, small=True).items() for a in ("--set", f"{key}={json.dumps(v)}")]
            plan = subprocess.run([sys.executable, "-m", "runner.hap", "plan", "--model", f"hf:{cls}", *sets,
                                   "--cluster", str(VERIFY_CLUSTER), "--out", f"{tmp}/plan.json"], cwd=ROOT,
                                  capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if plan.returncode != 0:
                out.append((model_type, "plan failed: " + (plan.stderr.strip().splitlines() or ["?"])[-1][:200]))
                continue
            run = subprocess.run([sys.executable, "-m", "runner.hap", "run", f"{tmp}/plan.json", "--steps", "2",
                                  "--verify"], cwd=ROOT, capture_output=True, text=True)
            lines = (run.stdout + run.stderr).strip().splitlines()
            verdict = next((ln for ln in reversed(lines) if ln.startswith(("verify: OK", "verify: FAILED"))), None)
            if verdict and verdict.startswith("verify: FAILED"):  # with the largest differences it found
                verdict = "; ".join(ln for ln in lines if ln.startswith("verify: largest")) + "; " + verdict
            out.append((model_type, verdict or ("run failed: " + (lines or ["?"])[-1][:200])))
        print(f"verify {model_type:28s} {out[-1][1]}", flush=True)
    return out


def main(args: Any) -> int:
    """`bench/coverage.py --all`: the sweep, its table and summary, written to bench/results/coverage_all.json."""
    meta = write_types() if args.write_types else read_types()
    types = meta["types"]
    if args.types:
        types = {t: types[t] for t in args.types.split(",")}
    start = time.perf_counter()
    outcomes = sweep(types, args.jobs, args.cap)
    elapsed = time.perf_counter() - start
    ran = running_versions()
    text = summary(outcomes, elapsed, ran)
    if ran != {k: meta[k] for k in ran}:
        text += f"\n(the list of types was written from transformers {meta['transformers']}, torch {meta['torch']})"
    print(text)
    doc: dict[str, Any] = {**ran, "summary": text,
                           "elapsed_s": round(elapsed, 1), "rows": [asdict(o) for o in outcomes]}
    if args.verify or args.verify_types:
        checks = verify([o.type for o in outcomes if o.status == "planned"], types, args.verify, args.seed,
                        args.verify_types)
        doc["verify"] = {"seed": args.seed, "rows": checks}
        print(f"verify: {sum(v.startswith('verify: OK') for _, v in checks)} of {len(checks)} OK (seed {args.seed})")
    if not args.types:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--one":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(asdict(one(sys.argv[2], sys.argv[3]))))
