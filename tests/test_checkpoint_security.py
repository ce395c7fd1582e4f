"""No file a user opens runs code: checkpoints and weights are read with torch.load(weights_only=True) and one
short allowlist (wsitrain.safe_load); a crafted file is refused with exit 2 and one message, before anything runs.

Also: checkpoints written before this change (tests/fixtures/ckpt_before_safe_load.pt, the last.pt of a 1-epoch
tiny sgd/cosine fit on 4 synthetic 128 px slides, written by commit f20c594) still load through predict, resume,
report and model.weights.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_runs import config_file as tiny_config
from tiny_runs import finished_run, invoke, synthetic_slides

from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.models.weights import load_weights
from wsitrain.train.checkpoint import load_checkpoint, rng_states, save_checkpoint, set_rng_states

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_before_safe_load.pt"
# Written under numpy 1.26.4 (numpy.core.multiarray._reconstruct in the pickle, where numpy 2 writes numpy._core):
# {"format": 1, "model": {"w": ones(2)}, "rng": {torch, numpy, python} after seed 3 each, "config": {...}}
FIXTURE_NUMPY1 = Path(__file__).parent / "fixtures" / "ckpt_numpy126_rng.pt"
REFUSED = "is not a wsitrain checkpoint or asks to run code"


def config_file(tmp: Path, synth_dir: Path, epochs: int = 1) -> Path:
    """The fixture's config (tiny, sgd, cosine) with this test's folders."""
    return tiny_config(tmp, synth_dir, epochs, schedule="cosine")


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_slides(tmp_path_factory.mktemp("synth"))


@pytest.fixture(scope="module")
def run_dir(synth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-epoch run folder (config.yaml, validation.json, best.pt, last.pt)."""
    return finished_run(config_file(tmp_path_factory.mktemp("run"), synth_dir))


# ---- the crafted file: what the evil.pt did, and a pure-python variant


class _Shell:
    """Unpickling it runs a shell command that creates the marker (the issue's evil.pt)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


class _Touch:
    """Unpickling it calls pathlib.Path.touch: no shell, a plain function of the standard library."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


PAYLOADS = {"os.system": _Shell, "pathlib.Path.touch": _Touch}


def crafted(path: Path, marker: Path, payload: str) -> Path:
    """A torch.save'd dict with the keys a wsitrain checkpoint has, and one object that runs code when unpickled."""
    torch.save({"format": 1, "model": build("tiny", 2).state_dict(), "config": {}, "junk": PAYLOADS[payload](marker)},
               path)  # fmt: skip
    return path


def assert_refused(result: Any, path: Path, marker: Path) -> None:
    assert result.exit_code == 2, result.output
    assert not marker.exists(), "the crafted file ran code"
    out = " ".join(result.output.split())  # rich wraps long lines
    assert REFUSED in out and str(path) in out, result.output
    assert out.count("error:") == 1 and "Traceback" not in out and "internal error" not in out, result.output


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_runs_when_unpickled_without_weights_only(tmp_path: Path, payload: str) -> None:
    """The crafted file is real: a plain pickle load creates the marker (so the tests below can fail)."""
    marker = tmp_path / "MARKER"
    path = crafted(tmp_path / "evil.pt", marker, payload)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_predict_refuses_a_crafted_checkpoint(tmp_path: Path, synth_dir: Path, payload: str) -> None:
    marker = tmp_path / "MARKER"
    path = crafted(tmp_path / "evil.pt", marker, payload)
    result = invoke("predict", str(config_file(tmp_path, synth_dir)), "--checkpoint", str(path),
                    "--slides", str(synth_dir), "--out", str(tmp_path / "p.csv"))  # fmt: skip
    assert_refused(result, path, marker)
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_resume_refuses_a_crafted_checkpoint(tmp_path: Path, synth_dir: Path, run_dir: Path, payload: str) -> None:
    marker = tmp_path / "MARKER"
    run = shutil.copytree(run_dir, tmp_path / "run")
    path = crafted(run / "last.pt", marker, payload)
    result = invoke("fit", str(config_file(tmp_path, synth_dir, epochs=2)), "--resume", str(run), "--force")
    assert_refused(result, path, marker)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_report_refuses_a_crafted_checkpoint(tmp_path: Path, run_dir: Path, payload: str) -> None:
    marker = tmp_path / "MARKER"
    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("heatmaps"))
    path = crafted(run / "best.pt", marker, payload)
    result = invoke("report", str(run))
    assert_refused(result, path, marker)


