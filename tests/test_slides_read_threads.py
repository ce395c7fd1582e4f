"""Chunks decoded on several threads (data.read_threads) give one thread's bytes, edges and errors included."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch

from wsitrain.errors import SlideError
from wsitrain.slides import pixels
from wsitrain.slides.pixels import fill_region, resolve_read_threads
from wsitrain.slides.readers import OpenSlideReader, SlideReader, TiffFileReader
from wsitrain.slides.stream import read_slide_region

SLIDES = Path(__file__).resolve().parents[2] / "shared" / "slides"
CMU = SLIDES / "cmu-1-small-region.svs"
BROKEN = SLIDES / "broken.svs"
needs_slides = pytest.mark.skipif(
    not SLIDES.is_dir(), reason=f"real test slides not found at {SLIDES} (they live beside the checkout)"
)
BG = (250, 240, 230)  # not white, so pixels outside the slide are told apart from white tissue-free pixels


@pytest.fixture(scope="module")
def tiled_tiff(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A deflate-compressed tiled TIFF (lossless, so the read can be checked against the pixels written)."""
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, size=(700, 900, 3), dtype=np.uint8)  # 700 and 900 are not multiples of tile or chunk
    path = tmp_path_factory.mktemp("tiff") / "tiled.tif"
    tifffile.imwrite(path, img, tile=(128, 128), compression="zlib", photometric="rgb")
    return path, img


class ThreadLog:
    """Wraps a reader's read_into to record which threads read chunks (so a test sees that threads were used)."""

    def __init__(self, reader: SlideReader) -> None:
        self.idents: set[int] = set()
        self.chunks = 0
        inner = reader.read_into
        lock = threading.Lock()

        def read_into(level: int, x: int, y: int, out: torch.Tensor) -> None:
            with lock:
                self.idents.add(threading.get_ident())
                self.chunks += 1
            inner(level, x, y, out)

        reader.read_into = read_into  # type: ignore[method-assign]


def _fill(reader: SlideReader, shape: tuple[int, int], origin: tuple[float, float], threads: int,
          scale: float = 1.0, chunk: int = 256) -> tuple[torch.Tensor, int]:
    out = torch.zeros((3, *shape), dtype=torch.uint8)
    used = fill_region(reader, out, 0, scale, origin, chunk=chunk, threads=threads)
    return out, used


def test_tiled_tiff_same_bytes_with_1_2_3_threads(tiled_tiff: tuple[Path, np.ndarray]) -> None:
    path, img = tiled_tiff
    with TiffFileReader(path, BG) as reader:
        log = ThreadLog(reader)
        outs = {}
        for n in (1, 2, 3):
            outs[n], used = _fill(reader, (700, 900), (0, 0), n)
            assert used == n
        # 3 x 4 chunks of 256 px, the last row and column ragged (188 and 132 px); more than one thread read them.
        assert log.chunks == 3 * 12 and len(log.idents) > 1
    expected = torch.from_numpy(img).permute(2, 0, 1)
    for n in (1, 2, 3):
        assert torch.equal(outs[n], expected), f"{n} threads"


def test_tiled_tiff_region_over_the_edge(tiled_tiff: tuple[Path, np.ndarray]) -> None:
    path, img = tiled_tiff
    with TiffFileReader(path, BG) as reader:
        outs = [_fill(reader, (300, 500), (650, 500), n)[0] for n in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    inside = torch.from_numpy(img[500:, 650:]).permute(2, 0, 1)  # 200 x 250 px of slide, the rest background
    assert torch.equal(outs[0][:, :200, :250], inside)
    assert (outs[0][:, 200:, :] == torch.tensor(BG, dtype=torch.uint8)[:, None, None]).all()
    assert (outs[0][:, :, 250:] == torch.tensor(BG, dtype=torch.uint8)[:, None, None]).all()


def test_resized_read_same_bytes_with_threads(tiled_tiff: tuple[Path, np.ndarray]) -> None:
    path, _img = tiled_tiff
    with TiffFileReader(path, BG) as reader:
        outs = [_fill(reader, (233, 300), (0.0, 0.0), n, scale=1 / 3, chunk=256)[0] for n in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_untiled_tiff_level_decoded_once_under_threads(tmp_path: Path) -> None:
    img = np.random.default_rng(1).integers(0, 256, size=(300, 400, 3), dtype=np.uint8)
    path = tmp_path / "strips.tif"
    tifffile.imwrite(path, img, compression="zlib", photometric="rgb")  # strips: the whole level is decoded
    with TiffFileReader(path) as reader:
        out, used = _fill(reader, (300, 400), (0, 0), 3, chunk=64)
    assert used == 3 and torch.equal(out, torch.from_numpy(img).permute(2, 0, 1))


@needs_slides
def test_svs_same_bytes_with_1_2_3_threads_and_at_the_edge() -> None:
    with OpenSlideReader(CMU, BG) as reader:
        w, h = reader.info.dimensions  # 2220 x 2967: chunks of 512 leave ragged ones
        whole = [_fill(reader, (h, w), (0, 0), n, chunk=512) for n in (1, 2, 3)]
        edge = [_fill(reader, (400, 300), (w - 100, h - 150), n, chunk=64)[0] for n in (1, 2, 3)]
    assert [used for _o, used in whole] == [1, 2, 3]
    assert all(torch.equal(whole[0][0], o) for o, _u in whole[1:])
    assert whole[0][0].float().std() > 10  # real tissue, not a blank buffer
    assert all(torch.equal(edge[0], o) for o in edge[1:])
    assert torch.equal(edge[0][:, :150, :100], whole[0][0][:, h - 150 :, w - 100 :])
    assert (edge[0][:, 150:, :] == torch.tensor(BG, dtype=torch.uint8)[:, None, None]).all()


@needs_slides
def test_read_slide_region_resized_svs_same_with_threads() -> None:
    reads = [read_slide_region(CMU, mpp=1.3, region="whole", chunk=256, read_threads=n) for n in (1, 2, 3)]
    assert [r.threads for r in reads] == [1, 2, 3]
    assert all(torch.equal(reads[0].image, r.image) for r in reads[1:])
    assert reads[0].mpx_per_s > 0


@needs_slides
def test_broken_slide_fails_the_same_under_threads() -> None:
    messages = []
    for n in (1, 3, "auto"):
        with pytest.raises(SlideError) as e:
            read_slide_region(BROKEN, read_threads=n)
        messages.append((e.value.message, e.value.hint))
    assert "broken.svs" in messages[0][0] and messages[0][1]
    assert messages[1] == messages[0] and messages[2] == messages[0]


class FailingReader(SlideReader):
    """Chunks whose x is at or past ``bad_x`` fail; the others read zeros."""

    def __init__(self, bad_x: int) -> None:
        super().__init__("fake.svs")
        self.bad_x = bad_x

    def read_into(self, level: int, x: int, y: int, out: torch.Tensor) -> None:
        if x >= self.bad_x:
            raise SlideError(f"chunk at x={x} y={y} is corrupt", hint="re-export the slide")
        out.zero_()


def test_a_failing_chunk_raises_its_error_under_threads() -> None:
    out = torch.empty((3, 256, 512), dtype=torch.uint8)
    for n in (1, 2, 3):
        with pytest.raises(SlideError, match=r"chunk at x=320 y=0 is corrupt"):  # the first bad chunk in order
            fill_region(FailingReader(bad_x=300), out, 0, 1.0, (0, 0), chunk=64, threads=n)


def test_thread_count_auto_is_bounded_and_bad_values_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pixels, "available_cores", lambda: 64)
    assert resolve_read_threads("auto") == pixels.MAX_AUTO_READ_THREADS == 8
    monkeypatch.setattr(pixels, "available_cores", lambda: 2)
    assert resolve_read_threads("auto") == resolve_read_threads(None) == 2
    assert resolve_read_threads(5) == 5
    for bad in (0, -1, True, 2.5, "many"):
        with pytest.raises(SlideError, match="read_threads"):
            resolve_read_threads(bad)  # type: ignore[arg-type]
    # Never more threads than chunks: one 64 px chunk is read on one thread whatever was asked.
    out = torch.empty((3, 64, 64), dtype=torch.uint8)
    assert fill_region(FailingReader(bad_x=10**6), out, 0, 1.0, (0, 0), chunk=64, threads=4) == 1
