"""The ``ferry`` command of the wheel: ``ferry info``, ``serve``, ``bench``,
``ls``, ``nixl install``, as ``cargo build -p ferry-cli`` makes it. pip
installs this module's :func:`main` as the ``ferry`` script; it replaces
the Python process with the packaged binary (``ferry/bin/ferry``), so
signals, the exit status and the process id are the command's own."""

import os
import sys
from pathlib import Path

__all__ = ["binary", "main"]


def binary() -> Path:
    """The packaged ``ferry`` binary."""
    return Path(__file__).resolve().parent / "bin" / "ferry"


def main() -> None:
    """Runs the ``ferry`` command with this process's arguments."""
    path = binary()
    try:
        os.execv(path, ["ferry", *sys.argv[1:]])
    except OSError as e:
        sys.exit(f"ferry: cannot run {path}: {e} (this ferry package has no command: "
                 "install the wheel, or build it with scripts/wheel.sh)")
