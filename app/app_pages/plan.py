"""Plan: the distributed program, the graph coloured by sharding, ratios and memory per device."""
import pandas as pd
import streamlit as st

from app import services
from engine import HapError, views
from engine.planner import OVERLAP_MEANING, spmd_alternatives
from engine.views import charts

st.title("Plan")
st.markdown("The **HAP workbench** plans the training of one model on a cluster of unlike GPUs. It searches for the "
            "program every device runs (which tensors to shard, where the collectives go) and the share of the work "
            "each device gets (HAP, EuroSys '24), and predicts how long one training iteration takes.")
steps = st.columns(3)
for col, (page, label) in zip(steps, (("model", "1. Model: pick or upload one"),
                                      ("cluster", "2. Cluster: pick or edit its devices"),
                                      ("search", "3. Search: plan the model on it"))):
    col.page_link(f"app_pages/{page}.py", label=label)
if st.session_state.get(services.Keys.CLUSTER_SOURCE) != f"sample_clusters/{services.PAPER_TESTBED}" and st.button(
        "Plan it on the paper's testbed", key="plan.testbed", help="HAP §7.1: 2 machines of 8 V100 and 6 of 8 P100, as 8 "
        "virtual devices, the current model with the current plan's options"):
    try:
        services.plan_on_sample(services.PAPER_TESTBED)
    except HapError as e:
        services.show_error(e)
        st.stop()
    st.rerun()
graph, cluster, plan = services.current_plan("plan")
if plan.parallelism == "pipeline":
    c = st.columns(4)
    c[0].metric("Predicted iteration", views.ms(plan.predicted_time_s))
    c[1].metric("Stages", len(plan.stages))
    c[2].metric("Schedule, microbatches", f"{plan.schedule}, B = {plan.microbatches}")
    if alternatives := spmd_alternatives(plan):
        best, ratio = alternatives[0], alternatives[0].predicted_time_s / plan.predicted_time_s
        c[3].metric("vs the best SPMD plan on this hardware", f"{ratio:.2f}x faster" if ratio >= 1 else
                    f"{1 / ratio:.2f}x slower", help=f"the best of the SPMD (HAP) plans priced: {best.label}, "
                    f"{views.ms(best.predicted_time_s)}. Priced: " + "; ".join(
                        f"{a.label} {views.ms(a.predicted_time_s)}" for a in alternatives))
    for col, (label, value, why) in zip(st.columns(4), views.utilisation_metrics(plan)):
        col.metric(label, value, help=why)
    st.markdown(f"The pipeline {plan.device_use.line()}.")
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
use = plan.device_use
c[1].metric("Devices used", f"{len(use.used)} of {use.total}", help=f"the plan {use.line()}")
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

key = services.plan_key(plan)
reason = services.ratio_reason(key, cluster.fingerprint(), plan, cluster)
st.markdown(f"**Why these ratios.** {reason.sentence()}")
left, right = st.columns(2)
left.altair_chart(charts.ratios_chart(views.ratio_rows(plan)), width="stretch")
right.altair_chart(charts.memory_chart(views.memory_rows(plan, cluster)), width="stretch")

st.subheader("Model graph, coloured by each tensor's sharding")
st.caption("grey: Full, orange: Partial, blue/green/purple: Shard(dim); ⇄ marks a collective on the tensor")
segs = list(range(plan.graph.num_segments))
expand = services.kept(st.multiselect, "Layers shown in full", f"plan.expand.{key[:12]}",
                       segs[:1] if len(plan.graph) > 150 else segs, segs)
st.graphviz_chart(views.graph_dot(plan.graph, expand=expand, forms=views.plan_forms(plan), comms=views.plan_collectives(plan)),
                  width="stretch")
st.dataframe(pd.DataFrame(views.form_counts(plan)), hide_index=True)

with st.expander("Program listing (one instruction a line)", expanded=False):
    st.code(plan.listing(), language="text")
