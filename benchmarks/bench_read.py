"""Read throughput of one slide region on 1 and 2 (or more) decoder threads, against OpenSlide's one-call read.

    python benchmarks/bench_read.py                       # writes an 8192 x 8192 JPEG-tiled TIFF in a temp folder
    python benchmarks/bench_read.py --size 4096 --compression zlib --runs 5
    python benchmarks/bench_read.py --slide path/to/slide.svs

Each configuration is read ``--runs`` times after one warm-up read (which fills the page cache, so the figures are
decoding, not the disk); the best and the median Mpx/s are printed. The threaded reads must give the same bytes as
the one-thread read, and the script says so. Readers: wsitrain's OpenSlide reader and tifffile reader (chunks via
``fill_region``), ``openslide.OpenSlide.read_region`` of the whole area in one call (one thread, RGBA via PIL), and
pyvips (libvips' own TIFF loader and thread pool, the file opened and decoded whole per read, its cache off) when
``import pyvips`` works. ``measure`` returns the figures as rows (benchmarks/bench_throughput.py reports them too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.slides.pixels import available_cores, fill_region
from wsitrain.slides.readers import OpenSlideReader, SlideReader, TiffFileReader

PAGE = "docs/benchmarks/read_throughput.md"  # where this script's figures are documented (named in --help)


def write_synthetic(path: Path, size: int, compression: str, tile: int = 256) -> None:
    """A tiled RGB TIFF with smooth colour and fine noise: JPEG compresses it about as much as H&E tissue."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.empty((size, size, 3), dtype=np.uint8)
    for c, f in enumerate((7.0, 11.0, 13.0)):
        band = 150 + 60 * np.sin(f * xx + c) * np.cos(f * yy - c) + rng.normal(0, 12, (size, size))
        img[..., c] = np.clip(band, 0, 255).astype(np.uint8)
    del yy, xx
    write_tiff(path, img, compression, tile)


def write_tiff(path: Path, img: np.ndarray, compression: str, tile: int = 256) -> None:
    """``img`` (H, W, 3) uint8 as a tiled RGB TIFF (JPEG at quality 90, or zlib)."""
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


def pyvips_or_reason() -> tuple[Any, str | None]:
    """The pyvips module, or None and why it cannot be used (it is optional: ``pip install pyvips-binary pyvips``)."""
    try:
        import pyvips
    except Exception as e:  # ImportError, or an OSError when the module is there but libvips is not
        return None, f"{type(e).__name__}: {e}"
    return pyvips, None


def bench_pyvips(pyvips: Any, path: Path, threads: list[int], runs: int) -> dict[int, tuple[list[float], torch.Tensor]]:
    """Seconds per whole-area read with libvips on ``n`` threads (``concurrency_set``), and the bytes read (3, H, W).

    Each read opens the file and decodes every tile (libvips' operation cache is off, so no run reuses another's
    pixels); libvips runs its own thread pool, not ``fill_region``."""
    pyvips.cache_set_max(0)
    before = pyvips.concurrency_get()
    results: dict[int, tuple[list[float], torch.Tensor]] = {}
    try:
        for n in threads:
            pyvips.concurrency_set(n)
            got: list[bytes] = []

            def read(got: list[bytes] = got) -> None:
                img = pyvips.Image.new_from_file(str(path), access="sequential")
                got[:] = [img.extract_band(0, n=3).write_to_memory()]

            secs = timed(read, runs)
            img = pyvips.Image.new_from_file(str(path))
            hwc = np.frombuffer(got[0], dtype=np.uint8).reshape(img.height, img.width, 3)
            results[n] = (secs, torch.from_numpy(hwc.copy()).permute(2, 0, 1))
    finally:
        pyvips.concurrency_set(before)
    return results


def bench_regions(path: Path, threads: list[int], runs: int, tile: int, chunk: int, row: Callable[..., dict[str, Any]]
                  ) -> list[dict[str, Any]]:  # fmt: skip
    """data.stream_tiles' reader: every ``tile`` x ``tile`` region of the slide (ragged at the edges) decoded one by
    one through ``SlideTileSource.read`` (``fill_box_masked`` on ``n`` decoder threads), as a streamed step asks for
    them; rows as ``measure``'s, the bytes checked against the whole read."""
    from wsitrain.slides.tile_source import open_tile_source

    out: list[dict[str, Any]] = []
    base = None
    whole = None
    for n in threads:
        src = open_tile_source(path, read_threads=n, chunk=chunk).image
        h, w = src.shape[-2:]
        boxes = [((r, min(h, r + tile)), (c, min(w, c + tile))) for r in range(0, h, tile) for c in range(0, w, tile)]
        got: list[torch.Tensor] = []

        def read_all(src: Any = src, boxes: list[Any] = boxes, got: list[torch.Tensor] = got) -> None:
            got[:] = [src.read(rows, cols) for rows, cols in boxes]

        secs = timed(read_all, runs)
        if whole is None:
            whole = src.materialize()
        pairs = zip(got, boxes, strict=True)
        same = all(torch.equal(g, whole[:, :, r0:r1, c0:c1]) for g, ((r0, r1), (c0, c1)) in pairs)
        src.close()
        base = base or min(secs)
        out.append(row(f"tile source regions {tile} px", n, secs, h * w / 1e6, base, bytes_equal_whole_read=same))
    return out


