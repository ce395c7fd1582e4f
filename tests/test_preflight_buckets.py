"""Shape buckets: few distinct shapes, every region fits its bucket, padding is the background colour."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsitrain.slides.buckets import bucket_edge, bucket_shape, pad_to_bucket


@pytest.mark.parametrize("steps", [1, 2, 4, 8])
@pytest.mark.parametrize("multiple", [1, 16, 32])
def test_edges_hold_the_length_are_multiples_idempotent_and_monotone(steps: int, multiple: int) -> None:
    previous = 0
    for length in range(1, 5000, 7):
        e = bucket_edge(length, multiple=multiple, steps=steps)
        assert e >= length and e % multiple == 0
        assert bucket_edge(e, multiple=multiple, steps=steps) == e  # an edge is its own bucket
        assert e >= previous
        previous = e
        # Growth is bounded by one ladder step (plus rounding up to the multiple).
        units = -(-length // multiple)
        assert e / multiple <= units * (1 + 1 / steps) + 1


def test_few_distinct_shapes_for_many_slides() -> None:
    rng = np.random.default_rng(0)
    shapes = [(int(h), int(w)) for h, w in rng.integers(2000, 40000, size=(500, 2))]
    buckets = {bucket_shape(s, multiple=32, steps=4) for s in shapes}
    edges = {e for b in buckets for e in b}
    # 2000..40000 px spans ~4.3 doublings: at most 4 edges per doubling (+1) on each side.
    assert len(edges) <= 4 * 5 + 1
    assert len(buckets) < len(set(shapes)) / 2
    for s in shapes:
        b = bucket_shape(s, multiple=32, steps=4)
        assert b[0] >= s[0] and b[1] >= s[1]
        assert b[0] <= 1.25 * s[0] + 32 and b[1] <= 1.25 * s[1] + 32


def test_more_steps_fewer_pixels_more_buckets() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1000, 20000, size=300)
    coarse = {bucket_edge(int(x), multiple=32, steps=2) for x in lengths}
    fine = {bucket_edge(int(x), multiple=32, steps=16) for x in lengths}
    assert len(coarse) < len(fine)
    waste = [sum(bucket_edge(int(x), multiple=32, steps=s) - x for x in lengths) for s in (2, 16)]
    assert waste[0] > waste[1]


def test_no_bucketing_rounds_to_the_stride_only() -> None:
    assert bucket_edge(1000, multiple=32, steps=None) == 1024
    assert bucket_edge(1025, multiple=32, steps=None) == 1056
    assert bucket_edge(1025, multiple=32, steps=4) == 1280


def test_bad_arguments() -> None:
    for kwargs in ({"length": 0}, {"length": 5, "multiple": 0}, {"length": 5, "steps": 0}):
        with pytest.raises(ValueError):
            bucket_edge(**kwargs)


def test_padding_uses_the_background_and_keeps_the_image() -> None:
    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 37, 51), dtype=torch.uint8, generator=g)
    bg = (240, 10, 128)
    out = pad_to_bucket(image, (64, 80), bg)
    assert out.shape == (3, 64, 80) and out.dtype == torch.uint8
    torch.testing.assert_close(out[:, :37, :51], image)
    expected = torch.tensor(bg, dtype=torch.uint8)[:, None, None]
    assert torch.equal(out[:, 37:, :], expected.expand(3, 64 - 37, 80))
    assert torch.equal(out[:, :37, 51:], expected.expand(3, 37, 80 - 51))


def test_padding_is_a_no_op_at_the_bucket_shape_and_refuses_a_smaller_bucket() -> None:
    image = torch.zeros((3, 32, 48), dtype=torch.uint8)
    assert pad_to_bucket(image, (32, 48), (255, 255, 255)) is image
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_bucket(image, (32, 40), (255, 255, 255))
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        pad_to_bucket(torch.zeros((32, 48), dtype=torch.uint8), (32, 48), (255, 255, 255))
