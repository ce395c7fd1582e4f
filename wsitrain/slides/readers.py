"""One small interface over two slide readers: OpenSlide for every format it opens, tifffile for other TIFFs.

``open_slide(path)`` returns a ``SlideReader``. Coordinates given to ``read_region`` are pixels *of the chosen
level* (not level 0, unlike OpenSlide's own API): chunked streaming works in one level's pixel grid. Pixels outside
the slide, and transparent pixels (alpha 0 in OpenSlide's premultiplied ARGB), come back as the background colour,
never black. Handles are opened lazily: a pickled reader (sent to a worker process) reopens its file on first use.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.errors import SlideError
from wsitrain.slides.metadata import SlideInfo

Background = tuple[int, int, int]
WHITE: Background = (255, 255, 255)

_FORMATS_HINT = (
    "wsitrain reads what OpenSlide reads (svs, ndpi, mrxs, scn, vms, vmu, bif, tiled TIFF, ...) and plain or OME "
    "TIFF through tifffile; check that the file is complete (copy or re-export it again)"
)


def _check_background(background: Any) -> Background:
    try:
        bg = tuple(int(v) for v in background)
    except (TypeError, ValueError):
        bg = ()
    if len(bg) != 3 or not all(0 <= v <= 255 for v in bg):
        raise SlideError(
            f"background {background!r} is not an RGB colour", hint="give three integers 0-255, e.g. [255, 255, 255]"
        )
    return bg  # type: ignore[return-value]


class SlideReader:
    """Base class: lazily opened handle, level-pixel ``read_region``, context manager, picklable."""

    reader_name = "base"

    def __init__(self, path: str | Path, background: Background = WHITE) -> None:
        self.path = Path(path)
        self.background = _check_background(background)
        self._handle: Any = None
        self._info: SlideInfo | None = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _open(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def _close_handle(self, handle: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _make_info(self, handle: Any) -> SlideInfo:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def handle(self) -> Any:
        # A lock because the prefetch thread and the main thread may share a reader.
        with self._lock:
            if self._handle is None:
                self._handle = self._open()
            return self._handle

    @property
    def info(self) -> SlideInfo:
        if self._info is None:
            self._info = self._make_info(self.handle)
        return self._info

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._close_handle(self._handle)
                self._handle = None

    def __enter__(self) -> SlideReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Native handles cannot cross a process boundary; the copy reopens its file on first use.
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass

    # -- pixels ----------------------------------------------------------------------------------------------
    def read_region(self, level: int, x: int, y: int, w: int, h: int) -> np.ndarray:
        """RGB uint8 array (h, w, 3) of the level-``level`` pixels starting at (x, y) in that level's grid."""
        info = self.info
        if not 0 <= level < info.level_count:
            raise SlideError(
                f"{self.path.name}: level {level} does not exist (the slide has {info.level_count})",
                hint=f"choose a level from 0 to {info.level_count - 1}",
            )
        if w <= 0 or h <= 0:
            raise SlideError(f"{self.path.name}: region {w}x{h} is empty", hint="ask for a positive width and height")
        return self._read(level, int(x), int(y), int(w), int(h))

    def _read(self, level: int, x: int, y: int, w: int, h: int) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def read_into(self, level: int, x: int, y: int, out: torch.Tensor) -> None:
        """Read the region of ``out``'s size at (x, y) straight into ``out`` (a uint8 (3, h, w) tensor view)."""
        _, h, w = out.shape
        out.copy_(torch.from_numpy(self.read_region(level, x, y, w, h)).permute(2, 0, 1))


