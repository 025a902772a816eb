"""The dashboard's entry point (``kvpool dashboard`` runs ``streamlit run`` on this file).

Multipage with ``st.navigation``; each page in ``pages/`` is a thin script over the functions
in ``data`` (cached kvpool calls), ``results`` (tables), ``charts`` (Altair) and ``state``.
"""

from __future__ import annotations

import streamlit as st

def main() -> None:
    """Draw the navigation and run the selected page (only under ``streamlit run``)."""
    st.set_page_config(page_title="kvpool capacity planner", page_icon=":material/database:", layout="wide")

    pages = [
        st.Page("pages/scenario.py", title="Scenario", icon=":material/tune:", default=True),
        st.Page("pages/run.py", title="Run", icon=":material/play_arrow:"),
        st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
        st.Page("pages/plan.py", title="Plan", icon=":material/query_stats:"),
    ]
    nav = st.navigation(pages)
    with st.sidebar:
        st.caption("kvpool: a shared KV pool for agentic LLM serving. The simulator behind these pages is "
                   "the one `kvpool sim run` uses.")
    from kvpool.dashboard.ui import warm_imports

    warm_imports()
    nav.run()


if __name__ == "__main__":  # Streamlit runs the script as __main__; importing it draws nothing
    main()
