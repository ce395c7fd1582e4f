"""The package as users get it: one version everywhere, and a wheel that holds every file of wsitrain/.

Runs from the checkout (the editable install); `make wheel-check` (.ci/wheel-check) installs the built wheel into a
clean venv and runs the CLI from it.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import wsitrain
from wsitrain.cli import app

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_files() -> list[Path]:
    """Every file under wsitrain/ the wheel must carry (caches aside), relative to the checkout."""
    return sorted(p.relative_to(ROOT) for p in (ROOT / "wsitrain").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))  # fmt: skip


def test_one_version_in_pyproject_the_package_the_cli_and_the_changelog() -> None:
    version = PYPROJECT["project"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert wsitrain.__version__ == version
    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"wsitrain {version}"
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == version, "CHANGELOG.md's newest entry is not pyproject.toml's version"


def test_every_non_python_file_is_declared_package_data() -> None:
    """A data file added under wsitrain/ (a preset, a model's file) that no package-data pattern covers would be
    left out of the wheel: an installed wsitrain would not find it."""
    patterns = [pat for pats in PYPROJECT["tool"]["setuptools"]["package-data"].values() for pat in pats]
    undeclared = [str(p) for p in package_files() if p.suffix != ".py"
                  and not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]  # fmt: skip
    assert not undeclared, f"add these to [tool.setuptools.package-data] in pyproject.toml: {undeclared}"


def test_the_wheel_holds_every_package_file_and_the_entry_point(tmp_path: Path) -> None:
    """`python -m build` (sdist, then the wheel from the sdist) on a copy of the checkout: the wheel carries every
    file of wsitrain/ (modules and data), the version, and the `wsitrain` command."""
    pytest.importorskip("build", reason="the `build` package comes with the test extra (pip install -e '.[test]')")
    src = tmp_path / "src"  # a copy: the sdist step writes wsitrain.egg-info into the tree it builds
    shutil.copytree(ROOT / "wsitrain", src / "wsitrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in", "constraints.txt"):
        shutil.copy2(ROOT / name, src / name)
    probe = src / "wsitrain" / "sft" / "planning" / "probe_preset.json"  # a data file in a sub-package, in the copy
    probe.write_text("{}\n")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    version = PYPROJECT["project"]["version"]
    (wheel,) = (tmp_path / "dist").glob(f"wsitrain-{version}-py3-none-any.whl")
    assert (tmp_path / "dist" / f"wsitrain-{version}.tar.gz").is_file()
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(p) for p in package_files() if p.as_posix() not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "wsitrain/sft/planning/probe_preset.json" in names  # the package-data patterns reach sub-packages
    entry = zipfile.ZipFile(wheel).read(f"wsitrain-{version}.dist-info/entry_points.txt").decode()
    assert "wsitrain = wsitrain.cli:main" in entry
