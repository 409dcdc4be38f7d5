"""Streamlit workbench (see issue: the workbench)."""
