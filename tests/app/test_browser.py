"""The workbench in a real headless Chromium (Debian `chromium`, driven by Playwright's Python API).

`hap ui --port <free port>` serves the app on 127.0.0.1; the test reads the first screen's introduction, exports
the default plan (4 ranks, one per GPU; plan.json and cluster.json must match), counts the Timeline's rendered lane
labels against the plan's lanes (4 devices, the paper's testbed of 8 one click away, the 16 of the 5 Gbps cluster,
64 devices grouped), switches the cluster and then the model without searching and checks that Plan, Timeline,
Compare and Export each say what changed and draw nothing of the old plan (nor name its devices), picks the zoo
MLP and `hap_paper_testbed.json`, runs the search, checks that the frontier and timeline charts render (Vega
canvas or svg present, no Streamlit exception box), downloads the plan and parses it, and saves a screenshot of
every page under tests/artifacts/.

The notebook front end in the same Chromium: JupyterLab on 127.0.0.1 serves a copy of examples/tour.ipynb (so
autosave never writes outputs into the repository), the test runs all its cells from the Run menu, waits for the
last one (a verified two-step run), finds the charts JupyterLab's Vega renderer drew, counts the lane labels of
the 3-stage pipeline's Gantt against its lanes, and saves the timeline and pipeline cells' pictures as
tests/artifacts/notebook_timeline.png and notebook_pipeline.png.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

from engine.planner import load_plan

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ["Model", "Cluster", "Theory", "Search", "Plan", "Timeline", "Runs", "Compare", "Export"]
WAIT_MS = 180_000

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"{CHROMIUM} is absent: install Debian's chromium (`apt-get install -y chromium`, "
                                       "as .ci/run does) to run the real-browser test")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Poll `url` (a server's health or status endpoint) until it answers 200 (or the process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{proc.args[:4]} did not answer on {url} within {timeout_s} s")


@contextlib.contextmanager
def serving(cmd: list[str], health_url: str, log_path: Path, *, cwd: Path = ROOT, env: dict | None = None):
    """A server process in a session of its own, yielded once `health_url` answers; stopped with its children."""
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(health_url, proc)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group is gone already when it died on start
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`hap ui` on a free port of 127.0.0.1, stopped (with its Streamlit child) at the end."""
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "runner.hap", "ui", "--port", url.rsplit(":", 1)[1]]
    with serving(cmd, f"{url}/_stcore/health", tmp_path_factory.mktemp("ui") / "server.log"):
        yield url


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def idle(page) -> None:
    """Wait until the script run is over (Streamlit shows a 'Running...' status widget while busy)."""
    page.wait_for_timeout(300)
    page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=WAIT_MS)


def goto(page, title: str) -> None:
    page.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
    page.get_by_role("heading", name=title, exact=True).first.wait_for(timeout=WAIT_MS)
    idle(page)


def pick(page, label: str, option: str) -> None:
    """Choose `option` in the Streamlit selectbox labelled `label`."""
    page.get_by_role("combobox", name=label).click()
    page.get_by_role("option", name=option, exact=True).click()
    idle(page)


def charts(page, at_least: int = 1) -> int:
    """Wait until `at_least` Vega charts have drawn (a canvas or an svg inside the chart element); their count."""
    drawn = page.locator('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks')
    drawn.nth(at_least - 1).wait_for(timeout=60_000)
    return drawn.count()


def assert_no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator('[data-testid="stException"]').first.inner_text()


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


OLD_PLAN = ('[data-testid="stVegaLiteChart"], [data-testid="stDataFrame"], [data-testid="stDownloadButton"], '
            '[data-testid="stGraphVizChart"], [data-testid="stMetric"], [data-testid="stCode"]')
"""What would show the old plan's numbers: charts, tables, downloads, metrics, listings and commands."""


def use_sample(page, name: str) -> None:
    goto(page, "Cluster")
    pick(page, "Sample", name)
    page.get_by_role("button", name="Use this sample").click()
    idle(page)
    page.get_by_text(f"{name.removesuffix('.json')}: ").first.wait_for()


