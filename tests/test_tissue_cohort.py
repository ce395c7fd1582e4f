"""Tissue detection against ground truth: synthetic slides with fragments of known sizes (one carrying a lesion),
dust, a pen line and a label (``synth.fragments``). Every fragment at or above the threshold and the lesion are kept,
inside the mask and the crop; dust, pen and label are dropped; what was dropped reaches the preflight, data.json and
the report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.config import WsiTrainConfig
from wsitrain.preflight import run_preflight
from wsitrain.report.html import data_uri
from wsitrain.report.tissue_pieces import tissue_section
from wsitrain.slides.readers import open_slide
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.slides.synth.fragments import FRAGMENT_MPP, FragmentScene, Truth
from wsitrain.slides.tissue import DEFAULT_MIN_FRAGMENT_MM2, TissueResult, TissueSettings, detect_tissue
from wsitrain.slides.tissue.summary import tissue_record
from wsitrain.train.runfolder import write_run_files

SEEDS = (0, 1)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, FragmentScene]]:
    d = tmp_path_factory.mktemp("fragments")
    scenes = {}
    for seed in SEEDS:
        scene = FragmentScene(seed)
        write_synthetic_slide(d / f"frag_{seed}.svs", size=scene.w, scene=scene, mpp=FRAGMENT_MPP)  # type: ignore[arg-type]
        scenes[f"frag_{seed}.svs"] = scene
    (d / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{'ab'[i % 2]}\n" for i, n in enumerate(scenes)))
    return d, scenes


_DETECTED: dict[tuple[Path, TissueSettings | None], TissueResult] = {}


def _detect(path: Path, settings: TissueSettings | None = None) -> TissueResult:
    """The detector's result (each slide and settings detected once in this module: the result is immutable)."""
    if (path, settings) not in _DETECTED:
        with open_slide(path) as reader:
            _DETECTED[path, settings] = detect_tissue(reader, settings=settings)
    return _DETECTED[path, settings]


def _thumb_px(t: TissueResult, x: float, y: float) -> tuple[int, int]:
    return int(y / t.downsample), int(x / t.downsample)


def _share_in_mask(t: TissueResult, obj: Truth) -> float:
    """Share of the thumbnail pixels wholly inside ``obj``'s box (its inner half) that the mask keeps."""
    x0, y0, x1, y1 = obj.box
    qx, qy = (x1 - x0) / 4, (y1 - y0) / 4
    r0, c0 = _thumb_px(t, x0 + qx, y0 + qy)
    r1, c1 = _thumb_px(t, x1 - qx, y1 - qy)
    return float(t.mask[r0 : r1 + 1, c0 : c1 + 1].mean())


def _kind_at(t: TissueResult, obj: Truth) -> str:
    """The kind of the piece under ``obj``'s centre (pen: a point on the line)."""
    r, c = _thumb_px(t, *obj.centre)
    for p in t.pieces:
        r0, c0, r1, c1 = p.bbox
        if r0 <= r < r1 and c0 <= c < c1 and (p.kind != "tissue" or t.mask[r, c]):
            return p.kind
    return "none"


def _inside(box: tuple[int, int, int, int], crop: tuple[int, int, int, int]) -> bool:
    x0, y0, x1, y1 = box
    cx, cy, cw, ch = crop
    return cx <= x0 and cy <= y0 and x1 <= cx + cw and y1 <= cy + ch


def test_fragments_and_lesion_are_kept_inside_mask_and_crop(cohort: tuple[Path, dict[str, FragmentScene]]) -> None:
    d, scenes = cohort
    for name, scene in scenes.items():
        t = _detect(d / name)
        assert t.box is not None and not t.mpp_assumed and t.mpp == FRAGMENT_MPP
        keep = [o for o in scene.truth if o.kind in ("main", "fragment", "lesion")]
        assert all(o.area_mm2 >= DEFAULT_MIN_FRAGMENT_MM2 for o in keep)
        for o in keep:
            assert _share_in_mask(t, o) > 0.95, (name, o)
            assert _inside(o.box, t.box), (name, o, t.box)
        # the lesion, dense and dark, is tissue; and the read crop and the background mask keep its pixels
        lesion = scene.of("lesion")[0]
        assert _kind_at(t, lesion) == "tissue"
        res = read_slide_region(d / name, region="tissue", mask_background=True)
        plain = read_slide_region(d / name, region="tissue")
        assert _inside(lesion.box, res.box) and res.box == plain.box
        x0, y0, x1, y1 = lesion.box
        ox, oy = res.box[:2]
        window = (slice(None), slice(y0 - oy, y1 - oy), slice(x0 - ox, x1 - ox))
        on_lesion = torch.from_numpy(scene.tissue[y0:y1, x0:x1])  # (h, w): the fragment's own pixels
        assert torch.equal(res.image[window][:, on_lesion], plain.image[window][:, on_lesion])


def test_dust_pen_label_and_speck_are_dropped(cohort: tuple[Path, dict[str, FragmentScene]]) -> None:
    d, scenes = cohort
    for name, scene in scenes.items():
        t = _detect(d / name)
        for kind, want in (("pen", "pen"), ("label", "label"), ("speck", "small")):
            (o,) = scene.of(kind)
            assert _kind_at(t, o) == want, (name, kind)
            assert _share_in_mask(t, o) == 0.0
        dust = scene.of("dust")
        clump = max(dust, key=lambda o: o.area_mm2)
        assert clump.area_mm2 > DEFAULT_MIN_FRAGMENT_MM2 and _kind_at(t, clump) == "dust"  # by colour, not size
        for o in dust:
            r, c = _thumb_px(t, *o.centre)
            assert not t.mask[r, c]
        kinds = [p.kind for p in t.pieces]
        # every painted object is one piece: main + 4 fragments + lesion kept; no other piece kept
        assert kinds.count("tissue") == 6 and kinds.count("pen") == 1 and kinds.count("label") == 1


