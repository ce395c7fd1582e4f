"""Stream a slide region, chunk by chunk, into one preallocated uint8 CHW tensor (pageable unless asked to pin).

Slides are not pinned by default: PyTorch's pinned allocator rounds every request up to a power of two (a 9 GB
slide pins 16 GB) and keeps freed blocks cached by size class, so pinning slide after slide piles up page-locked
memory across an epoch. No transfer needs it either: a tiled first segment copies its tiles through the stager's
own page-locked buffers, and a plain first segment's whole-image copy registers the slide's pages for the
duration of that copy (``wsitrain.sft.execution.host_register``).

No full-size intermediate ever exists: each chunk is read (and, off a pyramid level, resized with PIL's
antialiased bilinear filter using absolute source coordinates, so chunks join without seams) and copied into
its place in the output, on ``read_threads`` threads at once. Peak host memory is the output plus a chunk buffer
per thread.

With ``mask_background`` the pixels outside the detected tissue (its thumbnail mask, dilated by
``tissue.MASK_DILATION_PX`` thumbnail px) are set to the background colour, and chunks wholly outside it are not
decoded: background becomes one constant colour, which the engine can compute once and reuse.
"""

from __future__ import annotations

import threading
import time
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from wsitrain.errors import SlideError
from wsitrain.sft.execution.spill import HostAllocator
from wsitrain.slides.augment import Geometry
from wsitrain.slides.pixels import ReadThreads, RegionMask, fill_region_masked, resolve_read_threads
from wsitrain.slides.readers import Background, SlideReader, open_slide
from wsitrain.slides.resolution import Resolution, choose_resolution
from wsitrain.slides.tissue import TissueResult, TissueSettings, detect_tissue, region_mask
from wsitrain.slides.tissue.pieces import Piece

REGIONS = ("whole", "tissue", "fixed")


@dataclass
class ReadResult:
    """A streamed region and how it was read. ``box`` is (x, y, w, h) in level-0 pixels of the whole image."""

    image: torch.Tensor  # uint8 (3, H, W), contiguous
    path: str
    level: int
    scale: float  # output px per level px (<= 1)
    downsample: float  # level-0 px per output px
    box: tuple[int, int, int, int]
    mpp: float | None
    bytes: int
    seconds: float
    tissue_box: tuple[int, int, int, int] | None = None
    pinned: bool = False
    threads: int = 1  # decoder threads the read used
    # mask_background: share of the output's pixels inside the dilated tissue mask (kept); None when masking was
    # off or no tissue was found (then nothing was masked).
    tissue_fraction: float | None = None
    chunks_decoded: int = 0  # chunks read from the slide
    chunks_skipped: int = 0  # chunks wholly outside the tissue mask: filled with the background colour, not decoded
    mask: RegionMask | None = None  # mask_background's tissue mask (None when masking was off or found nothing)
    geometry: Geometry = Geometry()  # the flips and turns augmentation applied to ``image`` after the read

    def map_mask(self, h: int, w: int) -> torch.Tensor | None:
        """(1, 1, h, w) bool: which cells of ``image`` split into h x w hold tissue, in the augmented image's frame
        (an attention pool's mask at its map's size); None without a tissue mask."""
        if self.mask is None:
            return None
        pre = (w, h) if self.geometry.k % 2 else (h, w)  # a quarter turn swapped the axes
        cells = torch.from_numpy(self.mask.cells(*pre))[None, None]
        return self.geometry.apply(cells).contiguous()

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mpx_per_s(self) -> float:
        """Output megapixels per second, the whole read included (open, tissue detection, decode, resize)."""
        px = self.image.shape[-1] * self.image.shape[-2]
        return px / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def _as_hw(size: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        h = w = size
    elif isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) for v in size):
        h, w = size
    else:
        raise SlideError(
            f"{name}: size {size!r} is not an int or (height, width)", hint="set data.size to e.g. 4096 or [4096, 6144]"
        )
    if h <= 0 or w <= 0:
        raise SlideError(f"{name}: size {size!r} must be positive", hint="set data.size to e.g. 4096")
    return int(h), int(w)


