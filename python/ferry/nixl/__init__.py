"""ferry's NIXL backend plugin, as the wheel ships it
(``libplugin_FERRY.so`` beside this module).

``python -m ferry.nixl install`` puts it where this Python's NIXL loads
plugins from (beside UCX's, in every NIXL wheel installed: ``nixl_cu12``,
``nixl_cu13``, ...), so that ``nixl_agent_config(backends=["FERRY"])``
finds it. It runs ``ferry nixl install`` of the packaged command, which
refuses, with one line and copying nothing, a NIXL release whose plugin
ABI the plugin was not built for (such a NIXL would refuse it at load, as
the plugin does too)."""

import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from .._cli import binary

__all__ = ["PLUGIN", "install"]

#: The packaged plugin.
PLUGIN = Path(__file__).resolve().parent / "libplugin_FERRY.so"


def install(python: Optional[str] = None) -> List[Path]:
    """Copies :data:`PLUGIN` into the plugin directory of each NIXL wheel
    that ``python`` (default: this interpreter) imports; returns where it
    went. Raises ``RuntimeError`` with the command's one-line reason (no
    NIXL installed, no plugin packaged, ...)."""
    done = subprocess.run(
        [str(binary()), "nixl", "install", "--python", python or sys.executable,
         "--plugin", str(PLUGIN)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"ferry nixl install exited {done.returncode}")
    return [Path(line) for line in done.stdout.splitlines() if line.strip()]
