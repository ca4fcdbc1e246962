"""The fork guard: a node's threads do not survive ``fork()``, so in a
forked child every call on a node or region made before the fork is
refused, and nothing at exit waits on them."""

from __future__ import annotations

import os

from ._errors import FerryError

_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked from one that imported ferry."""
    return _forked


def refuse_in_child(what: str) -> None:
    """Raises :class:`FerryError` in a forked child."""
    if _forked:
        raise FerryError(f"{what} belongs to the parent process (fork): start a new node here")
