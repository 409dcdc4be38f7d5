"""The pages' prose speaks to a browser user (issue 30): no CLI prefix ("hap: error", "hap export:"), no flag to
pass outside code, no "None", no number with more than 4 significant digits. Commands in code blocks and inline
code, digests and exact counts (integers) are exempt. One AppTest run per page."""
from __future__ import annotations

from ui_helpers import app, assert_prose_for_people, open_page, prose_problems  # noqa: F401 (fixtures)

PAGES = ["plan", "model", "cluster", "theory", "search", "timeline", "runs", "compare", "export"]
"""Every page (the pipeline pages are scanned in test_pipeline_pages, on their plan)."""


def test_the_prose_checks_catch_what_they_should():
    assert prose_problems("hap export: hap: error: device 'v100-m0' is virtual") == [
        "CLI prefix 'hap export:'", "CLI prefix 'hap: error'"]
    assert prose_problems("give --cluster the spec") == ["flag '--cluster'"]
    assert prose_problems("run `hap run plan.json --steps 5`; sha256:" + "ab" * 32) == []
    assert prose_problems("0.000157 T, 742857142.8571, 38.50x, None") == [
        "None", "number 742857142.8571"]
    assert prose_problems("1.23456 ms and 15700000000000 FLOP/s") == ["number 1.23456", "number 15700000000000"]
    assert prose_problems("4523 states expanded, 16384 vocab, 12.35 ms") == []


def test_every_pages_prose_is_for_a_browser_user(app):
    """One session visits every page in turn (one app start for all: the suite's time is short)."""
    at = app
    for page in PAGES:
        at = open_page(at, page)
        assert_prose_for_people(at)


def test_the_stale_plan_messages_are_for_a_browser_user_too(app):
    import engine
    from ui_helpers import ROOT

    from app.services import Keys

    app.session_state[Keys.CLUSTER] = engine.load_cluster(ROOT / "sample_clusters" / "cpu_2.json")
    for page in ("plan", "timeline", "compare", "export", "search", "runs"):
        assert_prose_for_people(open_page(app, page))