def lane_labels(page) -> list[str]:
    """The axis labels the page's Vega charts drew (SVG text: the Gantt charts render as SVG)."""
    page.locator('[data-testid="stVegaLiteChart"] svg g.role-axis-label text').first.wait_for(timeout=60_000)
    return page.locator('[data-testid="stVegaLiteChart"] svg g.role-axis-label text').all_text_contents()


def assert_every_lane_labelled(page, plan, cluster) -> int:
    """The Timeline's Gantt chart labels each of the plan's lanes (issue 30, item 4): Vega drops overlapping labels
    from a chart too short for its rows. Returns the number of lanes."""
    from engine.compare import predicted_schedule
    from engine.views import predicted_lane_rows

    lanes = {r["row"] for r in predicted_lane_rows(predicted_schedule(plan, cluster).rows(), group=plan.world_size > 16)}
    drawn = [t for t in lane_labels(page) if " · " in t]
    assert sorted(drawn) == sorted(lanes), f"labelled {len(drawn)} of {len(lanes)} lanes"
    return len(lanes)


def assert_every_device_labelled(page, devices: list[str]) -> None:
    """Each device's compute and network lanes are labelled once (for a plan the test does not hold)."""
    drawn = [t for t in lane_labels(page) if " · " in t]
    assert len(drawn) == len(set(drawn)), "a lane labelled twice"
    for lane in ("compute", "network"):
        assert sorted(t.split(" · ")[0] for t in drawn if t.endswith(f" · {lane}")) == sorted(devices), lane


def download_set(page, stem: Path):
    """plan.json and cluster.json from the Export page: (plan, cluster), checked to be a matching pair."""
    from engine import load_cluster

    files = {}
    for name in ("plan.json", "cluster.json"):
        with page.expect_download() as dl:
            page.get_by_role("button", name=f"Download {name}").click()
        files[name] = Path(f"{stem}_{name}")
        dl.value.save_as(files[name])
        idle(page)  # a download button's click reruns the page
    plan, cluster = load_plan(files["plan.json"]), load_cluster(files["cluster.json"])
    assert plan.cluster_fingerprint == cluster.fingerprint(), "Export offered a plan and a cluster that do not match"
    return plan, cluster


def assert_stale_everywhere(page, change: str, shot: str, old_devices: tuple[str, ...] = ()) -> None:
    """Plan, Timeline, Compare and Export each say `change` and draw nothing of the old plan: no chart, table,
    download or listing, and none of its devices by name."""
    for title in ("Plan", "Timeline", "Compare", "Export"):
        goto(page, title)
        main = page.locator('[data-testid="stMain"]')
        main.get_by_text(change).first.wait_for()
        main.get_by_role("button", name="Plan again").wait_for()
        idle(page)
        page.wait_for_selector('[data-stale="true"]', state="detached")  # nothing left over from the page before
        assert main.get_by_role("button", name="Plan again").count() == 1
        assert main.locator(OLD_PLAN).count() == 0, f"{title} shows the old plan after: {change}"
        text = main.inner_text()
        assert not [d for d in old_devices if d in text], f"{title} names the old plan's devices after: {change}"
        assert_no_exception(page)
        shoot(page, f"{shot}_{title.lower()}")


