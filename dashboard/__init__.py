"""The Streamlit capacity-planning dashboard over the simulator (``kvpool dashboard``)."""
