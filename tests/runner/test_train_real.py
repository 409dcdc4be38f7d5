"""Training for real (issue 27): token data, AdamW with a schedule, clipping and accumulation, exact resume,
your own loop, pretrained weights in and safetensors out, and one line with exit 2 for every bad input.

The model is examples/llama_tiny.py (a transformers Llama) on three uneven gloo ranks
(sample_clusters/cpu_3_uneven.json), trained on the shipped public-domain text packed by `hap data prepare`.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import free_port
from dist_harness import run_ranks
from hap_inprocess import ROOT, run_hap
from warm_run import warm_hap

import engine
from runner.batches import batch_source
from runner.optim import OptimConfig
from runner.train import reference_run

TEXT = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"
CLUSTER = ROOT / "sample_clusters" / "cpu_3_uneven.json"
SETTINGS = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1", "--lr-schedule", "cosine",
            "--warmup", "2", "--clip-grad-norm", "1.0", "--grad-accum", "2"]
STEPS = 6


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Token files from 40 KB of the shipped text (training and held-out), and the plans."""
    out = tmp_path_factory.mktemp("train_real")
    (out / "text.txt").write_bytes(TEXT.read_bytes()[:40_000])
    r = run_hap("data", "prepare", str(out / "text.txt"), "--out", str(out / "tokens.parquet"),
                "--eval-fraction", "0.1", "--eval-out", str(out / "eval.parquet"))
    assert r.returncode == 0, r.stderr
    graph = engine.load_model(str(ROOT / "examples" / "llama_tiny.py"))
    cluster = engine.load_cluster(str(CLUSTER))
    engine.plan(graph, cluster).save(out / "plan.json")
    zero = engine.plan(graph, cluster, shard_states=1)
    assert zero.shard_states and zero.shard_states["stages"], "the plan shards optimizer states"
    zero.save(out / "zero.json")
    return out


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())
            if r.get("rank") == 0 and "loss" in r}


