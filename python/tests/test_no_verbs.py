"""ferry where rdma-core is missing: every ``libibverbs.so.1`` the dynamic
loader could find is hidden behind an empty file, in a mount namespace of
the test's own (``unshare -m``, then ``mount --bind``; root, or a user
namespace that allows it, else the tests skip and say why). There,
``import ferry`` works, a node and the ``ferry`` command report ibverbs
unavailable and why (``libibverbs not found``), and two processes move
verified bytes over same-host memory and over TCP; libibverbs is never
mapped into them.

ferry loads libibverbs at run time (``dlopen``), so nothing that links
ferry needs it to start; scripts/python-tests.sh runs this against the
installed wheel.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import TESTS, env_for, ferry_bin
from patterns import fresh_seed

CHILD = TESTS / "no_verbs_child.py"
SIZE = 8 << 20
#: The whole child run: two interpreters, two nodes, 16 MiB moved.
DEADLINE = 120.0


def verbs_paths() -> List[str]:
    """Every path the loader could open as ``libibverbs.so.1``: what
    ``ldconfig -p`` lists, and the usual library directories, with the
    files their symlinks name."""
    found = set()
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    for line in listed.splitlines():
        if "libibverbs.so.1 " in line and "=>" in line:
            found.add(line.split("=>")[1].strip())
    for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
              "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"):
        candidate = os.path.join(d, "libibverbs.so.1")
        if os.path.exists(candidate):
            found.add(candidate)
    return sorted(found | {os.path.realpath(p) for p in found})


@pytest.fixture(scope="module")
def hidden(tmp_path_factory: pytest.TempPathFactory) -> List[str]:
    """The ``unshare`` prefix that runs a command with libibverbs hidden."""
    empty = tmp_path_factory.mktemp("no-verbs") / "empty"
    empty.write_bytes(b"")
    binds = "".join(f"mount --bind {shlex.quote(str(empty))} {shlex.quote(p)} && " for p in verbs_paths())
    prefix = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", binds + 'exec "$@"', "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot make a mount namespace here: {e}")
    if probe.returncode != 0:
        pytest.skip(f"cannot hide libibverbs in a mount namespace here (needs root): {probe.stderr.strip()}")
    return prefix


def run_hidden(prefix: List[str], args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=DEADLINE, env=env)
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def unavailable_for_want_of_libibverbs(status: Dict[str, Any]) -> None:
    running, detail = status["ibverbs"]
    assert not running, status
    assert "libibverbs not found" in detail, detail


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_no_libibverbs_import_report_and_transfers(hidden: List[str], transport: str) -> None:
    env = env_for(transport)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    seed = fresh_seed() >> 1
    done = run_hidden(hidden, [sys.executable, str(CHILD), "reader", str(seed), str(SIZE)], env)
    result = json.loads(done.stdout.splitlines()[-1])
    for side in ("status", "owner_status"):
        unavailable_for_want_of_libibverbs(result[side])
        assert result[side][transport][0], result[side]
    if transport == "tcp":
        assert not result["status"]["memory"][0], result["status"]
    assert result["read_equal"], f"read: bytes differ from {result['read_first']}"
    assert result["write_equal"], f"write: bytes differ from {result['write_first']}"
    assert not result["ibverbs_mapped"], "libibverbs was mapped into the reader"


def test_no_libibverbs_ferry_info(hidden: List[str]) -> None:
    """The ``ferry`` command says why ibverbs is unavailable."""
    cli = ferry_bin()
    if cli is None or not Path(cli).is_file():
        pytest.skip("no ferry CLI binary: set FERRY_BIN (scripts/python-tests.sh sets it)")
    done = run_hidden(hidden, [str(cli), "info"], env_for("memory"))
    line = next(l for l in done.stdout.splitlines() if l.strip().startswith("ibverbs"))
    assert "unavailable" in line and "libibverbs not found" in line, done.stdout
