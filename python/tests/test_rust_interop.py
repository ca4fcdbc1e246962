"""A Python node and the Rust CLI move verified bytes both ways: Python
reads and writes a ``ferry serve`` region (and calls its ``echo`` RPC), and
``ferry bench`` writes, reads and calls a Python node's region and handler.

The CLI is ``$FERRY_BIN``, else ``<repo>/target/debug/ferry``; without one
these tests skip, saying so (scripts/python-tests.sh always sets it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, List

import numpy as np
import pytest

import ferry
from conftest import EXIT_DEADLINE, env_for, ferry_bin, read_line
from patterns import pattern

MiB = 1 << 20
SERVE_SIZE = 16 * MiB


@pytest.fixture(scope="module")
def cli() -> Path:
    path = ferry_bin()
    if path is None or not path.is_file():
        pytest.skip(
            "no ferry CLI binary: set FERRY_BIN, or build it with `cargo build -p ferry-cli` "
            "(looked in <repo>/target/debug)"
        )
    return path


class Served:
    def __init__(self, proc: "subprocess.Popen[bytes]", handle: ferry.RemoteRegion, raw: bytes) -> None:
        self.proc = proc
        self.handle = handle
        self.raw = raw


@pytest.fixture
def served(cli: Path, transport: str, tmp_path: Path) -> Iterator[Served]:
    """``ferry serve --size 16M --stdin``: its handle (one JSON line on
    stdout); stopped by closing stdin."""
    log = tmp_path / "serve.stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [str(cli), "serve", "--size", str(SERVE_SIZE), "--stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env_for(transport),
        )
    try:
        try:
            line = read_line(proc, time.monotonic() + 60.0, "ferry serve")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{log.read_text(errors='replace')}") from None
        yield Served(proc, ferry.RemoteRegion.from_bytes(line.strip()), line.strip())
    finally:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=EXIT_DEADLINE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=EXIT_DEADLINE)
        if proc.stdout is not None:
            proc.stdout.close()


def u8(region: Any) -> "np.ndarray[Any, np.dtype[np.uint8]]":
    return np.frombuffer(region, dtype=np.uint8)


def test_python_reads_and_writes_rust_serve(
    served: Served, node: ferry.Node, transport: str, seed: int
) -> None:
    handle = served.handle
    assert handle.nbytes == SERVE_SIZE
    assert json.loads(served.raw)["len"] == SERVE_SIZE
    # The JSON is the same handle format Python's to_bytes writes.
    assert ferry.RemoteRegion.from_bytes(handle.to_bytes()) == handle

    # `ferry serve` writes zeros over its whole region before it prints the
    # handle: a read sees them (into a buffer that held something else).
    back = node.alloc(SERVE_SIZE)
    u8(back)[:] = 0xA5
    node.read(back, handle, timeout=30.0)
    assert not u8(back).any(), "ferry serve's region should start as zeros"

    # Python -> Rust, then Rust -> Python: the whole region.
    src = node.alloc(SERVE_SIZE)
    u8(src)[:] = pattern(seed, SERVE_SIZE)
    node.write(src, handle, timeout=30.0)
    u8(back)[:] = 0
    node.read(back, handle, timeout=30.0)
    assert np.array_equal(u8(back), u8(src))

    # Odd offsets and lengths, one submit of several ops.
    other = pattern(seed + 1, 3 * MiB + 3)
    src2 = node.register(other.copy())
    node.submit(
        [
            ferry.Op.write(src2, handle, local_offset=1, remote_offset=5, length=1),
            ferry.Op.write(src2, handle, local_offset=7, remote_offset=SERVE_SIZE - 4099, length=4099),
            ferry.Op.write(src2, handle, local_offset=3, remote_offset=MiB + 1, length=2 * MiB + 1),
        ],
        timeout=30.0,
    )
    expected = pattern(seed, SERVE_SIZE).copy()
    expected[5] = other[1]
    expected[SERVE_SIZE - 4099 :] = other[7 : 7 + 4099]
    expected[MiB + 1 : 3 * MiB + 2] = other[3 : 3 + 2 * MiB + 1]
    node.read(back, handle, timeout=30.0)
    assert np.array_equal(u8(back), expected)

    # A prepared strided list against the Rust node: 4096 blocks of 4 KiB,
    # written in reverse order, read back in an interleaved one.
    count, block = 4096, 4096
    src3 = node.alloc(count * block)
    u8(src3)[:] = pattern(seed + 2, count * block)
    local = ferry.LocalDescs([src3], strided=ferry.Strided(0, 0, block, block, count))
    prepared = node.prepare_remote(
        ferry.RemoteDescs([handle], strided=ferry.Strided(0, 0, block, block, count))
    )
    reverse = np.arange(count - 1, -1, -1)
    xfer = node.make_xfer("WRITE", local, np.arange(count), prepared, reverse)
    xfer.post(timeout=30.0)
    assert xfer.wait(timeout=30.0)
    dst3 = node.alloc(count * block)
    mixed = np.empty(count, np.int64)
    mixed[0::2] = np.arange(count // 2)
    mixed[1::2] = np.arange(count // 2, count)
    local_dst = ferry.LocalDescs([dst3], strided=ferry.Strided(0, 0, block, block, count))
    xfer = node.make_xfer("READ", local_dst, mixed, prepared, mixed)
    xfer.post(timeout=30.0)
    assert xfer.wait(timeout=30.0)
    blocks = u8(src3).reshape(count, block)
    assert np.array_equal(u8(dst3).reshape(count, block), blocks[::-1])

    # Its `echo` RPC, and a notification into its inbox.
    payload = pattern(seed + 3, 60_000).tobytes()
    assert node.call(handle.owner, "echo", payload, timeout=10.0) == payload
    node.notify(handle.owner, b"hello from python", timeout=10.0)

    # It stops when its stdin closes, exit status 0.
    assert served.proc.stdin is not None
    served.proc.stdin.close()
    assert served.proc.wait(timeout=EXIT_DEADLINE) == 0
    with pytest.raises((ferry.PeerUnreachable, ferry.ConnectionLost, ferry.UnknownNode)):
        node.read(back, handle, timeout=5.0)


def test_rust_serve_stops_on_sigterm(cli: Path, node: ferry.Node, transport: str, tmp_path: Path) -> None:
    """Without --stdin, SIGTERM stops ``ferry serve`` (exit 0) after a Python
    node talked to it. (With --stdin it waits for stdin to close: the
    blocking stdin reader holds the runtime's shutdown; see the report.)"""
    with open(tmp_path / "serve.stderr", "wb") as err:
        proc = subprocess.Popen(
            [str(cli), "serve", "--size", "1M"],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env_for(transport),
        )
    try:
        handle = ferry.RemoteRegion.from_bytes(read_line(proc, time.monotonic() + 60.0, "ferry serve"))
        assert node.call(handle.owner, "echo", b"x", timeout=10.0) == b"x"
        local = node.alloc(1 << 20)
        node.read(local, handle)
        time.sleep(0.2)  # its signal handlers are installed just after the handle is printed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_DEADLINE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=EXIT_DEADLINE)
        assert proc.stdout is not None
        proc.stdout.close()


def rust_bench_pattern(nbytes: int, seed: int) -> "np.ndarray[Any, np.dtype[np.uint8]]":
    """`ferry bench`'s pattern (crates/ferry-cli/src/bench.rs): byte i is
    (i as u8) * 29 + (seed ^ (i >> 16) as u8), wrapping."""
    i = np.arange(nbytes, dtype=np.uint64)
    low = (i & np.uint64(0xFF)) * np.uint64(29)
    high = np.uint64(seed) ^ ((i >> np.uint64(16)) & np.uint64(0xFF))
    return ((low + high) & np.uint64(0xFF)).astype(np.uint8)


def run_bench(cli: Path, handle_file: Path, transport: str, args: List[str]) -> List[Any]:
    proc = subprocess.run(
        [str(cli), "bench", "--handle", str(handle_file), "--iters", "2", "--verify", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_for(transport),
    )
    assert proc.returncode == 0, f"ferry bench {args} failed:\n{proc.stdout}\n{proc.stderr}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stdout
    return rows


def test_rust_bench_against_python_node(
    cli: Path, node: ferry.Node, transport: str, tmp_path: Path, seed: int
) -> None:
    size = 4 * MiB
    memory = pattern(seed, size).copy()
    region = node.register(memory)
    node.serve_rpc("echo", lambda body: body)
    handle_file = tmp_path / "handle.json"
    handle_file.write_bytes(region.remote().to_bytes())
    want = "memory" if transport == "memory" else "tcp"

    # Rust writes into Python memory: blocks of 65543 bytes (so its
    # pattern's seed is 65543 as u8 = 7), as many as fit: 63 of them. The
    # bytes past them keep this run's pattern.
    block = 65543
    rows = run_bench(cli, handle_file, transport, ["--op", "write", "--block", str(block)])
    assert all(r["verified"] for r in rows) and rows[0]["transport"] == want
    covered = (size // block) * block
    expected = pattern(seed, size).copy()
    expected[:covered] = rust_bench_pattern(covered, block & 0xFF)
    if not np.array_equal(memory, expected):
        first = int(np.flatnonzero(memory != expected)[0])
        pytest.fail(f"Python's bytes differ from what ferry bench wrote at {first}")

    # Rust reads Python memory (it writes known bytes first, reads them
    # back and checks them).
    rows = run_bench(cli, handle_file, transport, ["--op", "read", "--block", "64K,1M"])
    assert all(r["verified"] for r in rows) and rows[0]["transport"] == want

    # Rust calls a Python RPC handler, and checks the answers.
    rows = run_bench(cli, handle_file, transport, ["--op", "rpc", "--block", "1K,60K"])
    assert all(r["verified"] for r in rows)
