"""Plan: the distributed program, the graph coloured by sharding, ratios and memory per device."""
import pandas as pd
import streamlit as st

from app import services
from engine import views
from engine.planner import OVERLAP_MEANING
from engine.views import charts

st.title("Plan")
graph, cluster, plan = services.current_plan("plan")
if plan.parallelism == "pipeline":
    times = plan.search.get("parallelism_s", {})
    c = st.columns(4)
    c[0].metric("Predicted iteration", views.ms(plan.predicted_time_s))
    c[1].metric("Stages", len(plan.stages))
    c[2].metric("Schedule, microbatches", f"{plan.schedule}, B = {plan.microbatches}")
    if "spmd" in times:
        c[3].metric("vs best SPMD plan", f"{times['spmd'] / plan.predicted_time_s:.2f}x faster",
                    help=f"the best SPMD (HAP) plan: {views.ms(times['spmd'])}")
    for col, (label, value, why) in zip(st.columns(4), views.utilisation_metrics(plan)):
        col.metric(label, value, help=why)
    st.markdown("A **pipeline** plan (HAPT): each stage runs a run of layers on its own group of devices, with "
                "HAP's plan of the stage inside the group (its **program**: data parallelism, or sharded weights "
                "and collectives); microbatches flow through the stages and their activations (forward) and "
                "gradients (backward) cross each boundary point to point. The **warm-up** count is how many "
                "forwards a stage runs before its first backward (H-1F1B sizes it to hide slow transfers).")
    st.dataframe(pd.DataFrame(views.pipeline_stage_rows(plan, cluster)), hide_index=True, width="stretch",
                 column_config={k: st.column_config.NumberColumn(format="%.3f") for k in
                                ("forward_ms", "backward_ms", "sync_ms", "peak_gib", "capacity_gib")})
    for i, s in enumerate(plan.stages):
        if s.plan is not None:
            with st.expander(f"Stage {i}'s program ({len(s.plan.program)} instructions)"):
                st.code(s.plan.listing(), language=None)
    if plan.boundaries:
        st.subheader("Boundaries")
        st.dataframe(pd.DataFrame(views.pipeline_boundary_rows(plan)), hide_index=True, width="stretch")
    st.caption(f"t_max (slowest stage, forward + backward per microbatch) {views.ms(plan.t_max_s)}; "
               f"pipeline planned in {plan.planning_s:.2f} s. The Timeline page draws the schedule.")
    st.stop()
base = {k: v for k, v in plan.search.get("baselines_s", {}).items() if v is not None}
c = st.columns(4)
c[0].metric("Predicted iteration", views.ms(plan.predicted_time_s))
c[1].metric("Devices", plan.world_size)
c[2].metric("Overlap", plan.overlap, help=OVERLAP_MEANING[plan.overlap])
if base:
    name = min(base, key=base.get)
    c[3].metric(f"vs best baseline ({name})", f"{base[name] / plan.predicted_time_s:.2f}x faster",
                help="baselines priced as PyTorch DDP runs: " + ", ".join(f"{k} {views.ms(t)}" for k, t in base.items()))
for col, (label, value, why) in zip(st.columns(4), views.utilisation_metrics(plan)):
    col.metric(label, value, help=why)
for mode, why in plan.search.get("overlap_skipped", {}).items():
    st.caption(f"overlap {mode} not tried: {why}")
if "pipeline" in plan.search.get("parallelism_s", {}):
    st.caption(f"parallelism: spmd kept; the best pipeline predicts {views.ms(plan.search['parallelism_s']['pipeline'])}")

left, right = st.columns(2)
left.altair_chart(charts.ratios_chart(views.ratio_rows(plan)), width="stretch")
right.altair_chart(charts.memory_chart(views.memory_rows(plan, cluster)), width="stretch")

st.subheader("Model graph, coloured by each tensor's sharding")
st.caption("grey: Full, orange: Partial, blue/green/purple: Shard(dim); ⇄ marks a collective on the tensor")
segs = list(range(plan.graph.num_segments))
expand = st.multiselect("Layers shown in full", segs, default=segs[:1] if len(plan.graph) > 150 else segs, key="plan.expand")
st.graphviz_chart(views.graph_dot(plan.graph, expand=expand, forms=views.plan_forms(plan), comms=views.plan_collectives(plan)),
                  width="stretch")
st.dataframe(pd.DataFrame(views.form_counts(plan)), hide_index=True)

with st.expander("Program listing (one instruction a line)", expanded=False):
    st.code(plan.listing(), language="text")
