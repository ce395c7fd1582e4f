"""Shared fixtures: where the real test slides are, and the repository root."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (`make test` runs one worker per core): one torch thread per worker, and for the processes the
# tests start. Two workers of two threads each on CI's 2 cores ran some float64 cases 9x slower than alone (the
# convnext_tiny trunk: 69 s against 7.9 s, measured with -n 2 and torch's default threads).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real slides live beside the checkout (../shared/slides), never inside the repository.
SHARED_SLIDES = Path(__file__).resolve().parents[2] / "shared" / "slides"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (where configs/ and pyproject.toml are)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_slides() -> Path:
    """The folder of small real slides; skips the test, saying why, when it is absent."""
    if not SHARED_SLIDES.is_dir():
        pytest.skip(f"real test slides not found at {SHARED_SLIDES} (beside the checkout, in ../shared/slides)")
    return SHARED_SLIDES


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write a YAML text to a file under tmp_path and return its path: ``write_yaml("model: {name: tiny}")``."""

    def _write(text: str, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return _write


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist deals files in the order collected (xdist_order.slowest_first), not by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after -m has deselected: the order is that of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (``xdist_order.py``: xdist's workers then end together); tests marked ``gpu`` are
    skipped, with the reason shown, where CUDA is not available."""
    from xdist_order import slowest_first

    slowest_first(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: keeps collection of the rest light

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test plans with (or writes) the user's time-model calibrations (~/.cache/wsitrain/calibration)."""
    monkeypatch.setenv("WSITRAIN_CALIBRATION_DIR", str(tmp_path_factory.getbasetemp() / "no-calibration"))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny float64 convolutions: one torch thread, many times faster than two on a busy machine (the model checks)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
