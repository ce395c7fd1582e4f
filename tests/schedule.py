"""The order in which `make test`'s pytest-xdist workers take test files: the slowest first.

Under ``--dist loadfile`` a file is one unit of work. xdist's own order deals files by their number of tests, so the
few-case slow files (a private Slurm cluster, two-process fits, the heavy float64 cases of CI's `make test-all`) came
last, and one worker ran such a file alone at the end while the other had finished. Dealt longest first (the LPT
rule), the last files to start are short ones and both workers end close together.

``SLOW_FILES`` is the seconds each file took on one worker of 2 cores, heavy cases included (*measured*: the cases'
`--durations` in the closing notes of 2026-11-24 to 2026-11-27 and this round's; only the order matters, so a rough
figure does). A file not listed keeps xdist's order after them: more tests first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

SLOW_FILES = {
    "test_model_zoo.py": 330,  # 59 default families 668 s wall at a load of 10 (about 200 s of CPU), 3 heavy 40-55 s
    "test_sft_multipass_regressions.py": 180,  # heavy: 118 s and 64 s cases under load (2026-11-27)
    "test_slurm_real.py": 140,  # a private two-node cluster: 100 s, and the heavy requeue case 30-50 s
    "test_fit_distributed.py": 120,  # the heavy signal case alone 90 s under load; a two-process fit
    "test_sft_simulate.py": 90,  # simulated whole-slide models: EfficientNet-B0 23 s, ConvNeXt-T, DarkNet
    "test_tasks_cv.py": 80,  # a k-fold cv, and the heavy two-process cv (30-50 s)
    "test_sft_memory.py": 60,  # VGG-16's RSS 22 s (heavy), DarkNet-19's
    "test_bench_throughput.py": 50,  # the heavy quick run 18-50 s
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