def test_cv_refuses_a_crafted_fold_checkpoint(tmp_path: Path, synth_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cv rerun resumes each fold with a last.pt (fit --resume): a planted one is refused the same way."""
    import wsitrain.train.cv as cv

    cfg = str(config_file(tmp_path, synth_dir))

    def stop(*args: Any, **kwargs: Any) -> None:
        raise WsiTrainError("stopped before the first fold trained")

    monkeypatch.setattr(cv, "run_fit", stop)  # the first run only lays out the folds (cv.json, fold CSVs)
    assert invoke("cv", cfg, "--folds", "2").exit_code == 2
    monkeypatch.undo()
    cv_dir = tmp_path / "runs" / "exp-cv2"
    assert (cv_dir / "cv.json").is_file()
    (cv_dir / "fold-1").mkdir()
    marker = tmp_path / "MARKER"
    path = crafted(cv_dir / "fold-1" / "last.pt", marker, "pathlib.Path.touch")
    assert_refused(invoke("cv", cfg, "--folds", "2"), path, marker)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_model_weights_refuse_a_crafted_file(tmp_path: Path, synth_dir: Path, payload: str) -> None:
    """model.weights: a local file is data too (fit reads it before training)."""
    marker = tmp_path / "MARKER"
    path = crafted(tmp_path / "evil.pt", marker, payload)
    with pytest.raises(WsiTrainError) as err:
        load_weights(build("tiny", 2), path)
    assert not marker.exists()
    assert err.value.exit_code == 2 and str(path) in err.value.message and REFUSED in err.value.message


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_a_planted_torchvision_cache_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     payload: str) -> None:  # fmt: skip
    """model.weights: imagenet reads torchvision's cache through torch.hub, whose default is weights_only=False."""
    from wsitrain.models.pretrained import torchvision_cache_file

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path, _ = torchvision_cache_file("resnet18")
    path.parent.mkdir(parents=True)
    marker = tmp_path / "MARKER"
    crafted(path, marker, payload)
    with pytest.raises(WsiTrainError) as err:
        build("torchvision/resnet18", 2, weights="imagenet")
    assert not marker.exists()
    assert err.value.exit_code == 2 and str(path) in err.value.message and REFUSED in err.value.message
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # held only while the library loads


def test_the_message_names_what_the_file_asked_for(tmp_path: Path) -> None:
    path = crafted(tmp_path / "evil.pt", tmp_path / "MARKER", "os.system")
    with pytest.raises(WsiTrainError) as err:
        load_checkpoint(path)
    assert "system" in err.value.message and "add_safe_globals" not in str(err.value)


@pytest.mark.parametrize(("content", "said"), [(b"not a checkpoint\n", "it starts with the text 'not a checkpoint'"),
                                              (b"", "it is empty"), (b"\xff\xd8\xff\xe0JFIF", "the bytes ff d8 ff e0")])
def test_a_file_that_is_no_checkpoint_at_all(tmp_path: Path, content: bytes, said: str) -> None:
    """Text, an empty file or an image: the message says the file is no torch save file and what it is instead,
    not torch's unpickler error (a text file gave `KeyError: 101`, the byte 'e')."""
    path = tmp_path / "notes.pt"
    path.write_bytes(content)
    with pytest.raises(WsiTrainError) as err:
        load_checkpoint(path)
    msg = err.value.message
    assert f"checkpoint {path} is not a wsitrain checkpoint (a torch save file" in msg and said in msg, msg
    assert "KeyError" not in msg and err.value.exit_code == 2


def test_resume_from_a_text_file_says_what_it_is_not(tmp_path: Path, synth_dir: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("epoch 3 looked good\n")
    result = invoke("fit", str(config_file(tmp_path, synth_dir, epochs=2)), "--resume", str(path))
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{path} is not a wsitrain checkpoint (a torch save file" in out and "KeyError" not in out, out
    assert not (tmp_path / "runs").exists()


# ---- checkpoints written before the change still load


def test_fixture_holds_numpy_rng_state_as_written_before() -> None:
    """The fixture is what it claims: an old-style file whose numpy RNG state is an ndarray (needs the allowlist)."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(FIXTURE)
    assert "numpy.ndarray" in unsafe
    with pytest.raises(Exception, match="numpy"):
        torch.load(FIXTURE, weights_only=True)  # without wsitrain's allowlist


def test_fixture_loads_and_restores_every_rng() -> None:
    ckpt = load_checkpoint(FIXTURE)
    assert ckpt["format"] == 1 and ckpt["class_names"] == ["negative", "positive"]
    assert isinstance(ckpt["rng"]["numpy"][1], np.ndarray) and ckpt["rng"]["numpy"][1].dtype == np.uint32
    set_rng_states(ckpt["rng"])
    draws = (torch.rand(3), np.random.rand(3), random.random())
    old = torch.load(FIXTURE, weights_only=False)["rng"]  # the same file, read the trusting way
    set_rng_states(old)
    torch.testing.assert_close(torch.rand(3), draws[0], rtol=0, atol=0)
    np.testing.assert_array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]


def test_a_checkpoint_written_under_numpy_1_loads() -> None:
    assert "numpy.core.multiarray._reconstruct" in torch.serialization.get_unsafe_globals_in_checkpoint(FIXTURE_NUMPY1)
    ckpt = load_checkpoint(FIXTURE_NUMPY1)
    assert ckpt["config"] == {"numpy": "1.26.4"}
    set_rng_states(ckpt["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    torch.testing.assert_close(got[0], torch.rand(3), rtol=0, atol=0)
    np.testing.assert_array_equal(got[1], np.random.rand(3))
    assert got[2] == random.random()


def test_fixture_loads_as_model_weights() -> None:
    model = build("tiny", 2)
    load_weights(model, FIXTURE)
    ref = torch.load(FIXTURE, weights_only=False)["model"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def test_fixture_predicts(tmp_path: Path, synth_dir: Path) -> None:
    out = tmp_path / "p.csv"
    result = invoke("predict", str(config_file(tmp_path, synth_dir)), "--checkpoint", str(FIXTURE),
                    "--slides", str(synth_dir), "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 1 + 4


def test_fixture_resumes(tmp_path: Path, synth_dir: Path) -> None:
    """A run folder whose last.pt is the old file continues into epoch 2 and writes a new-style last.pt."""
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    shutil.copy(FIXTURE, run / "last.pt")
    result = invoke("--quiet", "fit", str(config_file(tmp_path, synth_dir, epochs=2)), "--resume", str(run),
                    "--force")  # fmt: skip
    assert result.exit_code == 0, result.output
    new = load_checkpoint(run / "last.pt")
    assert new["epoch"] == 2 and new["global_step"] > torch.load(FIXTURE, weights_only=False)["global_step"]
    assert torch.serialization.get_unsafe_globals_in_checkpoint(run / "last.pt") == []


# ---- what today's code writes needs no allowlist at all


def test_new_checkpoints_load_with_plain_weights_only(tmp_path: Path) -> None:
    """A user's own `torch.load(best.pt)` (weights_only by default since torch 2.6) reads it without allowlisting."""
    np.random.seed(7)
    save_checkpoint(tmp_path / "last.pt", model={"w": torch.ones(2)}, rng=rng_states(), config={"seed": 7})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "last.pt") == []
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    expected = np.random.rand(3)
    set_rng_states(ckpt["rng"])
    np.testing.assert_array_equal(np.random.rand(3), expected)

