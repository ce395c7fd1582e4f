"""A patch encoder's frozen prefix output, kept from the forward sweep for the chunks' recompute (when planned).

The plan decides (``SegmentPlan.kept_prefix``, planning/kept_prefix.py); this runs it. A step's store lives on the
segment's autograd node (``TiledFunction``'s ctx): filled by the forward sweep, emptied chunk by chunk by the
recompute, dropped with the node. A chunk is keyed by the pixel intervals of the image its patch trunk reads, so a
recompute reads back exactly its own patches' prefix; a chunk with none kept (a background chunk the sweep reused,
or a recompute where the image wants its gradient, which must flow through the frozen blocks) runs the whole
encoder as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from wsitrain.patch.prefix import run_prefix, run_rest

Store = dict[Any, torch.Tensor]  # chunk key -> the first trainable block's input, (B * patches, tokens, D)


class PrefixKeeper:
    """Runs node ``node`` (a ``PatchTrunk``) split after its ``blocks`` frozen leading blocks while a store is
    active; holds no tensors itself."""

    def __init__(self, node: int, trunk: nn.Module, blocks: int) -> None:
        self.node = node
        self.trunk = trunk
        self.blocks = blocks
        self._store: Store | None = None

    @contextlib.contextmanager
    def active(self, store: Store | None) -> Iterator[None]:
        """Chunks run in this context keep their prefix into / read it from ``store`` (None: run whole)."""
        prev, self._store = self._store, store
        try:
            yield
        finally:
            self._store = prev

    def call(self, key: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the chunk ``key`` runs in the trunk's place; None (the trunk itself) without an active store."""
        store = self._store
        if store is None:
            return None
        trunk, k = self.trunk, self.blocks

        def run(x: torch.Tensor) -> torch.Tensor:  # (B, 3, h, w) -> (B, D, gh, gw)
            if x.requires_grad:  # the input gradient flows back through the frozen blocks: they run under autograd
                store.pop(key, None)
                return trunk(x)
            cells, grid = trunk.cells(x)  # (B * gh * gw, 3, p, p)
            if not torch.is_grad_enabled():  # the forward sweep: keep the prefix for this chunk's recompute
                h = store[key] = run_prefix(trunk.encoder, cells, k)
            else:
                h = store.pop(key, None)
                if h is None:  # not kept (the sweep reused this chunk): computed here, without autograd (frozen)
                    with torch.no_grad():
                        h = run_prefix(trunk.encoder, cells, k)
            return trunk.embedding_map(run_rest(trunk.encoder, h, k), grid)

        return run
