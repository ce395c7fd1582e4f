"""Read throughput of one slide region on 1 and 2 (or more) decoder threads, against OpenSlide's one-call read.

    python scripts/bench_read.py                       # writes an 8192 x 8192 JPEG-tiled TIFF in a temp folder
    python scripts/bench_read.py --size 4096 --compression zlib --runs 5
    python scripts/bench_read.py --slide path/to/slide.svs

Each configuration is read ``--runs`` times after one warm-up read (which fills the page cache, so the figures are
decoding, not the disk); the best and the median Mpx/s are printed. The threaded reads must give the same bytes as
the one-thread read, and the script says so. Readers: wsitrain's OpenSlide reader and tifffile reader (chunks via
``fill_region``) and ``openslide.OpenSlide.read_region`` of the whole area in one call (one thread, RGBA via PIL).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from wsitrain.slides.pixels import available_cores, fill_region
from wsitrain.slides.readers import OpenSlideReader, SlideReader, TiffFileReader


def write_synthetic(path: Path, size: int, compression: str, tile: int = 256) -> None:
    """A tiled RGB TIFF with smooth colour and fine noise: JPEG compresses it about as much as H&E tissue."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.empty((size, size, 3), dtype=np.uint8)
    for c, f in enumerate((7.0, 11.0, 13.0)):
        band = 150 + 60 * np.sin(f * xx + c) * np.cos(f * yy - c) + rng.normal(0, 12, (size, size))
        img[..., c] = np.clip(band, 0, 255).astype(np.uint8)
    del yy, xx
    import tifffile

    kwargs = {"compressionargs": {"level": 90}} if compression == "jpeg" else {}
    tifffile.imwrite(path, img, tile=(tile, tile), compression=compression, photometric="rgb", **kwargs)


def timed(fn: Callable[[], None], runs: int) -> list[float]:
    fn()  # warm-up: page cache, OpenSlide's tile index, imports
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_reader(reader: SlideReader, threads: list[int], runs: int, chunk: int) -> dict[int, list[float]]:
    w, h = reader.info.dimensions
    results: dict[int, list[float]] = {}
    first: torch.Tensor | None = None
    for n in threads:
        out = torch.empty((3, h, w), dtype=torch.uint8)
        results[n] = timed(lambda out=out, n=n: fill_region(reader, out, 0, 1.0, (0, 0), chunk, n), runs)
        if first is None:
            first = out
        elif not torch.equal(first, out):
            raise SystemExit(f"{reader.reader_name}: {n} threads read different bytes from {threads[0]}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slide", type=Path, help="a slide to read (default: write a synthetic tiled TIFF)")
    ap.add_argument("--size", type=int, default=8192, help="synthetic slide side in px")
    ap.add_argument("--compression", default="jpeg", choices=("jpeg", "zlib"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024, help="chunk side in px (fill_region's unit of work)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.slide
        if path is None:
            path = Path(tmp) / f"synthetic-{args.size}-{args.compression}.tif"
            t0 = time.perf_counter()
            write_synthetic(path, args.size, args.compression)
            print(f"wrote {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
        print(f"cores available: {available_cores()}; torch intra-op threads: {torch.get_num_threads()}; "
              f"chunk {args.chunk} px; best and median of {args.runs} runs after a warm-up")
        readers: list[SlideReader] = [OpenSlideReader(path)]
        if path.suffix.lower() in (".tif", ".tiff"):
            readers.append(TiffFileReader(path))
        for reader in readers:
            try:
                w, h = reader.info.dimensions
            except Exception as e:  # e.g. OpenSlide rejects a plain TIFF
                print(f"{reader.reader_name}: cannot read ({e})")
                continue
            mpx = w * h / 1e6
            res = bench_reader(reader, args.threads, args.runs, args.chunk)
            base = min(res[args.threads[0]])
            for n, secs in res.items():
                print(f"{reader.reader_name:>9} fill_region {n} thread(s): {mpx / min(secs):7.1f} Mpx/s best, "
                      f"{mpx / statistics.median(secs):7.1f} median; speed-up {base / min(secs):.2f}x "
                      f"({w} x {h} px, bytes identical)")
            if isinstance(reader, OpenSlideReader):
                slide = reader.handle
                secs = timed(lambda slide=slide, w=w, h=h: slide.read_region((0, 0), 0, (w, h)), args.runs)
                print(f"openslide read_region, one call: {mpx / min(secs):7.1f} Mpx/s best, "
                      f"{mpx / statistics.median(secs):7.1f} median")
            reader.close()


if __name__ == "__main__":
    main()
