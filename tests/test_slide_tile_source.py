"""data.stream_tiles: the first tiled segment reads its regions from the slide (slides/tile_source.py) and gets
bitwise the pixels, logits and gradients of the whole decoded and augmented image."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from rich.console import Console

import wsitrain.preflight as pf
from wsitrain.config import WsiTrainConfig
from wsitrain.host_need import host_need, streamed_bytes
from wsitrain.models import build
from wsitrain.plan.command import host_line
from wsitrain.preflight import PreflightError, run_preflight
from wsitrain.sft import SFT, plan
from wsitrain.sft.regions import SegmentRegions
from wsitrain.slides.augment import AugmentConfig, Geometry, augment_from_config
from wsitrain.slides.read_rate import segment_trains, stream_read_bytes
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.slides.tile_source import READ_AHEAD, SlideTileSource, open_tile_source, pre_box
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.fit import run_fit
from wsitrain.units import format_bytes

BG = (250, 245, 10)


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # odd, non-square (h 517 x w 703), two levels: level 0 reads and resized reads
    return write_synthetic_slide(tmp_path_factory.mktemp("src") / "s.svs", size=(703, 517), seed=5)


def whole_and_source(
    slide: Path, augment: AugmentConfig | None, seed: int, **kw: object
) -> tuple[torch.Tensor, SlideTileSource]:
    """Today's path (whole read, then augmentation in place) and the tile source for the same slide and seed."""
    res = read_slide_region(slide, background=BG, read_threads=2, **kw)  # type: ignore[arg-type]
    image = res.image if augment is None else augment_from_config(res.image, np.random.default_rng(seed), augment)
    src = open_tile_source(slide, augment=augment, rng=np.random.default_rng(seed), background=BG, read_threads=2,
                           **kw).image  # fmt: skip
    assert isinstance(src, SlideTileSource)
    return image[None], src


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("flips", [(False, False), (True, False), (False, True), (True, True)])
def test_pre_box_is_the_index_map_of_the_flips_and_turn(k: int, flips: tuple[bool, bool]) -> None:
    g = Geometry(flips[0], flips[1], k)
    img = torch.arange(5 * 7).view(1, 5, 7)
    aug = g.apply(img)
    for rows, cols in [((0, 2), (1, 4)), ((1, aug.shape[1]), (0, aug.shape[2])), ((2, 3), (3, 4))]:
        (y0, y1), (x0, x1) = pre_box(g, (5, 7), rows, cols)
        want = aug[:, rows[0] : rows[1], cols[0] : cols[1]]
        assert torch.equal(g.apply(img[:, y0:y1, x0:x1]), want)


AUGMENTS = {
    "none": None,
    "flips": AugmentConfig(flips=True, rot90=False),
    "rot90": AugmentConfig(flips=False, rot90=True),
    "hed": AugmentConfig(flips=True, rot90=True, color_jitter="hed", strength=0.1),
    "hsv": AugmentConfig(flips=True, rot90=True, color_jitter="hsv", strength=0.1),
}


@pytest.mark.parametrize("augment", list(AUGMENTS))
@pytest.mark.parametrize("read", ["level0", "resized", "masked", "tissue"])
def test_regions_equal_the_whole_image(slide: Path, augment: str, read: str) -> None:
    kw: dict[str, object] = {
        "level0": dict(pad_multiple=16),
        "resized": dict(mpp=0.8, pad_multiple=8),
        "masked": dict(mask_background=True, pad_multiple=16),
        "tissue": dict(region="tissue", mask_background=True, mpp=0.7, pad_multiple=4),
    }[read]
    # seeds chosen so the drawn geometry covers quarter turns and flips among the cases
    for seed in (0, 3):
        image, src = whole_and_source(slide, AUGMENTS[augment], seed, chunk=256, **kw)
        try:
            assert src.shape == image.shape and src.dtype == image.dtype
            H, W = image.shape[-2:]
            # a ragged tile grid with overlapping halos (tile 96, halo 13), the edge tiles smaller
            for r0 in range(0, H, 96):
                for c0 in range(0, W, 96):
                    rows = (max(0, r0 - 13), min(H, r0 + 96 + 13))
                    cols = (max(0, c0 - 13), min(W, c0 + 96 + 13))
                    got = src[:, :, rows[0] : rows[1], cols[0] : cols[1]]
                    assert torch.equal(got, image[:, :, rows[0] : rows[1], cols[0] : cols[1]]), (seed, rows, cols)
            assert torch.equal(src.materialize(), image)
        finally:
            src.close()