def _allocate(
    shape: tuple[int, int, int], pin_memory: bool, allocator: HostAllocator | None = None
) -> tuple[torch.Tensor, bool]:
    if allocator is not None:  # past engine.host_memory: a memory-mapped file in engine.spill_dir, never pinned
        return allocator.empty(shape, torch.uint8, "decoded slide"), False
    pin = bool(pin_memory)
    if pin and not torch.cuda.is_available():
        pin = False  # pinning needs a CUDA driver; asking for it on a CPU machine is not an error
    if pin:
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as e:  # pinned memory is a limited resource: train slower rather than fail
            warnings.warn(f"could not pin {shape} uint8 ({e}); using pageable memory", stacklevel=3)
    return torch.empty(shape, dtype=torch.uint8), False


# Tissue detections by (path, size, mtime, background): a single-level slide's thumbnail costs a full read, so a
# slide read every epoch detects its tissue once per process. Masks are kept bit-packed and zlib-compressed (a
# 512 px thumbnail's mask: a few KB), least recently used dropped first past either bound.
_TISSUE_CACHE: OrderedDict[tuple[str, int, int, Background, TissueSettings], _StoredTissue] = OrderedDict()
_TISSUE_CACHE_ENTRIES = 10000
_TISSUE_CACHE_BYTES = 64 * 2**20
_TISSUE_LOCK = threading.Lock()  # slides are read on the prefetch thread and the main thread


@dataclass(frozen=True)
class _StoredTissue:
    packed: bytes
    shape: tuple[int, int]
    downsample: float
    box: tuple[int, int, int, int] | None
    threshold: int
    pieces: tuple[Piece, ...]
    mpp: float | None
    mpp_assumed: bool
    min_fragment_mm2: float

    @classmethod
    def of(cls, t: TissueResult) -> _StoredTissue:
        packed = zlib.compress(np.packbits(t.mask.astype(bool)).tobytes(), 1)
        return cls(packed, (int(t.mask.shape[0]), int(t.mask.shape[1])), t.downsample, t.box, t.threshold,
                   t.pieces, t.mpp, t.mpp_assumed, t.min_fragment_mm2)  # fmt: skip

    def result(self) -> TissueResult:
        bits = np.frombuffer(zlib.decompress(self.packed), dtype=np.uint8)
        mask = np.unpackbits(bits, count=self.shape[0] * self.shape[1]).astype(bool).reshape(self.shape)
        return TissueResult(mask=mask, downsample=self.downsample, box=self.box, threshold=self.threshold,
                            pieces=self.pieces, mpp=self.mpp, mpp_assumed=self.mpp_assumed,
                            min_fragment_mm2=self.min_fragment_mm2)  # fmt: skip


def _tissue(reader: SlideReader, settings: TissueSettings | None = None) -> TissueResult:
    """``detect_tissue(reader, settings=settings)``, once per slide file, background colour and settings in this
    process."""
    settings = settings if settings is not None else TissueSettings()
    st = reader.path.stat()
    key = (str(reader.path.resolve()), st.st_size, st.st_mtime_ns, reader.background, settings)
    with _TISSUE_LOCK:
        stored = _TISSUE_CACHE.get(key)
        if stored is not None:
            _TISSUE_CACHE.move_to_end(key)
            return stored.result()
    # outside the lock: another thread's detection does not wait for this one
    result = detect_tissue(reader, settings=settings)
    with _TISSUE_LOCK:
        _TISSUE_CACHE[key] = _StoredTissue.of(result)
        _TISSUE_CACHE.move_to_end(key)
        total = sum(len(v.packed) for v in _TISSUE_CACHE.values())
        while len(_TISSUE_CACHE) > 1 and (len(_TISSUE_CACHE) > _TISSUE_CACHE_ENTRIES or total > _TISSUE_CACHE_BYTES):
            total -= len(_TISSUE_CACHE.popitem(last=False)[1].packed)
    return result


