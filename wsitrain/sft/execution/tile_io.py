"""A tiled segment's tiles in and out: input regions and gradient tiles cut or staged, outputs joined, tile order.

``TiledSegment`` (tiled.py) computes; this reads its inputs and writes its outputs. A checkpoint in host memory (or
the image streamed from the host) comes through the stager, which uploads the next tile's region while this one
computes, in ``tiles()`` order (any other order is still exact, only slower).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd.profiler import record_function

from wsitrain.sft.execution.hooks import ExecHooks
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.ops.fused_pool import Accumulator
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile
from wsitrain.sft.source import is_source

STAGE = "sft.stage"  # profiler range (torch.profiler): a tile packed and uploaded from host memory


class TileIO:
    """Where a tiled segment's tiles come from and go to, and the order every loop visits them in."""

    def __init__(self, seg: SegmentPlan, device: torch.device, stager: HostStager, hooks: ExecHooks) -> None:
        assert seg.regions is not None, "a tiled segment's plan carries its regions"
        self.seg = seg
        self.regions = seg.regions
        self.device = device
        self.stager = stager
        self.hooks = hooks
        self.start, self.end = seg.start, seg.end
        self.out_on_host = seg.output_location == "host"  # the next checkpoint lives in host memory
        # the input lives in host memory (a host checkpoint, or the image streamed from the host): its tiles are
        # staged up and its gradient tiles added back on the host, through the stager even on CPU
        self.in_on_host = seg.checkpoint_location == "host"
        self._indexed: object = None  # the regions the tile index below was built for
        self._row_of: dict[int, int] = {}
        self._col_of: dict[int, int] = {}
        self._order_key: tuple[object, object] = (None, None)  # the regions and visit hook the order is for
        self._order: list[tuple[int, int]] = []
        self._after: dict[tuple[int, int], tuple[int, int]] = {}
        self._source_for: object = None  # the tile order the source regions below were listed for
        self._source_regions: list[tuple[tuple[int, int], tuple[int, int]]] = []

    @contextlib.contextmanager
    def sweeping(self) -> Iterator[None]:
        """The forward sweep visits its own, larger tiles where the plan gives it some (planning/forward.py): every
        loop, index and prefetch reads ``self.regions``, which are the sweep's until it ends."""
        own = self.seg.forward_regions
        if own is None:
            yield
            return
        self.regions = own
        try:
            yield
        finally:
            self.regions = self.seg.regions  # type: ignore[assignment]

    def input_region(self, x: torch.Tensor, rt: AxisTile, ct: AxisTile) -> torch.Tensor:
        """The tile's input with its halo, cut from the checkpoint. (B, C, th + halo, tw + halo).

        From host memory, the tile comes through the stager, which also starts uploading the next tile's
        region in tile order (loops visit tiles in ``tiles()`` order; any other order is still exact).
        """
        rows, cols = rt.need[self.start], ct.need[self.start]
        if is_source(x):  # a slide read tile by tile (sft/source.py): told the visit order, so it reads ahead
            x.expect(self._source_order())  # type: ignore[attr-defined]
        elif not self.in_on_host and x.device == self.device:
            return x[:, :, rows[0] : rows[1], cols[0] : cols[1]]  # a view
        nxt = self._next_tile(*self._tile_of(rt, ct))
        reg = self.regions
        ahead = None if nxt is None else (reg.rows[nxt[0]].need[self.start], reg.cols[nxt[1]].need[self.start])
        with record_function(STAGE):
            return self.stager.fetch("input", x, rows, cols, self.device, ahead)

    def _source_order(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The input regions in ``tiles()`` order (one list per regions and visit order: a source sees it once)."""
        order = self.tiles()
        if self._source_for is not order:
            reg = self.regions
            self._source_regions = [(reg.rows[r].need[self.start], reg.cols[c].need[self.start]) for r, c in order]
            self._source_for = order
        return self._source_regions

    def grad_tile(self, grad_out: torch.Tensor, r: int, c: int) -> torch.Tensor:
        """Tile (r, c)'s share of the output gradient, on the device. (B, C, th, tw).

        From host memory (the output is a host checkpoint), staged like input regions, next tile prefetched.
        """
        reg = self.regions
        rows, cols = reg.rows_out[r], reg.cols_out[c]
        if not self.out_on_host and grad_out.device == self.device:
            return grad_out[:, :, rows[0] : rows[1], cols[0] : cols[1]]  # a view
        nxt = self._next_tile(r, c)
        ahead = None if nxt is None else (reg.rows_out[nxt[0]], reg.cols_out[nxt[1]])
        with record_function(STAGE):
            return self.stager.fetch("grad", grad_out, rows, cols, self.device, ahead)

    def new_output(self, y: torch.Tensor) -> torch.Tensor:
        """The joined output (B, C, Ho, Wo) for tiles like ``y``: on the device, or in host memory.

        Host memory here is pageable: tiles reach it through the stager's page-locked buffers (a strided tile
        of a pinned tensor would still be copied through a pageable temporary), so pinning it would only cost.
        """
        reg = self.regions
        shape = (y.shape[0], y.shape[1], reg.rows_out[-1][1], reg.cols_out[-1][1])
        if self.out_on_host and self.seg.output_spilled:  # a file on local disk (spill.py), staged the same way
            return self.stager.spill.empty(shape, y.dtype, f"checkpoint after segment {self.seg.index}")
        if self.out_on_host:
            return torch.empty(shape, dtype=y.dtype)
        return y.new_empty(shape)

    def new_input_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The zeroed input-gradient buffer, like ``x``: on disk beside a spilled checkpoint, else where ``x`` is."""
        if self.seg.spilled and self.in_on_host and x.device.type == "cpu":
            return self.stager.spill.zeros(tuple(x.shape), x.dtype, f"gradient of segment {self.seg.index}'s input")
        return torch.zeros_like(x)

    def store_tile(self, out: torch.Tensor, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """``out[:, :, rows, cols] = y``; into host memory through the stager (complete after ``stager.drain()``)."""
        dst = out[:, :, rows[0] : rows[1], cols[0] : cols[1]]
        if self.out_on_host or out.device != y.device:
            self.stager.store(dst, y, f"output tile rows {rows[0]}:{rows[1]} cols {cols[0]}:{cols[1]}")
        else:
            dst.copy_(y)

    def _tile_of(self, rt: AxisTile, ct: AxisTile) -> tuple[int, int]:
        """The grid indices of a tile's row and column regions (by identity; the index is built once per regions)."""
        if self._indexed is not self.regions:
            self._row_of = {id(t): i for i, t in enumerate(self.regions.rows)}
            self._col_of = {id(t): i for i, t in enumerate(self.regions.cols)}
            self._indexed = self.regions
        return self._row_of[id(rt)], self._col_of[id(ct)]

    def _next_tile(self, r: int, c: int) -> tuple[int, int] | None:
        """The tile after (r, c) in ``tiles()`` order, None after the last."""
        self.tiles()
        return self._after.get((r, c))

    def staged(self, x: torch.Tensor) -> bool:
        """Do this segment's input regions come through the stager (a buffer reused for the next tile)?"""
        return self.in_on_host or x.device != self.device

    def grad_staged(self, acc: Accumulator | None, g: torch.Tensor | None) -> bool:
        """Did the output-gradient tile ``g`` come through the stager (a buffer reused for the next tile)?"""
        return g is not None and acc is None and (self.out_on_host or g.device != self.device)

    def tiles(self) -> list[tuple[int, int]]:
        """The tiles every loop visits, in order: row by row, or the ``visit`` hook's (the simulated device)."""
        visit = self.hooks.visit
        if self._order_key[0] is not self.regions or self._order_key[1] is not visit:
            rows, cols = self.regions.grid
            self._order = [(r, c) for r in range(rows) for c in range(cols)] if visit is None else visit(self.regions)
            self._after = dict(zip(self._order, self._order[1:], strict=False))
            self._order_key = (self.regions, visit)
        return self._order
