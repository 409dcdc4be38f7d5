"""Export page: plan download, bundle when the engine has one, the commands to run the plan."""
from __future__ import annotations

import importlib.util

from ui_helpers import no_exception, open_page, app, tiny_plan  # noqa: F401 (fixtures)

import engine


def test_export_offers_the_plan_and_the_run_commands(app, tiny_plan):
    at = open_page(app, "export")
    no_exception(at)
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels[:2] == ["Download plan.json", "Download cluster.json"]
    commands = at.code[0].value
    assert "hap run plan.json --steps 5 --verify" in commands
    assert f"--nproc-per-node={tiny_plan.world_size}" in commands
    if importlib.util.find_spec("engine.bundle") is None:
        assert any("not part of this build" in c.value for c in at.caption)


def test_the_downloaded_text_is_the_plan(tiny_plan):
    """AppTest cannot read download bytes: the page offers plan.to_json(), which must parse back."""
    again = engine.Plan.from_json(tiny_plan.to_json())
    assert again.to_json() == tiny_plan.to_json()
