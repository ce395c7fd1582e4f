"""The documentation site builds with `mkdocs build --strict` (what `make docs` and CI run), and strict mode fails on
a broken link and on a broken anchor, naming each (mkdocs.yml's validation block). About 5 s per build here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[test]' (mkdocs-material)")
pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    for page in ("index.html", "getting-started.html", "reference/config.html", "reference/cli.html",
                 "benchmarks/index.html", "research/plateau.html", "engine/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_and_a_broken_anchor_fail_the_build(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "guide" / "gpus.md"
    page.write_text(page.read_text() + "\n[gone](no-such-page.md) and [there](../getting-started.md#no-such-anchor)\n")
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    log = result.stderr + result.stdout
    assert "no-such-page.md" in log and "guide/gpus.md" in log, log[-4000:]
    assert "#no-such-anchor" in log, log[-4000:]
    assert "Aborted with 2 warnings in strict mode" in log, log[-4000:]


def test_the_readme_links_only_to_files_that_exist() -> None:
    """README.md is the repository's front page, outside the site: its relative links are checked here."""
    import re

    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http", "#"))]
    assert len(targets) > 20
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {', '.join(missing)}"
    assert len(text.splitlines()) <= 350, "README.md is the front page: at most 350 lines (the rest goes to docs/)"