def _tissue_box(reader: SlideReader, settings: TissueSettings | None = None) -> tuple[int, int, int, int] | None:
    return _tissue(reader, settings).box


def read_slide_region(
    path: str | Path | SlideReader,
    *,
    level: int | None = None,
    mpp: float | None = None,
    magnification: float | None = None,
    fallback_mpp: float | None = None,
    region: str = "whole",
    size: int | tuple[int, int] | None = None,
    background: Background = (255, 255, 255),
    pad_multiple: int = 1,
    pin_memory: bool = False,
    chunk: int = 4096,
    read_threads: ReadThreads | None = "auto",
    mask_background: bool = False,
    tissue_settings: TissueSettings | None = None,
    allocator: HostAllocator | None = None,
) -> ReadResult:
    """Read a slide region at the chosen resolution into a (3, H, W) uint8 tensor.

    ``region``: "whole" (the slide), "tissue" (bounding box of detected tissue; the whole slide when none is found)
    or "fixed" (``size`` = int or (h, w) output px centred on the tissue: cropped when tissue is larger, padded with
    ``background`` when smaller). The output is padded at the right and bottom to a multiple of ``pad_multiple``.
    ``read_threads``: chunks decoded at once (a positive int, or "auto": the process's cores, at most 8).
    ``mask_background``: set the pixels outside the detected tissue (dilated by ``tissue.MASK_DILATION_PX``
    thumbnail px) to the background colour, and skip decoding chunks wholly outside it; when no tissue is found
    nothing is masked (``tissue_fraction`` None). Off, the read is exactly what it always was.
    ``tissue_settings``: how the detector keeps pieces (data.tissue; None: its defaults).
    ``allocator``: where the decoded region lives when not in RAM (``sft.execution.spill.SpillFiles``: a
    memory-mapped file in engine.spill_dir; the bytes are the same, only their home differs).
    """
    t0 = time.perf_counter()
    own = not isinstance(path, SlideReader)
    _check_read_args(read_threads, mask_background)
    reader = open_slide(path, background) if own else path  # type: ignore[arg-type]
    try:
        lay = layout_read(reader, level=level, mpp=mpp, magnification=magnification, fallback_mpp=fallback_mpp,
                          region=region, size=size, pad_multiple=pad_multiple,
                          mask_background=mask_background, tissue_settings=tissue_settings)  # fmt: skip
        out, pinned = _allocate((3, *lay.shape), pin_memory, allocator)
        res = lay.res
        filled = fill_region_masked(reader, out, res.level, res.scale, lay.origin, lay.mask, chunk, read_threads)
        return lay.result(out, reader, time.perf_counter() - t0, pinned, filled.threads, filled.decoded,
                          filled.skipped)  # fmt: skip
    finally:
        if own:
            reader.close()


def _check_read_args(read_threads: ReadThreads | None, mask_background: bool) -> None:
    resolve_read_threads(read_threads)  # a bad value fails before the slide is opened
    if not isinstance(mask_background, bool):
        raise SlideError(
            f"mask_background {mask_background!r} is not true or false", hint="set data.mask_background: true or false"
        )


