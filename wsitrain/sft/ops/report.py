"""What can run tiled, in words a user knows: for ``print(plan)``, the fit log and planner errors.

Reads resolved specs (ops_space.resolve_layouts) and names nodes with ``ops.user_name``: which layer
ends the tiled trunk and why, and which layers inside the trunk cannot be tiled (they run plain).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from wsitrain.sft.ops.space import ends_trunk
from wsitrain.sft.ops.types import OpSpec

# The config key that fixes each kind of blocker, for messages (wsitrain's YAML keys).
FIX_KEYS = {"BatchNorm2d": "model.freeze_bn: true"}


@dataclass(frozen=True)
class TilingReport:
    """How much of a model can run tiled on one input shape."""

    nodes: int  # graph nodes of the whole model
    trunk_nodes: int  # nodes up to the last checkpoint before the first whole-image value
    stop: tuple[str, str] | None  # (layer, why) of the first node that ends the tiled trunk
    untileable: tuple[tuple[str, str], ...]  # (layer, why) of trunk nodes that must run plain

    def lines(self) -> list[str]:
        """Lines for ``print(plan)`` and the fit log."""
        out = [f"{self.trunk_nodes} of {self.nodes} graph nodes can run tiled"]
        if self.stop is not None:
            out.append(f"tiling ends at {self.stop[0]}: {self.stop[1]}")
        out += [f"runs untiled: {name}: {why}" for name, why in self.untileable]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def tiling_report(specs: Sequence[OpSpec], trunk_end: int, name: Callable[[int], str]) -> TilingReport:
    """Report on resolved ``specs`` whose trunk ends at node ``trunk_end``; ``name(i)`` is ``user_name`` of node i."""
    first = next((i for i, s in enumerate(specs) if ends_trunk(s)), None)
    stop = None
    if first is not None:
        reason = specs[first].why_not or "global operations end the tiled part"
        later = [s for s in specs[first + 1 :] if not s.tileable and "computed from the whole image" in s.why_not]
        if later:
            reason = (
                "a global pooling inside the trunk (e.g. squeeze-excitation) needs the whole image before any tile "
                "can go on; the layers after it run untiled"
            )
        stop = (name(first), reason)
    bad = tuple(
        (name(i), s.why_not) for i, s in enumerate(specs[: trunk_end + 1]) if not s.tileable and s.kind != "input"
    )
    return TilingReport(len(specs), trunk_end + 1, stop, bad)


def fix_hint(spec: OpSpec) -> str:
    """The config key that fixes an untileable layer, if wsitrain has one."""
    key = FIX_KEYS.get(spec.type_name)
    return f"set {key}" if key else "give the engine more memory (engine.memory_budget)"
