"""A process that blocks in a ferry wait until SIGINT (Ctrl-C) interrupts it,
then shows that its node still works. Driven by test_gil_interrupt.py over
stdin/stdout, one line each way:

    python interrupt_child.py xfer HANDLE_HEX      # xfer.wait() on a stopped peer
    python interrupt_child.py write HANDLE_HEX     # node.write(timeout=60) to it
    python interrupt_child.py notification         # node.next_notification(timeout=60)

It prints ``ready`` (the test then stops the peer and answers ``go``),
``waiting`` just before it blocks, ``caught <status>`` once the
KeyboardInterrupt arrived, then (after the test continued the peer and wrote
``continued``) ``works`` once a new transfer or notification went through.
It returns from the script without closing anything: the exit is part of
the test.
"""

from __future__ import annotations

import signal
import sys
import time

import numpy as np

import ferry
from patterns import fresh_seed, pattern


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def expect(line: str) -> None:
    got = sys.stdin.readline().strip()
    if got != line:
        raise SystemExit(f"expected {line!r} on stdin, got {got!r}")


def main() -> int:
    # What an interactive `python` has. A process started in the background
    # by a non-interactive shell (as a CI runner may start the suite)
    # inherits SIGINT ignored, and Python then installs no handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = sys.argv[1]
    node = ferry.Node()
    if mode == "notification":
        say("ready")
        expect("go")
        say("waiting")
        try:
            node.next_notification(timeout=60.0)
            say("not interrupted")
            return 1
        except KeyboardInterrupt:
            say("caught")
        expect("continued")
        other = ferry.Node()
        other.notify(node.addr, b"after the interrupt")
        delivery = node.next_notification(timeout=10.0)
        assert delivery is not None and delivery.body == b"after the interrupt", delivery
        say("works")
        return 0

    handle = ferry.RemoteRegion.from_bytes(bytes.fromhex(sys.argv[2]))
    size = handle.nbytes
    src = node.alloc(size)
    view = np.frombuffer(src, np.uint8)
    view[:] = pattern(fresh_seed(), size)
    block = 1 << 20
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, block, block, size // block))
    prepared = node.prepare_remote(
        ferry.RemoteDescs([handle], strided=ferry.Strided(0, 0, block, block, size // block))
    )
    xfer = node.make_xfer("WRITE", local, range(size // block), prepared, range(size // block))
    node.write(src, handle, timeout=30.0)  # connected
    say("ready")
    expect("go")  # the peer is stopped now
    say("waiting")
    try:
        if mode == "xfer":
            xfer.post(timeout=60.0)
            xfer.wait()
        else:
            node.write(src, handle, timeout=60.0)
        say("not interrupted")
        return 1
    except KeyboardInterrupt:
        status = xfer.status().value if mode == "xfer" else "-"
        say(f"caught {status}")
    expect("continued")  # the peer runs again
    if mode == "xfer":
        # Cancelled by the interrupt: it settles (what was in flight
        # finishes), then it can be posted again.
        deadline = time.monotonic() + 20.0
        while xfer.status() is ferry.XferStatus.IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert xfer.status() is ferry.XferStatus.FAILED, xfer.status()
        assert isinstance(xfer.error, ferry.Cancelled), repr(xfer.error)
        view[:] = pattern(fresh_seed(), size)
        xfer.post(timeout=30.0)
        assert xfer.wait(timeout=30.0)
    else:
        view[:] = pattern(fresh_seed(), size)
        node.write(src, handle, timeout=30.0)
    back = node.alloc(size)
    node.read(back, handle, timeout=30.0)
    assert np.array_equal(np.frombuffer(back, np.uint8), view), "the peer's bytes differ"
    say("works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
