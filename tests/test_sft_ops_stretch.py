"""Resizes whose source grid the whole map's extents stretch (``wsitrain.sft.ops.stretch``) tiled: SFT equals plain
autograd.

Bilinear with ``align_corners=True`` and output sizes that are not a whole multiple of the input (GhostNetV2's gate
on odd maps: 5 -> 2 -> 5) read input ``o * (in - 1) / (out - 1)`` or ``floor(o * in / out)``; tiles gather their crop
at those global indices. float64, batch 2, odd non-square images, several tile sizes, convs before and after the
resize: outputs, every parameter gradient and the input gradient; the resize must run on tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sft_models import seeded_case
from test_sft_exact import assert_same, reference, variant
from torch import nn

from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.ops.stretch import Stretch, StretchCall, bilinear_reads, nearest_reads


class OddGate(nn.Module):
    """GhostNetV2's DFC gate: ``x * interpolate(gate(pool(x)), size=x.shape[-2:])`` on a map of any size."""

    def __init__(self, mode: str, align_corners: bool | None) -> None:
        super().__init__()
        self.mode, self.ac = mode, align_corners
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.gate = nn.Sequential(nn.Conv2d(6, 6, 1), nn.Conv2d(6, 6, (1, 5), padding=(0, 2), groups=6))
        self.primary = nn.Conv2d(6, 6, 3, padding=1)
        self.post = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1))  # halo 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))  # (B, 6, H, W)
        res = self.gate(F.avg_pool2d(x, kernel_size=2, stride=2, ceil_mode=True))  # (B, 6, ceil(H/2), ceil(W/2))
        out = self.primary(x)  # (B, 6, H, W)
        kw = {"align_corners": self.ac} if self.mode == "bilinear" else {}
        g = F.interpolate(torch.sigmoid(res), size=(out.shape[-2], out.shape[-1]), mode=self.mode, **kw)
        return self.post(out * g)


class CornerUp(nn.Module):
    """An HRNet-like fuse with ``nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.down = nn.Sequential(nn.Conv2d(6, 6, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.post = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))  # (B, 6, H, W), H and W even
        return self.post(y + self.up(self.down(y)))


def _resize_runs_on_tiles(var, model: nn.Module, shape: tuple[int, ...], word: str) -> None:
    facts = annotate(ModelGraph(model), shape, torch.float64, torch.float64, True)
    node = next(n for n in facts.nodes if word in n.name)
    assert node.spec.kind == WINDOW and isinstance(node.spec.windows[0], Stretch)
    p = var[3].plan_for(shape, input_dtype=torch.float64)
    assert any(s.n_tiles > 1 and s.start < node.index <= s.end for s in p.segments), "the resize must run on tiles"


GATE_CASES = [
    ("nearest", None, (2, 3, 45, 62), 8),
    ("nearest", None, (2, 3, 43, 37), 11),
    ("bilinear", False, (2, 3, 45, 62), 10),
    ("bilinear", False, (2, 3, 29, 41), 7),
    ("bilinear", True, (2, 3, 45, 62), 9),
    ("bilinear", True, (2, 3, 44, 61), 16),
]


@pytest.mark.parametrize(("mode", "ac", "shape", "tile"), GATE_CASES)
@pytest.mark.parametrize("one_segment", [True, False])
def test_stretched_gate_tiles_exact(
    mode: str, ac: bool | None, shape: tuple[int, ...], tile: int, one_segment: bool
) -> None:
    """``one_segment``: the product and the convs after it share the resize's tiled segment, so tiles need the
    resized gate from odd positions with a halo."""
    model, x, t = seeded_case(lambda: OddGate(mode, ac), shape, seed=3)
    ref = reference(model, x, t)
    cuts = {"checkpoints": ["relu", "post.2"]} if one_segment else {}
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB", **cuts)
    assert_same(ref, var)
    _resize_runs_on_tiles(var, model, shape, "interpolate")


@pytest.mark.parametrize(("shape", "tile"), [((2, 3, 44, 62), 10), ((2, 3, 38, 26), 7)])
def test_align_corners_upsample_tiles_exact(shape: tuple[int, ...], tile: int) -> None:
    model, x, t = seeded_case(CornerUp, shape, seed=5)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    _resize_runs_on_tiles(var, model, shape, "up")


def ulp(n: int, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` numbers at ``n``: one rounding of a source coordinate below ``n`` moves it so far."""
    return float(np.spacing(np.array(n, dtype=np.float64 if dtype == torch.float64 else np.float32)))


