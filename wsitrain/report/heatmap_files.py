"""`predict --heatmaps DIR`: per slide ``NAME.cam.npy`` (K, h, w), ``NAME.png``, optional ``NAME.saliency.npy``
(3, H/block, W/block), ``NAME.attention.npy`` (branches, h, w) for attention heads, the viewer files
``NAME.geojson`` (QuPath detections, ``report.geojson``) and ``NAME.heatmap.tif`` (a slide-sized pyramidal TIFF,
``report.heatmap_tiff``), and ``heatmaps.json`` indexing them (what the run report reads)."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wsitrain.report.decision import decided_on_tissue
from wsitrain.report.geojson import write_geojson
from wsitrain.report.heatmap import SlideMaps, eval_mode, slide_maps
from wsitrain.report.heatmap_tiff import write_heatmap_tiff
from wsitrain.report.map_grid import MapGrid
from wsitrain.report.overlay import Placement, Thumbnail, render_heatmap, slide_thumbnail
from wsitrain.train.attention_mask import tissue_masked
from wsitrain.write_errors import named_write_errors

INDEX = "heatmaps.json"
# Saliency cells: at least the model's stride, and coarse enough that the map's longer side stays <= this.
SALIENCY_MAX_SIDE = 1024


def saliency_block(image_hw: tuple[int, int], stride: int) -> int:
    return max(int(stride), -(-max(image_hw) // SALIENCY_MAX_SIDE))


class HeatmapWriter:
    """Writes each slide's maps into ``out_dir`` (created) and the index at ``close()``.

    ``viewer``: also write ``NAME.geojson`` and ``NAME.heatmap.tif`` for slide viewers (QuPath, ASAP);
    ``geojson_k``: map cells per GeoJSON detection side (None: as many as keep the file under ~50 MB)."""

    def __init__(
        self, out_dir: Path, class_names: list[str], saliency: bool = False,
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        viewer: bool = True, geojson_k: int | None = None,
        transform: Callable[[SlideMaps], SlideMaps] | None = None,
    ) -> None:
        # a task's view of the head's maps (survival: the hazard maps become one risk map); None: the maps as read
        self.transform = transform
        self.autocast = autocast  # predict's precision (e.g. Trainer.autocast), so the maps run under the same plan
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.class_names = [str(c) for c in class_names]
        self.saliency = saliency
        self.viewer = viewer
        self.geojson_k = geojson_k
        self.records: list[dict[str, Any]] = []

    def add(
        self,
        slide: str | Path,
        read: Any,
        model: nn.Module,
        probabilities: Callable[[torch.Tensor], torch.Tensor] | None = None,
        label: int | None = None,
    ) -> dict[str, Any]:
        """One slide: ``read`` is the ReadResult predict already has (image and where it sits on the slide)."""
        from wsitrain.slides.readers import open_slide
        from wsitrain.slides.tissue import tissue_mask

        slide = Path(slide)
        image = read.image  # (3, H, W) uint8
        stride = int(getattr(getattr(model, "model", model), "stride", 1))
        block = saliency_block(tuple(image.shape[-2:]), stride) if self.saliency else None
        with eval_mode(model), tissue_masked(model, read):
            maps = slide_maps(model, image, saliency_block=block, probabilities=probabilities, autocast=self.autocast)
        if self.transform is not None:
            maps = self.transform(maps)
        stem = _stem(slide)
        for kind, values in (("cam", maps.cam), ("saliency", maps.saliency), ("attention", maps.attention)):
            if values is not None:
                with named_write_errors(self.out_dir / f"{stem}.{kind}.npy", "the heatmap"):
                    np.save(self.out_dir / f"{stem}.{kind}.npy", values.float().numpy())
        with open_slide(slide) as reader:
            where = Placement(tuple(float(v) for v in read.box), float(read.downsample),  # type: ignore[arg-type]
                              tuple(reader.info.dimensions))  # type: ignore[arg-type]
            thumb = slide_thumbnail(reader, image, where)
            mpp = reader.info.mpp
        tissue, _ = tissue_mask(thumb.rgb)
        png = render_heatmap(self.out_dir / f"{stem}.png", maps, thumb, where, self.class_names, slide.name, tissue)
        rec = self._record(slide, stem, maps, where, png, label)
        # max pooling: does each class's deciding cell lie on the read's tissue? (None: no tissue mask)
        map_mask = getattr(read, "map_mask", None)
        rec["decisive_on_tissue"] = (decided_on_tissue(maps.decisive, map_mask(*maps.cam.shape[-2:]))
                                     if maps.decisive is not None and map_mask is not None else None)  # fmt: skip
        if self.viewer:
            level0_mpp = (mpp[0] + mpp[1]) / 2 if mpp else (read.mpp / read.downsample if read.mpp else None)
            rec.update(self._viewer_files(stem, maps, where, level0_mpp, thumb, tissue))
        else:
            rec.update(geojson=None, heatmap_tif=None)
        self.records.append(rec)
        return rec

    def _viewer_files(
        self, stem: str, maps: SlideMaps, where: Placement, mpp: float | None, thumb: Thumbnail, tissue: np.ndarray
    ) -> dict[str, Any]:
        """``NAME.geojson`` (every class's CAM and every attention branch, on tissue) and ``NAME.heatmap.tif`` (the
        predicted class's attention branch for attention heads, else its CAM)."""
        cam = maps.cam.double().numpy()
        grid = MapGrid.of_read(where.box, where.downsample, maps.stride, cam.shape[1:], where.slide_wh, mpp)
        # Cells off the tissue are left out of the GeoJSON (fewer, more useful detections); with no tissue found,
        # or all of the thumbnail tissue, every cell is kept.
        keep = grid.sample(tissue, thumb.extent) if tissue.any() and not tissue.all() else None
        named = {f"cam {c}": cam[k] for k, c in enumerate(self.class_names)}
        shown = f"cam {self.class_names[maps.predicted]}"
        colours: dict[str, Any] = {}
        if maps.attention is not None:  # weights (sum 1 per branch); a GeoJSON cell of k x k carries their mean
            att = maps.attention.double().numpy()
            branches = {"attention": att[0]} if len(att) == 1 else {
                f"attention {c}": att[k] for k, c in enumerate(self.class_names)}  # fmt: skip
            named.update(branches)
            shown = "attention" if len(att) == 1 else f"attention {self.class_names[maps.predicted]}"
            colours = {"vmin": 0.0, "vmax": float(branches[shown].max()) or 1.0, "cmap": "inferno"}
        gj = write_geojson(self.out_dir / f"{stem}.geojson", named, grid, k=self.geojson_k, keep=keep)
        tif = write_heatmap_tiff(self.out_dir / f"{stem}.heatmap.tif", named[shown], grid, **colours)
        return {
            "geojson": gj.path.name,
            "geojson_cell_px": gj.cell_px,
            "geojson_features": gj.features,
            "heatmap_tif": tif.path.name,
            "heatmap_tif_map": shown,
            "heatmap_tif_range": [tif.vmin, tif.vmax],
            "mpp": mpp,
        }

    def _record(
        self, slide: Path, stem: str, maps: SlideMaps, where: Placement, png: Path, label: int | None
    ) -> dict[str, Any]:
        return {
            "slide": slide.name,
            "path": str(slide),
            "png": png.name,
            "cam": f"{stem}.cam.npy",
            "saliency": f"{stem}.saliency.npy" if maps.saliency is not None else None,
            "attention": f"{stem}.attention.npy" if maps.attention is not None else None,  # (branches, h, w)
            "label": self.class_names[label] if label is not None else None,
            "predicted": self.class_names[maps.predicted],
            "probs": {c: float(p) for c, p in zip(self.class_names, maps.probs.tolist(), strict=True)},
            "logits": [float(v) for v in maps.logits.tolist()],
            "pool": maps.pool,
            "cam_shape": list(maps.cam.shape),
            "stride": maps.stride,
            "saliency_block": maps.block or None,
            "box": list(where.box),
            "downsample": where.downsample,
            "decisive": maps.decisive.tolist() if maps.decisive is not None else None,
        }

    def close(self) -> Path:
        path = self.out_dir / INDEX
        with named_write_errors(path, "the heatmap index"), open(path, "w") as f:
            json.dump({"classes": self.class_names, "slides": self.records}, f, indent=2)
            f.write("\n")
        return path


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".ome.tif", ".ome.tiff"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem
