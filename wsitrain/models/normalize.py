"""Input normalization: the first layer of every model, so the engine can feed raw uint8 tiles."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class InputNormalization(nn.Module):
    """Pointwise ``(x - mean) / std`` per channel; uint8 input is first scaled to [0, 1].

    Keeping this inside the model (instead of in the data loader) lets slides travel to the device
    as uint8, a quarter of the float32 bytes. It is pointwise, so tiling it is trivially exact.
    The dtype branch looks only at the tensor's dtype, never its values; fx tracers treat this
    module as a leaf.
    """

    # Tells the SFT engine this layer is pointwise (any tile of the input maps to the same tile of the output).
    sft_pointwise = True

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"InputNormalization: mean has {len(mean)} channels but std has {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"InputNormalization: std must be positive, got {tuple(std)}")
        # Buffers (not constants) so .double()/.to(device) move them with the model and they are in state_dict.
        self.register_buffer("mean", torch.tensor(tuple(mean), dtype=torch.float32))
        self.register_buffer("std", torch.tensor(tuple(std), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            x = x.to(self.mean.dtype) / 255
        y = (x - self.mean[:, None, None]) / self.std[:, None, None]
        # Under autocast the next convolution casts this map to the autocast dtype anyway (same values): emit it in
        # that dtype, so the map is the 2-byte activation the planner sizes, not a float32 one twice that size
        # beside the convolution's own cast copy.
        dev = y.device.type
        if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
            y = y.to(torch.get_autocast_dtype(dev))
        return y

    def extra_repr(self) -> str:
        return f"channels={self.mean.numel()}"
