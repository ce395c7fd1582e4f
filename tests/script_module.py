"""The benchmark scripts under benchmarks/ (and the probes under research/) as modules, for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, folder: str = "benchmarks") -> ModuleType:
    """``<folder>/<name>.py`` (benchmarks/, or research/ for the probes) imported as module ``name`` (registered in
    ``sys.modules``, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
