"""``wsitrain bench``: plain PyTorch vs checkpoint_sequential vs SFT, time and peak memory per image size.

Names load lazily: every benchmark configuration starts ``python -m wsitrain.bench.worker``, which imports
this package first, and the runner's imports (rich, matplotlib) would add to each worker's start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_bench": "wsitrain.bench.runner",
    "run_worker": "wsitrain.bench.runner",
    "run_config": "wsitrain.bench.worker",
    "BenchConfig": "wsitrain.bench.configs",
    "STRATEGIES": "wsitrain.bench.configs",
    "DEFAULT_MODEL": "wsitrain.bench.configs",
    "DEFAULT_RUNS": "wsitrain.bench.configs",
    "DEFAULT_SIZES": "wsitrain.bench.configs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wsitrain.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
