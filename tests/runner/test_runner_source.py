"""`hap plan --model FILE.py` then `hap run --verify`, bare and through a bundle (issue 13, item 4).

The model file holds `torch.cumprod` on the activations, an operator with no sharding rule: it plans
with the replicate fallback and its ranks run it on whole tensors (three uneven gloo ranks). The
example `examples/llama_tiny.py` (GQA, RoPE) runs from its bundle zip on cpu_4_uneven (the runner
takes the model file from the bundle, not from the path the plan names).
"""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, cluster_dict
from hap_inprocess import run_hap
from warm_run import warm_hap

CUMPROD = ROOT / "tests" / "fixtures" / "model_files" / "cumprod_mlp.py"


def test_a_model_file_with_an_op_without_rule_plans_and_verifies_on_3_uneven_ranks(tmp_path):
    spec = cluster_dict([2e10, 1e10, 5e9], name="three_uneven")
    (tmp_path / "cluster.json").write_text(json.dumps(spec))
    r = run_hap("plan", "--model", str(CUMPROD), "--fallback", "replicate", "--cluster", str(tmp_path / "cluster.json"),
            "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["model"]["origin"]["file"] == str(CUMPROD.resolve())
    assert any(n["op"] == "opaque" for n in plan["graph"]["nodes"])
    r = warm_hap("run", str(tmp_path / "p.json"), "--steps", "3", "--verify", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "on 3 ranks" in r.stdout and "verify: OK" in r.stdout


def test_llama_tiny_example_plans_exports_and_its_bundle_verifies_on_cpu_4_uneven(tmp_path):
    """The issue's acceptance through a bundle: the ranks run the bundle's copy of the model file."""
    pytest.importorskip("transformers")
    model = tmp_path / "llama_tiny.py"
    shutil.copy(ROOT / "examples" / "llama_tiny.py", model)
    r = run_hap("plan", "--model", str(model), "--cluster", "sample_clusters/cpu_4_uneven.json", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    r = run_hap("export", str(tmp_path / "p.json"), "--out", str(tmp_path / "b"), "--zip")
    assert r.returncode == 0, r.stderr
    model.unlink()  # the bundle must not need the original
    r = warm_hap("run", str(tmp_path / "b.zip"), "--steps", "3", "--verify", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "llama_tiny on 4 ranks" in r.stdout and "verify: OK" in r.stdout
