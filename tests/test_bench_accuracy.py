"""bench/accuracy.py's report: the figures per cluster, per training mode and per plan kind (issue 28)."""
from __future__ import annotations

from conftest import load_bench


def _row(cluster: str, strategy: str, overlap: str, predicted: float, measured: float) -> dict:
    split = {"compute_s": predicted / 2, "comm_s": predicted / 2}
    return {"cluster": cluster, "model": "mlp L2 h1024 in256", "strategy": strategy, "launch_spread": 0.0,
            "predicted": {"iteration_s": predicted, "overlap": overlap, "collectives": [], **split},
            "measured": {"iteration_s": measured, "load_before": 1.0, **split}}


def test_the_report_groups_the_variants_by_plan_kind():
    bench = load_bench("accuracy")
    rows = [_row("2 ranks", "hap", "none", 0.010, 0.020), _row("2 ranks", "dp-even", "ddp", 0.030, 0.030),
            _row("4 ranks", "hap", "none", 0.012, 0.020), _row("4 ranks", "dp-even", "ddp", 0.033, 0.030),
            _row("4 ranks", "hap", "duplex", 0.02, 0.02)]
    lines = {line.split("  ")[0]: line for line in bench.report(rows).splitlines()}
    assert "-45.0%" in lines["SPMD (no overlap) plans"] and " 2 " in lines["SPMD (no overlap) plans"]
    assert "+5.0%" in lines["ddp plans"]
    assert "duplex plans" not in lines  # one variant gives no correlation
