"""Bundles safe to share (issue 24): launch files run only what the plan means, a bundle digest, regeneration.

The generated scripts are run for real, by bash, with a PATH of stubs only (tests/launch_stubs.py):
the test sees torchrun's exact argv, every other command called, and every file that appeared.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import sample_dict, sample_path
from launch_stubs import expected_torchrun, run_script, slurm_env

import engine
from engine.bundle import grammar
from engine.bundle.archive import (MANIFEST, OLD_SCHEMA_WARNING, BundleError, LaunchNode, bundle_digest, check_bundle,
                                   export_bundle, read_folder)
from engine.bundle.launch_files import LaunchSettings, launch_node_script, slurm_script
from engine.cli import main

MLP = dict(layers=1, in_features=8, hidden=16, classes=4, batch=8)
PAYLOADS = ["h$(touch pwned)", "ok\ntouch pwned", "`touch pwned`", "a;touch pwned", "a'b\"c", "x\u2028y",
            "m\u202e0", "$HOME", "-rf", "a b"]
"""Shapes of injection: command substitution, a new line, backticks, a separator, quotes, Unicode line and
direction controls, a variable, an option, a space, nothing."""


def two_machines(machines: tuple[str, str] = ("m0", "m1")) -> dict:
    """Two machines of two CPU devices each."""
    dev = {"gpu_model": "cpu", "flops_per_gpu": 1e10, "memory_bytes_per_gpu": 2**33, "count": 2}
    return {"schema_version": 1, "name": "two_machines", "devices": [{**dev, "name": "a", "machine": machines[0]},
                                                {**dev, "name": "b", "machine": machines[1]}],
            "network": {"latency_s": 5e-5, "bandwidth_Bps": {"intra_machine": 2e9, "inter_machine": 1e9}}}


@pytest.fixture(scope="module")
def graph():
    return engine.load_model("zoo:mlp", **MLP)


@pytest.fixture(scope="module")
def made(graph, tmp_path_factory):
    """(plan file, cluster file, bundle folder, its digest) of the MLP on two machines."""
    root = tmp_path_factory.mktemp("safe")
    cluster = root / "cluster.json"
    cluster.write_text(json.dumps(two_machines()))
    plan = engine.evaluate(graph, engine.load_cluster(str(cluster)), "dp-even", optimizer="sgd")
    plan.save(root / "plan.json")
    out = export_bundle(plan, str(cluster), root / "bundle", zip=True)
    return root / "plan.json", cluster, out, bundle_digest(read_folder(out))


def hap(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- values outside their grammar


def plan_file_on(graph, cluster: dict, root: Path) -> tuple[Path, Path]:
    path = root / "c.json"
    path.write_text(json.dumps(cluster))
    plan = engine.evaluate(graph, engine.load_cluster(str(path)), "dp-even", optimizer="sgd")
    plan.save(root / "p.json")
    return root / "p.json", path


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_machine_name_outside_the_host_grammar_is_refused_by_export_naming_the_field(graph, tmp_path, capsys,
                                                                                       payload):
    plan, cluster = plan_file_on(graph, two_machines((payload, "m1")), tmp_path)
    rc, out, err = hap(["export", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "b")], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "node 0 machine" in err and "not a host name (RFC 1123" in err and "rename the machine" in err
    assert not (tmp_path / "b").exists() and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("option, value, named", [
    ("--rdzv-endpoint", "$(touch pwned):29500", "--rdzv-endpoint"),
    ("--rdzv-endpoint", "m0:29500\ntouch pwned", "--rdzv-endpoint"),
    ("--rdzv-endpoint", "m0:70000", "--rdzv-endpoint"),
    ("--rdzv-endpoint", "::1:29500", "--rdzv-endpoint"),
    ("--image", "hap;touch pwned", "--image"),
    ("--image", "Hap/Upper:1", "--image"),
    ("--image", "hap:latest\n  command: [sh]", "--image"),
    ("--run-args", "--steps 3 $(touch pwned)", "--run-args: word 2"),
    ("--run-args", "--steps '3\n4'", "--run-args: word 1"),
    ("--partition", "gpu\n#SBATCH --uid=0", "--partition"),
    ("--partition", "gpu part", "--partition"),
    ("--account", "$(touch pwned)", "--account"),
    ("--qos", ".normal", "--qos"),
    ("--time", "1h", "--time"),
    ("--time", "1:00:00 --uid=0", "--time"),
])
def test_an_export_option_outside_its_grammar_is_refused_naming_the_option(made, tmp_path, capsys, option, value,
                                                                           named):
    plan, cluster, _, _ = made
    rc, _, err = hap(["export", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "b"), option, value],
                     capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"hap: error: {named}" in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("field", ["name", "gpu_model"])
def test_a_device_name_shown_in_the_readme_may_not_start_a_line(graph, tmp_path, capsys, field):
    cluster = two_machines()
    cluster["devices"][1][field] = "b\n# injected heading" if field == "name" else "cpu\r\nx"
    if field == "gpu_model":
        cluster["devices"][1]["gpu_model"] = "P100\nx"
    plan, path = plan_file_on(graph, cluster, tmp_path)
    rc, _, err = hap(["export", str(plan), "--cluster", str(path), "--out", str(tmp_path / "b")], capsys)
    assert rc == 2 and f"cluster device 2 {field}" in err and "printable text on one line" in err, err


def test_hap_plan_warns_about_what_export_will_refuse_but_plans(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(two_machines(("h$(touch pwned)", "m1"))))
    rc, out, err = hap(["plan", "--model", "zoo:mlp", "--set", "layers=1", "--cluster", str(path),
                        "--time-budget", "2"], capsys)
    assert rc == 0 and "predicted" in out.lower()
    warning = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert warning == ["warning: machine of cluster devices 0, 1: 'h$(touch pwned)' is not a host name (RFC 1123: "
                       "dot-separated labels of letters, digits and '-') or an IPv4/IPv6 address; `hap export` will "
                       "refuse it, rename the machine"]


@pytest.mark.parametrize("value, ok", [("m0", True), ("node-1.example.com", True), ("10.0.0.7", True), ("::1", True),
                                       ("[fe80::1]", True), ("a" * 63, True), ("a" * 64, False), ("-a", False),
                                       ("a_b", False), ("a..b", False), ("a b", False), ("m0\n", False), ("", False),
                                       (7, False)])
def test_host_grammar(value, ok):
    assert (grammar.host_problem(value) is None) == ok


@pytest.mark.parametrize("value, ok", [("m0:29500", True), ("10.0.0.7:1", True), ("[::1]:65535", True),
                                       ("m0:0", False), ("m0:65536", False), ("m0", False), ("::1:29500", False),
                                       ("m0:29500 ", False), ("m0:+1", False), ("m0:٣", False)])
def test_endpoint_grammar(value, ok):
    assert (grammar.endpoint_problem(value) is None) == ok


@pytest.mark.parametrize("value, ok", [
    ("hap-workbench:latest", True), ("ghcr.io/org/team/hap:1.0-rc_1", True), ("localhost:5000/hap", True),
    ("registry.example.com/hap@sha256:" + "a" * 64, True), ("Hap:1", False), ("hap:", False), (":1", False),
    ("hap:1;x", False), ("hap latest", False), ("hap:latest\n", False), ("/hap", False), ("hap//x", False)])
def test_image_grammar(value, ok):
    assert (grammar.image_problem(value) is None) == ok


def test_runner_words_kubernetes_names_and_shown_text():
    assert grammar.run_args_problem(["--steps", "100", "--checkpoint-dir", "/mnt/ckpt", "--lr", "1e-3"]) is None
    assert "word 1" in grammar.run_args_problem(["--steps", "1 2"])
    assert grammar.k8s_name_problem("hap-gpt-a100x2") is None and grammar.k8s_name_problem("Hap") is not None
    assert grammar.k8s_name_problem("a" * 64) is not None and grammar.k8s_name_problem("a-") is not None
    assert grammar.text_problem("NVIDIA A100-SXM4-40GB") is None and grammar.text_problem("a\u2028b") is not None
    assert grammar.file_name_problem("my_model.py") is None and grammar.file_name_problem("..") is not None


# ----------------------------------------------------------------------------- the scripts, run under stubs


def test_launch_node_runs_exactly_torchrun_with_the_runner_options_as_given(made, tmp_path):
    _, _, bundle, _ = made
    hostile = ["--steps", "3", "$(touch pwned)", "`touch pwned`", "a;touch pwned", "x\ntouch pwned"]
    for node in (0, 1):
        run = run_script(bundle / "launch_node.sh", [str(node), *hostile], tmp_path)
        assert run.returncode == 0 and run.unexpected() == [], run
        assert run.calls_of("dirname") == [[str(bundle / "launch_node.sh")]]
        assert run.calls_of("torchrun") == [expected_torchrun(2, node, 2, "m0:29500", "hap-mlp-two-machines",
                                                              str(bundle), hostile, join_timeout=600)]
        assert [cmd for cmd, _ in run.calls] == ["dirname", "torchrun"]


def test_launch_node_takes_a_hostile_rendezvous_override_as_data(made, tmp_path):
    _, _, bundle, _ = made
    endpoint = "$(touch pwned):1;touch pwned"
    run = run_script(bundle / "launch_node.sh", ["0"], tmp_path, env={"HAP_RDZV_ENDPOINT": endpoint})
    assert run.unexpected() == [] and run.calls_of("torchrun")[0][4] == f"--rdzv-endpoint={endpoint}"


def test_a_bad_node_rank_runs_nothing(made, tmp_path):
    _, _, bundle, _ = made
    run = run_script(bundle / "launch_node.sh", ["$(touch pwned)"], tmp_path)
    assert run.returncode == 2 and run.calls_of("torchrun") == [] and run.created == []
    assert "NODE_RANK must be 0..1, got $(touch pwned)" in run.stderr


def test_slurm_script_under_a_stub_srun_starts_one_torchrun_per_node(made, tmp_path):
    _, _, bundle, _ = made
    hostile = ["--steps", "3", "$(touch pwned)", "'", '"']
    run = run_script(bundle / "slurm.sbatch", hostile, tmp_path, env=slurm_env(bundle, ["n7", "n8"]))
    assert run.returncode == 0 and run.unexpected() == [], run
    assert run.calls_of("scontrol") == [["show", "hostnames", "n7,n8"]] and run.calls_of("head") == [["-n", "1"]]
    assert len(run.calls_of("srun")) == 1
    assert run.calls_of("torchrun") == [expected_torchrun(2, k, 2, "n7:29500", "42", str(bundle), hostile)
                                        for k in (0, 1)]


def test_a_heterogeneous_slurm_script_under_a_stub_srun_starts_each_component_as_its_node(graph, tmp_path):
    """Slurm hints make one component per machine; node k is component k, the rendezvous the first host of group 0."""
    cluster = two_machines()
    cluster["devices"][0]["slurm"] = {"feature": "a100"}
    cluster["devices"][1]["slurm"] = {"feature": "p100", "nodelist": "gpu[01-02]"}
    plan, path = plan_file_on(graph, cluster, tmp_path)
    bundle = export_bundle(str(plan), str(path), tmp_path / "b")
    text = (bundle / "slurm.sbatch").read_text()
    assert "#SBATCH --constraint=a100" in text and "#SBATCH --constraint=p100" in text
    assert "#SBATCH --nodelist=gpu[01-02]" in text and "Nothing pins" not in text
    hostile = ["--steps", "3", "$(touch pwned)", "'", '"']
    run = run_script(bundle / "slurm.sbatch", hostile, tmp_path, env=slurm_env(bundle, ["n7", "n8"]))
    assert run.returncode == 0 and run.unexpected() == [], run
    assert run.calls_of("scontrol") == [["show", "hostnames", "n7"]] and len(run.calls_of("srun")) == 1
    assert run.calls_of("torchrun") == [expected_torchrun(2, k, 2, "n7:29500", "42", str(bundle),
                                                          ["--device-check", "error", *hostile]) for k in (0, 1)]


@pytest.mark.parametrize("key, value", [("feature", "a100&ib"), ("feature", "a100\n#SBATCH --uid=0"),
                                        ("gres_type", "a100:8"), ("nodelist", "gpu01 gpu02"), ("nodelist", "-w")])
def test_a_slurm_hint_outside_its_grammar_is_refused_by_export_naming_the_field(graph, tmp_path, capsys, key, value):
    cluster = two_machines()
    cluster["devices"][1]["slurm"] = {key: value}
    plan, path = plan_file_on(graph, cluster, tmp_path)
    rc, _, err = hap(["export", str(plan), "--cluster", str(path), "--out", str(tmp_path / "b")], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"cluster device 2 slurm.{key}" in err, err
    assert not (tmp_path / "b").exists()


def test_slurm_settings_and_a_setup_prelude_reach_both_scripts(made, tmp_path, capsys):
    """--partition/--account/--time/--qos become #SBATCH lines; --setup ships setup.sh, sourced before torchrun."""
    plan, cluster, _, _ = made
    setup = tmp_path / "env.sh"
    setup.write_text("head -c 0 /dev/null  # a prelude command the stubs record\n")
    rc, _, err = hap(["export", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "b"), "--partition",
                      "gpu", "--account", "proj-1", "--time", "1-00:30:00", "--qos", "high", "--setup", str(setup)],
                     capsys)
    assert rc == 0, err
    bundle = tmp_path / "b"
    text = (bundle / "slurm.sbatch").read_text()
    for line in ("--partition=gpu", "--account=proj-1", "--time=1-00:30:00", "--qos=high"):
        assert f"#SBATCH {line}\n" in text
    assert (bundle / "setup.sh").read_bytes() == setup.read_bytes() and check_bundle(bundle).ok
    manifest = json.loads((bundle / MANIFEST).read_text())
    assert manifest["export"]["setup"] is True and "setup.sh" in manifest["files"]
    for script, args, env in (("launch_node.sh", ["1"], {}), ("slurm.sbatch", [], slurm_env(bundle, ["n7", "n8"]))):
        run = run_script(bundle / script, args, tmp_path, env=env)
        assert run.returncode == 0 and run.unexpected() == [], run
        names = [(cmd, argv) for cmd, argv in run.calls if cmd in ("head", "torchrun") and argv[:1] != ["-n"]]
        assert [cmd for cmd, _ in names] == ["head", "torchrun"] * (len(names) // 2) and names, names
    (bundle / "setup.sh").write_text("touch pwned\n")
    assert any("setup.sh" in p for p in check_bundle(bundle).problems)
    (bundle / "setup.sh").unlink()
    assert any(p.startswith("missing file: setup.sh") for p in check_bundle(bundle).problems)


def test_generated_scripts_quote_values_even_when_the_grammar_is_bypassed(tmp_path):
    """Defence in depth: launch_node_script called directly, with values export would refuse."""
    nodes = [LaunchNode(0, "m0", (0, 1))]
    evil = LaunchSettings(job="x'; touch pwned; '", rdzv_endpoint="$(touch pwned):1'\"`touch pwned`")
    script = tmp_path / "b" / "launch_node.sh"
    script.parent.mkdir()
    script.write_text(launch_node_script(nodes, evil))
    run = run_script(script, ["0"], tmp_path)
    assert run.unexpected() == [], run
    argv = run.calls_of("torchrun")[0]
    assert argv[4] == f"--rdzv-endpoint={evil.rdzv_endpoint}" and argv[5] == f"--rdzv-id={evil.job}"
    with pytest.raises(BundleError, match="cannot be written into a launch file"):
        launch_node_script([LaunchNode(0, "m0\ntouch pwned", (0,))], evil)
    with pytest.raises(BundleError, match="job name"):
        slurm_script(nodes, evil)
    two = [LaunchNode(0, "m0", (0, 1)), LaunchNode(1, "m1", (2, 3))]
    for hints in ((("feature", "a\n#SBATCH --uid=0"),), (("nodelist", "x y"),)):
        hinted = LaunchSettings(job="ok", rdzv_endpoint="m0:1", node_slurm=((), hints))
        with pytest.raises(BundleError, match="slurm"):
            slurm_script(two, hinted)
    with pytest.raises(BundleError, match="slurm time"):
        slurm_script(nodes, LaunchSettings(job="ok", rdzv_endpoint="m0:1", sbatch=(("time", "1\n#SBATCH x"),)))


# ----------------------------------------------------------------------------- digest and regeneration


def tamper(bundle: Path, dest: Path, name: str = "launch_node.sh") -> Path:
    """A copy of the bundle with a command added to `name` and its hash in manifest.json edited to match."""
    shutil.copytree(bundle, dest)
    first, rest = (dest / name).read_text().split("\n", 1)
    text = f"{first}\ntouch pwned\n{rest}"
    (dest / name).write_text(text)
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text.encode())}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest


