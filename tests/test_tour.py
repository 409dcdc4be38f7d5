"""examples/tour.ipynb, executed top to bottom by nbclient in a fresh kernel (once, for every assertion): no cell
fails, the cells that show a plan, a pipeline plan, a cluster and a comparison emit Vega-Lite with an SVG or PNG
fallback, and the bundle it exports trains two verified steps. The notebook is stored without outputs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "examples" / "tour.ipynb"
VEGA_LITE = re.compile(r"application/vnd\.vegalite\.v(\d+)\+json")


@pytest.fixture(scope="module")
def tour():
    """The tour with its outputs, run where a user runs it (examples/), with nbclient's default timeout."""
    nbformat = pytest.importorskip("nbformat", reason="the notebook extra is not installed: pip install -e '.[notebook]'")
    nbclient = pytest.importorskip("nbclient", reason="the notebook extra is not installed: pip install -e '.[notebook]'")
    nb = nbformat.read(TOUR, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(TOUR.parent)}}).execute()
    return nb


def cell_ending(nb, last_line: str):
    """The code cell whose last source line starts with `last_line` (the expression it displays)."""
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.splitlines()[-1].startswith(last_line))


def charts_of(cell) -> list[dict]:
    """Display outputs of `cell` carrying a Vega-Lite spec (v5 or later)."""
    return [o["data"] for o in cell.outputs if o.output_type in ("display_data", "execute_result")
            and any((m := VEGA_LITE.fullmatch(k)) and int(m.group(1)) >= 5 for k in o["data"])]


def test_the_tour_runs_without_errors(tour):
    errors = [o for c in tour.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.parametrize("shown", ["plan", "pipeline", "cluster", "compare.compare("])
def test_plan_pipeline_cluster_and_comparison_cells_draw_vega_lite_with_a_static_fallback(tour, shown):
    charts = charts_of(cell_ending(tour, shown))
    assert charts, f"the cell showing {shown} drew no Vega-Lite chart"
    assert all("image/svg+xml" in d or "image/png" in d for d in charts)


def test_the_tour_exports_a_bundle_that_trains_two_verified_steps(tour):
    text = "".join(o.get("text", "") for o in cell_ending(tour, "assert run.returncode == 0").outputs)
    assert "step    1/2" in text and "verify: OK" in text


def test_the_tour_is_stored_without_outputs():
    nb = json.loads(TOUR.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
