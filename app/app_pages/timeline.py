"""Timeline: the predicted iteration as a compute lane and a network lane per device, beside a measured one."""
import pandas as pd
import streamlit as st

from app import services
from app.runs import parse_metrics
from engine import HapError, views
from engine.planner import OVERLAP_MEANING
from engine.views import charts

st.title("Timeline")
graph, cluster, plan = services.current_plan("timeline")
if plan.parallelism == "pipeline":
    from engine.pipeline.schedule import SCHEDULES

    st.markdown("A **pipeline** plan: a lane per stage with one box per microbatch forward and backward (labelled with "
                "its microbatch), a lane per link direction with the transfers, and each stage's gradient sync after "
                "the pipeline drains. Grey boxes are **bubbles**: the stage idles, waiting for a microbatch.")
    schedule = st.selectbox("Schedule", SCHEDULES, index=SCHEDULES.index(plan.schedule), key="timeline.schedule")
    try:
        rows = services.pipeline_gantt(services.plan_key(plan), schedule, plan)
    except HapError as e:
        services.show_error(e)
        st.stop()
    span = max((r["end_ms"] for r in rows), default=0.0)
    st.altair_chart(charts.pipeline_gantt_chart(rows, f"Predicted, {schedule}: {span:.3f} ms per iteration"),
                    width="stretch")
    st.dataframe(pd.DataFrame(views.bubble_share(rows)), hide_index=True,
                 column_config={"bubble_%": st.column_config.NumberColumn("bubbles", format="%.0f%%")})
    st.caption("Measured pipeline timelines are not drawn yet: the runner does not execute pipeline plans in this build.")
    st.stop()
st.markdown(f"Overlap mode **{plan.overlap}**: {OVERLAP_MEANING[plan.overlap]}. Every device has a **compute** lane "
            "and a **network** lane; where both are busy at once, communication is hidden behind computation. A "
            "forward stage opens with its collective, a backward stage ends with its dual (HAP §3.2); a device "
            "idles until the slowest one is done.")
group = st.toggle("Group devices with identical timelines", value=plan.world_size > 16, key="timeline.group")
try:
    rows = services.predicted_lanes(services.plan_key(plan), cluster.fingerprint(), group, plan, cluster)
except HapError as e:
    services.show_error(e)
    st.stop()
tooltip = ["device", "lane", "kind", "name", "stage", "half", "start_ms", "end_ms"]
st.altair_chart(charts.gantt_chart(rows, f"Predicted: {views.ms(plan.predicted_time_s)} per iteration", tooltip), width="stretch")
st.dataframe(pd.DataFrame(views.lane_summary(rows)), hide_index=True,
             column_config={"hidden_%": st.column_config.NumberColumn("communication hidden", format="%.0f%%")})

st.subheader("Measured timeline")
st.page_link("app_pages/runs.py", label="Loss, evaluation loss and step time over a whole run: the Runs page",
             icon=":material/monitoring:")
upload = st.file_uploader("Runner metrics (JSON lines from `hap run PLAN --timing --metrics FILE`)", type=["jsonl", "json", "txt"],
                          key="timeline.metrics")
if upload is not None:
    try:
        records = parse_metrics(upload.getvalue().decode("utf-8", errors="replace"))
        steps = sorted({r["step"] for r in records if r.get("timeline")})
        step = st.selectbox("Step", steps, index=len(steps) - 1, key="timeline.step") if steps else None
        measured = views.measured_rows(records, step)
        left, right = st.columns(2)
        left.altair_chart(charts.gantt_chart(rows, "Predicted", ["device", "lane", "kind", "name"]), width="stretch")
        right.altair_chart(charts.gantt_chart(measured, f"Measured, step {step}", ["device", "lane", "phase", "name", "kind",
                                                                             "start_ms", "end_ms"]), width="stretch")
        st.dataframe(pd.DataFrame(views.lane_summary(measured)), hide_index=True)
    except ValueError as e:
        st.error(str(e))
