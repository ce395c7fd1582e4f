"""Errors a user can act on.

Every error raised for bad input (a file, a config key, a layer, a plan) is a ``WsiTrainError``:
the CLI prints its message and hint on one line each, without a traceback unless ``--verbose``,
and exits with ``exit_code``.
"""

from __future__ import annotations


class WsiTrainError(Exception):
    """An error caused by the user's input, with a hint that says how to fix it."""

    exit_code: int = 2
    # True for an expected stop that is no failure (a preempted fit): printed as a notice, not as `error:`
    notice: bool = False

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(WsiTrainError):
    """A config file or override is invalid; ``problems`` lists every problem found."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        head = f"{source}: " if source else ""
        n = len(problems)
        msg = f"{head}{n} problem{'s' if n != 1 else ''} in the config:\n" + "\n".join(
            f"  - {p}" for p in problems
        )
        super().__init__(msg, hint="fix the keys above; `wsitrain validate CONFIG` checks a config without running")
        self.problems = problems


class SlideError(WsiTrainError):
    """A slide is missing, unreadable, or lacks what the config asks of it."""


class PlanError(WsiTrainError):
    """The engine cannot plan or run a model: an unsupported layer or a budget that cannot fit."""


class InternalEngineError(PlanError):
    """The engine met an inconsistency of its own while planning a model: a bug in wsitrain to report.

    It names the layer being processed; the original exception is chained as ``__cause__``.
    """


class NotAvailableError(WsiTrainError):
    """A command exists but is not implemented yet."""

    exit_code = 3
