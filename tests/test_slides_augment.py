"""Augmentation on the uint8 buffer: same results as torch's out-of-place ops, in place, reproducible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.slides.augment import (
    AugmentConfig,
    apply_color_jitter,
    apply_color_jitter_,
    augment_uint8,
    hflip_,
    rot90_,
    sample_color_jitter,
    vflip_,
)


@pytest.mark.parametrize("shape", [(5, 5), (37, 37), (7, 4), (33, 70)])
def test_flips_and_turns_match_torch(shape: tuple[int, int]) -> None:
    x = torch.randint(0, 256, (3, *shape), dtype=torch.uint8)
    assert torch.equal(hflip_(x.clone(), chunk_rows=4), x.flip(2))
    assert torch.equal(vflip_(x.clone(), chunk_rows=4), x.flip(1))
    for k in range(4):
        assert torch.equal(rot90_(x.clone(), k, chunk=8), torch.rot90(x, k, dims=(1, 2))), k


def test_square_turns_and_flips_stay_in_place() -> None:
    x = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)
    ptr = x.data_ptr()
    for k in (1, 2, 3):
        assert rot90_(x, k, chunk=16).data_ptr() == ptr
    y = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8)
    assert rot90_(y, 2).data_ptr() == y.data_ptr()
    assert rot90_(y, 1).shape == (3, 30, 20)  # non-square quarter turn: a new buffer


def test_augment_is_reproducible_and_varies_with_seed() -> None:
    x = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8)
    a = augment_uint8(x.clone(), np.random.default_rng(1), color_jitter="hed", strength=0.1)
    b = augment_uint8(x.clone(), np.random.default_rng(1), color_jitter="hed", strength=0.1)
    assert torch.equal(a, b)
    outs = {augment_uint8(x.clone(), s, flips=True, rot90=True).numpy().tobytes() for s in range(20)}
    assert len(outs) >= 4  # several of the 8 dihedral variants appear
    assert torch.equal(augment_uint8(x.clone(), 3, flips=False, rot90=False), x)


@pytest.mark.parametrize("kind", ["hed", "hsv"])
def test_color_jitter_identity_at_zero_strength_and_changes_otherwise(kind: str) -> None:
    x = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    assert torch.equal(apply_color_jitter(x, sample_color_jitter(0, kind, 0.0)), x)
    p = sample_color_jitter(0, kind, 0.1)
    y = apply_color_jitter(x, p)
    assert y.dtype == torch.uint8 and (y.int() - x.int()).abs().float().mean() > 1
    # Chunked in-place jitter on the host buffer equals jitter of the whole at once (per-pixel op).
    z = x.clone()
    apply_color_jitter_(z, p, chunk_rows=5)
    assert torch.equal(z, y)
    # Float tiles (as on the device, values 0-255) get the same colours before rounding.
    assert torch.allclose(apply_color_jitter(x.float(), p), y.float(), atol=0.51)


def test_hsv_jitter_keeps_gray_gray_and_hed_keeps_white_close() -> None:
    gray = torch.full((3, 4, 4), 128, dtype=torch.uint8)
    out = apply_color_jitter(gray, sample_color_jitter(5, "hsv", 0.1))
    assert (out == out[0:1]).all()  # no saturation to shift: still gray
    white = torch.full((3, 4, 4), 255, dtype=torch.uint8)
    assert (apply_color_jitter(white, sample_color_jitter(5, "hed", 0.02)).int() - 255).abs().max() < 40


def test_bad_settings_are_named() -> None:
    with pytest.raises(WsiTrainError, match="color_jitter 'lab'"):
        AugmentConfig(color_jitter="lab")
    with pytest.raises(WsiTrainError, match="jitter_strength"):
        augment_uint8(torch.zeros((3, 4, 4), dtype=torch.uint8), 0, strength=2.0)
    with pytest.raises(WsiTrainError, match="uint8"):
        augment_uint8(torch.zeros((3, 4, 4)), 0)
