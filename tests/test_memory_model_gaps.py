"""Memory the CUDA step holds that the model once missed: the dense copy of a conv's tile crop and the normalized
image in the autocast dtype (the optimizer step's temporaries: costs.OPTIMIZER_STEP_TEMPORARY)."""

from __future__ import annotations

import pytest
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
    # CPU float32 also holds oneDNN's blocked copy of conv1's output (3 -> 8 channels: padded to 16, twice the output;
    # the 3-channel input is read as it is); float64 never reaches oneDNN
    for device, act, copies in (("cpu", torch.float32, 2000), ("cuda", torch.float32, 0), ("cpu", torch.float64, 0)):
        sess = new_session(graph, (1, 3, 256, 256), act, torch.uint8, device, device == "cuda")
        convs = [i for i, n in enumerate(sess.facts.nodes) if n.spec.kind == WINDOW and n.spec.has_params]
        others = [i for i, n in enumerate(sess.facts.nodes) if i and n.spec.kind != WINDOW and n.inputs]
        op = sess.tile_op(convs[0], 1000, 700, True)
        want = 700 + copies  # the crop's dense copy, forward and backward
        assert (op.fwd_extra, op.bwd_extra) == (want, want), device
        plain = sess.tile_op(others[0], 1000, 700, True)
        assert (plain.fwd_extra, plain.bwd_extra) == (0, 0)


@pytest.mark.parametrize(
    ("in_ch", "out_ch", "input_grad", "forward", "backward"),
    # the profiler's live peaks of 3x3 convolutions on (B, C, H, W) maps in units of the output (onednn.py's doc):
    # forward beyond input and output, backward beyond output, its gradient and the input gradient
    [(3, 8, False, 2, 2), (64, 64, False, 1, 2), (64, 64, True, 1, 2), (32, 16, True, 2, 3)],
)
def test_onednn_copies_reproduce_the_measured_peaks(
    in_ch: int, out_ch: int, input_grad: bool, forward: int, backward: int
) -> None:
    """Same H and W in and out: a map's bytes are its channels. Measured: 3 -> 8 forward 3x the output in all; 64 -> 64
    2x; 32 -> 16 3x; backward 64 -> 64 4x (5x with the input's gradient, 1x of it planned already); 32 -> 16 with it 7x
    (the input gradient's 2x planned already)."""
    from wsitrain.sft.planning.onednn import conv_copies

    unit = 1 << 20  # bytes of one channel
    f, b = conv_copies(in_ch * unit, in_ch, out_ch * unit, out_ch, input_grad)
    assert (f, b) == (forward * out_ch * unit, backward * out_ch * unit)


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
