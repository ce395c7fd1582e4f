"""Run folders runs/NAME/: created fresh (never overwritten), with the resolved config and library versions;
the checkpoint a resume continues from; the JSON-lines logs a run appends to."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

import wsitrain
from wsitrain.config import TaskConfig, TissueConfig, check_run_name, diff_configs
from wsitrain.errors import WsiTrainError
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.data import FitData
from wsitrain.write_errors import named_write_errors


def check_log_dir(base: Path) -> None:
    """Refuse a log.dir that cannot hold run folders (checked before any write): part of its path is a file, or the
    folder where run folders would be made (its nearest existing part) is not writable by this process, e.g. a
    container's /runs volume owned by another uid."""
    base = Path(base)
    for part in (base, *base.parents):
        if part.exists():
            if not part.is_dir():
                where = "is a file" if part == base else f"lies under the file {part}"
                raise WsiTrainError(
                    f"log.dir {base}: {where}, not a folder",
                    hint="set log.dir to a folder (it is created when missing), e.g. --set log.dir=runs",
                )
            if not os.access(part, os.W_OK | os.X_OK):
                where = "" if part == base else f" (its existing parent {part})"
                raise WsiTrainError(
                    f"log.dir {base}{where}: not writable by this process (uid {_uid()})",
                    hint="make it writable (chown or chmod the folder), set log.dir to a folder you can write to "
                    "(e.g. --set log.dir=runs), or in a container run as its owner: docker run --user "
                    "$(id -u):$(id -g) ...",
                )
            return


def _uid() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else "?"


def discard_run_dir(run_dir: Path) -> None:
    """Remove a run folder this start made when the start fails before training: a failed start leaves no folder.

    Only for a folder ``create_run_dir`` claimed moments ago (it holds nothing but the files this start wrote);
    never for a resumed one. A folder that cannot be removed is left, not an error on top of the first.
    """
    shutil.rmtree(run_dir, ignore_errors=True)


def create_run_dir(base: Path, name: str | None) -> tuple[Path, str | None]:
    """Create base/NAME; if it exists, NAME-2, NAME-3, ... The old folder is never touched.

    Returns the folder and a note for the user when the name changed. ``os.mkdir`` without exist_ok makes the
    claim atomic, so two jobs started at once cannot share a folder. A name is one folder name
    (``config.check_run_name``), so the run folder is always directly inside ``base``.
    """
    base = Path(base)
    name = name or datetime.now().strftime("run-%Y%m%d-%H%M%S")
    problem = check_run_name(name, what="run name")
    if problem is not None:
        raise WsiTrainError(problem, hint="pass --name NAME (or the config key name:) with a plain folder name")
    check_log_dir(base)
    candidate, i = base / name, 1
    try:
        base.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                os.mkdir(candidate)
                break
            except FileExistsError:
                i += 1
                candidate = base / f"{name}-{i}"
    except OSError as e:
        raise WsiTrainError(
            f"log.dir {base}: cannot create the run folder {candidate}: {e.strerror or e}",
            hint="set log.dir to a folder you can write to, e.g. --set log.dir=runs (check permissions and free "
            "disk space)",
        ) from e
    note = None
    if candidate.name != name:
        note = (
            f"run folder {base / name} exists; writing to {candidate} instead "
            f"(use --resume {base / name} to continue it)"
        )
    return candidate, note


