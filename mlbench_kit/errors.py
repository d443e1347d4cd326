"""One error type for bad input: what went wrong, where, and what to do about it."""

from __future__ import annotations

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