def measure(path: Path, threads: list[int], runs: int, chunk: int, tile: int = 0) -> list[dict[str, Any]]:
    """Every reader on ``path``: one row per (reader, threads) with Mpx/s best and median, the threads' speed-up
    over the first thread count, and whether the bytes equal the first reader's. A reader that cannot open the
    file, or pyvips when it is not installed, gives a row with ``error``. ``tile``: also data.stream_tiles' reader,
    region by region (``bench_regions``)."""
    rows: list[dict[str, Any]] = []
    readers: list[SlideReader] = [OpenSlideReader(path)]
    if path.suffix.lower() in (".tif", ".tiff"):
        readers.append(TiffFileReader(path))
    reference: torch.Tensor | None = None

    def row(reader: str, n: int, secs: list[float], mpx: float, base: float, **kw: Any) -> dict[str, Any]:
        return {
            "reader": reader,
            "threads": n,
            "mpx": round(mpx, 3),
            "runs": len(secs),
            "mpx_per_s_best": round(mpx / min(secs), 2),
            "mpx_per_s_median": round(mpx / statistics.median(secs), 2),
            "speedup": round(base / min(secs), 3),
            **kw,
        }

    for reader in readers:
        try:
            w, h = reader.info.dimensions
        except Exception as e:  # e.g. OpenSlide rejects a plain TIFF
            rows.append({"reader": f"{reader.reader_name} fill_region", "error": f"cannot read ({e})"})
            continue
        mpx = w * h / 1e6
        res = bench_reader(reader, threads, runs, chunk)  # raises when threads read different bytes
        out = torch.empty((3, h, w), dtype=torch.uint8)
        fill_region(reader, out, 0, 1.0, (0, 0), chunk, 1)
        same = None if reference is None else bool(torch.equal(out, reference))
        reference = out if reference is None else reference
        base = min(res[threads[0]])
        for n, secs in res.items():
            rows.append(row(f"{reader.reader_name} fill_region", n, secs, mpx, base, bytes_equal_first=same))
        if isinstance(reader, OpenSlideReader):
            slide = reader.handle
            secs = timed(lambda slide=slide, w=w, h=h: slide.read_region((0, 0), 0, (w, h)), runs)
            rows.append(row("openslide read_region (one call)", 1, secs, mpx, min(secs)))
        reader.close()
    if tile:
        rows += bench_regions(path, threads, runs, tile, chunk, row)
    pyvips, why = pyvips_or_reason()
    if pyvips is None:
        rows.append({"reader": "pyvips", "error": f"not installed ({why})"})
        return rows
    res_v = bench_pyvips(pyvips, path, threads, runs)
    base = min(res_v[threads[0]][0])
    for n, (secs, got) in res_v.items():
        mpx = got.shape[1] * got.shape[2] / 1e6
        same = None if reference is None else bool(torch.equal(got, reference))
        version = f"pyvips {pyvips.__version__}, libvips {pyvips.version(0)}.{pyvips.version(1)}.{pyvips.version(2)}"
        rows.append(row("pyvips", n, secs, mpx, base, bytes_equal_first=same, version=version))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--slide", type=Path, help="a slide to read (default: write a synthetic tiled TIFF)")
    ap.add_argument("--size", type=int, default=8192, help="synthetic slide side in px")
    ap.add_argument("--compression", default="jpeg", choices=("jpeg", "zlib"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024, help="chunk side in px (fill_region's unit of work)")
    ap.add_argument("--tile", type=int, default=1694,
                    help="also time data.stream_tiles' reader on regions of this side (tiny's first-segment tile at "
                    "16,384 px under 512 MiB); 0: off")  # fmt: skip
    ap.add_argument("--jsonl", type=Path, help="append the rows here (one JSON object each)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.slide
        if path is None:
            path = Path(tmp) / f"synthetic-{args.size}-{args.compression}.tif"
            t0 = time.perf_counter()
            write_synthetic(path, args.size, args.compression)
            print(f"wrote {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
        print(
            f"cores available: {available_cores()}; torch intra-op threads: {torch.get_num_threads()}; "
            f"chunk {args.chunk} px; best and median of {args.runs} runs after a warm-up"
        )
        rows = measure(path, args.threads, args.runs, args.chunk, args.tile)
        if args.jsonl is not None:
            with open(args.jsonl, "a") as f:
                for r in rows:
                    f.write(json.dumps({"slide": path.name, "cores": available_cores(), **r}) + "\n")
        for r in rows:
            if "error" in r:
                print(f"{r['reader']}: {r['error']}")
                continue
            same = {None: "", True: ", bytes identical to the first reader's", False: ", bytes DIFFER from the first"}
            if "bytes_equal_whole_read" in r:
                same = {True: ", bytes identical to the whole read", False: ", bytes DIFFER from the whole read"}
                r = {**r, "bytes_equal_first": r["bytes_equal_whole_read"]}
            print(
                f"{r['reader']:>32} {r['threads']} thread(s): {r['mpx_per_s_best']:7.1f} Mpx/s best, "
                f"{r['mpx_per_s_median']:7.1f} median; speed-up {r['speedup']:.2f}x"
                f"{same[r.get('bytes_equal_first')]}"
            )


if __name__ == "__main__":
    main()
