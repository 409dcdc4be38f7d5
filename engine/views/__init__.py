"""Views: the rows, DOT text and charts the workbench shows, built once for both front ends (the Streamlit
pages in `app/` and the notebook displays). Plain functions: data in, rows or a chart out.

Owns: numbers in words (`figures`), a cluster's rows (`cluster`), the graph and cluster as DOT (`dot`), the theory's triples (`theory`),
an SPMD plan's and its search's rows (`plan`), the predicted and measured lanes (`lanes`), a pipeline plan's
rows (`pipeline`), the Altair charts of all of them (`charts`) and the optional-package check (`requires`).

May import: every engine layer below it (the top layer, beside `cli`: plan classes never import it), and
Altair and pandas in `charts` only; those are optional for the engine (the `app` and `notebook` extras
bring them) and `require` names the pip command where they are missing. Never Streamlit or the runner.
"""
from engine.views.cluster import capacity_rows, cluster_figures
from engine.views.dot import cluster_dot, form_color, graph_dot
from engine.views.figures import GIB, bandwidth_label, blank_missing, in_percent, in_units, ms, utilisation_metrics
from engine.views.lanes import (MAX_ROWS, TooManyBars, coarsen, focus_end_ms, lane_label, lane_summary, measured_rows,
                                plan_lane_rows, predicted_lane_rows)
from engine.views.pipeline import (bubble_share, pipeline_boundary_rows, pipeline_figures, pipeline_gantt_rows,
                                   pipeline_rows, pipeline_schedule_rows, pipeline_stage_rows)
from engine.views.plan import (best_baseline, form_counts, frontier_rows, history_rows, memory_rows, plan_collectives,
                               plan_figures, plan_forms, ratio_rows, replan_ratio_rows, replan_traffic_rows)
from engine.views.requires import ViewsUnavailable, require
from engine.views.theory import FORM_SENTENCES, collective_rows, model_summary, rule_counts, theory_rows

__all__ = ["capacity_rows", "cluster_figures", "MAX_ROWS", "TooManyBars", "coarsen", "plan_lane_rows",
           "pipeline_figures", "pipeline_gantt_rows", "best_baseline", "plan_figures", "form_color", "graph_dot",
           "cluster_dot", "GIB", "bandwidth_label", "blank_missing", "in_percent", "in_units", "ms",
           "utilisation_metrics", "focus_end_ms", "lane_label", "lane_summary", "measured_rows", "predicted_lane_rows",
           "bubble_share", "pipeline_boundary_rows", "pipeline_rows", "pipeline_schedule_rows", "pipeline_stage_rows",
           "form_counts", "frontier_rows", "history_rows", "memory_rows", "plan_collectives", "plan_forms",
           "ratio_rows", "replan_ratio_rows", "replan_traffic_rows", "ViewsUnavailable", "require", "FORM_SENTENCES",
           "collective_rows", "model_summary", "rule_counts", "theory_rows"]
