"""The architecture holds: the import-linter contracts of pyproject.toml, and no import circle between modules.

Both read the source without importing miles (about a second together). Every import counts, also one
inside a function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]

KNOWN_CIRCLES = {("miles.core.actors", "miles.core.cluster")}
"""The one import circle allowed, and only until the placement Plan lands: that rewrite of core/actors.py and
core/cluster.py removes it, and then this entry goes (with the ``acyclic-core`` contract's ignore_imports line)."""


def test_the_import_linter_contracts_are_kept(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports puts the working directory first
    status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert status == EXIT_STATUS_SUCCESS, capsys.readouterr().out


def test_no_import_circle_between_modules() -> None:
    graph = grimp.build_graph("miles", cache_dir=None)
    upstream = {m: graph.find_upstream_modules(m) for m in graph.modules}  # all it imports, directly or not
    circles = {frozenset({m} | {u for u in up if m in upstream[u]}) for m, up in upstream.items()}
    found = {tuple(sorted(c)) for c in circles if len(c) > 1}
    assert not found - KNOWN_CIRCLES, (
        f"modules that import each other, directly or through others: {sorted(found - KNOWN_CIRCLES)}; move what "
        "they share into a module of its own")
    assert not KNOWN_CIRCLES - found, (
        f"{sorted(KNOWN_CIRCLES - found)} no longer import each other: remove the entry from KNOWN_CIRCLES in "
        "tests/test_layers.py (and the matching ignore_imports line in pyproject.toml)")