def test_threshold_is_physical(cohort: tuple[Path, dict[str, FragmentScene]]) -> None:
    d, scenes = cohort
    name, scene = next(iter(scenes.items()))
    t = _detect(d / name, TissueSettings(min_fragment_mm2=0.004))
    for o in scene.of("fragment") + scene.of("lesion"):
        assert (_kind_at(t, o) == "tissue") == (o.area_mm2 >= 0.004), o
    t = _detect(d / name, TissueSettings(min_fragment_mm2=0.0002))
    assert _kind_at(t, scene.of("speck")[0]) == "tissue"


def test_record_counts_and_doubts(cohort: tuple[Path, dict[str, FragmentScene]]) -> None:
    d, scenes = cohort
    name, scene = next(iter(scenes.items()))
    r = tissue_record(_detect(d / name))
    assert r["kept"]["count"] == 6
    kept_truth = sum(o.area_mm2 for o in scene.truth if o.kind in ("main", "fragment", "lesion"))
    assert r["kept"]["area_mm2"] == pytest.approx(kept_truth, rel=0.03)
    by = r["dropped"]["by_reason"]
    assert by["pen"] == 1 and by["label"] == 1 and by["small"] == 1 and by["dust"] >= 2
    assert r["dropped"]["largest"]["kind"] == "label"
    # the speck (stained, 0.0004 mm², more than a tenth of the threshold) and the dust clump are doubts; pen and
    # label are not
    assert sorted(x["kind"] for x in r["doubts"] if x["area_mm2"] > 0.0003) == ["dust", "small"]
    assert all(x["kind"] in ("small", "dust") for x in r["doubts"])


def _cfg(d: Path) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "data": {"labels": str(d / "labels.csv"), "mpp": 4.0, "region": "tissue"},
        "model": {"name": "tiny"}, "engine": {"memory_budget": "64MiB", "device": "cpu"},
    })  # fmt: skip


def test_preflight_table_warning_data_json_and_report(
    cohort: tuple[Path, dict[str, FragmentScene]], tmp_path: Path
) -> None:
    d, scenes = cohort
    report = run_preflight(_cfg(d), 64 * 2**20, "cpu")
    records = report.tissue_records()
    assert set(records) == set(scenes) and all(r["kept"]["count"] == 6 for r in records.values())
    assert any("may be tissue" in w and "frag_0.svs" in w for w in report.warnings)
    assert report.tissue_table() is not None
    # validate prints the table and the warning
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{labels: {d / 'labels.csv'}, mpp: 4.0, region: tissue}}\nmodel: {{name: tiny}}\n"
                      "engine: {memory_budget: 64MiB, device: cpu}\n")  # fmt: skip
    out = CliRunner().invoke(app, ["validate", str(config)], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    assert "tissue pieces" in out.output and "warning: tissue:" in out.output and "1 pen" in out.output
    # data.json carries the records
    data = SimpleNamespace(labels_csv=d / "labels.csv", class_names=["a", "b"], train=[], val=[], test=[],
                           objective=None)  # fmt: skip
    write_run_files(tmp_path, {}, False, "cpu", data, records)  # type: ignore[arg-type]
    saved = json.loads((tmp_path / "data.json").read_text())["tissue"]
    assert saved["frag_0.svs"]["dropped"]["by_reason"]["pen"] == 1
    # the report's section: a row per slide, a picture each, doubts first
    page = tissue_section(saved, {"data": {}}, data_uri)
    assert page.count("<img") == 2 and "frag_0.svs" in page and "label" in page and "pen" in page
    assert page.index('class="wrong"') < page.index("frag_0.svs")


def test_report_picture_marks_kept_outline_and_dropped_pieces(cohort: tuple[Path, dict[str, FragmentScene]]) -> None:
    import io

    from PIL import Image

    from wsitrain.report.tissue_pieces import KEPT_OUTLINE, REASON_COLOURS, tissue_picture
    from wsitrain.slides.pixels import read_thumbnail

    d, scenes = cohort
    with open_slide(d / "frag_0.svs") as reader:
        t = detect_tissue(reader)
        thumb, _ = read_thumbnail(reader)
    pic = np.asarray(Image.open(io.BytesIO(tissue_picture(thumb, t))).convert("RGB"))
    colours = {tuple(int(v) for v in c) for c in pic.reshape(-1, 3)}
    assert KEPT_OUTLINE in colours and all(REASON_COLOURS[k] in colours for k in ("pen", "label", "small", "dust"))


def test_a_run_from_before_data_tissue_resumes_without_force(tmp_path: Path) -> None:
    from wsitrain.config import config_to_dict
    from wsitrain.errors import WsiTrainError
    from wsitrain.train.checkpoint import CHECKPOINT_FORMAT
    from wsitrain.train.runfolder import load_resume

    cfg_dict = config_to_dict(WsiTrainConfig.model_validate({"model": {"name": "tiny"}}))
    old = json.loads(json.dumps(cfg_dict))
    del old["data"]["tissue"]
    torch.save({"format": CHECKPOINT_FORMAT, "model": {}, "config": old}, tmp_path / "last.pt")
    assert load_resume(tmp_path, cfg_dict, force=False)[1] == tmp_path
    cfg_dict["data"]["tissue"]["min_fragment_mm2"] = 0.01  # a real change still needs --force
    with pytest.raises(WsiTrainError, match="data.tissue.min_fragment_mm2"):
        load_resume(tmp_path, cfg_dict, force=False)
