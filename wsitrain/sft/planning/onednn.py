"""The blocked copies a CPU convolution makes of (B, C, H, W) maps: oneDNN computes in channel blocks.

PyTorch runs float32 and bfloat16 convolutions on CPU through oneDNN. For maps in the default (B, C, H, W) layout
oneDNN reorders its operands into a layout of 16-channel blocks (``aBcd16b``, channels padded up to a multiple of 16),
computes there and reorders the result back: every convolution then holds copies as large as its maps, padded, beside
the tensors autograd knows. Measured on this project's 2-core AVX-512 CPU (torch 2.14, ``ONEDNN_VERBOSE=1`` for the
layouts, the profiler's allocation events for the bytes; 3x3 convolutions, 256 and 512 px):

- forward: the output's blocked copy always; the input's when it has more than 8 channels (3 and 8 channels are read as
  they are). Both exist at once, the output itself after the input's copy is freed: the peak is the input, then
  max(input copy + output copy, output copy + output). 3 -> 8 channels: 3x the output; 64 -> 64: 2x; 32 -> 16: 3x.
- backward: the output gradient's blocked copy, then the input gradient computed blocked and reordered (when the input
  wants a gradient), then the input's blocked copy for the weight gradient: 64 -> 64 held y, its gradient and two
  copies as large (4x the output); with the input's gradient 5x; 32 -> 16 with it 7x.

A tiled step on the tiny model at 8192 px measured 516 MiB for a 435 MiB plan without these copies (the forward
sweep's 1806 px tiles: conv1's 101 MiB output held 303 MiB). Float64 (the exactness tests) never reaches oneDNN.
"""

from __future__ import annotations

import torch

BLOCK = 16  # channels per block of oneDNN's float layouts on AVX-512 (AVX2 machines use 8: this is the larger)
READ_AS_IS = 8  # inputs with at most this many channels are read in their own layout (measured: 3 and 8 channels)
DTYPES = (torch.float32, torch.bfloat16)  # what PyTorch hands to oneDNN on CPU


def padded(nbytes: int, channels: int) -> int:
    """``nbytes`` of a map with ``channels`` channels, in oneDNN's blocked layout (channels padded to the block)."""
    if channels <= 0:
        return nbytes
    return nbytes * (-(-channels // BLOCK) * BLOCK) // channels


def conv_copies(in_bytes: int, in_ch: int, out_bytes: int, out_ch: int, input_grad: bool) -> tuple[int, int]:
    """(forward, backward) bytes a CPU convolution holds beyond its input, output, output gradient and input gradient,
    for a (B, C, H, W) input of ``in_bytes`` and output of ``out_bytes`` (see the module doc)."""
    src = 0 if in_ch <= READ_AS_IS else padded(in_bytes, in_ch)
    dst = padded(out_bytes, out_ch)
    forward = dst + max(0, src - out_bytes)
    backward = dst + max(padded(in_bytes, in_ch) if input_grad else 0, src)
    return forward, backward
