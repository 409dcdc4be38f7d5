"""Cluster: pick a sample or upload a spec, edit devices and links in tables (validated live), see it."""
import pandas as pd
import streamlit as st

from app import components as ui
from app import services
from engine import HapError

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
st.graphviz_chart(ui.cluster_dot(cluster), width="stretch")
st.dataframe(pd.DataFrame([{"collective": k, "latency_s": f.latency_s, "bandwidth_Bps": f.bandwidth_Bps}
                           for k, f in cluster.collectives.items()]), hide_index=True)
