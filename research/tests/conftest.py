"""The research probes' tests: run by hand, not by `make test` or CI (the probes are records, not the product):

    PYTHONPATH=. python -m pytest -q -n 0 research/tests

They use the suite's helpers (tests/tiny_runs.py, tests/script_module.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