def test_export_prints_the_digest_and_check_accepts_it(made, tmp_path, capsys):
    plan, cluster, bundle, digest = made
    rc, out, _ = hap(["export", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "b")], capsys)
    printed = out.strip().splitlines()[-1].split()[1].removeprefix("sha256:")
    assert rc == 0 and printed == hashlib.sha256((tmp_path / "b" / MANIFEST).read_bytes()).hexdigest()
    for target in (bundle, bundle.with_name("bundle.zip")):
        rc, out, _ = hap(["bundle", "check", str(target), "--digest", f"sha256:{digest}"], capsys)
        assert rc == 0 and "OK" in out


def test_a_tampered_script_with_its_hash_edited_is_refused_by_the_digest_and_by_regeneration(made, tmp_path, capsys):
    _, _, bundle, digest = made
    bad = tamper(bundle, tmp_path / "bad")
    rc, _, err = hap(["bundle", "check", str(bad), "--digest", digest], capsys)
    assert rc == 1 and "digest mismatch" in err and digest in err
    rc, _, err = hap(["bundle", "check", str(bad)], capsys)
    problems = [ln.strip() for ln in err.splitlines()[1:]]
    assert rc == 1 and problems == ["launch_node.sh: not the file `hap export` writes for this plan, cluster and "
                                    "export settings (line 2 is 'touch pwned' where export writes "
                                    "'# Run on every node of the job, each with its own NODE_RANK (see README.md):'); "
                                    "export the bundle again"]