SIZES = [(1, 1), (1, 4), (2, 5), (5, 2), (3, 7), (7, 3), (11, 32), (23, 45), (45, 23), (64, 65), (97, 40)]


@pytest.mark.parametrize(("n_in", "n_out"), SIZES)
@pytest.mark.parametrize(("mode", "ac"), [("nearest", None), ("bilinear", False), ("bilinear", True)])
def test_every_crop_gives_the_global_outputs(n_in: int, n_out: int, mode: str, ac: bool | None) -> None:
    """For every output interval: the crop the map asks for, resized by the stand-in, holds exactly the untiled
    outputs (bit for bit in the reads; to rounding in the weighted sums), in float64 and float32."""
    # Whether the kernel rounds the source coordinate once (FMA) or twice depends on the build and on the loop
    # it takes: vectorized AVX2 float64 fuses, ATEN_CPU_CAPABILITY=default does not; float32 fuses on short axes
    # (measured on torch 2.14.1, x86-64). One rounding of ``real`` moves a weight by at most ulp(in), so a value by
    # at most that times the two pixels' difference: the slack below, on top of the sums' own rounding.
    for dtype, base in ((torch.float64, 1e-15), (torch.float32, max(2e-6, 2.5e-7 * n_in))):
        x = torch.randn(2, 3, n_in, 5, dtype=dtype)
        tol = base + 2 * float(x.abs().max()) * ulp(n_in, dtype)
        kw = {"align_corners": ac} if mode == "bilinear" else {}
        full = F.interpolate(x, size=(n_out, 5), mode=mode, **kw)  # (2, 3, n_out, 5)
        rows, cols = Stretch(n_in, n_out, mode == "bilinear", bool(ac)), Stretch(5, 5, mode == "bilinear", bool(ac))
        call = StretchCall(rows, cols)
        for a in range(n_out):
            for b in range(a + 1, n_out + 1):
                lo, hi = rows.input_interval(a, b, n_in)
                assert 0 <= lo < hi <= n_in
                g0 = rows.first_output(lo)
                assert g0 <= a and g0 + rows.output_count(lo, hi) >= b
                got = call.at((lo, hi), (0, 5))(x[:, :, lo:hi], (n_out, 5), mode=mode)
                assert got.shape[2] == rows.output_count(lo, hi)
                torch.testing.assert_close(got[:, :, a - g0 : b - g0], full[:, :, a:b], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_source_indices_are_the_kernels(dtype: torch.dtype) -> None:
    """Nearest indices equal the CPU kernel's bit for bit (one-hot probes); bilinear weights within one rounding of
    the source coordinate, in float64 and float32.

    Whether the kernel fuses ``scale * (o + 0.5) - 0.5`` into one FMA depends on the torch build and on the loop it
    takes, not on the formula (measured): float32 at 255 -> 777 matched the stand-in bit for bit with torch 2.15.0
    and not with 2.14.1 (x86-64, AVX2 and ``ATEN_CPU_CAPABILITY=default`` alike); float64 matched with AVX2 and not
    with ``ATEN_CPU_CAPABILITY=default``. One rounding of ``real`` moves a weight by at most ``ulp(n_in)``; an index
    read near an integer ``real`` carries a weight within that of 0 or 1, so the weight matrices agree within it.
    """
    for n_in, n_out in [(2, 5), (5, 2), (3, 7), (37, 79), (255, 777), (1001, 513), (39, 2049)]:
        o = torch.arange(n_out)
        eye = torch.eye(n_in, dtype=dtype).view(1, n_in, n_in, 1)  # channel c: input pixel c along H
        got = F.interpolate(eye, size=(n_out, 1), mode="nearest")[0, :, :, 0]  # (in, out) weights
        exp = torch.zeros(n_in, n_out, dtype=dtype)
        exp[nearest_reads(o, n_in, n_out, torch.float64 if dtype == torch.float64 else torch.float32), o] = 1
        assert torch.equal(got, exp), ("nearest", n_in, n_out)
        tol = ulp(n_in, dtype)  # ``real < n_in``: the most one rounding of it moves ``l = real - i0``
        for ac in (False, True):
            got = F.interpolate(eye, size=(n_out, 1), mode="bilinear", align_corners=ac)[0, :, :, 0]
            i0, i1, lam = bilinear_reads(o, n_in, n_out, ac, dtype, False)
            exp = torch.zeros(n_in, n_out, dtype=dtype)
            exp.index_put_((i0, o), 1 - lam, accumulate=True)
            exp.index_put_((i1, o), lam, accumulate=True)
            torch.testing.assert_close(got, exp, rtol=0, atol=tol, msg=f"bilinear {ac} {n_in} {n_out}")