def test_read_ahead_follows_the_expected_order_and_skips(slide: Path) -> None:
    image, src = whole_and_source(slide, AUGMENTS["hed"], 1, pad_multiple=16)
    try:
        H, W = image.shape[-2:]
        order = [((r, min(H, r + 64)), (c, min(W, c + 64))) for r in range(0, H, 64) for c in range(0, W, 64)]
        src.expect(order)
        for i, (rows, cols) in enumerate(order):
            if i % 3 == 1:
                continue  # a skipped tile (zero gradient): its read-ahead is dropped, the next ones still match
            got = src[:, :, rows[0] : rows[1], cols[0] : cols[1]]
            assert torch.equal(got, image[:, :, rows[0] : rows[1], cols[0] : cols[1]])
        first = src.regions_read
        for rows, cols in order:  # the recompute: the same order again, read again
            assert torch.equal(src[:, :, rows[0] : rows[1], cols[0] : cols[1]],
                               image[:, :, rows[0] : rows[1], cols[0] : cols[1]])  # fmt: skip
        assert src.regions_read >= first + len(order)
    finally:
        src.close()


def _engine(dtype: torch.dtype) -> SFT:
    torch.manual_seed(0)
    model = build("tiny", 3, weights=None).to(dtype)
    return SFT(model, memory_budget="4GiB", tile_size=64)


@pytest.mark.parametrize("augment", ["none", "hed", "hsv"])
def test_fit_step_and_predict_equal_the_whole_image(slide: Path, augment: str) -> None:
    """Logits, every parameter gradient (train) and the eval logits (predict) are bitwise those of the whole image."""
    kw = dict(mask_background=True, pad_multiple=16, chunk=256)
    for seed in (0, 2):
        image, src = whole_and_source(slide, AUGMENTS[augment], seed, **kw)
        try:
            results = []
            for x in (image, src):
                sft = _engine(torch.float32)
                assert sft.plan_of(image).segments[0].mode == "tiled"  # the first segment reads tiles
                logits = sft(x)
                logits.float().square().sum().backward()
                grads = [p.grad.clone() for p in sft.parameters()]
                sft.eval()
                with torch.no_grad():
                    pred = sft(x)
                results.append((logits.detach(), grads, pred))
            (la, ga, pa), (lb, gb, pb) = results
            assert torch.equal(la, lb) and torch.equal(pa, pb)
            assert len(ga) == len(gb) and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
            assert src.regions_read > 0  # the source was read by regions, not materialized
        finally:
            src.close()


def _fit_cfg(root: Path, name: str, stream: bool) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": name, "seed": 4,
        "data": {"labels": str(root / "labels.csv"), "region": "whole", "val_fraction": 0.0, "read_threads": 2,
                 "stream_tiles": stream, "background": list(BG),
                 "augment": {"flips": True, "rot90": True, "color_jitter": "hed", "jitter_strength": 0.1}},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "device": "cpu", "tile_size": 64},
        "train": {"epochs": 2, "optimizer": "sgd", "lr": 0.01},
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })  # fmt: skip


