"""One error type for bad input: what went wrong, where, and what to do about it."""

from __future__ import annotations

import signal

from .escape import visible


class MLBenchError(Exception):
    """A user-facing error. The CLI prints it as one block and exits with status 2."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.render())

    def render(self) -> str:
        """The message as a terminal shows it: what an input held (a row's text, a file's value) cannot move the
        cursor, recolour or rewrite the line, since its control characters are shown as escapes."""
        head = f"{self.where}: {self.what}" if self.where else self.what
        return visible(head + (f"\n  fix: {self.fix}" if self.fix else ""))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is: Python's default action ends the process at once, which runs no
    ``finally`` and leaves vLLM's engine process (and a sandbox's) running after it. A KeyboardInterrupt, so every
    stage's Ctrl-C path (kept results, ``mlbench run``'s stage bookkeeping) is also the SIGTERM path."""


def raise_terminated(signum: int, frame: object) -> None:
    """The SIGTERM handler a stage runs under (`mlbench`'s CLI installs it): raises :class:`Terminated`."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise Terminated
