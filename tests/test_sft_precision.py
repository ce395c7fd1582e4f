"""Precision guard (issue 19, item 6): without autocast, every floating-point value SFT computes in forward and
backward is in the model's dtype. A float32 statistic in a float64 run (or a float64 one in a float32 run) would
round every tile's result, or double the memory the plan counted, without failing an exactness test at its
tolerance. A dispatch mode records the dtype of every operator's floating-point output.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sft_models_modern import convnext_like
from test_sft_multipass import _randomize_bn, bn_chain, multipass_segments, se_blocks
from test_sft_multipass_pool import resnet_like, se_like
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from wsitrain.sft import SFT


class DtypeLog(TorchDispatchMode):
    """Records (operator, dtype, shape) of every floating-point operator output not in ``dtypes``."""

    def __init__(self, *dtypes: torch.dtype) -> None:
        super().__init__()
        self.dtypes = dtypes
        self.ops = 0
        self.other: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # meta tensors hold no values: shape reads of the untiled map (a squeeze-excitation chain's x.size())
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                self.ops += 1
                if t.dtype not in self.dtypes:
                    self.other.append((str(func), t.dtype, tuple(t.shape)))
        return out


CASES: dict[str, tuple[Callable[[], nn.Module], bool, dict[str, object]]] = {
    # squeeze-excitation (torchvision's, in MBConv blocks) in multi-pass segments, frozen BatchNorm
    "squeeze_excitation": (se_blocks, False, {"tile_size": 16}),
    # train-mode BatchNorm: batch statistics summed over tiles, running statistics updated
    "train_batchnorm": (bn_chain, True, {"tile_size": 16}),
    # the global pool folded into the last (multi-pass, train BN) segment
    "fused_pool": (lambda: resnet_like("avg"), True, {"tile_size": 16, "checkpoints": []}),
    # squeeze-excitation before a fused max pool, eval
    "fused_pool_se": (lambda: se_like("amax"), False, {"tile_size": 16, "checkpoints": []}),
    # plain tiled segments: LayerNorm, channels-last, GELU
    "tiled": (convnext_like, False, {"tile_size": 16}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_every_value_stays_in_the_model_dtype(case: str, dtype: torch.dtype) -> None:
    make, train, kw = CASES[case]
    torch.manual_seed(0)
    model = make().to(dtype).train(train)
    _randomize_bn(model)
    plain = copy.deepcopy(model)
    engine = SFT(model, memory_budget="4GiB", **kw)
    x = torch.randn(2, 3, 45, 62, dtype=dtype)
    xs = x.clone().requires_grad_(True)
    with DtypeLog(dtype) as log:
        engine(xs).square().sum().backward()
    assert log.ops > 100, "the mode must see the step's operators"
    assert not log.other, f"{case}: values outside {dtype}: {log.other[:8]}"
    compiled = next(iter(engine._cache.values()))
    assert any(s is not None for s in compiled.segments), "the step must run tiled segments"
    if case != "tiled":
        assert multipass_segments(engine), "the step must run multi-pass segments"
    # and the step is still plain's, in the run's dtype
    xp = x.clone().requires_grad_(True)
    plain(xp).square().sum().backward()
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    torch.testing.assert_close(xs.grad, xp.grad, **tol)


@pytest.mark.parametrize("case", ["squeeze_excitation", "fused_pool"])
def test_autocast_values_are_bf16_or_float32(case: str) -> None:
    """Under bf16 autocast a float32 model computes in bf16 and float32 (statistics), never in float64."""
    make, train, kw = CASES[case]
    torch.manual_seed(0)
    model = make().train(train)
    _randomize_bn(model)
    engine = SFT(model, memory_budget="4GiB", **kw)
    x = torch.randn(2, 3, 45, 62).requires_grad_(True)
    with DtypeLog(torch.float32, torch.bfloat16) as log, torch.autocast("cpu", dtype=torch.bfloat16):
        y = engine(x)
    with DtypeLog(torch.float32, torch.bfloat16) as back:
        y.float().square().sum().backward()
    assert log.ops > 50 and back.ops > 50
    assert not log.other and not back.other, f"{case}: {(log.other + back.other)[:8]}"
    assert multipass_segments(engine), "the step must run multi-pass segments"
