"""Plan: the distributed program, the graph coloured by sharding, ratios and memory per device."""
import pandas as pd
import streamlit as st

from app import components as ui
from app import services

st.title("Plan")
graph, cluster, plan = services.current()
if plan is None:
    st.info("No plan yet: run the search on the Search page.")
    st.stop()
if not services.plan_matches(plan, graph, cluster):
    st.warning("This plan was made for another model or cluster: run the Search page again to update it.")
base = {k: v for k, v in plan.search.get("baselines_s", {}).items() if v is not None}
c = st.columns(2 + len(base))
c[0].metric("Predicted iteration", ui.ms(plan.predicted_time_s))
c[1].metric("Devices", plan.world_size)
for k, (name, t) in enumerate(base.items()):
    c[2 + k].metric(f"vs {name}", f"{t / plan.predicted_time_s:.2f}x faster", help=f"{name}: {ui.ms(t)}")

left, right = st.columns(2)
left.altair_chart(ui.ratios_chart(ui.ratio_rows(plan)), width="stretch")
right.altair_chart(ui.memory_chart(ui.memory_rows(plan, cluster)), width="stretch")

st.subheader("Model graph, coloured by each tensor's sharding")
st.caption("grey: Full, orange: Partial, blue/green/purple: Shard(dim); ⇄ marks a collective on the tensor")
segs = list(range(plan.graph.num_segments))
expand = st.multiselect("Layers shown in full", segs, default=segs[:1] if len(plan.graph) > 150 else segs, key="plan.expand")
st.graphviz_chart(ui.graph_dot(plan.graph, expand=expand, forms=ui.plan_forms(plan), comms=ui.plan_collectives(plan)),
                  width="stretch")
st.dataframe(pd.DataFrame(ui.form_counts(plan)), hide_index=True)

with st.expander("Program listing (one instruction a line)", expanded=False):
    st.code(plan.listing(), language="text")
