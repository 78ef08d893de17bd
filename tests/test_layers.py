"""The architecture holds: the import-linter contracts of pyproject.toml, and no import circle between modules.

Both read the source without importing miles (about a second together). Every import counts, also one
inside a function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_linter_contracts_are_kept(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports puts the working directory first
    # lint_imports configures logging with dictConfig, which disables every logger that exists: a later
    # test reading miles' log records (caplog) would see none
    enabled = [lg for lg in logging.Logger.manager.loggerDict.values()
               if isinstance(lg, logging.Logger) and not lg.disabled]
    try:
        status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        for lg in enabled:
            lg.disabled = False
    assert status == EXIT_STATUS_SUCCESS, capsys.readouterr().out


def test_no_import_circle_between_modules() -> None:
    graph = grimp.build_graph("miles", cache_dir=None)
    upstream = {m: graph.find_upstream_modules(m) for m in graph.modules}  # all it imports, directly or not
    circles = {frozenset({m} | {u for u in up if m in upstream[u]}) for m, up in upstream.items()}
    found = {tuple(sorted(c)) for c in circles if len(c) > 1}
    assert not found, (f"modules that import each other, directly or through others: {sorted(found)}; move what "
                       "they share into a module of its own")


def test_the_gpu_check_collects_without_ray() -> None:
    """scripts/gpu_check.sh runs tests/test_gpu.py and ``miles.bench gpu`` on a machine without Ray: neither
    may import it (here Ray's import is made to fail)."""
    import subprocess

    code = ("import sys; sys.modules['ray'] = None; import miles.bench.gpu, pytest; "
            "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', 'tests/test_gpu.py']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
