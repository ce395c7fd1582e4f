"""data.mask_background: pixels outside the (dilated) tissue mask become the background colour; chunks wholly
outside it are never decoded; off, the read is byte for byte what it was."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch

from wsitrain.config import load_config
from wsitrain.errors import ConfigError, SlideError
from wsitrain.slides import stream
from wsitrain.slides.pixels import fill_region
from wsitrain.slides.readers import SlideReader, open_slide
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.slides.tissue import MASK_DILATION_PX, detect_tissue
from wsitrain.train.data import masking_note, read_kwargs

BG = (250, 245, 10)  # far from the slide's off-white: a masked pixel cannot be mistaken for a read one


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 1280 x 768 px, two levels: level 0 reads and resized reads (mpp 0.8) both take the masked path.
    return write_synthetic_slide(tmp_path_factory.mktemp("mask") / "s.svs", size=(768, 1280), seed=3)


@pytest.fixture(scope="module")
def blank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A slide with no tissue: off-white with faint grey noise (saturation far below the tissue threshold)."""
    rng = np.random.default_rng(0)
    img = np.clip(240 + rng.integers(-3, 4, size=(400, 600, 1)), 0, 255).astype(np.uint8).repeat(3, axis=2)
    path = tmp_path_factory.mktemp("blank") / "blank.tif"
    tifffile.imwrite(path, img, tile=(128, 128), compression="zlib", photometric="rgb")
    return path


