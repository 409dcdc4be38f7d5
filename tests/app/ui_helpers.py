"""Helpers of the workbench AppTests (a module name no other test folder uses)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def open_page(at, name: str):
    """Switch an AppTest to app/app_pages/<name>.py and run it."""
    return at.switch_page(f"app_pages/{name}.py").run()


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
