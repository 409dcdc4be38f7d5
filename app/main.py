"""Router of the HAP workbench: `streamlit run app/main.py` (or `hap ui`, which binds 127.0.0.1).

The default model and cluster are planned on the first visit (cached per server), so the first
screen, the Plan page, shows a real plan.
"""
from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `app` and `engine` from a source checkout

from app import services  # noqa: E402
from engine import views  # noqa: E402

PAGES = [("model", "Model", ":material/model_training:"), ("cluster", "Cluster", ":material/dns:"),
         ("theory", "Theory", ":material/functions:"), ("search", "Search", ":material/travel_explore:"),
         ("plan", "Plan", ":material/account_tree:"), ("timeline", "Timeline", ":material/view_timeline:"),
         ("runs", "Runs", ":material/monitoring:"), ("compare", "Compare", ":material/leaderboard:"),
         ("export", "Export", ":material/download:")]


def main() -> None:
    st.set_page_config(page_title="HAP workbench", page_icon=":material/hub:", layout="wide")
    pages = [st.Page(f"app_pages/{name}.py", title=title, icon=icon, default=name == "plan")
             for name, title, icon in PAGES]
    nav = st.navigation(pages)
    services.init_state()
    graph, cluster, plan = services.current()
    with st.sidebar:
        st.caption(f"**Model** {st.session_state[services.Keys.MODEL_SOURCE]}")
        st.caption(f"**Cluster** {cluster.name} ({cluster.num_devices} devices)")
        if plan is not None:
            status = services.current_status()
            st.caption(f"**Plan** {views.ms(plan.predicted_time_s)} / iteration" if status.current else
                       f"**Plan** made for another {' and '.join(status.changed)}: plan again")
    nav.run()


main()
