"""The report's tissue section: per slide, what the tissue detector kept and dropped, with a thumbnail.

Records come from the run's data.json (``tissue``: the preflight's per-slide records, with each slide's path). Each
thumbnail is the detector's own 512 px view, detected again with the run's settings (config.yaml's data.tissue,
data.fallback_mpp and data.background): the kept tissue outlined in green, every dropped piece boxed in its reason's
colour. Slides with doubts (a dropped piece that may be tissue) come first; past ``THUMBNAILS`` slides the table goes
on without pictures, so a cohort of thousands stays a page.
"""

from __future__ import annotations

import html
import io
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from wsitrain.slides.tissue.pieces import DROP_REASONS
from wsitrain.slides.tissue.result import TissueResult
from wsitrain.slides.tissue.summary import describe_dropped

THUMBNAILS = 48  # slides shown with a picture; the rest are table rows only
SHOWN_SIDE = 320  # px: the picture's longer side in the table (its PNG is the detector's full 512 px view)
KEPT_OUTLINE = (34, 139, 34)  # forestgreen, as the heatmaps outline tissue
REASON_COLOURS = {"small": (220, 20, 60), "dust": (255, 140, 0), "pen": (148, 0, 211), "label": (0, 139, 139)}
assert set(REASON_COLOURS) == set(DROP_REASONS)


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def tissue_picture(thumb: np.ndarray, result: TissueResult) -> bytes:
    """PNG bytes: the (h, w, 3) uint8 thumbnail, the kept mask's outline in green, each dropped piece boxed (2 px
    beyond its own box, so a one-pixel speck is seen) in its reason's colour."""
    from skimage.segmentation import find_boundaries

    img = thumb.copy()
    img[find_boundaries(result.mask, mode="inner")] = KEPT_OUTLINE
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    for p in result.dropped:
        r0, c0, r1, c1 = p.bbox
        draw.rectangle((c0 - 2, r0 - 2, c1 + 1, r1 + 1), outline=REASON_COLOURS[p.kind], width=1)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return buf.getvalue()


def _picture(path: str, cfg: dict[str, Any]) -> bytes | None:
    """The slide's picture under the run's settings; None when the slide cannot be read now (moved, deleted)."""
    from wsitrain.errors import WsiTrainError
    from wsitrain.slides.pixels import read_thumbnail
    from wsitrain.slides.readers import open_slide
    from wsitrain.slides.tissue import TissueSettings, detect_tissue

    data = cfg.get("data") or {}
    tissue = data.get("tissue") or {}
    settings = TissueSettings(**({"min_fragment_mm2": tissue["min_fragment_mm2"]} if "min_fragment_mm2" in tissue
                                 else {}), fallback_mpp=data.get("fallback_mpp"))  # fmt: skip
    background = tuple(data.get("background") or (255, 255, 255))
    try:
        with open_slide(path, background) as reader:  # type: ignore[arg-type]
            result = detect_tissue(reader, settings=settings)
            thumb, _ = read_thumbnail(reader)
    except (WsiTrainError, OSError):
        return None
    return tissue_picture(thumb, result)


def tissue_section(records: dict[str, dict[str, Any]] | None, cfg: dict[str, Any], data_uri: Any) -> str:
    """HTML of the section; ``data_uri`` turns PNG bytes into an inline image source."""
    out = ["<h2>Tissue</h2>"]
    if not records:
        return out[0] + ('<div class="note">no tissue records in data.json: the run detected no tissue (region '
                         'whole without data.mask_background), skipped it (--shapes-only), or predates them</div>')
    first = next(iter(records.values()))
    keys = ", ".join(f'<span style="color:rgb{REASON_COLOURS[r]}">{r}</span>' for r in DROP_REASONS)
    out.append(f"<p class=\"muted\">Pieces of tissue of {first['min_fragment_mm2']:g} mm² or more are kept "
               "(data.tissue.min_fragment_mm2), however far apart; the crop covers them all. Kept tissue is "
               f"outlined in green; dropped pieces are boxed by reason: {keys}. A doubt is a dropped piece that may "
               "be tissue (larger than a tenth of the threshold, or darker than the kept tissue).</p>")
    order = sorted(records, key=lambda n: (not records[n]["doubts"], n))
    rows = []
    for i, name in enumerate(order):
        r = records[name]
        pic = ""
        if i < THUMBNAILS and r.get("path"):
            png = _picture(r["path"], cfg)
            pic = (f'<img alt="{_e(name)}" style="max-width:{SHOWN_SIDE}px;max-height:{SHOWN_SIDE}px" '
                   f'src="{data_uri(png)}">') if png else "(slide not readable now)"  # fmt: skip
        big = r["dropped"]["largest"]
        largest = f"{big['area_mm2']:.4g} mm² {big['kind']}" if big else "–"
        doubts = "; ".join(f"{d['kind']} {d['area_mm2']:.4g} mm² at {d['box'][:2]}: {d['why']}" for d in r["doubts"])
        mpp = f"{r['mpp']:g}" + (" (assumed)" if r["mpp_assumed"] else "")
        rows.append(
            f'<tr class="{"wrong" if r["doubts"] else ""}"><td>{_e(name)}</td><td>{pic}</td>'
            f'<td class="num">{r["kept"]["count"]}</td><td class="num">{r["kept"]["area_mm2"]:.4g}</td>'
            f"<td>{_e(describe_dropped(r))}</td>"
            f"<td>{_e(largest)}</td>"
            f"<td>{_e(doubts) if doubts else '–'}</td><td class=\"num\">{_e(mpp)}</td></tr>"
        )
    out.append("<table><tr><th>slide</th><th>thumbnail</th><th>kept</th><th>kept mm²</th><th>dropped</th>"
               "<th>largest dropped</th><th>doubts</th><th>µm/px</th></tr>" + "".join(rows) + "</table>")
    if len(order) > THUMBNAILS:
        out.append(f'<p class="muted">Pictures for the first {THUMBNAILS} slides (doubts first).</p>')
    return "\n".join(out)
