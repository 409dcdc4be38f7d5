"""Export page: plan download, the launch bundle and its digest, the commands to run the plan."""
from __future__ import annotations

import hashlib
import io
import zipfile

from ui_helpers import ROOT, app, cpu_cluster, no_exception, open_page, tiny_plan  # noqa: F401 (fixtures)

import engine
from engine.planner import load_plan


def test_export_offers_the_plan_and_the_run_commands(app, tiny_plan):
    at = open_page(app, "export")
    no_exception(at)
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels[:2] == ["Download plan.json", "Download cluster.json"]
    commands = next(c.value for c in at.code if "hap run plan.json" in c.value)
    assert "hap run plan.json --steps 5 --verify" in commands
    assert f"--nproc-per-node={tiny_plan.world_size}" in commands


def test_the_downloaded_text_is_the_plan(tiny_plan):
    """AppTest cannot read download bytes: the page offers plan.to_json(), which must parse back."""
    again = load_plan(tiny_plan.to_json())
    assert again.to_json() == tiny_plan.to_json()


def test_bundle_zip_holds_the_plan(tiny_plan, cpu_cluster):
    from app import services

    data, message, digest = services.bundle_zip(tiny_plan.to_json(), services.cluster_json(cpu_cluster))
    assert data is not None, message
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        name = next(n for n in zf.namelist() if n.endswith("plan.json"))
        assert load_plan(zf.read(name).decode()).to_json() == tiny_plan.to_json()
        manifest = zf.read(next(n for n in zf.namelist() if n.endswith("manifest.json")))
        assert digest == hashlib.sha256(manifest).hexdigest()


def test_export_page_offers_the_bundle(app):
    at = open_page(app, "export")
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    assert "Download launch bundle (zip)" in [b.proto.label for b in at.get("download_button")]
    digest = at.code[0].value.splitlines()[0]
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert f"hap run hap_bundle.zip --digest {digest[7:]}" in at.code[0].value


def test_bundle_of_an_uploaded_model_file_ships_the_upload(cpu_cluster):
    from app import services
    from engine.model.source import capture_source

    text = (ROOT / "tests" / "fixtures" / "model_files" / "cumprod_mlp.py").read_bytes()
    plan = engine.plan(capture_source(text, "net.py", fallback="replicate"), cpu_cluster)
    data, message, digest = services.bundle_zip(plan.to_json(), services.cluster_json(cpu_cluster))
    assert data is None and digest is None and "not found" in message  # the upload has no path on this machine
    data, message, _ = services.bundle_zip(plan.to_json(), services.cluster_json(cpu_cluster), ("net.py", text))
    assert data is not None, message
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read(next(n for n in zf.namelist() if n.endswith("model/net.py"))) == text