def test_workbench_in_chromium(server, browser, tmp_path):
    import engine

    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(server)
    # the first screen is the Plan page with the default model already planned
    page.get_by_text("Predicted iteration").first.wait_for()
    idle(page)
    sidebar = page.locator('[data-testid="stSidebar"]').inner_text()
    assert "zoo:gpt" in sidebar and "a100x2_p100x2" in sidebar
    page.get_by_text("The HAP workbench plans the training of one model").wait_for()  # the first screen explains itself
    page.get_by_text("Why these ratios.").wait_for()
    assert charts(page, 2) >= 2  # ratios and memory
    assert_no_exception(page)
    shoot(page, "plan_default")
    goto(page, "Export")  # the default cluster has one device per GPU: its plan is exported as it is
    page.get_by_text("(4 ranks, one per device)").wait_for()
    default, default_cluster = download_set(page, tmp_path / "default")
    assert default.world_size == 4 and default.cluster_name == "a100x2_p100x2"
    page.get_by_role("button", name="Download launch bundle (zip)").wait_for()
    assert_no_exception(page)
    shoot(page, "export_default")
    goto(page, "Timeline")
    assert assert_every_lane_labelled(page, default, default_cluster) >= 8  # 4 devices, a compute and a network lane
    shoot(page, "timeline_default")

    # the paper's testbed one click from the first screen: 8 devices, every lane labelled again
    goto(page, "Plan")
    page.get_by_role("button", name="Plan it on the paper's testbed").click()
    idle(page)
    page.get_by_text("hap_paper_testbed_machines (8 devices)").first.wait_for()
    goto(page, "Export")
    testbed, testbed_cluster = download_set(page, tmp_path / "testbed")  # expanded to one rank per GPU
    assert testbed.world_size == 64 and testbed_cluster.fingerprint() == testbed.cluster_fingerprint
    goto(page, "Timeline")
    assert_every_device_labelled(page, [d.name for d in engine.load_cluster(ROOT / "sample_clusters" /
                                                                             "hap_paper_testbed_machines.json").devices])
    shoot(page, "timeline_testbed")

    # 16 devices (the 5 Gbps cluster's A100 and V100 machines), planned again there: every lane labelled
    use_sample(page, "a100x8_v100x8_5gbps.json")
    goto(page, "Plan")
    page.get_by_role("button", name="Plan again").click()
    page.get_by_text("Predicted iteration").first.wait_for()  # planned (leaving sooner would stop the script run)
    idle(page)
    goto(page, "Timeline")
    assert_every_device_labelled(page, [d.name for d in engine.load_cluster(ROOT / "sample_clusters" /
                                                                             "a100x8_v100x8_5gbps.json").devices])
    shoot(page, "timeline_16_devices")
    use_sample(page, "a100x2_p100x2.json")  # back to the default cluster: its plan is made again (cached)
    goto(page, "Plan")
    page.get_by_role("button", name="Plan again").click()
    idle(page)

    # switch the cluster, then the model, without searching: no page shows the old plan
    use_sample(page, "hap_paper_testbed_machines.json")
    assert_stale_everywhere(page, "The cluster changed from a100x2_p100x2 to hap_paper_testbed_machines", "stale_cluster",
                            old_devices=tuple(default.device_names))
    use_sample(page, "a100x2_p100x2.json")  # the plan's own cluster again: current once more
    goto(page, "Plan")
    assert charts(page, 2) >= 2

    goto(page, "Model")
    pick(page, "Zoo model", "mlp")
    page.get_by_role("button", name="Load zoo model").click()
    idle(page)
    page.get_by_text("Current model: zoo:mlp").wait_for()
    assert_no_exception(page)
    shoot(page, "model")
    assert_stale_everywhere(page, "The model changed from zoo:gpt", "stale_model")

    goto(page, "Cluster")
    pick(page, "Sample", "hap_paper_testbed.json")
    page.get_by_role("button", name="Use this sample").click()
    idle(page)
    page.get_by_text("hap_paper_testbed: 64 devices").wait_for()
    assert page.locator('[data-testid="stGraphVizChart"] svg').count() >= 1
    assert_no_exception(page)
    shoot(page, "cluster")

    goto(page, "Theory")
    page.locator('[data-testid="stDataFrame"]').nth(1).wait_for()
    shoot(page, "theory")

    goto(page, "Search")
    page.get_by_role("button", name="Run search").click()
    page.get_by_text("States expanded", exact=True).wait_for()
    idle(page)
    page.locator('[data-testid="stVegaLiteChart"]').first.wait_for()
    assert charts(page, 1) >= 1, "the frontier chart did not render"
    assert_no_exception(page)
    shoot(page, "search")

    goto(page, "Plan")
    assert charts(page, 2) >= 2
    shoot(page, "plan")

    goto(page, "Timeline")
    page.locator('[data-testid="stVegaLiteChart"]').first.wait_for()
    assert charts(page, 1) >= 1, "the timeline chart did not render"
    assert_no_exception(page)
    shoot(page, "timeline")

    goto(page, "Compare")
    page.locator('[data-testid="stDataFrame"]').first.wait_for()
    assert charts(page, 1) >= 1
    assert_no_exception(page)
    shoot(page, "compare")

    goto(page, "Export")
    plan, cluster = download_set(page, tmp_path / "final")
    assert plan.cluster_name == "hap_paper_testbed" and plan.graph.name == "mlp" and plan.world_size == 64
    assert_no_exception(page)
    shoot(page, "export")
    goto(page, "Timeline")  # 64 devices, grouped where their lanes are identical: each group's lanes labelled
    assert assert_every_lane_labelled(page, plan, cluster) >= 2
    ctx.close()


