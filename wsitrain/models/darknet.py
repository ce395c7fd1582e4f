"""DarkNet-19 trunk (the YOLO9000 classifier's 19 convolutions, without its 1x1 classifier conv)."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

# Channels per conv; "M" is a 2x2 max pool. Widths that halve the previous conv are 1x1 bottlenecks.
# fmt: off
DARKNET19_CFG: tuple[int | str, ...] = (
    32, "M", 64, "M", 128, 64, 128, "M", 256, 128, 256, "M",
    512, 256, 512, 256, 512, "M", 1024, 512, 1024, 512, 1024,
)
# fmt: on


def darknet19_features() -> nn.Sequential:
    """Conv(bias=False)-BN-LeakyReLU(0.1) blocks with 5 max pools: stride 32, 1024 output channels."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    in_ch, prev_out, n_conv, n_pool = 3, None, 0, 0
    for item in DARKNET19_CFG:
        if item == "M":
            n_pool += 1
            layers[f"pool{n_pool}"] = nn.MaxPool2d(2, 2)
            continue
        out_ch = int(item)
        # A conv that halves the width of the conv before it is the 1x1 squeeze of the triple/quintuple.
        k = 1 if prev_out is not None and out_ch * 2 == prev_out else 3
        n_conv += 1
        layers[f"conv{n_conv}"] = nn.Conv2d(in_ch, out_ch, k, padding=k // 2, bias=False)
        layers[f"bn{n_conv}"] = nn.BatchNorm2d(out_ch)
        layers[f"act{n_conv}"] = nn.LeakyReLU(0.1, inplace=True)
        in_ch = prev_out = out_ch
    return nn.Sequential(layers)
