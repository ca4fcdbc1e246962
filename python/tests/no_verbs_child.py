"""Run by ``test_no_verbs.py`` inside a mount namespace where every
``libibverbs.so.1`` is an empty file: a host without rdma-core, as far as
the dynamic loader can tell.

``no_verbs_child.py reader SEED SIZE``: imports ferry, starts a node,
reports its transports (JSON on stdout's first line), starts an owner
(this script, ``owner``) in a second process of the same namespace,
reads the owner's region and compares it with ``pattern(SEED)``, writes
``pattern(SEED + 1)`` into the owner's second region, and has the owner
compare that. Prints a JSON verdict as its last line. The transport is
whatever the environment leaves (``FERRY_DISABLE_MEMORY=1``: TCP).

Every wait has a deadline (the reader's reads and writes, the owner's
line); the owner exits when its stdin closes.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from typing import Any, Dict

import numpy as np

import ferry
from patterns import pattern

DEADLINE = 30.0


def ibverbs_mapped() -> bool:
    with open("/proc/self/maps") as f:
        return any("libibverbs" in line for line in f)


def status(node: ferry.Node) -> Dict[str, Any]:
    return {t.name: [t.running, t.detail] for t in node.transport_status()}


def owner(seed: int, size: int) -> None:
    with ferry.Node() as node:
        readable = node.register(pattern(seed, size).copy())
        written = np.zeros(size, dtype=np.uint8)
        target = node.register(written)
        line = {
            "read": readable.remote().to_bytes().hex(),
            "write": target.remote().to_bytes().hex(),
            "status": status(node),
        }
        print(json.dumps(line), flush=True)
        # The reader says when its write is done, then closes stdin.
        sys.stdin.readline()
        expected = pattern(seed + 1, size)
        differ = np.flatnonzero(written != expected)
        verdict = {"equal": differ.size == 0, "first": int(differ[0]) if differ.size else -1}
        print(json.dumps(verdict), flush=True)
        sys.stdin.read()


def line_of(proc: "subprocess.Popen[str]") -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE)
    if not ready:
        raise SystemExit(f"the owner printed nothing within {DEADLINE} s")
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the owner exited ({proc.wait(DEADLINE)}) without a line")
    return line


def reader(seed: int, size: int) -> None:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, __file__, "owner", str(seed), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    try:
        peer = json.loads(line_of(proc))
        with ferry.Node() as node:
            mine = status(node)
            got = np.zeros(size, dtype=np.uint8)
            local = node.register(got)
            node.read(local, ferry.RemoteRegion.from_bytes(bytes.fromhex(peer["read"])), timeout=DEADLINE)
            differ = np.flatnonzero(got != pattern(seed, size))
            src = node.register(pattern(seed + 1, size).copy())
            node.write(src, ferry.RemoteRegion.from_bytes(bytes.fromhex(peer["write"])), timeout=DEADLINE)
            proc.stdin.write("written\n")
            proc.stdin.flush()
            written = json.loads(line_of(proc))
            result = {
                "status": mine,
                "owner_status": peer["status"],
                "read_equal": differ.size == 0,
                "read_first": int(differ[0]) if differ.size else -1,
                "write_equal": written["equal"],
                "write_first": written["first"],
                "ibverbs_mapped": ibverbs_mapped(),
                "seconds": time.monotonic() - started,
            }
    finally:
        proc.stdin.close()
        proc.wait(DEADLINE)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    role, seed_text, size_text = sys.argv[1:]
    (owner if role == "owner" else reader)(int(seed_text), int(size_text))