def test_data_run_verifies_reports_and_resumes_bit_identically(work, tmp_path):
    data = ["--data", str(work / "tokens.parquet"), "--eval-data", str(work / "eval.parquet"), "--eval-every", "3",
            "--eval-batches", "2"]
    r = warm_hap("run", str(work / "plan.json"), "--steps", str(STEPS), *SETTINGS, *data, "--verify",
                 "--metrics", str(tmp_path / "full.jsonl"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout and "tokens.parquet" in r.stdout
    records = [json.loads(line) for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    steps = [x for x in records if "loss" in x and x["rank"] == 0]
    assert [x["step"] for x in steps] == list(range(STEPS))
    assert steps[0]["lr"] == pytest.approx(1.5e-3) and steps[1]["lr"] == pytest.approx(3e-3)  # warm-up
    assert steps[-1]["lr"] < steps[2]["lr"], "cosine decay"
    assert all(x["grad_norm"] > 0 and x["tokens"] == 2 * 6 * 16 and x["tokens_per_s"] > 0 and x["grad_accum"] == 2
               and 0 < x["mfu"] < 1
               for x in steps)
    evals = [(x["step"], x["eval_loss"]) for x in records if "eval_loss" in x]
    assert [s for s, _ in evals] == [0, 3, 6] and evals[-1][1] < evals[0][1]
    assert steps[0]["run"]["optimizer"] == OptimConfig(name="adamw", lr=3e-3, weight_decay=0.1, schedule="cosine",
                                                       warmup=2, steps=STEPS, clip_grad_norm=1.0, grad_accum=2).record()

    # killed at the start of step 3, resumed from the checkpoint after step 2: the same losses to the bit
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1", "--metrics", str(tmp_path / "cut.jsonl")]
    cut = warm_hap("run", str(work / "plan.json"), "--steps", str(STEPS), *SETTINGS, *data, *ck,
                   env={"HAP_RUNNER_FAULT": "1:3:kill"}, timeout=300)
    assert cut.returncode != 0
    resumed = warm_hap("run", str(work / "plan.json"), "--steps", str(STEPS), *SETTINGS, *data, *ck, "--resume",
                       timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from the checkpoint after step 3" in resumed.stdout
    assert losses(tmp_path / "cut.jsonl") == losses(tmp_path / "full.jsonl")


def own_loop_rank(rank: int, world: int, _init: str, port: int, argv: list[str]) -> int:
    """examples/own_loop.py as torchrun runs it: the launch environment, its argv, its exit status."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.argv = ["own_loop.py", *argv]
    try:
        runpy.run_path(str(ROOT / "examples" / "own_loop.py"), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    return 0


@pytest.mark.parametrize("plan", ["plan.json", "zero.json"])
def test_own_loop_verifies_and_equals_hap_run_to_the_bit(plan, work, tmp_path, capfd):
    common = ["--data", str(work / "tokens.parquet"), "--steps", "4"]
    own = [str(work / plan), *common, "--lr", "3e-3", "--weight-decay", "0.1", "--warmup", "2", "--clip", "1.0",
           "--accum", "2", "--losses", str(tmp_path / "own.json"), "--verify"]
    assert run_ranks(own_loop_rank, 3, tmp_path / "own", free_port(), own) == [0, 0, 0]
    assert "verify: OK" in capfd.readouterr().out
    r = warm_hap("run", str(work / plan), *common, *SETTINGS, "--metrics", str(tmp_path / "run.jsonl"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    mine = json.loads((tmp_path / "own.json").read_text())
    assert mine == [losses(tmp_path / "run.jsonl")[s] for s in range(4)], "one code path: the same losses to the bit"


def test_fine_tune_from_pretrained_and_save_for_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=16)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "pre")
    r = run_hap("plan", "--model", "hf:LlamaForCausalLM", "--config", str(tmp_path / "pre" / "config.json"),
                "--set", "batch=6", "--set", "seq_len=16", "--cluster", str(CLUSTER), "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    r = warm_hap("run", str(tmp_path / "p.json"), "--init-from", str(tmp_path / "pre"), "--steps", "20",
                 "--optimizer", "adamw", "--lr", "1e-3", "--save-model", str(tmp_path / "out"), "--verify", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: OK" in r.stdout
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    plan = engine.load_plan(str(tmp_path / "p.json"))
    _, ref = reference_run(plan, 20, 0, optim=OptimConfig(name="adamw", lr=1e-3), init=str(tmp_path / "pre"))
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(ref, strict=False)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (4, 16), generator=gen)
    with torch.no_grad():
        got, want = tuned(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    assert float(abs(got - want) / want) < 1e-5, (float(got), float(want))
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "pre")
    with torch.no_grad():
        assert float(start(input_ids=ids, labels=ids).loss) != float(got), "the weights were trained"


def write_tokens(path: Path, table: pa.Table) -> str:
    pq.write_table(table, path)
    return str(path)


def bad_inputs(tmp: Path, work: Path) -> list[tuple[list[str], str]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=16)).save_pretrained(tmp / "gpt2")
    good = (tmp / "gpt2" / "model.safetensors").read_bytes()
    (tmp / "cut.safetensors").write_bytes(good[: len(good) // 2])
    ints = pa.array(list(range(100)) * 10, pa.int64())
    return [
        (["--data", write_tokens(tmp / "col.parquet", pa.table({"tokens": ints}))], "has no column 'input_ids'"),
        (["--data", write_tokens(tmp / "float.parquet", pa.table({"input_ids": pa.array([0.5] * 1000)}))], "input_ids"),
        (["--data", write_tokens(tmp / "big.parquet", pa.table({"input_ids": pa.array([1] * 500 + [300] + [1] * 499)}))],
         "row 500"),
        (["--data", write_tokens(tmp / "short.parquet", pa.table({"input_ids": pa.array([[1] * 8] * 100)}))], "shorter"),
        (["--data", write_tokens(tmp / "empty.parquet", pa.table({"input_ids": pa.array([], pa.int64())}))], "empty"),
        (["--init-from", str(tmp / "gpt2")], "has no tensor model.embed_tokens.weight"),
        (["--init-from", str(tmp / "cut.safetensors")], "truncated"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(work, tmp_path):
    for extra, needle in bad_inputs(tmp_path, work):
        r = run_hap("run", str(work / "plan.json"), "--steps", "3", *extra)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (extra, r.stderr)


@pytest.mark.parametrize("extra, needle", [(["--eval-every", "2"], "--eval-every needs --eval-data"),
                                           (["--warmup", "50"], "--warmup must be in 0..3"),
                                           (["--weight-decay", "0.1", "--optimizer", "adam"], "use --optimizer adamw"),
                                           (["--grad-accum", "0"], "--grad-accum must be in 1..")])
def test_bad_optimiser_settings_are_usage_errors(work, extra, needle):
    r = run_hap("run", str(work / "plan.json"), "--steps", "3", *extra)
    assert r.returncode == 2 and needle in r.stderr.strip().splitlines()[-1], r.stderr


def test_a_pipeline_plan_trains_with_the_same_settings_evaluates_and_saves(work, tmp_path):
    """`hap run` on a pipeline plan: the same data, optimiser settings, metrics, evaluation and saved model
    as an SPMD plan's run (runner.pipeline_run over runner.pipeline_api), verified against single-device
    microbatch accumulation with the same settings."""
    from transformers import AutoModelForCausalLM

    graph = engine.load_model(str(ROOT / "examples" / "llama_tiny.py"))
    plan = engine.plan(graph, engine.load_cluster(str(CLUSTER)), parallelism="pipeline")
    assert plan.parallelism == "pipeline"
    plan.save(tmp_path / "pipe.json")
    data = ["--data", str(work / "tokens.parquet"), "--eval-data", str(work / "eval.parquet"), "--eval-every", "2",
            "--eval-batches", "2"]
    r = warm_hap("run", str(tmp_path / "pipe.json"), "--steps", "3", *SETTINGS, *data, "--verify",
                 "--metrics", str(tmp_path / "m.jsonl"), "--save-model", str(tmp_path / "out"), timeout=300)
    assert r.returncode == 0 and "verify: OK" in r.stdout, r.stdout + r.stderr
    assert "tokens.parquet" in r.stdout and "step    2/3" in r.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [x for x in records if "loss" in x and x["rank"] == 0]
    assert [x["step"] for x in steps] == [0, 1, 2]
    schedule = OptimConfig(name="adamw", lr=3e-3, schedule="cosine", warmup=2, steps=3)
    assert [x["lr"] for x in steps] == [schedule.lr_at(s) for s in range(3)] and steps[0]["lr"] == pytest.approx(1.5e-3)
    assert all(x["grad_norm"] > 0 and x["step_time_s"] > 0 and x["tokens"] == 2 * 6 * 16 and x["grad_accum"] == 2
               for x in steps)
    assert [x["step"] for x in records if "eval_loss" in x] == [0, 2, 3]
    assert steps[0]["run"]["optimizer"]["schedule"] == "cosine" and "run" not in steps[1]
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.isfinite(tuned(input_ids=ids, labels=ids).loss)
    refused = run_hap("run", str(tmp_path / "pipe.json"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    assert refused.returncode == 2 and "--checkpoint-dir is not supported for pipeline plans" in refused.stderr
    bad = write_tokens(tmp_path / "col.parquet", pa.table({"tokens": pa.array(list(range(100)) * 10, pa.int64())}))
    for extra, needle in [(["--data", bad], "has no column 'input_ids'"),
                          (["--init-from", str(tmp_path / "none")], "no such file or directory")]:
        r = run_hap("run", str(tmp_path / "pipe.json"), "--steps", "2", *extra)  # checked before any rank starts
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


MODEL_WITH_BATCHES = '''
import torch

def build_model():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 24), torch.nn.Linear(24, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)
    return Net()

def example_inputs():
    return torch.randn(12, 8), torch.randint(0, 4, (12,))

def batches(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 8, generator=g)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()   # a learnable rule, not noise
'''


def test_a_model_file_may_give_its_own_batches(tmp_path):
    (tmp_path / "net.py").write_text(MODEL_WITH_BATCHES)
    engine.plan(engine.load_model(str(tmp_path / "net.py")), engine.load_cluster(str(CLUSTER))).save(tmp_path / "p.json")
    r = warm_hap("run", str(tmp_path / "p.json"), "--steps", "30", "--lr", "0.05", "--verify",
                 "--metrics", str(tmp_path / "m.jsonl"), timeout=300)
    assert r.returncode == 0 and "verify: OK" in r.stdout and "net.py: batches(step)" in r.stdout, r.stdout + r.stderr
    trained = losses(tmp_path / "m.jsonl")
    assert trained[29] < 0.6 * trained[0], "the rule in batches(step) is learnt"
    (tmp_path / "bad.py").write_text(MODEL_WITH_BATCHES.replace("torch.randn(12, 8, generator=g)", "torch.randn(10, 8, generator=g)"))
    engine.plan(engine.load_model(str(tmp_path / "bad.py")), engine.load_cluster(str(CLUSTER))).save(tmp_path / "b.json")
    bad = run_hap("run", str(tmp_path / "b.json"), "--steps", "3")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "batches(step) gave input" in bad.stderr and "[10, 8]" in bad.stderr, bad.stderr


def test_a_model_trained_on_tokenizer_data_is_saved_with_the_tokenizer(work, tmp_path):
    from test_data import tiny_tokenizer
    from transformers import AutoTokenizer

    tok = tiny_tokenizer(tmp_path / "tok")
    r = run_hap("data", "prepare", str(work / "text.txt"), "--out", str(tmp_path / "t.parquet"), "--tokenizer", str(tok))
    assert r.returncode == 0, r.stderr
    r = run_hap("plan", "--model", "hf:LlamaForCausalLM", "--set", "vocab_size=320", "--set", "hidden_size=32",
                "--set", "intermediate_size=64", "--set", "num_hidden_layers=1", "--set", "num_attention_heads=4",
                "--set", "num_key_value_heads=2", "--set", "batch=6", "--set", "seq_len=16",
                "--cluster", str(CLUSTER), "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    r = warm_hap("run", str(tmp_path / "p.json"), "--data", str(tmp_path / "t.parquet"), "--steps", "2",
                 "--save-model", str(tmp_path / "out"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("In the beginning")["input_ids"] == \
        AutoTokenizer.from_pretrained(tok)("In the beginning")["input_ids"]