def library_versions(device: torch.device | None = None) -> dict[str, Any]:
    """Versions of everything that changes numbers: python, torch, torchvision, openslide, wsitrain, CUDA, device."""
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "wsitrain": wsitrain.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "numpy": _version("numpy"),
        "torchvision": _version("torchvision"),
        "openslide": _version("openslide", "__library_version__"),
        "openslide_python": _version("openslide"),
        "tifffile": _version("tifffile"),
    }
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(dev)
    else:
        out["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return out


def _version(module: str, attr: str = "__version__") -> str | None:
    try:
        mod = __import__(module)
        return str(getattr(mod, attr, None))
    except Exception:  # a missing optional library is recorded as null, not an error
        return None


def _named(path: Path) -> contextlib.AbstractContextManager[None]:
    """A failed write of a run file (full disk, file-size limit, read-only disk, ...): exit 2 naming the file."""
    return named_write_errors(
        path, then="run the command again (a fit continues with `wsitrain fit CONFIG --resume RUN_DIR`)"
    )


def write_yaml(path: Path, data: dict[str, Any]) -> None:
    with _named(path), open(path, "w") as f:
        yaml.safe_dump(_plain(data), f, sort_keys=False)


def read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    with _named(path), open(path, "w") as f:
        json.dump(_plain(data), f, indent=2)
        f.write("\n")


def _plain(x: Any) -> Any:
    """Paths and tuples to str and list, so yaml.safe_dump and json accept the resolved config."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None  # strict JSON has no NaN (e.g. an AUC with one class present)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a killed run's log is complete up to the kill."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f = None
        if path is not None:
            with _named(path):
                self._f = open(path, "a")  # noqa: SIM115 - kept open for the run; closed by close()

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        with _named(self.path):
            self._f.write(json.dumps(_plain(record)) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def drop_rows_after_step(path: Path, step: int) -> int:
    """Rewrite a JSON-lines log without the rows of optimizer steps after ``step`` (what a stopped run logged past
    its last checkpoint, which the resume redoes): no step appears twice. Rows without a step are kept; a torn last
    line is dropped. Atomic (temp file + os.replace): a kill leaves the old or the new file. Returns rows dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with _named(path):
            with open(tmp, "w") as f:
                f.write("".join(f"{line}\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    return dropped


# Keys whose change makes a checkpoint's weights meaningless for the new config: refused even with --force.
ARCHITECTURE_KEYS = ("model.name",)


def load_resume(resume: Path, cfg_dict: dict[str, Any], force: bool) -> tuple[dict[str, Any], Path]:
    """The checkpoint to continue from (a run folder means its last.pt); refuse a changed config unless forced.

    A different model is refused even with ``force``: its weights cannot be loaded, and the run folder must not
    be touched before that is known.
    """
    path = resume / "last.pt" if resume.is_dir() else resume
    if not resume.exists():
        raise WsiTrainError(f"--resume {resume}: no such run folder", hint="pass a folder under runs/ written by fit")
    if not path.is_file():
        raise WsiTrainError(
            f"--resume {resume}: no last.pt in it (the run stopped before its first checkpoint)",
            hint="start a new run instead, or set train.checkpoint_every to checkpoint within an epoch",
        )
    ckpt = load_checkpoint(path)
    old = ckpt.get("config", {})
    if "task" not in old:  # written before the task section existed: such a run was the default classification
        old = {**old, "task": TaskConfig().model_dump(mode="json")}
    if "balance" not in old.get("distributed", {}):  # written before distributed.balance: not a change of config (the
        # resume deals slides round robin, as that run did: recipe._balance reads the checkpoint)
        old = {**old, "distributed": {**old.get("distributed", {}), "balance": cfg_dict["distributed"]["balance"]}}
    if "tissue" not in old.get("data", {}):  # written before data.tissue existed: its default is no change of config
        old = {**old, "data": {**old.get("data", {}), "tissue": TissueConfig().model_dump(mode="json")}}
    # written before fine-tuning keys existed: such a run had them at their defaults
    old = {**old, "model": {"freeze": None, **old.get("model", {})},
           "train": {"backbone_lr_scale": 1.0, "class_balance": "none", **old.get("train", {})}}
    changed = [k for k in diff_configs(old, cfg_dict) if k != "name"]
    refrozen = [k for k in changed if k == "model.freeze" or k.startswith("model.freeze.")]
    if refrozen:
        raise WsiTrainError(
            f"--resume {resume}: the run froze {_get(old, 'model.freeze')!r}, the config now freezes "
            f"{_get(cfg_dict, 'model.freeze')!r}; a resume keeps what the run trained and its optimizer state",
            hint="resume with the run's model.freeze (its config.yaml), or start a new run from its weights "
            "(model.weights: RUN/best.pt)",
        )
    fixed = [k for k in changed if k in ARCHITECTURE_KEYS]
    if fixed:
        details = "; ".join(f"{k}: {_get(old, k)!r} -> {_get(cfg_dict, k)!r}" for k in fixed)
        raise WsiTrainError(
            f"--resume {resume}: the run trained another model ({details}); its weights cannot continue in this one",
            hint=f"resume with {_get(old, 'model.name')!r} (the run's config.yaml), or start a new run without "
            "--resume",
        )
    if changed and not force:
        details = "; ".join(f"{k}: {_get(old, k)!r} -> {_get(cfg_dict, k)!r}" for k in changed)
        raise WsiTrainError(
            f"--resume {resume}: the config differs from the run's in {len(changed)} key(s): {details}",
            hint="resume with the run's own config (its config.yaml), or add --force to continue with the new one",
        )
    return ckpt, path.parent


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def write_run_files(
    run_dir: Path, cfg_dict: dict[str, Any], resumed: bool, device: torch.device, data: FitData,
    tissue: dict[str, Any] | None = None,
) -> None:
    """config.yaml, versions.json and data.json; on a resume with a changed config, config.resume-N.yaml instead.
    ``tissue``: each slide's kept and dropped tissue pieces (the preflight's ``tissue_records``), by file name."""
    if not resumed:
        write_yaml(run_dir / "config.yaml", cfg_dict)
        write_json(run_dir / "versions.json", library_versions(device))
        write_json(run_dir / "data.json", {
            "labels": str(data.labels_csv), "classes": data.class_names,
            "train": [r.slide_id for r in data.train], "val": [r.slide_id for r in data.val],
            # only where there is something to say, so a plain classification run's data.json is as before
            **({"test": [r.slide_id for r in data.test]} if data.test else {}),
            **({"task": data.objective.state()} if data.objective is not None else {}),
            **({"patients": {r.slide_id: r.patient for r in data.train + data.val + data.test if r.patient}}
               if any(r.patient for r in data.train + data.val + data.test) else {}),
            **({"tissue": tissue} if tissue else {}),
        })  # fmt: skip
        return
    saved = run_dir / "config.yaml"
    if saved.exists() and not diff_configs(read_yaml(saved), cfg_dict):
        return
    i = 1
    while (run_dir / f"config.resume-{i}.yaml").exists():
        i += 1
    write_yaml(run_dir / f"config.resume-{i}.yaml", cfg_dict)
    write_json(run_dir / f"versions.resume-{i}.json", library_versions(device))
