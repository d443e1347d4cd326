"""Python's ``ast.parse`` made safe for the scorer's threads.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state (gh-106905, fixed in 3.12/3.13):
when two threads build ASTs at once and the garbage collector runs Python code mid-parse, ``ast.parse`` raises
``SystemError: AST constructor recursion depth mismatch`` for valid code. Eval scores answers on a thread pool, so
every parse the scorer makes goes through one lock.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.RLock()  # re-entrant: a finalizer run mid-parse may parse too


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, serialised across threads (raises what ``ast.parse`` raises)."""
    with _LOCK:
        return ast.parse(source, filename)


def compile_python(source: str, filename: str) -> ast.Module:
    """Parse ``source`` and compile its AST (the compiler's own checks, e.g. ``return`` outside a function),
    serialised like :func:`parse_python`; returns the tree."""
    with _LOCK:
        tree = ast.parse(source, filename)
        compile(tree, filename, "exec", dont_inherit=True)
        return tree
