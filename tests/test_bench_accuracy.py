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


def test_a_pipeline_plan_is_its_own_kind_priced_by_its_schedule():
    from types import SimpleNamespace as NS

    bench = load_bench("accuracy")
    plan = NS(microbatches=4, predicted_s=0.05, schedule="1f1b",
              stages=[NS(forward_s=0.002, backward_s=0.004, ratios=(1.0,)), NS(forward_s=0.003, backward_s=0.005,
                                                                             ratios=(0.6, 0.4))],
              boundaries=[NS(transfer_s=0.001)])
    p = bench.pipeline_predicted(plan)
    assert p["iteration_s"] == 0.05 and p["overlap"] == "pipeline"
    assert abs(p["compute_s"] - 4 * 0.008) < 1e-12 and abs(p["comm_s"] - 2 * 4 * 0.001) < 1e-12
    rows = [_row("2 ranks", "hap+pipeline", "pipeline", 0.010, 0.020), _row("4 ranks", "hap+pipeline", "pipeline",
                                                                             0.030, 0.040)]
    lines = {line.split("  ")[0]: line for line in bench.report(rows).splitlines()}
    assert "pipeline plans" in lines and "hap+pipeline" in lines