# ---------------------------------------------------------------------------------------------------------------
class OpenSlideReader(SlideReader):
    """Any format OpenSlide opens. Reads go straight into a numpy buffer (no PIL image per region).

    One handle serves every chunk thread without a lock: OpenSlide documents its handles as thread-safe for reads
    (and its tile cache as shared safely), and ctypes releases the GIL during the C call, so chunks decode in parallel.
    """

    reader_name = "openslide"

    def _open(self) -> Any:
        import openslide

        try:
            slide = openslide.OpenSlide(str(self.path))
        except (openslide.OpenSlideError, OSError) as e:
            raise SlideError(f"{self.path}: OpenSlide cannot read it ({e})", hint=_FORMATS_HINT) from e
        cache = _shared_cache()
        if cache is not None:
            slide.set_cache(cache)
        return slide

    def _close_handle(self, handle: Any) -> None:
        handle.close()

    def _make_info(self, handle: Any) -> SlideInfo:
        props = handle.properties
        mpp = None
        try:
            if "openslide.mpp-x" in props and "openslide.mpp-y" in props:
                mpp = (float(props["openslide.mpp-x"]), float(props["openslide.mpp-y"]))
                if not (mpp[0] > 0 and mpp[1] > 0):
                    mpp = None
        except ValueError:
            mpp = None
        try:
            power = float(props["openslide.objective-power"]) if "openslide.objective-power" in props else None
        except ValueError:
            power = None
        return SlideInfo(
            path=str(self.path),
            reader=self.reader_name,
            vendor=props.get("openslide.vendor"),
            dimensions=tuple(handle.dimensions),
            level_count=handle.level_count,
            level_dimensions=tuple(tuple(d) for d in handle.level_dimensions),
            level_downsamples=tuple(float(d) for d in handle.level_downsamples),
            mpp=mpp,
            objective_power=power if power and power > 0 else None,
            associated_images=sorted(handle.associated_images.keys()),
        )

    def _raw_bgra(self, level: int, x: int, y: int, w: int, h: int) -> np.ndarray | None:
        """Premultiplied pixels as (h, w, 4) bytes in B, G, R, A order, or None when the fast path is missing."""
        from openslide import lowlevel

        raw = getattr(lowlevel, "_read_region", None)
        if raw is None or not np.little_endian:
            return None
        ds = self.info.level_downsamples[level]
        # OpenSlide's C call fills our own buffer: no PIL image, no un-premultiply pass, no RGBA copy.
        buf = np.empty((h, w), dtype=np.uint32)
        raw(
            self.handle._osr,
            buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
            *self._level0(level, ds, x, y),
            level,
            w,
            h,
        )
        return buf.view(np.uint8).reshape(h, w, 4)

    @staticmethod
    def _level0(level: int, ds: float, x: int, y: int) -> tuple[int, int]:
        return int(round(x * ds)), int(round(y * ds))

    def _read(self, level: int, x: int, y: int, w: int, h: int) -> np.ndarray:
        bgra = self._raw_bgra(level, x, y, w, h)
        if bgra is None:
            x0, y0 = self._level0(level, self.info.level_downsamples[level], x, y)
            img = np.asarray(self.handle.read_region((x0, y0), level, (w, h)))  # RGBA, not premultiplied
            return _composite_straight(img, self.background)
        out = np.empty((h, w, 3), dtype=np.uint8)
        _composite_premultiplied(bgra, [out[..., c] for c in range(3)], self.background)
        return out

    def read_into(self, level: int, x: int, y: int, out: torch.Tensor) -> None:
        _, h, w = out.shape
        bgra = (
            self._raw_bgra(level, x, y, w, h)
            if out.device.type == "cpu" and 0 <= level < self.info.level_count
            else None
        )
        if bgra is None:
            super().read_into(level, x, y, out)
            return
        dst = out.numpy()  # a view: channels are written straight into the (possibly pinned) output
        _composite_premultiplied(bgra, [dst[c] for c in range(3)], self.background)


def _composite_premultiplied(bgra: np.ndarray, dst: list[np.ndarray], bg: Background) -> None:
    """Write R, G, B of premultiplied BGRA into ``dst``: colour + background * (1 - alpha), so transparent pixels
    become ``bg``, not black."""
    alpha = bgra[..., 3]
    if alpha.min() == 255:  # the usual case inside a scanned area: plain channel copies
        for c in range(3):
            dst[c][...] = bgra[..., 2 - c]
        return
    inv = (255 - alpha).astype(np.uint16)
    for c in range(3):
        val = bgra[..., 2 - c].astype(np.uint16) + (inv * bg[c] + 127) // 255
        np.minimum(val, 255, out=val)
        dst[c][...] = val