# ----------------------------------------------------------------------------- the notebook front end


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab on a free port of 127.0.0.1 serving a folder holding a copy of the tour, its settings and runtime
    files in that folder too (nothing of the user's); (url, token)."""
    pytest.importorskip("jupyterlab", reason="the notebook extra is not installed: pip install -e '.[notebook]'")
    home = tmp_path_factory.mktemp("jupyter")
    shutil.copy(ROOT / "examples" / "tour.ipynb", home / "tour.ipynb")
    port, token = free_port(), "hap-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.root_dir={home}", f"--IdentityProvider.token={token}",
           f"--LabApp.workspaces_dir={home / 'workspaces'}"]
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/api/status?token={token}", home / "jupyterlab.log", cwd=home, env=env):
        yield url, token


def test_tour_in_jupyterlab(jupyterlab, browser):
    url, token = jupyterlab
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{url}/lab/tree/tour.ipynb?token={token}")
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()  # before it, Run All Cells is not enabled yet
    page.locator('.lm-MenuBar-itemLabel:text-is("Run")').click()
    page.locator('.lm-Menu-itemLabel:text-is("Run All Cells")').click()
    page.get_by_text("verify: OK").wait_for(timeout=2 * WAIT_MS)  # the last cell: a verified two-step run
    drawn = page.locator(".jp-RenderedVegaCommon5 canvas, .jp-RenderedVegaCommon5 svg")
    drawn.first.wait_for()
    assert page.locator(".jp-RenderedVegaCommon5").count() >= 8  # graph, cluster, plan, search, ... natively
    assert page.locator('[data-mime-type="application/vnd.jupyter.error"]').count() == 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    plan_cell = page.locator(".jp-Cell", has=page.locator(".jp-InputArea", has_text="plan = engine.plan(gpt")).first
    plan_cell.locator(".jp-OutputArea").screenshot(path=str(ARTIFACTS / "notebook_timeline.png"))
    pipeline_cell = page.locator(".jp-Cell", has=page.locator(".jp-InputArea", has_text="pipeline = engine.plan(")).first
    assert_every_pipeline_lane_labelled(pipeline_cell, stages=3)
    pipeline_cell.locator(".jp-OutputArea").screenshot(path=str(ARTIFACTS / "notebook_pipeline.png"))
    ctx.close()


def assert_every_pipeline_lane_labelled(cell, stages: int) -> None:
    """The pipeline Gantt of `cell` labels each of its lanes (issue 30, item 4): a lane per stage and, between
    neighbouring stages, one per link direction (engine.views.pipeline's lane names), for a pipeline of `stages`."""
    texts = cell.locator(".jp-RenderedVegaCommon5 svg g.role-axis-label text").all_text_contents()
    drawn = sorted(t for t in texts if t.startswith(("stage ", "link ")))
    lanes = ([f"stage {s}" for s in range(stages)] + [f"link {s}→{s + 1}" for s in range(stages - 1)]
             + [f"link {s}←{s + 1}" for s in range(stages - 1)])
    assert drawn == sorted(lanes), f"labelled {drawn}, the {stages}-stage pipeline's lanes are {sorted(lanes)}"
