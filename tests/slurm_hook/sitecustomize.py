"""Test-only: holds rank 0 of a Slurm job's fit at a known step until its stop signal has arrived.

tests/test_slurm_real.py puts this folder first on the job's PYTHONPATH, so every Python process of the job imports
this module at start-up; only a torchrun rank 0 given WSITRAIN_TEST_PAUSE_FILE acts. After optimizer step
WSITRAIN_TEST_PAUSE_AFTER_STEP it writes that file (the test then signals the job) and waits until wsitrain's own
handler has seen the signal, so the ranks stop at the next step whatever the machine's speed. Once the file exists
(the requeued attempt) it does nothing. wsitrain itself has no test hooks: this wraps FitRecipe from outside.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

# How long rank 0 waits for the signal: the test sends it within a second of seeing the file (measured); a job
# whose signal never comes fails loudly instead of training on.
WAIT_S = 120.0


class _PauseUntilStopped:
    def __init__(self, recipe: Any, step: int, marker: Path) -> None:
        self.recipe, self.step, self.marker = recipe, step, marker

    def on_step_end(self, state: Any) -> None:
        if state.global_step != self.step or self.marker.exists():
            return
        self.marker.write_text(f"paused after step {self.step}\n")
        deadline = time.monotonic() + WAIT_S
        while self.recipe.signals.requested is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"test pause: no stop signal within {WAIT_S:.0f} s of {self.marker}")
            time.sleep(0.05)


def _install(step: int, marker: Path) -> None:
    from wsitrain.train import recipe

    original = recipe.FitRecipe.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.callbacks.append(_PauseUntilStopped(self, step, marker))

    recipe.FitRecipe.__init__ = init  # type: ignore[method-assign]


if os.environ.get("WSITRAIN_TEST_PAUSE_FILE") and os.environ.get("RANK") == "0":
    _install(int(os.environ["WSITRAIN_TEST_PAUSE_AFTER_STEP"]), Path(os.environ["WSITRAIN_TEST_PAUSE_FILE"]))
