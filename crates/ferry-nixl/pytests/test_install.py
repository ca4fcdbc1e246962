"""The wheel's installer, ``python -m ferry.nixl install``: it puts the
packaged plugin beside a NIXL wheel's own plugins, and refuses, with one
line and copying nothing, a NIXL release whose plugin ABI the plugin is
not built for (which would refuse it at load). The NIXL here is a stand-in
(a package directory, its plugin directory and a ``*.dist-info``) that a
wrapper of this interpreter finds first on its path, so the test changes
nothing in this environment's real NIXL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ferry_nixl = pytest.importorskip(
    "ferry.nixl", reason="the ferry wheel is not installed here: scripts/nixl-tests.sh installs it"
)

DEADLINE = 60.0


def fake_nixl(root: Path, release: str) -> Path:
    """A Python whose ``nixl_cu12`` is a stand-in of ``release``; returns
    the interpreter wrapper."""
    site = root / "site-packages"
    (site / "nixl_cu12").mkdir(parents=True)
    (site / "nixl_cu12" / "__init__.py").write_text("")
    (site / ".nixl_cu12.mesonpy.libs" / "plugins").mkdir(parents=True)
    (site / f"nixl_cu12-{release}.dist-info").mkdir()
    python = root / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def install(python: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("FERRY_NIXL_ANY_RELEASE", None)
    return subprocess.run(
        [sys.executable, "-m", "ferry.nixl", "install", "--python", str(python)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env=env,
    )


def test_a_nixl_of_another_release_is_refused_in_one_line(tmp_path: Path) -> None:
    python = fake_nixl(tmp_path, "1.9.0")
    done = install(python)
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "NIXL 1.9.0" in lines[0] and "FERRY_NIXL_ANY_RELEASE=1" in lines[0], lines[0]
    assert done.stdout == "", done.stdout
    plugins = tmp_path / "site-packages" / ".nixl_cu12.mesonpy.libs" / "plugins"
    assert list(plugins.iterdir()) == [], "the refused install copied something"


def test_a_nixl_of_a_supported_release_gets_the_packaged_plugin(tmp_path: Path) -> None:
    python = fake_nixl(tmp_path, "1.5.1")
    done = install(python)
    assert done.returncode == 0, done
    target = tmp_path / "site-packages" / ".nixl_cu12.mesonpy.libs" / "plugins" / "libplugin_FERRY.so"
    assert done.stdout.split() == [str(target)], done.stdout
    assert target.read_bytes() == ferry_nixl.PLUGIN.read_bytes()


LOAD = """
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("version", nixl_agent_config(backends=[]))
agent.create_backend("FERRY", {})
print("created")
"""


def test_the_plugin_says_ferrys_version_and_nixls_at_load() -> None:
    """The plugin NIXL loads is the wheel's, of ferry's one version: its
    log line at load names it (``FERRY_LOG=info``)."""
    import ferry

    env = dict(os.environ, FERRY_LOG="info", NIXL_LOG_LEVEL="WARN")
    done = subprocess.run(
        [sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=DEADLINE, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "created", done
    expected = f"FERRY plugin of ferry {ferry.__version__} loaded into NIXL 1.5.1"
    assert expected in done.stderr, done.stderr
