"""The folder host checkpoints spill to (``engine.spill_dir``) and the host RAM budget that decides what spills.

Checked before a run writes anything: the folder must exist, be a folder this process may write, and have room
for what the plan spills on this node (per rank, times the ranks sharing the node's disk). ``engine.host_memory``
defaults to the node's RAM divided among the ranks on the node. What spills is the planner's decision
(``wsitrain.sft.planning.placement``); how a spilled tensor is made is the executor's (``sft/execution/spill.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from wsitrain.errors import WsiTrainError
from wsitrain.units import format_bytes

KEY = "engine.spill_dir"


def spill_folder(value: str | Path | None) -> Path:
    """The folder spilled checkpoints go to: the configured one, or the system temp folder."""
    return Path(value) if value is not None else Path(tempfile.gettempdir())


def folder_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot hold spill files (missing, not a folder, not writable), or None."""
    p = Path(path)
    if not p.exists():
        return f"{p} does not exist"
    if not p.is_dir():
        return f"{p} is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by this process"
    return None


def check_spill_dir(value: str | Path | None, spill_per_rank: int, ranks: int = 1) -> None:
    """Raise one ``WsiTrainError`` naming engine.spill_dir and the folder when it cannot take ``spill_per_rank``
    bytes for each of ``ranks`` processes on this node; nothing when nothing spills."""
    if spill_per_rank <= 0:
        return
    folder = spill_folder(value)
    problem = folder_problem(folder)
    fix = f"set {KEY} to a folder on a local disk with room for it (default: the system temp folder)"
    if problem is not None:
        raise WsiTrainError(f"{KEY}: {problem}; the plan spills {format_bytes(spill_per_rank)} per rank there",
                            hint=fix)  # fmt: skip
    need = spill_per_rank * ranks
    free = shutil.disk_usage(folder).free
    if need > free:
        ranks_text = f" x {ranks} ranks on this node" if ranks > 1 else ""
        raise WsiTrainError(
            f"{KEY}: {folder} has {format_bytes(free)} free; the plan spills {format_bytes(spill_per_rank)} per rank"
            f"{ranks_text} there",
            hint=f"{fix}, or raise engine.host_memory so less spills",
        )


def node_ram_bytes() -> int:
    """The node's physical RAM."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_host_memory(ranks: int) -> int:
    """engine.host_memory's default: the node's RAM divided among the ranks on it."""
    return node_ram_bytes() // max(1, ranks)
