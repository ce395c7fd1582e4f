"""Internal errors that name what the engine was working on.

Planning and compiling walk a user's model node by node. A structure the engine mishandles would
otherwise surface as a bare ``KeyError: 33`` deep inside the planner (as DLA's unused shortcut did).
``guarded`` wraps the public entry points: such an error becomes an ``InternalEngineError`` (a
``PlanError``) that names the layer and segment being processed and says it is a bug to report, with the
original exception chained. Loops record where they are in ``WHERE`` (one attribute store per node).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from wsitrain.errors import InternalEngineError, WsiTrainError

# What an inconsistency of the engine's own raises: lookups, assertions, arithmetic and type slips.
INTERNAL = (LookupError, AssertionError, ArithmeticError, TypeError, ValueError, AttributeError, StopIteration)


class _Where(threading.local):
    node: int | None = None  # the graph node being processed
    segment: tuple[int, int] | None = None  # the segment (start, end] being planned or compiled


WHERE = _Where()


def at_segment(start: int, end: int) -> None:
    """Record the segment being planned or compiled (and forget the node of the previous one)."""
    WHERE.segment = (start, end)
    WHERE.node = None


def where(name_of: Callable[[int], str] | None) -> str:
    """``at layer 'features.3' in the segment after 'features.1' through 'features.5'`` (or '')."""
    if name_of is None:
        return ""
    parts = []
    with contextlib.suppress(Exception):  # naming must never hide the error itself
        if WHERE.node is not None:
            parts.append(f"at layer '{name_of(WHERE.node)}'")
        if WHERE.segment is not None:
            a, b = WHERE.segment
            parts.append(f"in the segment after '{name_of(a)}' through '{name_of(b)}'")
    return (" " + " ".join(parts)) if parts else ""


@contextlib.contextmanager
def guarded(doing: str, name_of: Callable[[int], str] | None = None) -> Iterator[None]:
    """Turn an internal error raised inside the block into an ``InternalEngineError`` naming where it happened.

    ``doing``: what the engine was doing, e.g. "planning ResNet on input (1, 3, 512, 512)". ``name_of``: the
    layer name of a node index. Errors for the user (``WsiTrainError``) pass through unchanged; so does
    anything that is not an internal slip (a RuntimeError from torch, a KeyboardInterrupt).
    """
    saved = (WHERE.node, WHERE.segment)
    WHERE.node = WHERE.segment = None
    try:
        yield
    except WsiTrainError:
        raise
    except INTERNAL as exc:
        raise InternalEngineError(
            f"internal error in the SFT engine while {doing}{where(name_of)}: {type(exc).__name__}: {exc}",
            hint="this is a bug in wsitrain, not in your model: please report it with the model and input shape "
            "(`wsitrain check-model NAME` reproduces it; --verbose shows the original traceback)",
        ) from exc
    finally:
        WHERE.node, WHERE.segment = saved