def expected_keep(path: Path, shape: tuple[int, int], downsample: float = 1.0) -> np.ndarray:
    """The detector's mask grown by MASK_DILATION_PX thumbnail px (plain numpy shifts), looked up at every output
    pixel's centre, for a whole-slide read of ``shape`` output px that each cover ``downsample`` level-0 px."""
    with open_slide(path, BG) as reader:
        t = detect_tissue(reader)
        w0, h0 = reader.info.dimensions
    assert t.found and 0.02 < t.mask.mean() < 0.8  # some tissue, and some background to mask
    m, d = t.mask, MASK_DILATION_PX
    padded = np.pad(m, d)
    grown = np.zeros_like(m)
    for dy in range(2 * d + 1):
        for dx in range(2 * d + 1):
            grown |= padded[dy : dy + m.shape[0], dx : dx + m.shape[1]]
    assert grown.sum() > m.sum()  # the margin adds pixels, so a missing dilation shows
    cy = (np.arange(shape[0]) + 0.5) * downsample
    cx = (np.arange(shape[1]) + 0.5) * downsample
    ry = np.minimum((cy // t.downsample).astype(int), m.shape[0] - 1)
    rx = np.minimum((cx // t.downsample).astype(int), m.shape[1] - 1)
    keep = grown[ry][:, rx]
    keep &= (cy < h0)[:, None] & (cx < w0)[None, :]
    return keep


def masked_by_hand(image: torch.Tensor, keep: np.ndarray) -> torch.Tensor:
    out = image.clone()
    drop = torch.from_numpy(~keep)
    for c in range(3):
        out[c][drop] = BG[c]
    return out


class Spy:
    """Counts the reader's decode calls (read_into on level reads, read_region on resized reads) and where."""

    def __init__(self, reader: SlideReader) -> None:
        self.calls: list[tuple[int, int]] = []
        lock = threading.Lock()
        read_into, read_region = reader.read_into, reader.read_region

        def spy_into(level: int, x: int, y: int, out: torch.Tensor) -> None:
            with lock:
                self.calls.append((x, y))
            read_into(level, x, y, out)

        def spy_region(level: int, x: int, y: int, w: int, h: int) -> np.ndarray:
            with lock:
                self.calls.append((x, y))
            return read_region(level, x, y, w, h)

        reader.read_into = spy_into  # type: ignore[method-assign]
        reader.read_region = spy_region  # type: ignore[method-assign]


def test_mask_follows_the_tissue_detector(slide: Path) -> None:
    plain = read_slide_region(slide, background=BG, chunk=128)
    masked = read_slide_region(slide, background=BG, chunk=128, mask_background=True)
    keep = expected_keep(slide, tuple(plain.image.shape[1:]))
    assert torch.equal(masked.image, masked_by_hand(plain.image, keep))  # inside: the unmasked read, exactly
    assert masked.tissue_fraction == pytest.approx(keep.mean(), abs=1e-12)
    assert plain.tissue_fraction is None and plain.chunks_skipped == 0


def test_resized_read_masks_the_same_way(slide: Path) -> None:
    plain = read_slide_region(slide, mpp=0.8, background=BG, chunk=128)  # 1.6 level-0 px per output px
    masked = read_slide_region(slide, mpp=0.8, background=BG, chunk=128, mask_background=True)
    keep = expected_keep(slide, tuple(plain.image.shape[1:]), downsample=1.6)
    assert torch.equal(masked.image, masked_by_hand(plain.image, keep))
    assert masked.chunks_skipped > 0


def test_off_reproduces_the_unmasked_input_exactly(slide: Path) -> None:
    res = read_slide_region(slide, background=BG, chunk=128, mask_background=False)
    with open_slide(slide, BG) as reader:
        direct = torch.from_numpy(reader.read_region(0, 0, 0, *reader.info.dimensions)).permute(2, 0, 1)
        old_way = torch.empty_like(direct)
        fill_region(reader, old_way, 0, 1.0, (0.0, 0.0), chunk=128)
    assert torch.equal(res.image, direct) and torch.equal(res.image, old_way)
    assert res.tissue_fraction is None and res.chunks_skipped == 0 and res.chunks_decoded == 6 * 10


def test_chunks_outside_tissue_are_not_decoded(slide: Path) -> None:
    chunk = 128
    with open_slide(slide, BG) as reader:
        stream._tissue(reader)  # detection (its thumbnail reads) first, so the spy sees only the region's chunks
        spy = Spy(reader)
        masked = read_slide_region(reader, background=BG, chunk=chunk, mask_background=True, read_threads=2)
    with open_slide(slide, BG) as reader:
        plain = read_slide_region(reader, background=BG, chunk=chunk)
    H, W = masked.image.shape[1:]
    keep = expected_keep(slide, (H, W))
    corners = {(x, y) for y in range(0, H, chunk) for x in range(0, W, chunk)}
    wanted = {(x, y) for x, y in corners if keep[y : y + chunk, x : x + chunk].any()}
    assert 0 < len(wanted) < len(corners)
    assert sorted(spy.calls) == sorted(wanted)  # each chunk touching the mask decoded once, no other
    assert (masked.chunks_decoded, masked.chunks_skipped) == (len(wanted), len(corners) - len(wanted))
    assert torch.equal(masked.image, masked_by_hand(plain.image, keep))  # skipping equals decoding and masking


def test_one_and_two_threads_give_the_same_masked_read(slide: Path) -> None:
    reads = [read_slide_region(slide, background=BG, chunk=96, mask_background=True, read_threads=n) for n in (1, 2)]
    assert [r.threads for r in reads] == [1, 2]
    assert torch.equal(reads[0].image, reads[1].image)
    assert (reads[0].chunks_decoded, reads[0].chunks_skipped) == (reads[1].chunks_decoded, reads[1].chunks_skipped)
    assert reads[0].chunks_skipped > 0


def test_no_tissue_found_masks_nothing(blank: Path) -> None:
    with open_slide(blank, BG) as reader:
        assert not detect_tissue(reader).found
    plain = read_slide_region(blank, background=BG, chunk=128)
    masked = read_slide_region(blank, background=BG, chunk=128, mask_background=True)
    assert torch.equal(masked.image, plain.image)
    assert masked.tissue_fraction is None and masked.chunks_skipped == 0 and masked.chunks_decoded == 4 * 5


def test_config_key_defaults_on_and_reaches_the_reader(write_yaml) -> None:
    path = write_yaml("")
    on = load_config(path)
    assert on.data.mask_background is True and read_kwargs(on, 16)["mask_background"] is True
    assert "data.mask_background: false" in masking_note(on)
    off = load_config(path, ["data.mask_background=false"])
    assert off.data.mask_background is False and read_kwargs(off, 16)["mask_background"] is False
    assert "off" in masking_note(off)


@pytest.mark.parametrize("bad", ["maybe", "1", "0", "[true]"])
def test_a_non_bool_value_is_a_config_error_naming_the_key(write_yaml, bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(""), [f"data.mask_background={bad}"])
    problems = info.value.problems
    assert len(problems) == 1 and problems[0].startswith("data.mask_background: expected true or false"), problems


def test_read_slide_region_refuses_a_non_bool(slide: Path) -> None:
    with pytest.raises(SlideError, match="mask_background"):
        read_slide_region(slide, mask_background="yes")  # type: ignore[arg-type]


def test_tissue_is_detected_once_per_slide_and_the_cache_stays_bounded(
    slide: Path, blank: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def counting(reader: SlideReader, *args: object, **kwargs: object) -> object:
        calls.append(reader.path.name)
        return detect_tissue(reader, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stream, "detect_tissue", counting)
    monkeypatch.setattr(stream, "_TISSUE_CACHE", type(stream._TISSUE_CACHE)())
    monkeypatch.setattr(stream, "_TISSUE_CACHE_ENTRIES", 2)
    first = read_slide_region(slide, background=BG, mask_background=True, region="tissue")
    again = read_slide_region(slide, background=BG, mask_background=True, region="tissue")
    assert calls == ["s.svs"] and torch.equal(first.image, again.image)
    assert again.tissue_fraction == first.tissue_fraction and again.tissue_box == first.tissue_box
    other = tmp_path / "copy.svs"
    other.write_bytes(slide.read_bytes())
    for path in (blank, other, slide):  # a third slide drops the least recently used (s.svs) from the cache
        read_slide_region(path, background=BG, mask_background=True)
    assert calls == ["s.svs", "blank.tif", "copy.svs", "s.svs"] and len(stream._TISSUE_CACHE) == 2
