"""The optional packages the charts and notebook displays need, imported on demand with an error that says
what to install (the engine itself plans without them)."""
from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import HapError

EXTRA_OF = {"altair": "notebook", "pandas": "notebook", "vl_convert": "notebook", "IPython": "notebook",
            "ipywidgets": "notebook"}
"""The extra of pyproject.toml that brings each optional package (`app` brings altair and pandas too)."""


class ViewsUnavailable(HapError, ImportError):
    """An optional package a chart or a notebook display needs is not installed."""


def require(module: str) -> ModuleType:
    """`module` imported, or `ViewsUnavailable` naming the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRA_OF.get(module.split(".")[0], "notebook")
        raise ViewsUnavailable(f"{module} is not installed; the workbench's charts and notebook displays need it: "
                               f'pip install -e ".[{extra}]" (or ".[app]" for the Streamlit pages)') from e
