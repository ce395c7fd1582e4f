"""The order in which `make test`'s pytest-xdist workers take test files: the slowest first.

Under ``--dist loadfile`` a file is one unit of work. xdist's own order deals files by their number of tests, so the
few-case slow files (a private Slurm cluster, two-process fits, the heavy float64 cases of CI's `make test-all`) came
last, and one worker ran such a file alone at the end while the other had finished. Dealt longest first (the LPT
rule), the last files to start are short ones and both workers end close together.

``SLOW_FILES`` is about the seconds each file takes on one worker of 2 cores, heavy cases included: the default
cases from the `--durations=60` of a full run on 2026-12-01 (*measured* at a load of 10, divided by 3.5, the slowdown
test_model_zoo.py showed at that load), the heavy ones from their closing notes (2026-11-24 to 2026-11-27). Only the
order matters, so a rough figure does. A file not listed keeps xdist's order after them: more tests first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

SLOW_FILES = {
    "test_model_zoo.py": 330,  # 59 default families (about 200 s of CPU) and 3 heavy ones of 40-55 s
    "test_sft_simulate.py": 260,  # simulated whole-slide models and representative tiles; 2 heavy cases
    "test_sft_multipass_regressions.py": 180,  # heavy: the 45% FBNetV3 and EfficientNetV2 cases (planning)
    "test_slurm_real.py": 140,  # a private two-node cluster: 100 s, and the heavy requeue case 30-50 s
    "test_fit_distributed.py": 120,  # a two-process fit; the heavy signal case alone 90 s under load
    "test_sft_cpu_budget.py": 90,  # fresh processes measuring the CPU budget (a fresh-clone CI run, 2026-12-01)
    "test_plan_cmd.py": 80,
    "test_tasks_learn.py": 80,  # three task fits to their targets
    "test_tasks_cv.py": 80,  # a k-fold cv, and the heavy two-process cv (30-50 s)
    "test_sft_timm_families.py": 70,
    "test_sft_clock.py": 60,
    "test_sft_memory.py": 60,  # DarkNet-19's RSS, and VGG-16's (heavy)
    "test_sft_multipass.py": 55,
    "test_bench_throughput.py": 50,  # the heavy quick run 18-50 s
    "test_sft_multipass_pool.py": 45,  # ResNet-50 planned at 100,000 px with train-mode BatchNorm
    "test_synth_lesions.py": 45,
    "test_patch_tasks.py": 30,  # three tiny ViT fits, a 2-fold cv, and the heavy two-process fit (15 s)
}


def slowest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files in SLOW_FILES first (slowest first), then the rest by their number of tests;
    each file's tests keep their order."""
    per_file = Counter(Path(str(item.fspath)).name for item in items)

    def key(name: str) -> tuple[bool, float]:
        seconds = SLOW_FILES.get(name)
        return (seconds is None, -(seconds if seconds is not None else per_file[name]))

    first_seen = {name: i for i, name in reversed(list(enumerate(Path(str(it.fspath)).name for it in items)))}
    items.sort(key=lambda it: (*key(Path(str(it.fspath)).name), first_seen[Path(str(it.fspath)).name]))