@dataclass(frozen=True)
class ReadLayout:
    """Where a read's pixels come from: the one arithmetic shared by the whole-image read (``read_slide_region``)
    and the region-by-region read (``wsitrain.slides.tile_source``), so both give the same pixels."""

    res: Resolution
    shape: tuple[int, int]  # (H, W) output px, padded to pad_multiple
    origin: tuple[float, float]  # the output's top-left corner in level px
    box: tuple[int, int, int, int]  # (x, y, w, h) level-0 px
    tissue_box: tuple[int, int, int, int] | None
    mask: RegionMask | None

    def result(
        self, image: torch.Tensor, reader: SlideReader, seconds: float, pinned: bool = False, threads: int = 1,
        decoded: int = 0, skipped: int = 0,
    ) -> ReadResult:  # fmt: skip
        """The ``ReadResult`` of this layout with ``image`` (a tensor, or a region source standing in for one)."""
        h, w = self.shape
        return ReadResult(
            image=image,
            path=str(reader.path),
            level=self.res.level,
            scale=self.res.scale,
            downsample=self.res.downsample,
            box=self.box,
            mpp=self.res.mpp,
            bytes=3 * h * w,
            seconds=seconds,
            tissue_box=self.tissue_box,
            pinned=pinned,
            threads=threads,
            tissue_fraction=None if self.mask is None else self.mask.fraction(),
            mask=self.mask,
            chunks_decoded=decoded,
            chunks_skipped=skipped,
        )


def layout_read(
    reader: SlideReader,
    *,
    level: int | None = None,
    mpp: float | None = None,
    magnification: float | None = None,
    fallback_mpp: float | None = None,
    region: str = "whole",
    size: int | tuple[int, int] | None = None,
    pad_multiple: int = 1,
    mask_background: bool = False,
    tissue_settings: TissueSettings | None = None,
) -> ReadLayout:
    """The layout ``read_slide_region`` reads with these arguments (resolution, size, origin, tissue mask)."""
    info = reader.info
    name = info.name
    if region not in REGIONS:
        raise SlideError(f"{name}: region {region!r} is not one of {', '.join(REGIONS)}", hint="set data.region")
    if not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise SlideError(
            f"pad_multiple {pad_multiple!r} must be a positive int", hint="use the model's stride, e.g. 32"
        )
    if region == "fixed" and size is None:
        raise SlideError(f"{name}: region 'fixed' needs a size", hint="set data.size, e.g. 4096 or [4096, 6144]")
    if region != "fixed" and size is not None:
        raise SlideError(
            f"{name}: size {size!r} is only used with region 'fixed' (got {region!r})",
            hint="set data.region: fixed, or remove data.size",
        )
    res: Resolution = choose_resolution(info, level=level, mpp=mpp, magnification=magnification,
                                        fallback_mpp=fallback_mpp)  # fmt: skip
    w0, h0 = info.dimensions
    tissue = _tissue(reader, tissue_settings) if region in ("tissue", "fixed") or mask_background else None
    tissue_box = tissue.box if tissue is not None and region in ("tissue", "fixed") else None
    ds = res.downsample
    if region == "fixed":
        assert size is not None
        oh, ow = _as_hw(size, name)
        cx, cy = (
            (w0 / 2, h0 / 2)
            if tissue_box is None
            else (tissue_box[0] + tissue_box[2] / 2, tissue_box[1] + tissue_box[3] / 2)
        )
        bx, by = cx - ow * ds / 2, cy - oh * ds / 2
    else:
        bx, by, bw, bh = (0, 0, w0, h0) if region == "whole" or tissue_box is None else tissue_box
        ow, oh = max(1, int(round(bw / ds))), max(1, int(round(bh / ds)))
    ow = -(-ow // pad_multiple) * pad_multiple
    oh = -(-oh // pad_multiple) * pad_multiple
    ds_level = info.level_downsamples[res.level]
    if res.scale >= 1.0:  # snap to the level grid so no resampling happens
        bx, by = round(bx / ds_level) * ds_level, round(by / ds_level) * ds_level
    mask = None
    if mask_background:
        assert tissue is not None
        mask = region_mask(tissue, (w0, h0), (bx, by), ds, (oh, ow), reader.background)
    box = (int(round(bx)), int(round(by)), int(round(ow * ds)), int(round(oh * ds)))
    return ReadLayout(res, (oh, ow), (bx / ds_level, by / ds_level), box, tissue_box, mask)