_CACHE: Any = None
# Streaming reads each tile about once, so a big per-slide tile cache (OpenSlide's default: 32 MiB for every open
# slide) only adds host memory; one small cache shared by all slides keeps tiles that straddle chunk edges.
CACHE_BYTES = 16 * 2**20


def _shared_cache() -> Any:
    global _CACHE
    if _CACHE is None:
        try:
            import openslide

            _CACHE = openslide.OpenSlideCache(CACHE_BYTES)
        except Exception:  # OpenSlide < 4.0 has no shareable caches: keep its default
            _CACHE = False
    return _CACHE or None


def _composite_straight(rgba: np.ndarray, bg: Background) -> np.ndarray:
    """Straight (non-premultiplied) RGBA or RGB onto ``bg``."""
    if rgba.ndim == 2:
        rgba = rgba[..., None]
    if rgba.shape[-1] in (1, 2):  # gray or gray+alpha
        gray = rgba[..., :1]
        rgba = np.concatenate([gray, gray, gray] + ([rgba[..., 1:2]] if rgba.shape[-1] == 2 else []), axis=-1)
    if rgba.shape[-1] == 3:
        return np.ascontiguousarray(rgba, dtype=np.uint8)
    a = rgba[..., 3:4].astype(np.uint16)
    if int(a.min()) == 255:
        return np.ascontiguousarray(rgba[..., :3])
    rgb = rgba[..., :3].astype(np.uint16)
    bgv = np.asarray(bg, dtype=np.uint16)
    return ((rgb * a + bgv * (255 - a) + 127) // 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------------
class TiffFileReader(SlideReader):
    """Plain, tiled, pyramidal or OME TIFFs that OpenSlide rejects, read with tifffile.

    Tiled levels decode only the tiles a region touches. Untiled (strip) levels are memory-mapped when stored
    uncompressed, else decoded once and kept for the life of the handle (such files are small in practice).
    """

    reader_name = "tifffile"

    def __init__(self, path: str | Path, background: Background = WHITE) -> None:
        super().__init__(path, background)
        self._cache: dict[int, np.ndarray] = {}
        # Chunks read on several threads may all miss the decoded-level cache at once: one decodes, the others wait.
        # Not ``_lock``: filling the cache opens the handle, which takes ``_lock`` (not reentrant).
        self._cache_lock = threading.Lock()

    def _open(self) -> Any:
        import tifffile

        try:
            tif = tifffile.TiffFile(str(self.path))
            _ = tif.series[0].levels  # parse now so a broken file fails here, not mid-read
        except Exception as e:  # tifffile raises many kinds for corrupt files
            raise SlideError(f"{self.path}: tifffile cannot read it ({e})", hint=_FORMATS_HINT) from e
        return tif

    def _close_handle(self, handle: Any) -> None:
        handle.close()
        self._cache.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = {}
        state["_cache_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cache_lock = threading.Lock()

    def _levels(self) -> list[Any]:
        return list(self.handle.series[0].levels)

    def _level_layout(self, level: int) -> tuple[Any, int, int, int, str]:
        """(series level, width, height, samples, axes) with only Y, X and S axes left."""
        lv = self._levels()[level]
        axes = lv.axes.upper()
        shape = dict(zip(axes, lv.shape, strict=True))
        extra = [a for a in axes if a not in "YXS" and shape[a] != 1]
        if extra:
            raise SlideError(
                f"{self.path.name}: TIFF axes {lv.axes} {lv.shape} have more than one image plane",
                hint="export one 2-D RGB or grayscale plane per file (no Z, T or C stacks)",
            )
        if lv.dtype != np.uint8:
            raise SlideError(
                f"{self.path.name}: TIFF pixels are {lv.dtype}, not 8-bit",
                hint="convert the slide to 8-bit RGB (e.g. with vips or tifffile) before training",
            )
        return lv, shape["X"], shape["Y"], shape.get("S", 1), axes

    def _make_info(self, handle: Any) -> SlideInfo:
        levels = []
        for i in range(len(self._levels())):
            _lv, w, h, _s, _axes = self._level_layout(i)
            levels.append((int(w), int(h)))
        w0, h0 = levels[0]
        page = handle.series[0].levels[0].keyframe
        mpp, power = _tiff_mpp_and_power(handle, page)
        return SlideInfo(
            path=str(self.path),
            reader=self.reader_name,
            vendor="ome-tiff" if handle.is_ome else "tiff",
            dimensions=(w0, h0),
            level_count=len(levels),
            level_dimensions=tuple(levels),
            level_downsamples=tuple(float((w0 / w + h0 / h) / 2) for w, h in levels),
            mpp=mpp,
            objective_power=power,
            associated_images=[],
        )

    def _read(self, level: int, x: int, y: int, w: int, h: int) -> np.ndarray:
        lv, lw, lh, samples, axes = self._level_layout(level)
        out = np.empty((h, w, 3), dtype=np.uint8)
        out[...] = np.asarray(self.background, dtype=np.uint8)
        # Intersection of the request with the level; the rest stays background.
        ix0, iy0, ix1, iy1 = max(x, 0), max(y, 0), min(x + w, lw), min(y + h, lh)
        if ix0 >= ix1 or iy0 >= iy1:
            return out
        page = lv.keyframe
        single_page = len(lv.pages) == 1
        if single_page and page.is_tiled and page.planarconfig == 1 and axes.replace("S", "") == "YX":
            block = self._read_tiles(page, ix0, iy0, ix1, iy1, samples)
        else:
            block = self._level_array(level, axes)[iy0:iy1, ix0:ix1]
        out[iy0 - y : iy1 - y, ix0 - x : ix1 - x] = _composite_straight(block, self.background)
        return out

    def _level_array(self, level: int, axes: str) -> np.ndarray:
        with self._cache_lock:
            return self._level_array_locked(level, axes)

    def _level_array_locked(self, level: int, axes: str) -> np.ndarray:
        if level not in self._cache:
            lv = self._levels()[level]
            try:
                arr = lv.asarray(out="memmap") if lv.keyframe.is_memmappable else lv.asarray()
            except Exception:
                arr = lv.asarray()
            keep = [a for a in axes if a in "YXS"]
            arr = arr.reshape([lv.shape[i] for i, a in enumerate(axes) if a in "YXS"])
            if keep and keep[0] == "S":  # planar RGB: samples first
                arr = np.moveaxis(arr, 0, -1)
            self._cache[level] = arr
        return self._cache[level]

    def _read_tiles(self, page: Any, x0: int, y0: int, x1: int, y1: int, samples: int) -> np.ndarray:
        th, tw = page.tilelength, page.tilewidth
        ntx = -(-page.imagewidth // tw)
        block = np.empty((y1 - y0, x1 - x0, samples), dtype=np.uint8)
        fh = self.handle.filehandle
        decode = page.decode
        for ty in range(y0 // th, (y1 - 1) // th + 1):
            for tx in range(x0 // tw, (x1 - 1) // tw + 1):
                idx = ty * ntx + tx
                offset, count = page.dataoffsets[idx], page.databytecounts[idx]
                if count == 0:  # sparse tile never written: background
                    tile = np.full((th, tw, samples), 255, dtype=np.uint8)
                else:
                    # One file position is shared by every thread reading this handle (the prefetch thread and
                    # the chunk threads): only the seek and the read of the compressed bytes are serialised; the
                    # decode, the expensive part, runs outside the lock and in parallel.
                    with self._lock:
                        fh.seek(offset)
                        data = fh.read(count)
                    seg, _indices, _shape = decode(data, idx, jpegtables=page.jpegtables)
                    tile = np.asarray(seg).reshape(th, tw, samples)
                # This tile's part of the requested block.
                sy0, sx0 = max(y0, ty * th), max(x0, tx * tw)
                sy1, sx1 = min(y1, (ty + 1) * th), min(x1, (tx + 1) * tw)
                block[sy0 - y0 : sy1 - y0, sx0 - x0 : sx1 - x0] = tile[
                    sy0 - ty * th : sy1 - ty * th, sx0 - tx * tw : sx1 - tx * tw
                ]
        return block


def _tiff_mpp_and_power(tif: Any, page: Any) -> tuple[tuple[float, float] | None, float | None]:
    """mpp from OME PhysicalSize or the resolution tags; objective power from OME NominalMagnification."""
    power = None
    if tif.is_ome and tif.ome_metadata:
        xml = tif.ome_metadata
        mx = re.search(r'PhysicalSizeX="([0-9.eE+-]+)"', xml)
        my = re.search(r'PhysicalSizeY="([0-9.eE+-]+)"', xml)
        unit = re.search(r'PhysicalSizeXUnit="([^"]+)"', xml)
        mag = re.search(r'NominalMagnification="([0-9.eE+-]+)"', xml)
        power = float(mag.group(1)) if mag else None
        scale = {"µm": 1.0, "um": 1.0, "nm": 1e-3, "mm": 1e3}.get(unit.group(1) if unit else "µm")
        if mx and scale is not None:
            mppx = float(mx.group(1)) * scale
            mppy = float(my.group(1)) * scale if my else mppx
            if mppx > 0 and mppy > 0:
                return (mppx, mppy), power
    tags = page.tags
    unit_tag = tags.get("ResolutionUnit")
    xr, yr = tags.get("XResolution"), tags.get("YResolution")
    if unit_tag is None or xr is None or yr is None:
        return None, power
    microns = {2: 25400.0, 3: 10000.0}.get(int(unit_tag.value))
    if microns is None:
        return None, power

    def per_unit(v: Any) -> float:
        return v[0] / v[1] if isinstance(v, tuple) and v[1] else float(v if not isinstance(v, tuple) else 0)

    rx, ry = per_unit(xr.value), per_unit(yr.value)
    if rx <= 0 or ry <= 0:
        return None, power
    mpp = (microns / rx, microns / ry)
    # Screen defaults (72 or 96 dpi, ~265-350 um) are not a microscope's resolution: treat as unknown.
    if mpp[0] > 50:
        return None, power
    return mpp, power


def open_slide(path: str | Path, background: Background = WHITE) -> SlideReader:
    """Open ``path`` with OpenSlide, or with tifffile when OpenSlide rejects a TIFF; ``SlideError`` otherwise."""
    p = Path(path)
    if not p.exists():
        raise SlideError(f"{p}: no such slide file", hint="check the path (and the data.slides_dir it is relative to)")
    if p.is_dir():
        raise SlideError(
            f"{p}: is a folder, not a slide file", hint="point to the slide file itself (for MRXS, the .mrxs file)"
        )
    reader: SlideReader = OpenSlideReader(p, background)
    try:
        _ = reader.info
        return reader
    except SlideError as first:
        reader.close()
        openslide_reason = str(first.__cause__ or first.message)
    tiff = TiffFileReader(p, background)
    try:
        _ = tiff.info
        return tiff
    except SlideError as second:
        tiff.close()
        tiff_reason = str(second.__cause__ or second.message)
    raise SlideError(
        f"{p.name}: not a readable slide (OpenSlide: {openslide_reason}; tifffile: {tiff_reason}) [{p}]",
        hint=_FORMATS_HINT,
    )


def read_whole(path: str | Path, level: int = 0, background: Background = WHITE) -> np.ndarray:
    """The whole of one level of a slide as (H, W, 3) uint8 RGB, transparency on ``background``: for small slides
    (the benchmark's and the tests'), a whole level in memory."""
    with open_slide(path, background) as reader:
        w, h = reader.info.level_dimensions[level]
        return reader.read_region(level, 0, 0, w, h)
