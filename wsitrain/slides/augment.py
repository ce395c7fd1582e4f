"""Augmentation at gigapixel scale, on the uint8 CHW slide buffer without a full-size float (or second) copy.

Flips are done in place by swapping row/column blocks; 180-degree turns are two flips; 90/270-degree turns are
an in-place block transpose for square images and, for non-square ones, one new uint8 buffer filled block by
block (the old one is freed when the caller drops it). Colour jitter (HED stain jitter after Tellez et al. 2018,
or HSV) is applied in row chunks, converting only a chunk to float at a time; ``apply_color_jitter`` does the
same on a device tile, so jitter can also run per tile inside the model with the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wsitrain.errors import WsiTrainError

JITTERS = ("hed", "hsv")

# Ruifrok & Johnston stain vectors (rows: haematoxylin, eosin, DAB), as in scikit-image's rgb_from_hed.
_RGB_FROM_HED = torch.tensor([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]], dtype=torch.float64)
_RGB_FROM_HED = _RGB_FROM_HED / _RGB_FROM_HED.norm(dim=1, keepdim=True)
_HED_FROM_RGB = torch.linalg.inv(_RGB_FROM_HED)


@dataclass(frozen=True)
class AugmentConfig:
    """Which augmentations to draw per slide read. ``strength`` scales the colour jitter (0.05 is mild)."""

    flips: bool = True
    rot90: bool = True
    color_jitter: str | None = None  # None, "hed" or "hsv"
    strength: float = 0.05

    def __post_init__(self) -> None:
        _check_jitter(self.color_jitter, self.strength)


@dataclass(frozen=True)
class ColorJitterParams:
    """Drawn once per slide so every chunk/tile of the slide gets the same colour change."""

    kind: str
    alpha: tuple[float, float, float]  # hed: per-stain scale; hsv: (unused, saturation scale, value scale)
    beta: tuple[float, float, float]  # hed: per-stain shift; hsv: (hue shift in turns, 0, 0)


def _check_jitter(kind: str | None, strength: float) -> None:
    if kind is not None and kind not in JITTERS:
        raise WsiTrainError(
            f"data.augment.color_jitter {kind!r} is not one of hed, hsv", hint="set it to hed, hsv or none"
        )
    if not 0 <= strength <= 1:
        raise WsiTrainError(
            f"data.augment.jitter_strength {strength} must be within 0..1", hint="0.05 is a mild jitter, 0.2 strong"
        )


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def sample_color_jitter(rng: np.random.Generator | int | None, kind: str, strength: float) -> ColorJitterParams:
    """Draw jitter parameters: HED alpha ~ U(1-s, 1+s), beta ~ U(-s, s); HSV hue +-s turns, sat/value 1 +- 4s/2s."""
    _check_jitter(kind, strength)
    g = _rng(rng)
    s = float(strength)
    if kind == "hed":
        a = tuple(float(v) for v in g.uniform(1 - s, 1 + s, size=3))
        b = tuple(float(v) for v in g.uniform(-s, s, size=3))
        return ColorJitterParams("hed", a, b)  # type: ignore[arg-type]
    hue = float(g.uniform(-s, s))
    sat = float(g.uniform(max(0.0, 1 - 4 * s), 1 + 4 * s))
    val = float(g.uniform(max(0.0, 1 - 2 * s), 1 + 2 * s))
    return ColorJitterParams("hsv", (1.0, sat, val), (hue, 0.0, 0.0))


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x[..., 0, :, :], x[..., 1, :, :], x[..., 2, :, :]
    mx, _ = x.max(dim=-3)
    mn, _ = x.min(dim=-3)
    d = mx - mn
    safe = torch.where(d > 0, d, torch.ones_like(d))
    h = torch.where(mx == r, ((g - b) / safe) % 6, torch.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h = torch.where(d > 0, h / 6, torch.zeros_like(h))
    s = torch.where(mx > 0, d / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    return torch.stack([h, s, mx], dim=-3)


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    h, s, v = x[..., 0, :, :], x[..., 1, :, :], x[..., 2, :, :]
    k = lambda n: (n + h * 6) % 6  # noqa: E731 - the standard closed form
    f = lambda n: v - v * s * torch.clamp(torch.minimum(k(n), 4 - k(n)), 0, 1)  # noqa: E731
    return torch.stack([f(5), f(3), f(1)], dim=-3)


def apply_color_jitter(x: torch.Tensor, params: ColorJitterParams) -> torch.Tensor:
    """Jitter an RGB tensor (..., 3, h, w) with values 0-255 (uint8 or float), on any device; same dtype back."""
    dtype = x.dtype
    f = x.to(torch.float32)
    if params.kind == "hed":
        m_in = _HED_FROM_RGB.to(device=x.device, dtype=torch.float32)
        m_out = _RGB_FROM_HED.to(device=x.device, dtype=torch.float32)
        od = -torch.log((f + 1.0) / 256.0)  # optical density, 0 for white
        hed = torch.einsum("...chw,cd->...dhw", od, m_in)
        a = torch.tensor(params.alpha, device=x.device, dtype=torch.float32).view(3, 1, 1)
        b = torch.tensor(params.beta, device=x.device, dtype=torch.float32).view(3, 1, 1)
        od = torch.einsum("...dhw,dc->...chw", hed * a + b, m_out)
        out = 256.0 * torch.exp(-od) - 1.0
    else:
        hsv = _rgb_to_hsv(f / 255.0)
        h = (hsv[..., 0:1, :, :] + params.beta[0]) % 1.0
        s = (hsv[..., 1:2, :, :] * params.alpha[1]).clamp(0, 1)
        v = (hsv[..., 2:3, :, :] * params.alpha[2]).clamp(0, 1)
        out = _hsv_to_rgb(torch.cat([h, s, v], dim=-3)) * 255.0
    out = out.clamp(0, 255)
    return out.round().to(dtype) if not dtype.is_floating_point else out.to(dtype)


def apply_color_jitter_(image: torch.Tensor, params: ColorJitterParams, chunk_rows: int = 256) -> torch.Tensor:
    """In-place jitter of a uint8 (3, H, W) buffer, ``chunk_rows`` rows at a time (float only per chunk)."""
    for r in range(0, image.shape[1], chunk_rows):
        blk = image[:, r : r + chunk_rows]
        blk.copy_(apply_color_jitter(blk, params))
    return image


def hflip_(image: torch.Tensor, chunk_rows: int = 512) -> torch.Tensor:
    """Mirror left-right in place (a row block at a time)."""
    for r in range(0, image.shape[1], chunk_rows):
        blk = image[:, r : r + chunk_rows]
        blk.copy_(blk.flip(-1))
    return image


def vflip_(image: torch.Tensor, chunk_rows: int = 512) -> torch.Tensor:
    """Mirror top-bottom in place by swapping row blocks from both ends."""
    H = image.shape[1]
    for i in range(0, H // 2, chunk_rows):
        j = min(i + chunk_rows, H // 2)
        top = image[:, i:j].clone()
        image[:, i:j].copy_(image[:, H - j : H - i].flip(1))
        image[:, H - j : H - i].copy_(top.flip(1))
    return image


def _transpose_square_(image: torch.Tensor, block: int = 512) -> torch.Tensor:
    """Swap H and W of a square (3, N, N) buffer in place, block pair by block pair."""
    n = image.shape[1]
    for i in range(0, n, block):
        for j in range(i, n, block):
            a = image[:, i : i + block, j : j + block]
            if i == j:
                a.copy_(a.transpose(1, 2).clone())
                continue
            b = image[:, j : j + block, i : i + block]
            tmp = a.clone()
            a.copy_(b.transpose(1, 2))
            b.copy_(tmp.transpose(1, 2))
    return image


def rot90_(image: torch.Tensor, k: int, chunk: int = 512) -> torch.Tensor:
    """``torch.rot90(image, k, dims=(1, 2))`` in place when possible; non-square 90/270 turns return a new buffer."""
    k %= 4
    if k == 0:
        return image
    if k == 2:
        return vflip_(hflip_(image, chunk), chunk)
    _, H, W = image.shape
    if H == W:
        _transpose_square_(image, chunk)
        return vflip_(image, chunk) if k == 1 else hflip_(image, chunk)
    out = torch.empty((3, W, H), dtype=image.dtype, pin_memory=image.is_pinned())
    for i0 in range(0, W, chunk):
        i1 = min(W, i0 + chunk)
        if k == 1:  # out = image.transpose.flip(rows): out row i is image column W-1-i
            out[:, i0:i1].copy_(image[:, :, W - i1 : W - i0].transpose(1, 2).flip(1))
        else:  # k == 3: out = image.transpose.flip(cols)
            out[:, i0:i1].copy_(image[:, :, i0:i1].transpose(1, 2).flip(2))
    return out


def augment_uint8(
    image: torch.Tensor,
    rng: np.random.Generator | int | None,
    flips: bool = True,
    rot90: bool = True,
    color_jitter: str | None = None,
    strength: float = 0.05,
) -> torch.Tensor:
    """Randomly flip / turn / colour-jitter a uint8 (3, H, W) slide; in place except non-square 90-degree turns.

    Use the returned tensor (it is ``image`` itself unless a non-square image was turned by 90 degrees).
    """
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
        raise WsiTrainError(f"augment_uint8 needs a uint8 (3, H, W) tensor, got {image.dtype} {tuple(image.shape)}")
    _check_jitter(color_jitter, strength)
    geo, params = draw_augmentation(rng, AugmentConfig(flips, rot90, color_jitter, strength))
    return apply_drawn(image, geo, params)


def draw_augmentation(
    rng: np.random.Generator | int | None, cfg: AugmentConfig
) -> tuple[Geometry, ColorJitterParams | None]:
    """The flips, turns and jitter parameters ``augment_from_config`` applies with a generator in ``rng``'s state.

    Every random number is drawn up front, in a fixed order, so a seed gives the same result whatever is enabled.
    """
    g = _rng(rng)
    geo = _draw_geometry(g, cfg.flips, cfg.rot90)
    return geo, sample_color_jitter(g, cfg.color_jitter, cfg.strength) if cfg.color_jitter else None


def apply_drawn(image: torch.Tensor, geo: Geometry, params: ColorJitterParams | None) -> torch.Tensor:
    """Apply drawn augmentations to a uint8 (3, H, W) slide, in place except non-square quarter turns."""
    if geo.hflip:
        hflip_(image)
    if geo.vflip:
        vflip_(image)
    if geo.k:
        image = rot90_(image, geo.k)
    if params is not None:
        apply_color_jitter_(image, params)
    return image


@dataclass(frozen=True)
class Geometry:
    """The flips and quarter turns one augmentation applied, in this order (to move a mask along with the image)."""

    hflip: bool = False
    vflip: bool = False
    k: int = 0  # quarter turns, as torch.rot90 over (H, W)

    def apply(self, m: torch.Tensor) -> torch.Tensor:
        """The same flips and turns on ``m`` (..., H, W)."""
        if self.hflip:
            m = m.flip(-1)
        if self.vflip:
            m = m.flip(-2)
        return torch.rot90(m, self.k, (-2, -1)) if self.k else m


def _draw_geometry(g: np.random.Generator, flips: bool, rot90: bool) -> Geometry:
    do_h, do_v, k = g.random() < 0.5, g.random() < 0.5, int(g.integers(4))
    return Geometry(flips and do_h, flips and do_v, k if rot90 else 0)


def geometry_of(rng: np.random.Generator | int | None, cfg: AugmentConfig) -> Geometry:
    """The flips and turns ``augment_from_config`` applies with a generator in the same state as ``rng``."""
    return _draw_geometry(_rng(rng), cfg.flips, cfg.rot90)


def augment_from_config(image: torch.Tensor, rng: np.random.Generator | int | None, cfg: AugmentConfig) -> torch.Tensor:
    """``augment_uint8`` with the settings of an ``AugmentConfig``."""
    return augment_uint8(image, rng, cfg.flips, cfg.rot90, cfg.color_jitter, cfg.strength)
