"""``PatchTrunk``: a patch encoder applied on a slide's non-overlapping grid, as one operator of the SFT engine.

An encoder taking ``(N, 3, p, p)`` to ``(N, D)`` (a ViT, a pathology foundation model, a small CNN) applied to every
``p`` x ``p`` patch of a ``(B, 3, H, W)`` image gives a ``(B, D, H // p, W // p)`` embedding map: an operator whose
"kernel" is the encoder, with kernel = stride = ``p`` and no padding, so its receptive field is its own patch and a
tile of whole patches needs no halo. The engine's operator registry describes it as such a window
(``patch_spec``), so the existing executor tiles it: the forward sweep keeps no activations, the head runs forward
and backward on the embedding map (the segment's checkpoint), and each tile (a chunk of patches) is recomputed under
autograd and its embedding gradient back-propagated. Every head, the tissue masks, background reuse, prediction
heatmaps and torchrun come through the engine unchanged. Within a chunk, flat patches (a masked slide's background)
are encoded once per colour, not each (``flat_cells.py``), exactly.

Border rule: rows and columns past the last whole patch are not encoded (as a strided convolution drops them). The
slide reader never leaves any: it pads the read region to whole patches with ``data.background``
(``read_kwargs``' ``pad_multiple`` is the model's stride, ``p``), and a border patch is tissue, and pooled, when any
of its pixels is (``RegionMask.cells``), so tissue at the slide's edge is kept, its patch completed with background.
"""

from __future__ import annotations

import torch
from torch import nn

from wsitrain.patch.flat_cells import encode_distinct


class PatchTrunk(nn.Module):
    """``encoder`` on every ``patch`` x ``patch`` patch of the image: (B, 3, H, W) -> (B, dim, H // patch, W // patch).

    ``encoder`` maps (N, 3, patch, patch) to (N, dim). ``sft_patch`` marks the module for the engine's registry
    (``wsitrain.sft.ops.registry``), which keeps it whole when tracing and tiles it in whole patches.
    """

    sft_patch = True

    def __init__(self, encoder: nn.Module, patch: int, dim: int) -> None:
        super().__init__()
        if patch < 1 or dim < 1:
            raise ValueError(f"patch {patch} and dim {dim} must be positive")
        self.encoder = encoder
        self.patch = int(patch)
        self.dim = int(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cells, grid = self.cells(x)
        # a flat (background) patch encoded once per colour (flat_cells.py)
        return self.embedding_map(encode_distinct(self.encoder, cells), grid)  # (B, D, gh, gw)

    def cells(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(B, C, H, W) -> its whole patches (B * gh * gw, C, p, p) in row-major order, and (B, gh, gw)."""
        b, c, h, w = x.shape
        p = self.patch
        gh, gw = h // p, w // p
        # (B, C, gh, p, gw, p) -> (B, gh, gw, C, p, p) -> (B * gh * gw, C, p, p): patches in row-major order
        cells = x[:, :, : gh * p, : gw * p].reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
        return cells.reshape(b * gh * gw, c, p, p), (b, gh, gw)

    def embedding_map(self, emb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The encoder's (B * gh * gw, D) embeddings as the (B, D, gh, gw) map."""
        if emb.dim() != 2 or emb.shape != (grid[0] * grid[1] * grid[2], self.dim):
            raise ValueError(
                f"the patch encoder {type(self.encoder).__name__} gave {tuple(emb.shape)} for "
                f"{grid[0] * grid[1] * grid[2]} patches, not (N, {self.dim})"
            )
        b, gh, gw = grid
        return emb.reshape(b, gh, gw, self.dim).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"patch={self.patch}, dim={self.dim}"

