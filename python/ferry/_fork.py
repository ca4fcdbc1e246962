"""The fork guard: a node's threads (the runtime every node shares) do not
survive ``fork()``, so in a child forked after a node started every call on
a node or region is refused, and nothing at exit waits on them. A process
that only imported ferry forks freely (``multiprocessing``'s default on
Linux)."""

from __future__ import annotations

import os

from ._errors import FerryError

_started = False
_forked = False


def node_started() -> None:
    """Called once a node (and so the runtime) runs in this process."""
    global _started
    _started = True


def _after_fork_in_child() -> None:
    global _forked
    _forked = _started


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked from one that ran a node."""
    return _forked


def refuse_in_child(what: str) -> None:
    """Raises :class:`FerryError` in a forked child."""
    if _forked:
        raise FerryError(f"{what} belongs to the parent process (fork): start a new node here")
