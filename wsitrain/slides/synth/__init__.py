"""Synthetic slides: real pyramidal Aperio-style SVS files (tiled JPEG) with a learnable signal.

Every slide has pink, smooth "tissue" blobs on an off-white background with a few pale, scattered nuclei.
Positive slides add clusters of large dark round nuclei inside the tissue: a strong local texture that a small
CNN with 3-4 stride-2 stages sees at 1024 px. Slides are rendered band by band (256 rows at a time) and streamed
to tifffile as tiles, so a 16384 px slide never needs its level 0 in memory; coarser levels are 2x2 means of the
level above (the level-1 buffer, a quarter of level 0, is the largest array held).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from wsitrain.errors import SlideError, WsiTrainError
from wsitrain.slides.synth.fields import add_lobe, coarse_grid, smooth_noise, upsample

TILE = 256
LEVEL_MIN_SIDE = 512  # stop adding pyramid levels below this
MANIFEST = "synth_manifest.json"
_VERSION = 1


class _Scene:
    """Random scene description for one slide; renders any band of level-0 rows."""

    def __init__(self, width: int, height: int, positive: bool, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w, self.h = width, height
        self.positive = positive
        self.background = rng.integers(238, 248) + rng.integers(-3, 4, size=3)
        # The smooth fields (tissue shape, colour drift) live on a grid of at most 2048 px and are repeated up:
        # at 16384 px their 8-px steps are invisible and rendering stays fast.
        self.f = max(1, int(np.ceil(max(width, height) / 2048)))
        lw, lh = -(-width // self.f), -(-height // self.f)
        # Smooth fields are computed on a grid of at most 256 px and bilinearly upsampled: thresholding the
        # upsampled field still gives smooth tissue outlines.
        gw, gh, u, v = coarse_grid(lw, lh)
        field = np.zeros((gh, gw), dtype=np.float32)
        for _ in range(int(rng.integers(2, 5))):
            field = add_lobe(field, rng, u, v, centre=(0.3, 0.7), radii=(0.12, 0.25))
        field = field - 0.12 * smooth_noise(rng, (gh, gw), 6)
        drift = smooth_noise(rng, (gh, gw), 5)
        field, drift = upsample(field, (lh, lw)), upsample(drift, (lh, lw))
        self.tissue = field > 0.45  # (lh, lw) bool
        base = np.array([232, 150, 196], dtype=np.float32) + rng.uniform(-10, 10, size=3)
        colour = base + drift[..., None] * np.array([8, 18, 12], dtype=np.float32)
        colour = np.where(self.tissue[..., None], colour, self.background.astype(np.float32))
        self.colour = np.clip(colour, 0, 255).astype(np.int16)
        self.noise = rng.integers(-7, 8, size=(512, 512, 3)).astype(np.int16)
        # Nuclei: (x, y, r, colour) in level-0 px.
        r = max(2.5, min(width, height) / 200)
        nuclei: list[tuple[float, float, float, np.ndarray]] = []
        for x, y in self._inside(rng, 40):
            nuclei.append((x, y, r * rng.uniform(0.5, 0.7), np.array([175, 125, 190]) + rng.integers(-10, 10, size=3)))
        if positive:
            for cx, cy in self._inside(rng, int(rng.integers(8, 13))):
                for _ in range(int(rng.integers(15, 30))):
                    x, y = cx + rng.normal(0, 2.5 * r), cy + rng.normal(0, 2.5 * r)
                    if self._is_tissue(x, y):
                        col = np.array([75, 35, 125]) + rng.integers(-15, 15, size=3)
                        nuclei.append((x, y, r * rng.uniform(0.8, 1.2), col))
        self.nuclei = nuclei

    def _is_tissue(self, x: float, y: float) -> bool:
        i, j = int(y) // self.f, int(x) // self.f
        return 0 <= i < self.tissue.shape[0] and 0 <= j < self.tissue.shape[1] and bool(self.tissue[i, j])

    def _inside(self, rng: np.random.Generator, n: int) -> list[tuple[float, float]]:
        pts: list[tuple[float, float]] = []
        for _ in range(n * 50):
            x, y = rng.uniform(0, self.w), rng.uniform(0, self.h)
            if self._is_tissue(x, y):
                pts.append((x, y))
                if len(pts) == n:
                    break
        return pts

    def band(self, y0: int, y1: int) -> np.ndarray:
        """Level-0 rows [y0, y1) as (y1 - y0, w, 3) uint8."""
        f = self.f
        rows = np.arange(y0, y1) // f
        cols = np.arange(self.w) // f
        img = self.colour[rows][:, cols]  # (bh, w, 3) int16
        tissue = self.tissue[rows][:, cols]
        noise = self.noise[np.arange(y0, y1) % 512][:, np.arange(self.w) % 512]
        img = img + np.where(tissue[..., None], noise, noise // 3)
        for x, y, r, col in self.nuclei:
            if y + r < y0 or y - r >= y1:
                continue
            ya, yb = max(y0, int(y - r)), min(y1, int(y + r) + 1)
            xa, xb = max(0, int(x - r)), min(self.w, int(x + r) + 1)
            yy, xx = np.mgrid[ya:yb, xa:xb]
            disc = (xx + 0.5 - x) ** 2 + (yy + 0.5 - y) ** 2 <= r * r
            patch = img[ya - y0 : yb - y0, xa:xb]
            patch[disc] = (patch[disc] * 3 + col * 7) // 10
        return np.clip(img, 0, 255).astype(np.uint8)


def _as_wh(size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int):
        w = h = size
    else:
        h, w = size
    if w < 64 or h < 64:
        raise SlideError(f"synthetic slide size {size!r} is too small", hint="use a size of at least 64 px (e.g. 1024)")
    return int(w), int(h)


def render_synthetic(size: int | tuple[int, int], positive: bool, seed: int) -> np.ndarray:
    """The full level-0 image ``write_synthetic_slide`` writes, as (h, w, 3) uint8 (for tests; small sizes)."""
    w, h = _as_wh(size)
    scene = _Scene(w, h, positive, seed)
    return np.concatenate([scene.band(y, min(h, y + TILE)) for y in range(0, h, TILE)], axis=0)


def _halve(img: np.ndarray) -> np.ndarray:
    """2x2 mean (rounded), dropping an odd last row/column."""
    h, w = img.shape[0] // 2 * 2, img.shape[1] // 2 * 2
    a = img[:h, :w].astype(np.uint16)
    s = a[0::2, 0::2] + a[1::2, 0::2] + a[0::2, 1::2] + a[1::2, 1::2] + 2
    return (s // 4).astype(np.uint8)


def write_synthetic_slide(
    path: str | Path,
    *,
    size: int | tuple[int, int] = 4096,
    positive: bool = True,
    seed: int = 0,
    mpp: float = 0.5,
    app_mag: float = 20.0,
    quality: int = 90,
    scene: _Scene | None = None,
) -> Path:
    """Write one pyramidal Aperio-style SVS (tiled JPEG, 2x levels down to ~512 px) and return its path.

    ``scene``: a prepared scene of this size (synth.targets draws its own nuclei; lesions.LesionScene renders
    lesions and distractors); else one from positive, seed."""
    import tifffile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = _as_wh(size)
    scene = scene if scene is not None else _Scene(w, h, positive, seed)
    bg = scene.background.astype(np.uint8)
    level1 = np.empty((h // 2, w // 2, 3), dtype=np.uint8) if min(w, h) // 2 >= LEVEL_MIN_SIDE // 2 else None

    def level0_tiles() -> Iterator[np.ndarray]:
        for y in range(0, h, TILE):
            band = scene.band(y, min(h, y + TILE))
            if level1 is not None:
                half = _halve(band)
                level1[y // 2 : y // 2 + half.shape[0]] = half[: max(0, level1.shape[0] - y // 2)]
            for x in range(0, w, TILE):
                tile = band[:, x : x + TILE]
                if tile.shape[:2] != (TILE, TILE):  # edge tiles are stored full size, padded
                    full = np.empty((TILE, TILE, 3), dtype=np.uint8)
                    full[...] = bg
                    full[: tile.shape[0], : tile.shape[1]] = tile
                    tile = full
                yield tile

    head = f"Aperio Image Library v12.0.0 \r\n{w}x{h} [0,0 {w}x{h}] ({TILE}x{TILE}) JPEG/RGB Q={quality}"
    tail = f"|AppMag = {app_mag:g}|MPP = {mpp:g}|Filename = {path.stem}|wsitrain = synthetic"
    opts = dict(
        tile=(TILE, TILE),
        compression="jpeg",
        compressionargs={"level": quality},
        photometric="rgb",
        metadata=None,
        maxworkers=1,
    )
    with tifffile.TiffWriter(path, bigtiff=w * h * 3 > 2**31) as tif:
        tif.write(level0_tiles(), shape=(h, w, 3), dtype=np.uint8, description=head + tail, **opts)
        level = level1
        while level is not None:
            lh, lw = level.shape[:2]
            desc = f"Aperio Image Library v12.0.0 \r\n{w}x{h} [0,0 {w}x{h}] ({TILE}x{TILE}) -> {lw}x{lh} JPEG/RGB"
            tif.write(level, description=f"{desc} Q={quality}", subfiletype=0, **opts)
            level = _halve(level) if min(lh, lw) >= 2 * LEVEL_MIN_SIDE else None
    return path


def cached_dataset(out: Path, params: dict[str, object], names: list[str]) -> Path | None:
    """``out/labels.csv`` when ``out`` already holds the dataset ``params`` describes (its manifest says so and every
    slide in ``names`` exists); None when it must be written (an unreadable manifest included)."""
    csv_path, manifest = out / "labels.csv", out / MANIFEST
    if manifest.exists() and csv_path.exists() and all((out / nm).exists() for nm in names):
        try:
            if json.loads(manifest.read_text()).get("params") == params:
                return csv_path
        except (OSError, ValueError):
            pass
    return None


def _make_out_dir(out: Path) -> None:
    """Create the output folder, or say which part of its path is in the way (a file, no permission)."""
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == out else f"lies under the file {blocker}"
        raise SlideError(f"synth: {out} {where}, not a folder", hint="choose a folder path for the slides")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SlideError(
            f"synth: cannot create {out}: {e.strerror or e}", hint="choose a folder you can write to"
        ) from e


def write_synthetic_dataset(
    out_dir: str | Path,
    n: int = 8,
    size: int = 4096,
    seed: int = 0,
    positive_fraction: float = 0.5,
    mpp: float | None = None,
    app_mag: float | None = None,
    lesions: str = "none",
) -> Path:
    """Write ``out_dir/slide_000.svs ...`` and ``out_dir/labels.csv`` (slide,label); return the CSV path.

    ``lesions="small"``: the scenes of ``synth.lesions`` (small lesions and look-alike distractors, at its own mpp
    and magnification unless given), with their boxes in ``lesions.json``; ``"paired"``: the same with a look-alike
    on every slide of either class; ``"none"``: the scenes above.

    Labels are "negative"/"positive", ``round(n * positive_fraction)`` positives in a seeded order. A folder that
    already holds a dataset with the same parameters (``synth_manifest.json``) and all its files is reused.
    """
    if n < 1:
        raise SlideError(f"synth: n={n} must be at least 1", hint="e.g. --n 8")
    if not 0.0 <= positive_fraction <= 1.0:
        raise SlideError(f"synth: positive_fraction {positive_fraction} must be within 0..1", hint="e.g. 0.5")
    import wsitrain.slides.synth.lesions as SL

    if lesions not in SL.LESION_MODES:
        raise WsiTrainError(f"synth: lesions {lesions!r} is not one of {', '.join(SL.LESION_MODES)}",
                            hint="e.g. --lesions small")  # fmt: skip
    if lesions != "none":

        mpp, app_mag = mpp or SL.LESION_MPP, app_mag or SL.LESION_APP_MAG
        SL.check_size(*_as_wh(size), mpp)  # before any folder is made
    mpp, app_mag = mpp or 0.5, app_mag or 20.0
    out = Path(out_dir)
    params = {
        "version": _VERSION,
        "n": n,
        "size": size,
        "seed": seed,
        "positive_fraction": positive_fraction,
        "mpp": mpp,
        "app_mag": app_mag,
    }
    if lesions != "none":  # the default's manifest stays as it was, so existing caches are reused
        params["lesions"] = lesions
    names = [f"slide_{i:03d}.svs" for i in range(n)]
    csv_path = out / "labels.csv"
    files = [*names, "lesions.json"] if lesions != "none" else names  # a lesion dataset is whole with its boxes
    if cached_dataset(out, params, files) is not None:
        return csv_path
    _make_out_dir(out)
    # Several processes (torchrun ranks, jobs sharing a cache) may start on a cold cache at once: one writes while
    # the others wait on the lock, then find the dataset complete and reuse it.
    with _locked(out / ".synth.lock"):
        if cached_dataset(out, params, files) is not None:
            return csv_path
        return _write_dataset(out, params, names, csv_path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; released when the process dies, so never stale."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _replace_text(path: Path, text: str) -> None:
    """Write through a temp file and os.replace: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_dataset(out: Path, params: dict[str, object], names: list[str], csv_path: Path) -> Path:
    n, seed = int(params["n"]), int(params["seed"])  # type: ignore[call-overload]
    positive_fraction, mpp, app_mag = params["positive_fraction"], params["mpp"], params["app_mag"]
    size = params["size"]
    (out / MANIFEST).unlink(missing_ok=True)  # the dataset is being rewritten: incomplete until the new manifest
    n_pos = int(round(n * positive_fraction))
    labels = np.array([1] * n_pos + [0] * (n - n_pos))
    np.random.default_rng(seed).shuffle(labels)
    rows = []
    # each slide is written under its own name in a private folder (the name is in its metadata), then renamed in
    staging = out / f".staging-{os.getpid()}"
    staging.mkdir(exist_ok=True)
    lesions = params.get("lesions", "none")
    boxes: dict[str, dict[str, Any]] = {}
    for i, (name, lab) in enumerate(zip(names, labels, strict=True)):
        tmp = staging / name
        scene = None
        if lesions != "none":
            import wsitrain.slides.synth.lesions as SL

            scene = SL.LesionScene(*_as_wh(size), bool(lab), seed * 100_003 + i, mpp,  # type: ignore[arg-type]
                                   paired=lesions == "paired")  # fmt: skip
            boxes[name] = {"label": "positive" if lab else "negative", "tissue_px": scene.tissue_px,
                           "boxes": scene.boxes}  # fmt: skip
        write_synthetic_slide(
            tmp, size=size, positive=bool(lab), seed=seed * 100_003 + i, mpp=mpp, app_mag=app_mag,  # type: ignore[arg-type]
            scene=scene,  # type: ignore[arg-type]
        )  # fmt: skip
        os.replace(tmp, out / name)
        rows.append({"slide": name, "label": "positive" if lab else "negative"})
    shutil.rmtree(staging, ignore_errors=True)
    if lesions != "none":
        SL.write_sidecar(out, boxes)
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=["slide", "label"], lineterminator="\r\n")
    wr.writeheader()
    wr.writerows(rows)
    _replace_text(csv_path, buf.getvalue())
    _replace_text(out / MANIFEST, json.dumps({"params": params, "slides": names}, indent=1))
    return csv_path
