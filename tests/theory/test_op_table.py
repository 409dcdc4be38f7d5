"""The Core ATen operator table (engine/theory/op_table.py, docs/core_aten_ops.md): complete for the
installed torch, honest about capture, and committed as generated."""
from __future__ import annotations

from pathlib import Path

from engine.model import capture
from engine.theory.core import registered_ops
from engine.theory.op_table import KINDS, TABLE, core_overloads, render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "core_aten_ops.md"


def _lowering(overload: str) -> object:
    """Capture's lowering of an overload (its own, or its operator's; of real tensors or of complex ones held as
    pairs), None when capture has none."""
    name = overload.split(".")[0]
    for table in (capture._SPLITS, capture._HANDLERS, capture._COMPLEX):
        if overload in table or name in table:
            return table.get(overload, table.get(name))
    return None


def test_every_core_overload_of_the_installed_torch_has_a_row() -> None:
    """A torch release that adds (or drops) a core operator fails here until the table says what capture does."""
    core = set(core_overloads())
    assert len(core) > 150
    assert sorted(core - set(TABLE)) == [], "add a row to engine/theory/op_table.py for each"
    assert sorted(set(TABLE) - core) == [], "rows for overloads the installed torch does not tag core"
    assert {row.kind for row in TABLE.values()} <= set(KINDS)


def test_lowered_rows_have_a_lowering_and_ruled_operators_and_the_others_have_none() -> None:
    ruled = set(registered_ops())
    for name, row in TABLE.items():
        if row.kind == "lowered":
            assert _lowering(name) is not None, f"{name}: the table says lowered, capture has no lowering"
            assert row.canonical and set(row.canonical) <= ruled, f"{name}: {row.canonical} without rules"
        else:  # (an out= variant shares its name with the functional operator capture lowers)
            assert name.endswith(".out") or _lowering(name) is None, f"{name} is {row.kind} but capture lowers it"
            assert not row.canonical
            assert row.note, f"{name}: a {row.kind} row says why"


def test_the_committed_docs_table_is_the_generated_one() -> None:
    assert DOCS.read_text() == render(), "run: python -m engine.theory.op_table --write docs/core_aten_ops.md"
