"""Fixtures of the ferry Python tests: peer processes, nodes per transport,
the Rust CLI binary.

Every wait here has a deadline, and every process a test starts is killed
when the test ends (a stopped one is continued first).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

import ferry
from patterns import fresh_seed

TESTS = Path(__file__).resolve().parent
PYTHON_DIR = TESTS.parent
REPO = PYTHON_DIR.parent
PEER = TESTS / "peer.py"

#: How long a peer may take to print its line (imports, node start).
START_DEADLINE = 30.0
#: How long a peer may take to exit once asked.
EXIT_DEADLINE = 10.0

TRANSPORTS = ["memory", "tcp"]


def env_for(transport: str) -> Dict[str, str]:
    """The environment of a process that should use ``transport`` between
    same-host nodes: ``tcp`` sets ``FERRY_DISABLE_MEMORY=1``."""
    env = dict(os.environ)
    env.pop("FERRY_DISABLE_MEMORY", None)
    if transport == "tcp":
        env["FERRY_DISABLE_MEMORY"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def read_line(proc: "subprocess.Popen[bytes]", deadline: float, what: str) -> bytes:
    """One line of ``proc``'s stdout before ``deadline`` (monotonic)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""
    while not buffer.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: no line on stdout in time (so far {buffer!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1)
        if not chunk:
            code = proc.poll()
            raise AssertionError(f"{what}: stdout closed (exit code {code}); got {buffer!r}")
        buffer += chunk
    return buffer


def all_threads_stopped(pid: int) -> bool:
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


class PeerProcess:
    """A running ``peer.py``."""

    def __init__(self, proc: "subprocess.Popen[bytes]", info: Dict[str, Any], log: Path) -> None:
        self.proc = proc
        self.info = info
        self.log = log
        self.addr = ferry.NodeAddr.parse(info["addr"])
        self.pid: int = info["pid"]
        self.transports: List[str] = info["transports"]
        self.handles = [ferry.RemoteRegion.from_bytes(bytes.fromhex(h)) for h in info["handles"]]
        self.handle_bytes = [bytes.fromhex(h) for h in info["handles"]]
        self.stopped = False

    def rpc(self, node: ferry.Node, name: str, request: Any = None, timeout: float = 30.0) -> Any:
        """Calls ``name`` with ``request`` as JSON; the JSON answer."""
        body = json.dumps(request if request is not None else {}).encode()
        return json.loads(node.call(self.addr, name, body, timeout=timeout))

    def sha256(self, node: ferry.Node, region: int = 0, offset: int = 0, length: Optional[int] = None) -> str:
        request: Dict[str, Any] = {"region": region, "offset": offset}
        if length is not None:
            request["length"] = length
        digest: str = self.rpc(node, "sha256", request)["sha256"]
        return digest

    def sigstop(self) -> None:
        """SIGSTOP, and waits until every thread of the peer is stopped:
        ``kill`` returns before a busy thread has stopped, and a transfer
        posted in between can still complete."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True
        deadline = time.monotonic() + EXIT_DEADLINE
        while not all_threads_stopped(self.proc.pid):
            assert time.monotonic() < deadline, "the peer does not stop"
            time.sleep(0.001)

    def sigcont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL, and reaps it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=EXIT_DEADLINE)

    def stderr(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def shut(self) -> None:
        """Ends it: continued if stopped, stdin closed (it exits), killed
        if it does not within the deadline."""
        if self.proc.poll() is None:
            if self.stopped:
                self.sigcont()
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=EXIT_DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=EXIT_DEADLINE)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class PeerFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.peers: List[PeerProcess] = []

    def __call__(
        self,
        transport: str = "memory",
        sizes: Sequence[int] = (4096,),
        mode: str = "alloc",
        loop: bool = False,
    ) -> PeerProcess:
        args = [sys.executable, str(PEER), "--sizes", ",".join(str(s) for s in sizes), "--mode", mode]
        if loop:
            args.append("--loop")
        log = self.tmp_path / f"peer-{len(self.peers)}.stderr"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env_for(transport),
                cwd=str(TESTS),
            )
        try:
            line = read_line(proc, time.monotonic() + START_DEADLINE, "peer.py")
        except AssertionError as error:
            proc.kill()
            proc.wait(timeout=EXIT_DEADLINE)
            raise AssertionError(f"{error}\nstderr:\n{log.read_text(errors='replace')}") from None
        peer = PeerProcess(proc, json.loads(line), log)
        self.peers.append(peer)
        return peer

    def shut_all(self) -> None:
        for peer in self.peers:
            try:
                peer.shut()
            except Exception:  # noqa: BLE001 - teardown goes on
                if peer.proc.poll() is None:
                    peer.proc.kill()


@pytest.fixture
def spawn_peer(tmp_path: Path) -> Iterator[PeerFactory]:
    """Starts ``peer.py`` processes; all are ended after the test."""
    factory = PeerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.shut_all()


@pytest.fixture
def seed() -> int:
    """A fresh seed for this test's data pattern."""
    return fresh_seed()


def make_node(monkeypatch: pytest.MonkeyPatch, transport: str) -> ferry.Node:
    """A node of this process that uses ``transport`` for same-host peers."""
    if transport == "tcp":
        monkeypatch.setenv("FERRY_DISABLE_MEMORY", "1")
    else:
        monkeypatch.delenv("FERRY_DISABLE_MEMORY", raising=False)
    node = ferry.Node()
    if transport == "tcp":
        assert "memory" not in node.transports(), node.transports()
    else:
        assert node.transports()[0] == "memory", node.transports()
    return node


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """``"memory"`` (the same-host path, the default) or ``"tcp"``
    (``FERRY_DISABLE_MEMORY=1`` in both processes)."""
    value: str = request.param
    return value


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, transport: str) -> Iterator[ferry.Node]:
    """This process's node, on ``transport``."""
    n = make_node(monkeypatch, transport)
    try:
        yield n
    finally:
        n.close()


def run_script(
    args: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None
) -> "subprocess.CompletedProcess[str]":
    """Runs a Python script to its end (``timeout`` seconds at most: killed
    and failed past it)."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env if env is not None else env_for("memory"),
        cwd=str(TESTS),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=EXIT_DEADLINE)
        raise AssertionError(
            f"{args} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ferry_bin() -> Optional[Path]:
    """The Rust CLI: ``$FERRY_BIN``, else the repo's debug build."""
    from_env = os.environ.get("FERRY_BIN")
    if from_env:
        return Path(from_env)
    candidate = REPO / "target" / "debug" / "ferry"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    return None
