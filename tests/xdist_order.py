"""The order in which `make test`'s pytest-xdist workers take test files: the slowest first.

Under ``--dist loadfile`` a file is one unit of work. xdist's own order deals files by their number of tests, so the
few-case slow files (a private Slurm cluster, two-process fits, the heavy float64 cases of CI's `make test-all`) came
last, and one worker ran such a file alone at the end while the other had finished. Dealt longest first (the LPT
rule), the last files to start are short ones and both workers end close together.

``SLOW_FILES`` gives about the seconds each file's default cases and its ``heavy`` cases take on one worker of CI's 2
cores (*measured* with --junitxml on two fresh-clone CI runs, 2026-12-01, the larger of the two): `make test` runs
the first, `make test-heavy` the second, `make test-all` both, so a file's figure is the sum over the kinds its
selected tests are. Only the order matters, so a rough figure does. A file not listed keeps xdist's order after
them: more tests first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

SLOW_FILES: dict[str, tuple[float, float]] = {  # file: (default cases' seconds, heavy cases' seconds)
    "test_model_zoo.py": (161, 147),  # 50 families in the default run, 13 heavy (5-55 s each)
    "test_sft_simulate.py": (82, 120),  # simulated whole-slide models and representative tiles
    "test_sft_cpu_budget.py": (20, 52),  # fresh processes measuring the CPU budget
    "test_sft_memory.py": (0, 58),  # fresh processes measuring RSS: VGG-16 (tiled) and DarkNet-19
    "test_sft_attention.py": (49, 24),
    "test_slurm_real.py": (0, 71),  # a private two-node cluster: its jobs and the requeue
    "test_sft_multipass_regressions.py": (3, 47),  # the 45% FBNetV3 and EfficientNetV2 cases (planning)
    "test_bench_learning_script.py": (5, 43),
    "test_fit_distributed.py": (0, 45),  # two-process fits and the signal case
    "test_tasks_learn.py": (0, 43),  # three task fits to their targets
    "test_sft_timm_families.py": (13, 27),
    "test_plan_cmd.py": (7, 24),
    "test_synth_lesions.py": (21, 9),
    "test_gpu_session.py": (27, 0),
    "test_fit_train.py": (27, 0),
    "test_bench_throughput.py": (0, 26),
    "test_sft_multipass.py": (23, 0),
    "test_slide_bn.py": (23, 0),
    "test_fit_preempt.py": (20, 0),
    "test_tasks_cv.py": (0, 19),
    "test_fit_start_ranks.py": (0, 18),
    "test_patch_tasks.py": (8, 15),  # tiny ViT fits and a 2-fold cv; the two-process fit (heavy)
}


def slowest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` (the selected tests: called after ``-m`` deselects) in place: files in SLOW_FILES first
    (slowest first), then the rest by their number of tests; each file's tests keep their order."""
    per_file = Counter(Path(str(item.fspath)).name for item in items)
    kinds: dict[str, set[bool]] = {}
    for item in items:
        kinds.setdefault(Path(str(item.fspath)).name, set()).add(item.get_closest_marker("heavy") is not None)

    def key(name: str) -> tuple[bool, float]:
        figures = SLOW_FILES.get(name)
        if figures is None:
            return (True, -per_file[name])
        return (False, -sum(figures[heavy] for heavy in kinds[name]))

    first_seen = {name: i for i, name in reversed(list(enumerate(Path(str(it.fspath)).name for it in items)))}
    items.sort(key=lambda it: (*key(Path(str(it.fspath)).name), first_seen[Path(str(it.fspath)).name]))
