"""``KVMigration`` is a component behind a Protocol: it never reaches into the engine module."""

from __future__ import annotations

import ast
from pathlib import Path

import baton_serve.workers.kv.migration as migration


def _imported_modules(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_migration_does_not_import_the_engine_core() -> None:
    imported = _imported_modules(Path(migration.__file__).read_text())
    core = "baton_serve.workers.engine.core"
    assert not {m for m in imported if m == core or m.startswith(core + ".")}
