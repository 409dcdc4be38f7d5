"""How a plan draws itself without importing any chart code: plan classes (low layers) inherit `Shows`, whose
`show` calls the drawer a front end on the top layer installs (`engine.notebook` does, on import). The
plan classes thus stay free of Altair and of `engine.views`, which the layers contract keeps above them."""
from __future__ import annotations

from typing import Any, Callable

from engine.errors import HapError

Drawer = Callable[..., Any]
"""`drawer(obj, view, **options)`: one view of `obj` as something a notebook displays."""

_drawers: list[Drawer] = []


class NoDrawer(HapError, RuntimeError):
    """`show` was called before any front end installed a drawer."""


def install(drawer: Drawer) -> None:
    """Make `drawer` the one `Shows.show` calls (installing again replaces it)."""
    _drawers[:] = [drawer]


class Shows:
    """Mixin of the plan kinds: `plan.show("timeline")`, `plan.show("memory", cluster=c)` and the like."""

    def show(self, view: str | None = None, **options: Any) -> Any:
        """One view of the plan (None: its main one), drawn by the installed front end; the views and their
        options are listed by `engine.notebook.VIEWS`."""
        if not _drawers:
            raise NoDrawer("nothing draws plans yet: run `import engine.notebook` (or `%load_ext engine.notebook`) "
                           "first; it needs the notebook extra: pip install -e \".[notebook]\"")
        return _drawers[0](self, view, **options)
