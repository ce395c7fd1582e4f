"""The research probes' tests: run by hand, not by `make test` or CI (the probes are records, not the product):

    PYTHONPATH=. python -m pytest -q -n 0 research/tests

They use the suite's helpers (tests/tiny_runs.py, tests/script_module.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in tests/conftest.py: no probe test plans with (or writes) the user's time-model calibrations."""
    monkeypatch.setenv("WSITRAIN_CALIBRATION_DIR", str(tmp_path_factory.getbasetemp() / "no-calibration"))
