"""Theory: the Hoare triples of the background theory T for the current model (HAP §4.2), filterable."""
import pandas as pd
import streamlit as st

from app import services
from engine import views

st.title("Theory")
st.markdown("A **property** says how a distributed tensor relates to a tensor `e` of the single-device graph:")
for sentence in views.FORM_SENTENCES.values():
    st.markdown(f"- {sentence}")
st.markdown("A **Hoare triple** `{pre} instruction {post}` says: if the devices hold the properties `pre`, running "
            "the instruction on every device establishes `post`. The search chains triples from the empty "
            "program to `Partial(loss)` (§4.3).")

graph = st.session_state[services.Keys.GRAPH]
rows = services.theory(services.graph_key(graph), graph)
c = st.columns(3)
ops = c[0].multiselect("Operator", sorted({r["op"] for r in rows}), key="theory.ops")
tensors = c[1].multiselect("Tensor", list(dict.fromkeys(r["tensor"] for r in rows)), key="theory.tensors")
colls = c[2].multiselect("Collective", sorted({r["collective"] for r in rows if r["collective"]}), key="theory.colls")
kinds = st.multiselect("Kind", ["leaf", "compute", "collective"], default=["leaf", "compute", "collective"], key="theory.kinds")
shown = [r for r in rows if r["kind"] in kinds and (not ops or r["op"] in ops) and (not tensors or r["tensor"] in tensors)
         and (not colls or r["collective"] in colls)]
st.caption(f"{len(shown)} of {len(rows)} triples")
st.dataframe(pd.DataFrame(shown, columns=["tensor", "op", "kind", "rule", "triple"]), hide_index=True, width="stretch")
st.subheader("Triples per rule")
st.dataframe(pd.DataFrame(views.rule_counts(shown)), hide_index=True)
