"""The user guide (docs/, MkDocs) builds without a warning: a broken link, a missing page or an anchor
that does not exist fails here; and every page the README links to exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_user_guide_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "backends" / "index.html").is_file()


def test_every_file_the_readme_links_to_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets, "the README links to the user guide"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
