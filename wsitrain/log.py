"""Console output: one rich Console per command; errors on stderr. (Run logs: ``wsitrain.train.runfolder``.)"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

# Resolves sys.stderr at print time (rich looks it up on each write), so test runners that swap it still capture it.
_stderr = Console(stderr=True, highlight=False)


def make_console(quiet: bool = False, verbose: bool = False, summaries: bool = False) -> Console:
    """The command's stdout console (silent when quiet); also routes the ``wsitrain`` logger to stderr.

    quiet: only warnings and errors are shown. verbose: ``logging.debug`` from wsitrain modules is shown too.
    summaries: the console stays on with quiet: the command itself prints only its summaries then (`fit --quiet`
    keeps one line per epoch).
    """
    logger = logging.getLogger("wsitrain")
    logger.handlers[:] = [RichHandler(console=_stderr, show_time=False, show_path=verbose, markup=False)]
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False
    console = Console(quiet=quiet and not summaries, highlight=False)
    # Redirected to a file (Slurm logs, CI): don't hard-wrap lines at rich's default 80 columns.
    console.soft_wrap = not console.is_terminal
    return console


def error(message: str, hint: str | None = None) -> None:
    """An error and its hint on stderr, one line each; long paths are not wrapped so they can be copied."""
    _stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    if hint:
        _stderr.print(f"[cyan]hint:[/] {escape(hint)}", soft_wrap=True)


def notice(message: str, hint: str | None = None) -> None:
    """An expected stop that is no failure (a preempted fit), on stderr: one line, and its hint."""
    _stderr.print(f"[bold yellow]stopped:[/] {escape(message)}", soft_wrap=True)
    if hint:
        _stderr.print(f"[cyan]hint:[/] {escape(hint)}", soft_wrap=True)


def traceback() -> None:
    """The traceback of the exception being handled, on stderr (call inside ``except``)."""
    _stderr.print_exception()


def internal_error(exc: BaseException, verbose: bool) -> None:
    """A bug, not bad input: say so, and show the traceback only when asked (call inside ``except``)."""
    if verbose:
        _stderr.print_exception()
    _stderr.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}", soft_wrap=True)
    if not verbose:
        _stderr.print("[cyan]hint:[/] run again with --verbose for the traceback, and report it", soft_wrap=True)
