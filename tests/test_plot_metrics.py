"""bench/plot_metrics.py: a metrics file's loss and eval loss as a self-contained SVG (the README's loss curve)."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import load_bench

ROOT = Path(__file__).resolve().parent.parent
METRICS = ROOT / "tests" / "fixtures" / "metrics"
SVG = "{http://www.w3.org/2000/svg}"


@functools.cache
def _bench():
    """The script as a module (registered first: its dataclasses look their module up by name)."""
    return load_bench("plot_metrics")


def _lines(root: ET.Element) -> dict[str, ET.Element]:
    """label -> polyline of every series group."""
    return {g.get("data-label"): g.find(f"{SVG}polyline") for g in root.iter(f"{SVG}g") if g.get("class") == "series"}


def _series(root: ET.Element) -> dict[str, list[tuple[float, float]]]:
    """label -> the polyline's pixel points."""
    return {label: [tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for label, line in _lines(root).items()}


def test_the_script_writes_loss_and_eval_loss(tmp_path):
    out = tmp_path / "docs" / "loss_curve.svg"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_metrics.py"), str(METRICS / "run_3ranks_eval.jsonl"),
                        "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "eval loss 5.5500 -> 3.7900 (31.7% lower)" in r.stdout
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    series = _series(root)
    assert list(series) == ["loss", "eval loss"]
    assert len(series["loss"]) == 6 and len(series["eval loss"]) == 3
    xs = [x for x, _ in series["loss"]]
    assert xs == sorted(xs) and series["loss"][0][1] < series["loss"][-1][1]  # loss falls: y grows downwards
    legend = [t.text for g in root.iter(f"{SVG}g") if g.get("class") == "legend" for t in g.iter(f"{SVG}text")]
    assert legend == ["loss", "eval loss"]


def test_several_runs_get_a_colour_each(tmp_path):
    out = tmp_path / "two.svg"
    assert _bench().main([str(METRICS / "run_3ranks_eval.jsonl"), str(METRICS / "old_format.jsonl"), "--out", str(out)]) == 0
    strokes = {label: line.get("stroke") for label, line in _lines(ET.parse(out).getroot()).items()}
    assert list(strokes) == ["run_3ranks_eval.jsonl: loss", "run_3ranks_eval.jsonl: eval loss", "old_format.jsonl: loss"]
    new, new_eval, old = strokes.values()
    assert new == new_eval != old


def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"step": 0, "rank": 0, "loss": "x"}) + "\n")
    assert _bench().main([str(bad), "--out", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot_metrics: error: m.jsonl: record of step 0, rank 0: 'loss'") and err.count("\n") == 1
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize("lo, hi, ticks", [(0, 5, [0, 1, 2, 3, 4, 5]), (0, 199, [0, 50, 100, 150, 200]),
                                           (3.71, 5.62, [3.5, 4.0, 4.5, 5.0, 5.5, 6.0]),
                                           (2.0, 2.0, [1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6])])  # a flat line
def test_axes_end_on_round_ticks(lo, hi, ticks):
    axis = _bench().axis(lo, hi, 0, 100)
    assert list(axis.ticks) == pytest.approx(ticks) and (axis(axis.lo), axis(axis.hi)) == (0, 100)
