"""Processes that end without closing anything, for test_process.py. Each
prints ``started`` once everything runs, then leaves the script (or calls
``sys.exit``): the exit must be clean (status 0) and quick.

    python exit_child.py plain      nodes, an RPC server, a transfer in flight
    python exit_child.py threads    ...and threads blocked in ferry calls
    python exit_child.py asyncio    ...and an event loop with ferry awaits pending
    python exit_child.py sysexit    sys.exit(0) from inside an RPC handler's caller
    python exit_child.py fork       a forked child uses the parent's node
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import numpy as np

import ferry

MiB = 1 << 20


def busy_nodes() -> tuple[ferry.Node, ferry.Node, ferry.Region, ferry.Region, ferry.Xfer]:
    """Two nodes, an RPC server, a big transfer posted and not waited for,
    and a one-shot transfer half way."""
    a = ferry.Node()
    b = ferry.Node(memory=False)  # TCP between them: transfers take a while
    a.serve_rpc("echo", lambda body: body)

    def slow(body: bytes) -> bytes:
        time.sleep(30)
        return body

    a.serve_rpc("slow", slow)
    assert b.call(a.addr, "echo", b"x") == b"x"
    size = 64 * MiB
    dst = a.alloc(size)
    src = b.alloc(size)
    np.frombuffer(src, np.uint8)[:] = 1
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, MiB, MiB, 64))
    prepared = b.prepare_remote(ferry.RemoteDescs([dst.remote()], strided=ferry.Strided(0, 0, MiB, MiB, 64)))
    xfer = b.make_xfer("WRITE", local, np.arange(64)[::-1], prepared, range(64), notification=b"n")
    xfer.post(timeout=60.0)
    return a, b, src, dst, xfer


def main() -> int:
    mode = sys.argv[1]
    if mode == "fork":
        return fork()
    keep = busy_nodes()
    a, b = keep[0], keep[1]
    if mode == "threads":
        def call_slow() -> None:
            try:
                b.call(a.addr, "slow", b"zzz", timeout=60.0)
            except ferry.FerryError:
                pass

        def wait_note() -> None:
            try:
                b.next_notification(timeout=60.0)
            except ferry.FerryError:
                pass

        def write_loop() -> None:
            src, dst = keep[2], keep[3]
            try:
                while True:
                    b.write(src, dst.remote(), timeout=60.0)
            except ferry.FerryError:
                pass

        for target in (call_slow, wait_note, write_loop):
            threading.Thread(target=target, daemon=True).start()
        time.sleep(0.3)
    elif mode == "asyncio":
        async def pending() -> None:
            loop = asyncio.get_running_loop()
            loop.create_task(b.call_async(a.addr, "slow", b"zzz", timeout=60.0))
            loop.create_task(b.submit_async([ferry.Op.write(keep[2], keep[3].remote())], timeout=60.0))

            async def listen() -> None:
                async for _ in a.incoming():
                    pass

            loop.create_task(listen())
            await asyncio.sleep(0.3)
            # Leaves with the tasks pending: asyncio.run cancels them.

        asyncio.run(pending())
    elif mode == "sysexit":
        print("started", flush=True)
        sys.exit(0)
    print("started", flush=True)
    return 0


#: What the parent keeps alive at exit (as a module-level node would be).
KEEP: list[ferry.Node] = []


def fork() -> int:
    """The child of a fork gets FerryError from the parent's node, cannot
    start a node, and exits normally (its atexit hooks run, with the
    parent's nodes still referenced); the parent's node is unaffected."""
    node = ferry.Node()
    other = ferry.Node()
    KEEP.extend([node, other])
    region = node.alloc(4096)
    np.frombuffer(region, np.uint8)[:] = 3
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        results = []
        for name, call in (
            ("alloc", lambda: node.alloc(16)),
            ("write", lambda: node.write(region, other.alloc(4096).remote())),
            ("call", lambda: node.call(other.addr, "x", b"")),
            ("notifications", lambda: node.notifications()),
            ("remote", lambda: region.remote()),
            ("close", lambda: region.close()),
            ("new node", lambda: ferry.Node()),
        ):
            try:
                call()
                results.append(f"{name}:no-error")
            except ferry.FerryError as error:
                results.append(f"{name}:FerryError:{type(error).__name__}")
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                results.append(f"{name}:{type(error).__name__}")
        os.write(w, (";".join(results) + "\n").encode())
        os.close(w)
        sys.exit(0)  # the normal exit path: atexit hooks run in the child
    os.close(w)
    with os.fdopen(r) as pipe:
        print("child:", pipe.readline().strip(), flush=True)
    deadline = time.monotonic() + 5.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit:", os.waitstatus_to_exitcode(status), flush=True)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child exit: hung (killed after 5 s)", flush=True)
            break
        time.sleep(0.01)
    # The parent's node still works.
    dst = other.alloc(4096)
    node.write(region, dst.remote())
    assert (np.frombuffer(dst, np.uint8) == 3).all()
    print("parent works", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
