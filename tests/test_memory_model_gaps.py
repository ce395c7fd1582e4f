"""Memory the CUDA step holds that the model once missed: the dense copy of a conv's tile crop and the normalized
image in the autocast dtype (the optimizer step's temporaries: costs.OPTIMIZER_STEP_TEMPORARY)."""

from __future__ import annotations

import torch
from torch import nn

from wsitrain.models import build
from wsitrain.models.normalize import InputNormalization
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.planning.planner import new_session


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return build(name, 2)


def test_conv_tile_crop_is_copied_dense_on_cuda_as_on_cpu() -> None:
    graph = ModelGraph(_meta("tiny"))
    for device in ("cpu", "cuda"):
        sess = new_session(graph, (1, 3, 256, 256), torch.float32, torch.uint8, device, device == "cuda")
        convs = [i for i, n in enumerate(sess.facts.nodes) if n.spec.kind == WINDOW and n.spec.has_params]
        others = [i for i, n in enumerate(sess.facts.nodes) if i and n.spec.kind != WINDOW and n.inputs]
        op = sess.tile_op(convs[0], 1000, 700, True)
        assert (op.fwd_extra, op.bwd_extra) == (700, 700), device  # the crop's dense copy, forward and backward
        plain = sess.tile_op(others[0], 1000, 700, True)
        assert (plain.fwd_extra, plain.bwd_extra) == (0, 0)


def test_normalized_image_is_in_the_autocast_dtype() -> None:
    norm, conv = InputNormalization(), nn.Conv2d(3, 4, 3)
    x = torch.randint(0, 256, (1, 3, 12, 12), dtype=torch.uint8)
    assert norm(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
        # the same values the convolution would have cast the float32 map to: its output is unchanged
        assert y.dtype == torch.bfloat16
        fp32 = (x.float() / 255 - norm.mean[:, None, None]) / norm.std[:, None, None]
        torch.testing.assert_close(conv(y), conv(fp32))
