"""Fixtures for the FERRY backend's tests: NIXL agents in this process and
in peer processes (``nixl_peer.py``), with the plugin installed into this
Python's NIXL by ``scripts/nixl-tests.sh`` (``ferry nixl install``)."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
PEER = HERE / "nixl_peer.py"
sys.path.insert(0, str(HERE))

#: Every wait in these tests ends within this many seconds.
DEADLINE = 60.0


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (state ``T`` or
    ``t`` in its ``/proc`` stat)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][:1]
        except (FileNotFoundError, IndexError):
            return False
        if state not in ("T", "t"):
            return False
    return True


class Peer:
    """An agent in another process (see ``nixl_peer.py``)."""

    def __init__(
        self,
        name: str,
        backends: List[str],
        params: Dict[str, Dict[str, str]],
        listen_port: Optional[int] = None,
        prefix: Optional[List[str]] = None,
    ):
        self.name = name
        listen = [] if listen_port is None else [str(listen_port)]
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(PEER), name, json.dumps(backends), json.dumps(params), *listen],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.metadata = base64.b64decode(self._read()["metadata"])

    def _read(self, timeout: float = DEADLINE) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"peer {self.name} did not answer within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"peer {self.name} exited ({self.proc.poll()})"
        return json.loads(line)

    def ask(self, op: str, **args: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"peer {self.name}: {op}: {answer['error']}")
        return answer

    def alloc(self, length: int, seed: int) -> dict:
        """Registers `length` bytes of ``pattern(length, seed)``; its address
        and length. The peer's metadata is refreshed to name them."""
        answer = self.ask("alloc", len=length, seed=seed)
        self.metadata = base64.b64decode(answer["metadata"])
        return answer

    def notifs(self, count: int, timeout: float = 10.0) -> Dict[str, List[bytes]]:
        got = self.ask("notifs", count=count, timeout=timeout)["notifs"]
        return {agent: [base64.b64decode(m) for m in msgs] for agent, msgs in got.items()}

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP, and waits until every thread of the peer is stopped:
        ``kill`` returns before a busy thread has stopped, and a transfer
        posted in between can still complete."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + DEADLINE
        while not stopped(self.proc.pid):
            assert time.monotonic() < deadline, f"peer {self.name} does not stop"
            time.sleep(0.001)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def peers():
    """Starts peers on demand; every one is closed at the end."""
    started: List[Peer] = []

    def start(name: str, backends: Optional[List[str]] = None, params=None, listen_port=None, prefix=None) -> Peer:
        """A peer agent; `prefix` runs it under a command (`ip netns exec NS`)."""
        peer = Peer(name, backends or ["FERRY"], params or {}, listen_port, prefix)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.close()
