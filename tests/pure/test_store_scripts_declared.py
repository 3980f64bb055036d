"""Every script a store module registers declares itself (its first line), so that a Redis Cluster
holds it to one slot. Read from the source, no Redis."""

from __future__ import annotations

import ast
import importlib

from fleet.store.lua import SHEBANG
from tests.paths import ROOT

STORE = ROOT / "fleet" / "store"


def _registered_scripts() -> list[tuple[str, str, str]]:
    """(module, constant, text) for every script a store module passes to register_script."""
    out = []
    for path in sorted(STORE.glob("*.py")):
        mod = importlib.import_module(f"fleet.store.{path.stem}")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "register_script" and node.args and isinstance(node.args[0], ast.Name)):
                out.append((path.stem, node.args[0].id, getattr(mod, node.args[0].id)))
    return out


def test_every_store_script_declares_itself_so_the_cluster_holds_it_to_one_slot() -> None:
    scripts = _registered_scripts()
    assert len(scripts) >= 15, scripts  # the line, admission, limits, budgets, ledger, leader
    undeclared = [f"{m}.{name}" for m, name, text in scripts if not text.startswith(SHEBANG)]
    assert undeclared == [], f"scripts without the {SHEBANG!r} first line: {undeclared}"
