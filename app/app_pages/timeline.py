"""Timeline: the predicted iteration as a Gantt chart per device and stage, beside a measured one."""
import streamlit as st

from app import components as ui
from app import services

st.title("Timeline")
graph, cluster, plan = services.current()
if plan is None:
    st.info("No plan yet: run the search on the Search page.")
    st.stop()
st.markdown("Each stage opens with a collective (forward) or ends with one (backward, which runs the stages in "
            "reverse); every device computes its share, then **idles** until the slowest device is done (HAP §3.2).")
group = st.toggle("Group devices with identical timelines", value=plan.world_size > 16, key="timeline.group")
rows = ui.timeline_rows(plan, group=group)
st.altair_chart(ui.gantt_chart(rows, f"Predicted: {ui.ms(plan.predicted_time_s)} per iteration",
                               ["device", "stage_label", "kind", "start_ms", "end_ms"]), width="stretch")
busy = {}
for r in rows:
    busy.setdefault(r["device"], {"compute": 0.0, "communication": 0.0, "idle": 0.0})[r["kind"]] += r["end_ms"] - r["start_ms"]
st.dataframe([{"device": d, **{f"{k}_ms": v for k, v in t.items()}} for d, t in busy.items()], hide_index=True)

st.subheader("Measured timeline")
upload = st.file_uploader("Runner metrics (JSON lines from `hap run PLAN --timing --metrics FILE`)", type=["jsonl", "json", "txt"],
                          key="timeline.metrics")
if upload is not None:
    try:
        records = ui.parse_metrics(upload.getvalue().decode("utf-8", errors="replace"))
        steps = sorted({r["step"] for r in records if r.get("timeline")})
        step = st.selectbox("Step", steps, index=len(steps) - 1, key="timeline.step") if steps else None
        measured = ui.measured_rows(records, step)
        left, right = st.columns(2)
        left.altair_chart(ui.gantt_chart(rows, "Predicted", ["device", "stage_label", "kind"]), width="stretch")
        right.altair_chart(ui.gantt_chart(measured, f"Measured, step {step}", ["device", "phase", "name", "kind", "start_ms", "end_ms"]),
                           width="stretch")
    except ValueError as e:
        st.error(str(e))
