"""Compare: the plan against data parallelism (ddp), the ablations of HAP Fig. 15, the plan with and
without duplex, and what-if clusters."""
import pandas as pd
import streamlit as st

from app import services
from engine import HapError, views
from engine.views import charts

st.title("Compare")
graph, cluster, plan = services.current_plan("compare")
budget = float(st.session_state[services.Keys.BUDGET])
if plan.parallelism == "pipeline":
    rows = views.pipeline_schedule_rows(plan)
    st.markdown("The pipeline plan's stages under each schedule (HAPT §4), simulated on the same stage and transfer "
                "times: **GPipe** all forwards then all backwards; **1F1B** warm-up S - i + 1; **Eager-1F1B** "
                "2(S - i) + 1; **H-1F1B** sized by each boundary's transfer time. More warm-up hides transfers but "
                "holds more microbatches' activations: peak memory per stage is per GPU on its fullest device. "
                "The SPMD row is the best SPMD (HAP) plan of the same search (`auto`).")
    st.altair_chart(charts.pipeline_schedule_chart(rows), width="stretch")
    st.dataframe(pd.DataFrame(views.in_percent(rows)), hide_index=True, width="stretch",
                 column_config={"predicted_ms": st.column_config.NumberColumn("predicted ms", format="%.3f"),
                                "mfu": st.column_config.NumberColumn("MFU", format="%.3g%%")})
    if "spmd" not in plan.search.get("parallelism_s", {}):
        st.caption("No SPMD plan to compare with: plan with parallelism 'auto' on the Search page.")
    st.stop()
st.markdown("All rows are predicted by the same cost model. Baselines (**ddp**, **dp-even**, **dp-proportional**) are "
            "priced as PyTorch DDP runs: gradient buckets all-reduced during backward. Ablations (§7.4): **Q** "
            "program synthesis alone with flops-proportional ratios; **Q+B** with the load balancer's LP ratios; "
            "**Q+B+C** adds communication optimisation (grouped-broadcast all-gather, sufficient-factor "
            "broadcasting): HAP without duplex; **Q+B+C+D** the same search with duplex (HiDup's two half-batches).")
try:
    result = services.comparison(services.plan_key(plan), cluster.fingerprint(), budget, plan, cluster)
    table = result.table()
    best = result.best_baseline
    if best is not None:
        st.metric(f"Plan vs the best baseline ({best.name})", f"{result.speedup(best):.2f}x faster",
                  help=f"{best.name}: {views.ms(best.predicted_time_s)}; the plan: {views.ms(plan.predicted_time_s)} "
                       f"(overlap {plan.overlap})")
    st.altair_chart(charts.compare_chart(table), width="stretch")
    st.dataframe(pd.DataFrame(views.in_percent(table)), hide_index=True, width="stretch",
                 column_config={"predicted_ms": st.column_config.NumberColumn("predicted ms", format="%.2f"),
                                "plan_speedup": st.column_config.NumberColumn("plan speed-up", format="%.2fx"),
                                "mfu": st.column_config.NumberColumn("MFU", format="%.3g%%")})
    if result.compute_bound_s is not None:
        st.caption(f"MFU: the compute bound, {views.ms(result.compute_bound_s)} (the model's FLOPs at the devices' summed "
                   "peak, the same for every row), over each row's predicted time.")
except HapError as e:
    services.show_error(e)

st.subheader("What if?")
models = sorted({d.gpu_model for d in cluster.devices})
levels = sorted(cluster.network.bandwidth_Bps)
c = st.columns(2)
gpu = c[0].selectbox("GPU model", models, key="compare.gpu")
flops = c[0].slider("scale its FLOP/s", 0.25, 4.0, 1.0, 0.25, key="compare.flops")
level = c[1].selectbox("Link level", levels, key="compare.level") if levels else None
bw = c[1].slider("scale its bandwidth", 0.25, 16.0, 1.0, 0.25, key="compare.bw", disabled=not levels)
if flops == 1.0 and bw == 1.0:
    st.caption("Move a slider to re-plan on a changed cluster.")
    st.stop()
try:
    w = services.what_if(services.plan_key(plan), cluster.fingerprint(), (gpu, flops) if flops != 1.0 else None,
                         (level, bw) if level and bw != 1.0 else None, budget, plan, cluster)
except HapError as e:
    services.show_error(e)
    st.stop()
st.markdown(f"Changed: {', '.join(w.changes)}")
m = st.columns(3)
m[0].metric("Plan, original cluster", views.ms(w.before_s))
m[1].metric("Same plan, changed cluster", views.ms(w.same_plan_s), delta=f"{(w.same_plan_s - w.before_s) * 1e3:+.4g} ms",
            delta_color="inverse")
m[2].metric("Re-planned, changed cluster", views.ms(w.replanned_s), delta=f"{(w.replanned_s - w.same_plan_s) * 1e3:+.4g} ms",
            delta_color="inverse", help="change against the same plan on the changed cluster")
st.altair_chart(charts.ratios_chart([{**r, "segment": f"re-planned {r['segment']}"} for r in views.ratio_rows(w.replanned)]
                                + [{**r, "segment": f"plan {r['segment']}"} for r in views.ratio_rows(plan)]),
                width="stretch")
