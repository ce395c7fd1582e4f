"""The frozen-feature cache: a frozen encoder's patch embeddings of each slide and augmentation, computed once and
kept on disk, so the head (wsitrain.train.frozen_mil) trains on them for as many epochs as it likes.

This is the CLAM / TRIDENT pipeline built from wsitrain's pieces: the model is the one end-to-end training builds
(``wsitrain.models.zoo.build``, an encoder's ``PatchTrunk`` or a CNN trunk) with everything up to the head frozen,
and a bag is ``frozen_mil.patch_features`` of the slide (or of one of its 8 flips and rotations, the augmentations
end-to-end training draws, ``data.augment``) laid out as the patches' row-major grid.

Files: ``<folder>/<fingerprint>/<slide>.aug<k>.pt``, one (N, D) float32 tensor each, read back through the safe
loader (wsitrain.safe_load). The fingerprint is a hash of everything the embeddings depend on: the frozen modules'
weights and buffers (the input normalisation among them), the patch size and the dtype, so a cache is never read
for another encoder, other weights or another patch size; the slide's key is the caller's (its file name and size).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from wsitrain.safe_load import safe_torch_load

DIHEDRAL = 8  # the flips and quarter turns of a square grid: augmentation k is rot90 k % 4, then a flip if k >= 4


def dihedral(image: torch.Tensor, k: int) -> torch.Tensor:
    """Augmentation ``k`` (0: the image itself) of a (B, C, H, W) image: ``k % 4`` quarter turns, then a
    horizontal flip when ``k >= 4``."""
    if not 0 <= k < DIHEDRAL:
        raise ValueError(f"augmentation {k} is not one of 0..{DIHEDRAL - 1}")
    out = torch.rot90(image, k % 4, (-2, -1))
    return out.flip(-1) if k >= 4 else out


def fingerprint(model: nn.Module, patch: int) -> str:
    """A hash of the frozen part's state (``normalize`` and ``features``: weights and buffers), the patch size and
    the dtype: two caches share files only when their embeddings are the same numbers."""
    h = hashlib.sha256(f"patch={patch}".encode())
    for part in ("normalize", "features"):
        for name, t in getattr(model, part).state_dict().items():
            h.update(f"{part}.{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class FeatureCache:
    """Bags of a frozen model's patch embeddings on disk under ``folder``; ``hits`` / ``computed`` count reads."""

    def __init__(self, folder: Path, model: nn.Sequential, patch: int) -> None:
        self.model = model
        self.patch = patch
        self.folder = Path(folder) / fingerprint(model, patch)
        self.hits = 0
        self.computed = 0

    def path(self, slide: str, aug: int) -> Path:
        return self.folder / f"{slide}.aug{aug}.pt"

    def bag(self, slide: str, aug: int, image: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Slide ``slide``'s bag under augmentation ``aug``: (N, D), read from the cache or computed from
        ``image()`` ((1, 3, H, W) float in [0, 1], read only on a miss) and written there."""
        from wsitrain.train.frozen_mil import patch_features

        feats = self.load(slide, aug)
        if feats is not None:
            return feats
        feats = patch_features(self.model, dihedral(image(), aug), self.patch)  # (N, D)
        self.store(slide, aug, feats)
        return feats

    def load(self, slide: str, aug: int, kind: str = "") -> torch.Tensor | None:
        """The stored tensor (``kind``: a companion file's suffix, e.g. the bag's grid), None when not stored; a
        bag's read counts as a hit."""
        path = self.path(slide, aug).with_suffix(f"{kind}.pt")
        if not path.is_file():
            return None
        self.hits += not kind
        return safe_torch_load(path, "feature cache file")

    def store(self, slide: str, aug: int, value: torch.Tensor, kind: str = "") -> None:
        """Write ``value`` (a bag, or with ``kind`` its companion), atomically; a bag counts as computed."""
        path = self.path(slide, aug).with_suffix(f"{kind}.pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # then renamed: a parallel reader never sees half
        torch.save(value.contiguous(), tmp)
        tmp.replace(path)
        self.computed += not kind
