"""Every third-party module wsitrain imports comes from a distribution pyproject.toml declares.

A fresh install (the Docker image, a new .venv) gets only the declared distributions and what they require: wsitrain
once imported click, which typer stopped requiring (typer 0.2x carries its own copy), so `wsitrain --version` failed
in a freshly built image while every developer's older .venv still had click.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Imported directly, installed by a declared distribution that requires it (checked below, so this cannot go stale).
BROUGHT_BY = {
    "huggingface-hub": "timm",  # huggingface_hub: timm's pretrained weights; imported only with the timm extra
    "safetensors": "timm",  # a patch encoder's local .safetensors weights, and the hub's (wsitrain.patch.encoders)
}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503): `PyYAML>=6` -> `pyyaml`."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_name(r) for r in requirements}


def _imported_top_level_modules() -> dict[str, str]:
    """Third-party top-level module -> one file of wsitrain that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "wsitrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "wsitrain" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(_imported_top_level_modules().items()):
        names = {_name(d) for d in distributions.get(module, [])}
        if not names:
            problems.append(f"{module} (imported in {where}) is not installed here")
        elif not names & (declared | set(BROUGHT_BY)):
            problems.append(f"{module} (imported in {where}) comes from {sorted(names)}, not in pyproject.toml")
    assert not problems, "; ".join(problems)


def test_the_distributions_brought_by_others_are_required_by_them() -> None:
    for name, by in BROUGHT_BY.items():
        assert by in _declared(), f"{by} is no longer declared, so nothing brings {name}"
        required = {_name(r) for r in importlib.metadata.requires(by) or [] if "extra ==" not in r}
        assert name in required, f"{by} no longer requires {name}: declare {name} in pyproject.toml"

