"""A tiled segment's gradient sums: each tile's input gradient overlap-added, its parameter gradients summed.

``TiledSegment`` (tiled.py) and the multi-pass and one-pass sweeps recompute tiles and hand each tile's autograd
results here (or a background tile's cached ones, ``reuse.py``). An input-gradient tile goes to the first segment's
sink, into the device buffer, or through the stager when the buffer lives in host memory; parameter gradients are
summed with one multi-tensor add per tile.
"""

from __future__ import annotations

import torch

from wsitrain.sft.execution.hooks import TileObserver
from wsitrain.sft.execution.reuse import BackwardValue, Key, ReuseCache, backward_hit
from wsitrain.sft.execution.tile_io import TileIO
from wsitrain.sft.ops.fused_pool import Accumulator
from wsitrain.sft.regions import AxisTile


class TileGradSums(TileIO):
    """Adds tiles' gradients into a sweep's sums (see the module doc)."""

    # parameter sums still holding the gradient autograd returned for their first tile (add_tile_grads): the id of
    # the sweep's list of sums, and their indices
    _borrowed_for: int
    _borrowed: set[int]

    def count(self, what: str) -> None:
        """One more tile reused or skipped in this step's stats ("reused_forward", "reused_backward", ...)."""
        if self.hooks.stats is not None:
            st = self.hooks.stats.stats
            setattr(st, what, getattr(st, what) + 1)

    def add_cached(
        self,
        cache: ReuseCache[BackwardValue],
        key: Key | None,
        region: torch.Tensor,
        g: torch.Tensor | None,
        acc: Accumulator | None,
        pooled_grad: torch.Tensor | None,
        r: int,
        c: int,
        need_x: bool,
        sink: TileObserver | None,
        grad_x: torch.Tensor | None,
        grads: list[torch.Tensor | None],
    ) -> bool:
        """Add tile (r, c)'s cached backward contribution when it may reuse one (``reuse.backward_hit``)."""
        reg = self.regions
        hit = backward_hit(cache, key, region, g, acc, pooled_grad, reg.rows_out[r], reg.cols_out[c])
        if hit is None:
            return False
        self.add_tile_grads(hit.value[1], need_x, reg.rows[r], reg.cols[c], sink, grad_x, grads)
        self.count("reused_backward")
        return True

    def add_tile_grads(
        self,
        res: tuple[torch.Tensor | None, ...],
        need_x: bool,
        rt: AxisTile,
        ct: AxisTile,
        sink: TileObserver | None,
        grad_x: torch.Tensor | None,
        grads: list[torch.Tensor | None],
    ) -> None:
        """Fold one tile's gradients (input region first when ``need_x``, then parameters) into the sums."""
        if need_x:
            gx = res[0]
            if gx is not None:
                rows, cols = rt.need[self.start], ct.need[self.start]
                if sink is not None:
                    sink(gx, rows, cols)
                else:
                    assert grad_x is not None
                    dst = grad_x[:, :, rows[0] : rows[1], cols[0] : cols[1]]
                    if self.in_on_host or grad_x.device != gx.device:
                        # copied down on the side stream, added in tile order
                        what = f"input-gradient tile rows {rows[0]}:{rows[1]} cols {cols[0]}:{cols[1]}"
                        self.stager.accumulate(dst, gx, what)
                    else:
                        dst += gx
            res = res[1:]
        sums: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        if self._borrowed_for != id(grads):  # a new sweep's sums (a stale set only makes a sum out of place)
            self._borrowed_for, self._borrowed = id(grads), set()
        firsts: list[int] = []
        for k, gp in enumerate(res):
            if gp is None:
                continue
            acc_k = grads[k]
            if acc_k is None:
                # never sum into a returned gradient in place: it may share memory with what autograd or the next
                # tile still reads (seen as NaNs in bf16 weight gradients). Copy-free (issue 57): hold it as it is
                # and make the second tile's sum out of place; else own a copy at once (a clone per parameter)
                if self.hooks.copy_free:
                    grads[k] = gp
                    self._borrowed.add(k)
                else:
                    grads[k] = gp.clone()
            elif k in self._borrowed:
                firsts.append(k)
            else:
                sums.append(acc_k)
                parts.append(gp)
        if firsts:  # the same a + b as in place, into new tensors the sums then own
            owned = torch._foreach_add([grads[k] for k in firsts], [res[k] for k in firsts])  # type: ignore[misc]
            for k, t in zip(firsts, owned, strict=True):
                grads[k] = t
                self._borrowed.discard(k)
        if sums:
            # one multi-tensor launch per tile instead of one add per parameter (ResNet-50 at 8192 px capped: 606
            # adds per step, measured by sft/simulate/host_time.py); each element is the same a + b either way
            torch._foreach_add_(sums, parts)
