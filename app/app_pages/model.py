"""Model: pick a zoo model and its knobs, a Hugging Face class and its config, or upload a graph-IR JSON or a
trusted Python model file."""
import streamlit as st

from app import services
from engine import HapError, views
from engine.model.zoo import ZOO
from engine.views import charts

st.title("Model")
source = st.radio("Source", ["Zoo model", "Hugging Face model", "Graph JSON", "Python file"], horizontal=True,
                  key="model.kind")

if source == "Zoo model":
    name = st.selectbox("Zoo model", sorted(ZOO), index=sorted(ZOO).index(services.DEFAULT_ZOO), key="model.zoo")
    defaults = services.DEFAULT_KNOBS if name == services.DEFAULT_ZOO else {}
    knobs = {}
    cols = st.columns(4)
    for k, (knob, kind, default) in enumerate(services.zoo_knobs(name)):
        value = defaults.get(knob, default)
        with cols[k % 4]:
            key = f"model.knob.{name}.{knob}"
            if kind is bool:
                knobs[knob] = st.checkbox(knob, value=value, key=key)
            elif kind is int:
                knobs[knob] = st.number_input(knob, value=value, min_value=1, step=1, key=key)
            elif kind is float:
                knobs[knob] = st.number_input(knob, value=value, key=key)
            else:
                knobs[knob] = st.text_input(knob, value=str(value), key=key)
    if st.button("Load zoo model", type="primary"):
        try:
            services.set_model(services.zoo_model(name, tuple(knobs.items())),
                               f"zoo:{name} " + " ".join(f"{k}={v}" for k, v in knobs.items()))
        except HapError as e:
            services.show_error(e)
elif source == "Hugging Face model":
    cls = st.selectbox("Class (built from its config: no weights are downloaded)", services.HF_CLASSES, key="model.hf.class")
    try:
        starting = services.hf_small_config(cls)
    except HapError as e:  # e.g. transformers is not installed
        services.show_error(e)
        st.stop()
    config = st.text_area("Config: keys of the transformers config as JSON (every other key keeps its default)",
                          value=starting, height=180, key=f"model.hf.config.{cls}")
    cols = st.columns(2)
    batch = cols[0].number_input("batch", value=8, min_value=1, step=1, key="model.hf.batch")
    seq_len = None if services.hf_is_vision(cls) else \
        cols[1].number_input("seq_len", value=32, min_value=1, step=1, key="model.hf.seq_len")
    if st.button("Build and capture", type="primary", key="model.hf.load"):
        try:
            services.set_model(services.hf_model(cls, config, int(batch), None if seq_len is None else int(seq_len)),
                               f"hf:{cls} batch={batch}" + ("" if seq_len is None else f" seq_len={seq_len}"))
        except HapError as e:
            services.show_error(e)
elif source == "Graph JSON":
    upload = st.file_uploader("Graph IR JSON (from `hap capture` or Graph.save)", type=["json"], key="model.json")
    if upload is not None:
        try:
            services.set_model(services.graph_from_json(upload.getvalue()), f"graph {upload.name}")
            st.success(f"Loaded {upload.name}")
        except HapError as e:
            services.show_error(e)
else:
    st.warning("A Python file is code: running it can do anything your account can. Only tick the box "
               "for a file you wrote or have read.", icon=":material/warning:")
    st.code(services.PYTHON_CONVENTION, language="text")
    upload = st.file_uploader("Python model file", type=["py"], key="model.py")
    digest = services.content_digest(upload.getvalue()) if upload is not None else "none"
    # the box belongs to this file's content: another upload must be trusted anew
    trusted = st.checkbox("I trust this code and want to run it", key=f"{services.Keys.PYTHON_TRUST}.{digest}")
    if upload is not None and not trusted:
        st.info(f"{upload.name} is uploaded but NOT executed: tick the box to run it.")
    if upload is not None and trusted:
        try:
            services.set_model(services.model_from_python(upload.getvalue(), upload.name), f"python {upload.name}",
                               (upload.name, upload.getvalue()))
            st.success(f"Captured {upload.name}")
        except HapError as e:
            services.show_error(e)

graph = st.session_state[services.Keys.GRAPH]
st.subheader(f"Current model: {st.session_state[services.Keys.MODEL_SOURCE]}")
s = views.model_summary(graph)
c = st.columns(4)
c[0].metric("Parameters", f"{s['parameters'] / 1e6:.2f} M")
c[1].metric("FLOPs / iteration", f"{s['iteration_flops'] / 1e12:.3g} T", help="forward + backward (about 2x forward)")
c[2].metric("Nodes", s["nodes"])
c[3].metric("Layers (segments)", s["segments"])
left, right = st.columns([1, 2])
left.altair_chart(charts.histogram_chart(graph.op_histogram()), width="stretch")
with right:
    segs = list(range(graph.num_segments))
    expand = st.multiselect("Layers shown in full (others collapse into one box)", segs,
                            default=segs if len(graph) <= 150 else segs[:1], key="model.expand")
    st.graphviz_chart(views.graph_dot(graph, expand=expand), width="stretch")
