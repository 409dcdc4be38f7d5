"""Cluster: pick a sample or upload a spec, edit devices and links in tables (validated live), see it."""
import pandas as pd
import streamlit as st

from app import components as ui
from app import services
from engine import HapError, views
from engine.views import charts

st.title("Cluster")
kind = st.radio("Source", ["Sample cluster", "Upload JSON"], horizontal=True, key="cluster.kind")
if kind == "Sample cluster":
    names = services.sample_clusters()
    name = st.selectbox("Sample", names, index=names.index(services.DEFAULT_CLUSTER), key="cluster.sample")
    if st.button("Use this sample", type="primary"):
        sample = services.sample_cluster(name)
        st.session_state.pop(f"{services.Keys.EDITOR}.{sample.fingerprint()[:12]}", None)  # start from the file
        st.session_state[services.Keys.BASE] = sample
        services.set_cluster(sample, f"sample_clusters/{name}")
else:
    upload = st.file_uploader("Cluster spec JSON (schema_version 1, see sample_clusters/)", type=["json"], key="cluster.upload")
    if upload is not None:
        try:
            base = services.cluster_from_json(upload.getvalue())
            if st.session_state.get(services.Keys.BASE) != base:
                st.session_state[services.Keys.BASE] = base
                services.set_cluster(base, f"upload {upload.name}")
        except HapError as e:
            services.show_error(e)

base = st.session_state.setdefault(services.Keys.BASE, st.session_state[services.Keys.CLUSTER])
st.subheader(f"{base.name}: {base.num_devices} devices")
st.caption(base.description)
st.markdown("**Devices** (edit cells, add or delete rows; checked by the engine as you type)")
devices = st.data_editor(pd.DataFrame(ui.device_rows(base)), num_rows="dynamic", width="stretch",
                         key=f"{services.Keys.EDITOR}.{base.fingerprint()[:12]}")
st.markdown("**Links** (bandwidth in bytes/s per link level) and per-hop latency")
links = st.data_editor(pd.DataFrame(ui.link_rows(base)), width="stretch", num_rows="dynamic",
                       key=f"cluster.links.{base.fingerprint()[:12]}")
latency = st.number_input("network latency (s)", value=base.network.latency_s, format="%.2e",
                          key=f"cluster.latency.{base.fingerprint()[:12]}")
try:
    edited = services.cluster_with_edits(base, ui.records(devices), ui.records(links), latency)
    if edited != base:
        services.set_cluster(edited, f"{base.name} (edited)")
        st.success("Edits are valid; the edited cluster is the current one.")
except HapError as e:
    services.show_error(e)

cluster = st.session_state[services.Keys.CLUSTER]
for warning in services.launch_warnings(cluster):
    st.warning(warning, icon=":material/warning:")
st.graphviz_chart(views.cluster_dot(cluster), width="stretch")
st.dataframe(pd.DataFrame([{"collective": k, "latency_s": f.latency_s, "bandwidth_Bps": f.bandwidth_Bps}
                           for k, f in cluster.collectives.items()]), hide_index=True)

st.subheader("Re-plan on a changed cluster")
st.caption("Remove devices or add one (a copy of an existing device) and see what the engine's re-plan "
           "(engine.replan, `hap replan`) changes, and what the switch must move.")
graph, cluster, plan = services.current()
if plan is None or not services.plan_matches(plan, graph, cluster):
    st.info("Plan the current model on this cluster first (Search page): the re-plan starts from that plan.")
else:
    names = [d.name for d in cluster.devices]
    remove = st.multiselect("Remove devices", names, key="cluster.replan.remove")
    add = st.selectbox("Add a copy of device", ["(none)", *names], key="cluster.replan.add")
    try:
        changed = services.changed_cluster(cluster, remove, None if add == "(none)" else add)
    except HapError as e:
        services.show_error(e)
        changed = None
    if changed is not None and st.button("Re-plan", key="cluster.replan.run", disabled=changed == cluster):
        try:
            result = services.replan(services.plan_key(plan), changed.fingerprint(),
                                     st.session_state[services.Keys.BUDGET], plan, changed)
            st.session_state[services.REPLAN] = (services.plan_key(plan), changed.fingerprint(), result, changed)
        except HapError as e:
            services.show_error(e)
    shown = st.session_state.get(services.REPLAN)
    if shown and changed is not None and shown[:2] == (services.plan_key(plan), changed.fingerprint()):
        _, _, result, new_cluster = shown
        report = result.report
        before, after, switch = st.columns(3)
        before.metric("predicted step, before", views.ms(report.time_before_s))
        after.metric("predicted step, after", views.ms(report.time_after_s),
                     delta=views.ms(report.time_after_s - report.time_before_s), delta_color="inverse")
        switch.metric("predicted switch", views.ms(report.switch_s), help="the busiest device at its links' bandwidth")
        st.caption(f"chosen: {report.chosen}; devices removed: {', '.join(report.removed) or '-'}; "
                   f"added: {', '.join(report.added) or '-'}")
        st.markdown("**Ratios** (per segment)")
        st.dataframe(pd.DataFrame(views.replan_ratio_rows(report)), hide_index=True, key="cluster.replan.ratios")
        st.markdown(f"**Shardings changed**: {len(report.shardings)}")
        if report.shardings:
            st.dataframe(pd.DataFrame([vars(c) for c in report.shardings]), hide_index=True,
                         key="cluster.replan.shardings")
        traffic = views.replan_traffic_rows(report)
        st.markdown(f"**State to move**: {report.moved_bytes} bytes over links")
        st.dataframe(pd.DataFrame(traffic), hide_index=True, key="cluster.replan.traffic")
        st.altair_chart(charts.replan_traffic_chart(traffic), width="stretch")
        if st.button("Use the new cluster and plan", key="cluster.replan.use"):
            services.set_plan(result.plan)
            st.session_state[services.Keys.BASE] = new_cluster
            services.set_cluster(new_cluster, f"{cluster.name} (re-planned)")
