"""Host tensors that live on local disk: checkpoints the plan spills past the host's RAM budget.

A spilled checkpoint (``SegmentPlan.spilled``) and its gradient buffer are ordinary CPU tensors whose storage is a
shared memory mapping of a file in ``engine.spill_dir`` (``torch.from_file``). Everything that reads or writes a
host checkpoint (the stager packing a tile's region into its page-locked buffer, landing an output tile or adding
an input-gradient tile) does the same memcpy on them, so copies overlap compute exactly as for host memory and the
results are bitwise the same; the kernel's page cache moves pages between RAM and disk, writing back what the
step is not touching.

The file is unlinked as soon as it is mapped: the mapping keeps its blocks until the tensor's storage is freed, and
nothing is left on disk after the step, after an error, or when the process is killed. Nothing here decides what
spills (the planner's ``placement.py`` does) or checks the folder (``spill_dir.py``, before a run writes anything).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Protocol

import torch

SPILL_PREFIX = "wsitrain-spill-"  # the files' names while they are being mapped (a few microseconds)


class HostAllocator(Protocol):
    """Allocates the host tensors of checkpoints the plan placed on disk."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor: ...

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor: ...


class SpillFiles:
    """Disk-backed tensors in one folder (see the module doc); counts the bytes it hands out, for the stats."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
        self.allocated = 0  # bytes mapped so far (a running total: the stats' and the tests' check)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "spilled checkpoint") -> torch.Tensor:
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        fd, name = tempfile.mkstemp(prefix=SPILL_PREFIX, dir=self.folder)
        try:
            os.close(fd)
            # shared: writes go to the file (a private mapping would copy every written page into RAM)
            flat = torch.from_file(name, shared=True, size=n, dtype=dtype)
        finally:
            os.unlink(name)  # the mapping keeps the blocks; nothing is left behind whatever happens next
        self.allocated += n * flat.element_size()
        return flat.view(shape)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "spilled gradient") -> torch.Tensor:
        # a new file is extended with zeros (ftruncate) and reads as zeros: writing them would dirty every page
        return self.empty(shape, dtype, what)
