"""Where a max-pooling head decides (wsitrain/report/decision.py): the deciding cell per class, and whether it lies
on the tissue; an unmasked pool decides on a bright corner off the tissue, the masked pool never does."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from wsitrain.report.decision import DecisionWatch, decided_on_tissue, on_tissue_share
from wsitrain.report.heatmap import slide_maps
from wsitrain.sft import SFT
from wsitrain.sft.ops.masked_pool import MaskedMaxPool2d
from wsitrain.train.attention_mask import tissue_masked


@dataclass
class Read:
    """What the watch and ``tissue_masked`` read of a ``ReadResult``: its tissue mask at the map's size."""

    cells: torch.Tensor  # (1, 1, h, w) bool
    mask: object = True  # a read with a tissue mask

    def map_mask(self, h: int, w: int) -> torch.Tensor:
        assert (h, w) == tuple(self.cells.shape[-2:])
        return self.cells


def model() -> nn.Sequential:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)
    with torch.no_grad():
        conv.weight.abs_()  # every channel grows with the image: a bright corner is every channel's maximum
    return nn.Sequential(OrderedDict([("features", nn.Sequential(conv, nn.ReLU())), ("pool", MaskedMaxPool2d()),
                                      ("flatten", nn.Flatten(1)), ("fc", nn.Linear(6, 2))])).double()  # fmt: skip


def corner_image() -> torch.Tensor:
    x = torch.rand(3, 40, 56, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[:, :3, :3] = 40.0  # bright, off the tissue
    return x


def tissue() -> torch.Tensor:
    cells = torch.zeros(1, 1, 20, 28, dtype=torch.bool)
    cells[:, :, 5:18, 6:25] = True
    return cells


def test_unmasked_max_decides_off_tissue_masked_never() -> None:
    net = model()
    engine = SFT(net, tile_size=16, memory_budget="1GiB")
    x, read = corner_image(), Read(tissue())
    watch = DecisionWatch(engine)
    assert watch.active
    with torch.no_grad(), watch.slide(x, read):  # no mask set: the whole map is pooled
        engine(x[None])
    assert watch.last == [False, False]
    assert watch.cells is not None and all(r < 3 and c < 3 for r, c in watch.cells), "decided at the bright corner"
    with torch.no_grad(), tissue_masked(net, read), watch.slide(x, read):
        engine(x[None])
    assert watch.last == [True, True]
    assert watch.cells is not None and all(bool(read.cells[0, 0, r, c]) for r, c in watch.cells)
    # the same cells as the plain model's heatmap under the same mask
    with torch.no_grad(), tissue_masked(net, read):
        maps = slide_maps(net, x)
    assert maps.decisive is not None and [tuple(v) for v in maps.decisive.tolist()] == watch.cells


def test_no_tissue_mask_no_record_and_shares() -> None:
    assert decided_on_tissue(torch.tensor([[0, 0], [1, 1]]), None) is None
    cells = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    cells[0, 0, 1, 1] = True
    assert decided_on_tissue(torch.tensor([[0, 0], [1, 1]]), cells) == [False, True]
    recs = [[False, True], None, [True, True]]
    assert on_tissue_share(recs, 0) == 0.5 and on_tissue_share(recs, 1) == 1.0
    assert on_tissue_share([None], 0) is None


def test_an_average_pooling_head_records_nothing() -> None:
    net = nn.Sequential(OrderedDict([("features", nn.Conv2d(3, 4, 3)), ("pool", nn.AdaptiveAvgPool2d(1)),
                                     ("flatten", nn.Flatten(1)), ("fc", nn.Linear(4, 2))]))  # fmt: skip
    watch = DecisionWatch(SFT(net, tile_size=16, memory_budget="1GiB"))
    assert not watch.active
    with watch.slide(torch.rand(3, 20, 20), None):
        pass
    assert watch.last is None
