"""Search: run the planner (A* + LP, HAP §3.1) with a time budget and watch the frontier move."""
import time

import pandas as pd
import streamlit as st

import engine
from app import services
from engine import HapError, views
from engine.options import GRAD_DTYPES, PRECISIONS, RECOMPUTE, SHARD_STATES
from engine.views import charts


def ui_choice(where, label: str, choices: tuple, key: str):
    """A select box of `choices` in `where` that starts from, and keeps, the session's value under `key`."""
    options = list(choices)
    value = where.selectbox(label, options, index=options.index(st.session_state[key]), format_func=str,
                            key=f"{key}_choice")
    st.session_state[key] = value
    return value


st.title("Search")
graph, cluster, plan = services.current()
st.markdown(f"Model **{st.session_state[services.Keys.MODEL_SOURCE]}** ({len(graph)} nodes) on cluster "
            f"**{cluster.name}** ({cluster.num_devices} devices).")
budget = st.slider("Time budget (s): the search returns the best plan found when it runs out", 1.0, 120.0,
                   value=float(st.session_state[services.Keys.BUDGET]), key="search.budget_slider")
st.session_state[services.Keys.BUDGET] = budget
segments = st.number_input("Segments: runs of layers with their own sharding ratios (HAP §5.2; 1 = one set of ratios)",
                           min_value=1, max_value=max(1, graph.num_segments), value=1, step=1, key="search.segments")
modes = ["auto", *engine.OVERLAP_MODES]
overlap = st.selectbox("Overlap: 'auto' plans with DDP's gradient buckets (ddp) and with HiDup's two half-batches "
                       "(duplex) and keeps the faster", modes, index=modes.index(st.session_state[services.Keys.OVERLAP]),
                       key="search.overlap_mode")
st.session_state[services.Keys.OVERLAP] = overlap
kinds = list(engine.PARALLELISMS)
parallelism = st.selectbox("Parallelism: 'spmd' every device runs every layer (HAP); 'pipeline' layers in stages on "
                           "device groups (HAPT, helps across slow links); 'auto' plans both and keeps the faster",
                           kinds, index=kinds.index(st.session_state[services.Keys.PARALLELISM]),
                           key="search.parallelism_kind")
st.session_state[services.Keys.PARALLELISM] = parallelism
numerics = st.expander("Precision and memory: mixed precision, recomputation, sharded optimizer states (ZeRO)")
n = numerics.columns(4)
precision = ui_choice(n[0], "Precision: fp32, or mixed precision under autocast (bf16, fp16 with loss scaling)",
                      PRECISIONS, services.Keys.PRECISION)
grad_dtype = ui_choice(n[1], "Gradient dtype: what gradients are all-reduced in", GRAD_DTYPES, services.Keys.GRAD_DTYPE)
recompute = ui_choice(n[2], "Recompute: 'auto' recomputes activations only where memory binds; 'all' every layer",
                      RECOMPUTE, services.Keys.RECOMPUTE)
shard_states = ui_choice(n[3], "Shard states (ZeRO stage): 'auto' per weight where needed to fit; 0 none, 1 optimizer "
                         "state, 2 and gradients, 3 and weights", SHARD_STATES, services.Keys.SHARD_STATES)
go = st.button("Run search", type="primary", key="search.run")
status, bar, live = st.empty(), st.empty(), st.empty()

if go:
    points: list[dict] = []
    last = [0.0]
    start = time.perf_counter()

    def progress(p) -> None:
        """Called by the engine every few dozen expansions: redraw at most 4 times a second."""
        points.append({"expanded": p.expanded, "queue_size": p.queue_size, "best_cost": p.best_cost,
                       "lowest_open_score": p.lowest_open_score, "iteration": p.iteration})
        now = time.perf_counter()
        if now - last[0] > 0.25:
            last[0] = now
            best = "none yet" if p.best_cost == float("inf") else views.ms(p.best_cost)
            status.info(f"Q<->B iteration {p.iteration}: {p.expanded} states expanded, queue {p.queue_size}, best {best}")
            bar.progress(min(1.0, (now - start) / budget), text=f"{now - start:.1f} s of {budget:.0f} s")
            live.altair_chart(charts.frontier_chart(views.frontier_rows(points)), width="stretch")

    try:
        with st.spinner("Searching ..."):
            options = services.plan_options(budget, int(segments), overlap, parallelism, precision, grad_dtype,
                                            recompute, shard_states)
            plan = services.run_plan(graph, cluster, options, progress)
        services.set_plan(plan)
        st.session_state[services.Keys.FRONTIER] = points or None
        st.rerun()  # redraw the page (and the sidebar) around the new plan
    except HapError as e:
        status.empty()
        bar.empty()
        live.empty()
        services.show_error(e)

if plan is None:
    st.info("No plan for this model and cluster yet: run the search.")
    st.stop()
if not (status := services.current_status()).current:
    st.info(f"{status.message} Run the search to plan the current model on the current cluster.")
    st.stop()
s = plan.search
if plan.parallelism == "pipeline":
    c = st.columns(4)
    c[0].metric("Predicted iteration", views.ms(plan.predicted_time_s))
    c[1].metric("Parallelism", "pipeline", help="predicted per kind: " + ", ".join(
        f"{k} {views.ms(t)}" for k, t in s.get("parallelism_s", {}).items()))
    c[2].metric("Stages", len(plan.stages))
    c[3].metric("Pipeline planning time", f"{plan.planning_s:.2f} s")
    for kind, why in s.get("parallelism_skipped", {}).items():
        st.caption(f"{kind}: {why}")
    st.caption("The Plan page lists the stages; the Timeline page draws the schedule.")
    st.stop()
c = st.columns(6)
c[0].metric("Predicted iteration", views.ms(plan.predicted_time_s))
c[1].metric("States expanded", s.get("expanded", 0))
c[2].metric("Q<->B iterations", s.get("iterations", 0))
c[3].metric("Search time", f"{s.get('elapsed_s', 0.0):.2f} s")
c[4].metric("Segments", len(plan.ratios))
c[5].metric("Overlap", plan.overlap, help="predicted per mode: " + ", ".join(
    f"{m} {views.ms(t)}" for m, t in s.get("overlap_s", {}).items()))
if "pipeline" in s.get("parallelism_s", {}):
    st.caption(f"parallelism: spmd kept; the best pipeline predicts {views.ms(s['parallelism_s']['pipeline'])}")
for kind, why in s.get("parallelism_skipped", {}).items():
    st.caption(f"{kind}: {why}")
st.caption("Every search was exact: each Q<->B step's program is proven optimal for the rule set at that step's "
           "ratios (the alternation with the LP is a heuristic, as in HAP)." if s.get("optimal") else
           "Beam-limited or stopped by the budget: the best plan found, not proven optimal.")
points = st.session_state.get(services.Keys.FRONTIER) or s.get("frontier", [])
if points:
    st.altair_chart(charts.frontier_chart(views.frontier_rows(points)), width="stretch")
if plan.history:
    st.altair_chart(charts.history_chart(views.history_rows(plan)), width="stretch")
    st.dataframe(pd.DataFrame(views.history_rows(plan))[["step", "predicted_ms"]], hide_index=True)