@pytest.mark.parametrize("name", ["slurm.sbatch", "README.md", "model.json", "pytorchjob.yaml"])
def test_every_generated_file_is_checked_by_regeneration(made, tmp_path, name):
    _, _, bundle, _ = made
    bad = tamper(bundle, tmp_path / "bad", name) if name != "model.json" else shutil.copytree(bundle, tmp_path / "bad")
    if name == "model.json":  # another zoo config, re-hashed: the runner would build another model
        doc = json.loads((bad / name).read_text())
        doc["config"]["hidden"] = 32
        text = json.dumps(doc, indent=1) + "\n"
        (bad / name).write_text(text)
        manifest = json.loads((bad / MANIFEST).read_text())
        manifest["files"][name]["sha256"] = hashlib.sha256(text.encode()).hexdigest()
        (bad / MANIFEST).write_text(json.dumps(manifest))
    report = check_bundle(bad)
    assert not report.ok and report.problems[0].startswith(f"{name}: not the file `hap export` writes"), report.problems


def test_recorded_export_settings_are_regenerated_and_an_added_file_is_refused(made, tmp_path):
    plan, cluster, _, _ = made
    out = export_bundle(str(plan), str(cluster), tmp_path / "b", rdzv_endpoint="10.1.2.3:1234",
                        image="ghcr.io/me/hap:1", run_args=["--steps", "7"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["export"] == {"rdzv_endpoint": "10.1.2.3:1234", "image": "ghcr.io/me/hap:1",
                                  "run_args": ["--steps", "7"], "annotations": False, "partition": None,
                                  "account": None, "time": None, "qos": None, "setup": False}
    assert check_bundle(out).ok
    manifest["export"]["image"] = "ghcr.io/me/other:1"  # settings edited, files left: they no longer match
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert any(p.startswith("pytorchjob.yaml: not the file") for p in check_bundle(out).problems)
    manifest["export"]["image"] = "x;touch pwned"
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert check_bundle(out).problems == ["--image: 'x;touch pwned' is not an OCI image reference such as "
                                          "registry.example.com:5000/team/hap-workbench:1.0 (lower-case path, optional "
                                          ":tag, @sha256:...) (refused: it would be written into the launch files)"]
    manifest["export"] = {"partition": "gpu"}  # a Slurm setting added by hand: slurm.sbatch no longer matches
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert any(p.startswith("slurm.sbatch: not the file") for p in check_bundle(out).problems)
    manifest["export"] = {"reservation": "r1"}
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert "manifest.json export.reservation: not an export setting" in check_bundle(out).problems[0]


def test_a_file_export_never_writes_is_refused_even_when_listed(made, tmp_path):
    _, _, bundle, _ = made
    bad = shutil.copytree(bundle, tmp_path / "bad")
    (bad / "run.sh").write_text("touch pwned\n")
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["files"]["run.sh"] = {"sha256": hashlib.sha256(b"touch pwned\n").hexdigest(), "bytes": 12}
    (bad / MANIFEST).write_text(json.dumps(manifest))
    assert check_bundle(bad).problems == ["run.sh: not a file `hap export` writes; a bundle holds only its plan, "
                                          "cluster, model and generated files"]


def test_a_schema_1_bundle_checks_with_a_warning_and_a_newer_schema_is_refused(made, tmp_path):
    old = Path(__file__).parents[1] / "fixtures" / "written_by_66fbce9" / "spmd_bundle"
    report = check_bundle(old)
    assert report.ok and report.warnings[-1] == OLD_SCHEMA_WARNING
    _, _, bundle, _ = made
    new = shutil.copytree(bundle, tmp_path / "new")
    manifest = json.loads((new / MANIFEST).read_text())
    manifest["schema_version"] = 3
    (new / MANIFEST).write_text(json.dumps(manifest))
    assert "schema_version 3 is not one this hap-workbench reads (1..2)" in check_bundle(new).problems[0]


def test_digest_option_grammar(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bundle", "check", ".", "--digest", "abc"])
    assert e.value.code == 2 and "64 hex digits" in capsys.readouterr().err


def test_sample_clusters_export_without_a_warning():
    for path in sorted(Path(sample_path("cpu_2")).parent.glob("*.json")):
        from engine.bundle.launch_files import cluster_launch_warnings

        assert cluster_launch_warnings(engine.load_cluster(sample_dict(path.stem))) == [], path


def test_a_bundle_whose_cluster_and_nodes_were_edited_to_a_hostile_machine_is_refused_naming_it(made, tmp_path):
    _, _, bundle, _ = made
    bad = shutil.copytree(bundle, tmp_path / "bad")
    cluster = json.loads((bad / "cluster.json").read_text())
    for device in cluster["devices"][:2]:  # node 0's two devices
        device["machine"] = "m0$(touch pwned)"
    text = json.dumps(cluster, indent=1) + "\n"
    (bad / "cluster.json").write_text(text)
    plan = (bad / "plan.json").read_text().replace('"m0"', '"m0$(touch pwned)"')  # the plan's machines too
    (bad / "plan.json").write_text(plan)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["nodes"][0]["machine"] = "m0$(touch pwned)"
    for name, data in (("cluster.json", text), ("plan.json", plan)):
        manifest["files"][name] = {"sha256": hashlib.sha256(data.encode()).hexdigest(), "bytes": len(data)}
    (bad / MANIFEST).write_text(json.dumps(manifest))
    assert check_bundle(bad).problems == ["node 0 machine 'm0$(touch pwned)' is not a host name (RFC 1123: "
                                          "dot-separated labels of letters, digits and '-') or an IPv4/IPv6 address; "
                                          "rename the machine in the cluster spec (refused: it would be written into "
                                          "the launch files)"]
