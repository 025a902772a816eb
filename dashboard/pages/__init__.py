"""The dashboard's pages: Streamlit scripts (each draws its page when run), not modules to import."""
