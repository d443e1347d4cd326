"""One error type for bad input: what went wrong, where, and what to do about it."""

from __future__ import annotations


class MLBenchError(Exception):
    """A user-facing error. The CLI prints it as one block and exits with status 2."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.where}: {self.what}" if self.where else self.what
        return head + (f"\n  fix: {self.fix}" if self.fix else "")
