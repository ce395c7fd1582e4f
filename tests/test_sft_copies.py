"""Tiles without copies where a view serves (ExecHooks.copy_free, issue 57): a crop's and a trimmed layer output's
gradient go back as one zero pad, a forward sweep whose one tile is the whole map returns it as the checkpoint. The
step is bitwise the earlier path's, with fewer copy kernels."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from sft_models import small_resnet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wsitrain.models import freeze_batchnorm
from wsitrain.sft import SFT
from wsitrain.sft.ops.crop import crop
from wsitrain.sft.simulate.clock import JOINS, TWO_COPIES

# what the simulated clock's copy counter counts (clock.COPY_KIND), as aten operators on real tensors
COPY_OPS = JOINS


class CopyCounter(TorchDispatchMode):
    """Copy kernels a block runs on real tensors (slicing's backward: a zeroed buffer and a copy, two)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if (name in COPY_OPS or name.rstrip("_") in COPY_OPS) and not any(a.device.type == "meta" for a in flat):
            self.ops[name] += 2 if name in TWO_COPIES else 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _step(model: nn.Module, x: torch.Tensor, copy_free: bool, **kw: Any) -> tuple[tuple, CopyCounter]:
    model.zero_grad(set_to_none=True)
    sft = SFT(model, memory_budget="4GiB", **kw)
    sft._hooks.copy_free = copy_free
    xr = x.detach().clone().requires_grad_()
    with CopyCounter() as counter:
        y = sft(xr)
        y.square().sum().backward()
    return (y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad), counter


@pytest.mark.parametrize(("tile", "shape"), [(16, (2, 3, 45, 62)), (24, (1, 3, 53, 41)), (4096, (1, 3, 45, 62))])
def test_copy_free_step_is_bitwise_the_same(tile: int, shape: tuple[int, ...]) -> None:
    """float32, ragged tiles, batch 2, and one tile per segment (the forward sweep's tile is the checkpoint): outputs,
    every parameter gradient and the input gradient bit for bit; fewer copies."""
    torch.manual_seed(0)
    model = freeze_batchnorm(small_resnet(bottleneck=True))
    x = torch.randn(*shape)
    old, before = _step(model, x, False, tile_size=tile)
    new, after = _step(model, x, True, tile_size=tile)
    assert torch.equal(new[0], old[0])
    for a, b in zip(old[1], new[1], strict=True):
        assert torch.equal(b, a)
    assert torch.equal(new[2], old[2])
    assert after.total < before.total, f"{dict(after.ops)} against {dict(before.ops)}"


def test_crop_gradient_is_one_pad() -> None:
    """A crop's gradient: one constant_pad_nd, equal to the zeroed buffer with the gradient copied in; channels-last
    image axes too."""
    torch.manual_seed(0)
    for dims, shape in (((2, 3), (2, 3, 9, 11)), ((1, 2), (2, 9, 11, 3))):
        v = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        g = torch.randn_like(crop(v, dims, (2, 7), (1, 10)))
        grads = []
        for one_pad in (True, False):
            with CopyCounter() as counter:
                (out,) = torch.autograd.grad(crop(v, dims, (2, 7), (1, 10), one_pad), v, g)
            grads.append(out)
            assert counter.total == (1 if one_pad else 2), dict(counter.ops)
        assert torch.equal(grads[0], grads[1])