def test_fit_with_streamed_tiles_trains_bitwise_the_same(tmp_path: Path) -> None:
    """Two epochs of fit (augmented, masked, odd sizes): every slide's loss and the final weights are bitwise those
    of the whole-image fit."""
    sides = [(203, 331), (260, 190), (317, 245)]
    for i, side in enumerate(sides):
        write_synthetic_slide(tmp_path / f"s{i}.svs", size=side, positive=bool(i % 2), seed=10 + i)
    (tmp_path / "labels.csv").write_text(
        "slide,label\n" + "".join(f"s{i}.svs,{'positive' if i % 2 else 'negative'}\n" for i in range(len(sides)))
    )
    runs = {}
    for stream in (False, True):
        name = f"stream-{stream}"
        run_fit(_fit_cfg(tmp_path, name, stream), console=Console(file=io.StringIO(), width=200), quiet=True)
        runs[stream] = tmp_path / "runs" / name
    rows = {s: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
            for s, r in runs.items()}  # fmt: skip
    losses = {s: [(r["slide"], r["loss"]) for r in v if r.get("kind") == "train"] for s, v in rows.items()}
    assert len(losses[True]) == 2 * len(sides) and losses[True] == losses[False]
    # the streamed fit decoded nothing up front: its slides were read tile by tile (the whole read decodes chunks)
    assert all(r["chunks_decoded"] == 0 for r in rows[True]) and all(r["chunks_decoded"] > 0 for r in rows[False])
    wa, wb = (load_checkpoint(r / "last.pt")["model"] for r in (runs[False], runs[True]))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_preflight_counts_streamed_tiles_not_the_slide(slide: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host RAM per node with data.stream_tiles is a few tiles, not the slide; the refusal names the need, the ranks
    and the fix (exit 2 through PreflightError)."""
    (slide.parent / "labels.csv").write_text(f"slide,label\n{slide.name},positive\n")

    def cfg(stream: bool) -> WsiTrainConfig:
        return WsiTrainConfig.model_validate({
            "data": {"labels": str(slide.parent / "labels.csv"), "stream_tiles": stream, "prefetch": True},
            "model": {"name": "tiny"}, "engine": {"device": "cpu", "tile_size": 64},
        })  # fmt: skip

    whole = run_preflight(cfg(False), 2**30, "cpu")
    streamed = run_preflight(cfg(True), 2**30, "cpu")
    image = 3 * whole.buckets[0].bucket[0] * whole.buckets[0].bucket[1]
    assert streamed.buckets[0].plan is not None and streamed.buckets[0].plan.segments[0].mode == "tiled"
    # today: the slide in the plan's peak and the next one read ahead; streamed: neither
    assert whole.host_needed_bytes - streamed.host_needed_bytes >= image
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(pf, "available_host_bytes", lambda: 8 * streamed.host_needed_bytes)
    run_preflight(cfg(True), 2**30, "cpu")  # 8 ranks of the streamed need fit
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg(False), 2**30, "cpu")
    (problem,) = info.value.problems
    assert "x 8 processes on this node" in problem.message and "data.stream_tiles: true" in problem.hint


def test_planned_host_ram_per_rank_streamed_is_a_few_tiles() -> None:
    """`wsitrain plan` on CUDA: the whole slides (trained + read ahead) against the regions of a streamed slide."""
    with torch.device("meta"):
        model = build("tiny", 2).train()
    p = plan(model, (1, 3, 20000, 20000), "1GiB", device="cuda")
    assert p.fits and p.segments[0].mode == "tiled" and p.input_on_host
    streamed = streamed_bytes(p, READ_AHEAD)
    first = p.segments[0]  # the larger of the forward sweep's tiles (its own where it has some) and the recompute's
    tile = 3 * max(a * b for a, b in (first.tile_shape, first.forward_tile_shape or first.tile_shape))
    assert streamed == (READ_AHEAD + 2) * tile
    whole = host_need(p, 3 * 20000 * 20000, 2, "cuda")
    lean = host_need(p, 0, 0, "cuda", 1, streamed)
    assert whole.per_rank - lean.per_rank == 2 * 3 * 20000 * 20000 - streamed  # the same staging and checkpoints
    line = host_line(p)
    assert whole.describe() in line and lean.describe() in line and "streamed tiles" in line


def test_cache_keeps_the_first_regions_within_its_bound(slide: Path) -> None:
    """data.stream_cache: the first regions asked for stay (within the bound) and the second pass in the same order
    (the backward recompute) takes them from memory; the rest are decoded again; the pixels are the same."""
    image, src = whole_and_source(slide, AUGMENTS["hsv"], 2, pad_multiple=16)
    src.close()
    H, W = image.shape[-2:]
    order = [((r, min(H, r + 96)), (c, min(W, c + 96))) for r in range(0, H, 96) for c in range(0, W, 96)]
    sizes = [3 * (r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in order]
    bound = sum(sizes[:3]) + sizes[3] // 2  # room for three regions and half of the fourth
    src = SlideTileSource(src.reader, src.layout, src.geometry, src.jitter, 2, cache_bytes=bound, own_reader=False)
    try:
        src.expect(order)
        for _ in range(2):
            for rows, cols in order:
                got = src[:, :, rows[0] : rows[1], cols[0] : cols[1]]
                assert torch.equal(got, image[:, :, rows[0] : rows[1], cols[0] : cols[1]])
        kept = []  # the policy: each region in order while it still fits (a smaller edge region may, later)
        for n in sizes:
            if sum(kept) + n <= bound:
                kept.append(n)
        assert len(kept) > 3 and src.cached_bytes == sum(kept) <= bound
        assert src.regions_from_cache == len(kept) and src.regions_read == 2 * len(order) - len(kept)
    finally:
        src.reader.close()
        src.close()


def test_cached_recompute_gives_the_same_gradients(tmp_path: Path) -> None:
    """A training step whose recompute takes its regions from the cache: logits and every parameter gradient
    bitwise those of the step that decodes them again; each region the recompute takes from the cache is one
    decode fewer."""
    small = write_synthetic_slide(tmp_path / "small.svs", size=(203, 141), seed=6)  # odd, a ragged grid
    results = []
    for cache in (0, 2**30):
        src = open_tile_source(small, background=BG, read_threads=2, pad_multiple=16, cache_bytes=cache).image
        assert isinstance(src, SlideTileSource)
        try:
            torch.manual_seed(0)
            # the first segment through two convolutions (left to itself the planner cuts after the normalisation
            # at this size, and a segment without parameters has no backward to recompute)
            sft = SFT(build("tiny", 3, weights=None), memory_budget="1GiB", tile_size=64,
                      checkpoints=["features.pool2"])  # fmt: skip
            plan_ = sft.plan_of(src)  # type: ignore[arg-type]
            first = plan_.segments[0]
            assert first.mode == "tiled" and first.end > 2 and first.regions is not None
            assert segment_trains(sft.model, first)
            tiles = first.regions.grid[0] * first.regions.grid[1]
            assert tiles > 1
            logits = sft(src)  # type: ignore[arg-type]
            logits.float().square().sum().backward()
            # the bytes the preflight says a step decodes (read_rate.py) are the bytes this step decoded
            assert src.bytes_read == stream_read_bytes(plan_, 2, cache) > 0
            results.append((logits.detach(), [p.grad.clone() for p in sft.parameters()], src))
        finally:
            src.close()
    (la, ga, plain), (lb, gb, cached) = results
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
    assert plain.regions_from_cache == 0 and plain.regions_read == 2 * tiles  # forward, then the recompute
    assert cached.regions_from_cache == tiles and cached.regions_read == tiles


def test_preflight_gives_the_streamed_read_against_the_measured_reader(slide: Path) -> None:
    """data.stream_tiles: preflight counts what a step decodes (the plan's first-segment regions, forward and, when
    that segment trains, the recompute) and measures the reader on the run's slide."""
    (slide.parent / "labels.csv").write_text(f"slide,label\n{slide.name},positive\n")
    cfg = WsiTrainConfig.model_validate({
        "data": {"labels": str(slide.parent / "labels.csv"), "stream_tiles": True, "read_threads": 2},
        "model": {"name": "tiny"}, "engine": {"device": "cpu", "tile_size": 64, "checkpoints": ["features.pool2"]},
    })  # fmt: skip
    report = run_preflight(cfg, 2**30, "cpu")
    plan_ = report.buckets[0].plan
    read = report.stream_read
    assert plan_ is not None and read is not None and read.rate is not None
    assert read.passes == 2 and read.bytes_per_step == stream_read_bytes(plan_, 2) > 0  # conv1, conv2 train
    assert read.rate.bytes_per_s > 0 and read.rate.slide == slide.name and read.rate.threads == 2
    text = read.text()
    assert "forward and recompute" in text and "MB/s on s.svs (2 read threads, measured)" in text
    assert run_preflight(cfg.model_copy(update={"data": cfg.data.model_copy(update={"stream_tiles": False})}),
                         2**30, "cpu").stream_read is None  # fmt: skip


def test_preflight_refuses_a_node_short_of_ram_with_exit_2(slide: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:  # fmt: skip
    """`wsitrain validate` (fit's preflight) on a node whose RAM holds fewer ranks than LOCAL_WORLD_SIZE: exit 2,
    one message naming the need per node, the ranks and the fixes."""
    from tiny_runs import invoke

    (slide.parent / "labels.csv").write_text(f"slide,label\n{slide.name},positive\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{labels: {slide.parent / 'labels.csv'}}}\nmodel: {{name: tiny}}\n"
                   "engine: {device: cpu, tile_size: 64, memory_budget: 1GiB}\n")  # fmt: skip
    one = run_preflight(WsiTrainConfig.model_validate(yaml.safe_load(cfg.read_text())), 2**30, "cpu")
    monkeypatch.setattr(pf, "available_host_bytes", lambda: 3 * one.host_needed_bytes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert invoke("validate", str(cfg)).exit_code == 0  # three ranks fit
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    result = invoke("validate", str(cfg))
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert f"needs {format_bytes(4 * one.host_needed_bytes)}" in out and "x 4 processes on this node" in out
    assert "data.stream_tiles: true" in out and "run fewer processes per node" in out


def test_plan_gives_the_read_rate_the_stream_needs() -> None:
    """`wsitrain plan`: the streamed step's decoded bytes (every first-segment region, halo in, forward and
    recompute) and the rate they need at the simulated step time, else the planned one."""
    from wsitrain.plan.command import stream_read

    with torch.device("meta"):
        model = build("tiny", 2).train()
    p = plan(model, (1, 3, 20000, 20000), "1GiB", device="cuda", input_on_host=True)
    first = p.segments[0]
    assert first.mode == "tiled" and first.regions is not None

    def once(reg: SegmentRegions) -> int:
        return sum(3 * (r1 - r0) * (c1 - c0) for rt in reg.rows for ct in reg.cols
                   for (r0, r1), (c0, c1) in [(rt.need[0], ct.need[0])])  # fmt: skip

    assert first.sweep_regions is not None
    forward, recompute = once(first.sweep_regions), once(first.regions)
    assert recompute > 3 * 20000 * 20000  # the halos overlap
    both = forward + recompute
    assert stream_read_bytes(p, 2) == both and stream_read_bytes(p, 1) == forward
    # the cache keeps the forward's regions for the recompute, so it saves only where both read the same regions
    kept = 0 if first.forward_grid else 2**30
    assert stream_read_bytes(p, 2, 2**30) == both - kept
    planned = stream_read(p, None, 100.0)
    assert planned is not None and f"it needs {both / 100 / 1e6:.0f} MB/s (planned)" in planned
    simulated = stream_read(p, 50.0, 100.0)
    assert simulated is not None and f"it needs {both / 50 / 1e6:.0f} MB/s (simulated)" in simulated
