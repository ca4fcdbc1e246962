"""RPC (raising, async and concurrent handlers) and notifications and
messages, each delivered exactly once."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Set

import numpy as np
import pytest

import ferry
from conftest import PeerFactory

# -- RPC -------------------------------------------------------------------------


def test_raising_handler_is_remote_error_and_serving_goes_on(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str
) -> None:
    peer = spawn_peer(transport)
    for i in range(3):
        with pytest.raises(ferry.RemoteError) as caught:
            node.call(peer.addr, "fail", f"attempt {i}".encode())
        assert f"handler failed on purpose: attempt {i}" in str(caught.value)
        assert not isinstance(caught.value, ferry.NoSuchHandler)
        assert node.call(peer.addr, "echo", b"still here %d" % i) == b"still here %d" % i
    with pytest.raises(ferry.NoSuchHandler):
        node.call(peer.addr, "no-such-handler", b"")
    assert node.call(peer.addr, "echo", b"") == b""


def test_in_process_handlers(node: ferry.Node) -> None:
    """Sync, raising and async handlers of this process, and unserve."""
    with ferry.Node() as server:
        server.serve_rpc("upper", lambda body: body.upper())
        server.serve_rpc("memview", lambda body: memoryview(body[::-1]))

        def broken(body: bytes) -> bytes:
            raise RuntimeError(f"nope: {body!r}")

        async def slow_double(body: bytes) -> bytes:
            await asyncio.sleep(0.01)
            return body * 2

        server.serve_rpc("broken", broken)
        server.serve_rpc("double", slow_double)
        assert node.call(server.addr, "upper", b"abc") == b"ABC"
        assert node.call(server.addr, "memview", b"abc") == b"cba"
        with pytest.raises(ferry.RemoteError, match="nope: b'x'"):
            node.call(server.addr, "broken", b"x")
        # No loop ran when it was served: each call runs it with asyncio.run.
        assert node.call(server.addr, "double", b"ab") == b"abab"
        assert server.unserve_rpc("upper") is True
        assert server.unserve_rpc("upper") is False
        with pytest.raises(ferry.NoSuchHandler):
            node.call(server.addr, "upper", b"abc")


@pytest.mark.parametrize("loop", [True, False], ids=["peer-loop", "no-loop"])
def test_async_handler(spawn_peer: PeerFactory, node: ferry.Node, loop: bool) -> None:
    """An ``async def`` handler runs on the loop that was running when it
    was served, or (none running) on one of its own per call."""
    peer = spawn_peer("memory", loop=loop)
    answer = json.loads(node.call(peer.addr, "async-echo", b"hi"))
    assert answer["body"] == "hi"
    assert answer["on_main_loop"] is loop
    if loop:
        assert answer["thread"] == "MainThread"


def test_32_concurrent_calls(spawn_peer: PeerFactory, node: ferry.Node, transport: str) -> None:
    peer = spawn_peer(transport, loop=True)

    # 32 threads, each its own blocking call.
    bodies = [f"call {i} ".encode() * (i + 1) for i in range(32)]
    barrier = threading.Barrier(32, timeout=10.0)

    def one(body: bytes) -> bytes:
        barrier.wait()
        return node.call(peer.addr, "echo", body, timeout=20.0)

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(one, bodies, timeout=60.0))
    assert answers == bodies

    # 32 call_async at once, to the async handler on the peer's loop, and
    # to the sync one.
    async def many() -> List[bytes]:
        calls = [node.call_async(peer.addr, "async-echo", b"a%d" % i, timeout=20.0) for i in range(32)]
        calls += [node.call_async(peer.addr, "echo", b"s%d" % i, timeout=20.0) for i in range(32)]
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=60.0)

    results = asyncio.run(many())
    assert [json.loads(r)["body"] for r in results[:32]] == ["a%d" % i for i in range(32)]
    assert results[32:] == [b"s%d" % i for i in range(32)]

    async def failing() -> None:
        await node.call_async(peer.addr, "fail", b"async", timeout=20.0)

    with pytest.raises(ferry.RemoteError, match="handler failed on purpose: async"):
        asyncio.run(failing())


# -- notifications and messages ------------------------------------------------------


def bodies_of(got: List[List[str]], kind: str = "notification") -> List[bytes]:
    assert all(k == kind for k, _, _ in got), got
    return [bytes.fromhex(b) for _, b, _ in got]


def test_notifications_counted_exactly_once(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str
) -> None:
    """100 notified writes, 50 notified transfer requests, 20 standalone
    notifications: exactly those bodies arrive at the owner, once each,
    from this node; nothing more after a further wait."""
    block = 4096
    peer = spawn_peer(transport, sizes=[64 * block])
    src = node.alloc(64 * block)
    np.frombuffer(src, np.uint8)[:] = 9
    expected: Set[bytes] = set()
    for i in range(100):
        body = b"write-%d" % i
        node.write(src, peer.handles[0], length=block, remote_offset=(i % 64) * block, notification=body)
        expected.add(body)
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, block, block, 64))
    prepared = node.prepare_remote(ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, block, block, 64)))
    for i in range(50):
        body = b"xfer-%d" % i
        idx = np.array([i % 64, (i * 7) % 64, (i * 13 + 1) % 64])
        xfer = node.make_xfer("WRITE" if i % 2 else "READ", local, idx, prepared, idx, notification=body)
        xfer.post(timeout=10.0)
        assert xfer.wait(timeout=10.0)
        expected.add(body)
    for i in range(20):
        body = b"plain-%d" % i
        node.notify(peer.addr, body)
        expected.add(body)
    got = peer.rpc(node, "notifications", {"count": len(expected), "timeout": 10.0})["got"]
    received = bodies_of(got)
    assert len(received) == len(expected), f"{len(received)} deliveries for {len(expected)} sent"
    assert set(received) == expected
    assert all(sender == str(node.addr) for _, _, sender in got)
    # Those of one kind arrived in the order they were sent.
    writes = [b for b in received if b.startswith(b"write-")]
    assert writes == [b"write-%d" % i for i in range(100)]
    # Nothing more: no duplicate turns up later.
    time.sleep(0.5)
    more = peer.rpc(node, "notifications", {"count": 1, "timeout": 0.5})["got"]
    assert more == []


def test_notifications_into_this_process(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str
) -> None:
    """The peer writes into this node's region 100 times, notified: they
    arrive here once each, through ``notifications()`` and
    ``next_notification()``."""
    peer = spawn_peer(transport, sizes=[4096])
    region = node.alloc(4096)
    answer = peer.rpc(
        node,
        "notified-writes",
        {"handle": region.remote().to_bytes().hex(), "count": 100, "length": 512, "prefix": "n-"},
    )
    assert answer == {"done": True}
    received: List[ferry.Delivery] = []
    deadline = time.monotonic() + 10.0
    while len(received) < 100 and time.monotonic() < deadline:
        received += node.notifications(max=7)
        if len(received) < 100:
            d = node.next_notification(timeout=0.2)
            if d is not None:
                received.append(d)
    assert [d.body for d in received] == [b"n-%d" % i for i in range(100)]
    assert all(d.kind == "notification" and d.sender == peer.addr for d in received)
    assert node.next_notification(timeout=0.5) is None
    assert node.notifications() == []


def test_messages_and_notifications_in_order(node: ferry.Node) -> None:
    with ferry.Node() as sender:
        for i in range(30):
            if i % 3 == 0:
                sender.notify(node.addr, b"%d" % i)
            else:
                sender.send_message(node.addr, bytearray(b"%d" % i))
        got: List[ferry.Delivery] = []
        deadline = time.monotonic() + 10.0
        while len(got) < 30 and time.monotonic() < deadline:
            d = node.next_notification(timeout=1.0)
            if d is not None:
                got.append(d)
        assert [d.body for d in got] == [b"%d" % i for i in range(30)]
        assert [d.kind for d in got] == ["notification" if i % 3 == 0 else "message" for i in range(30)]
        assert all(d.sender == sender.addr for d in got)
        with pytest.raises(ferry.TooLarge):
            sender.send_message(node.addr, bytes(16 << 20))


def test_incoming_async_iterator(node: ferry.Node) -> None:
    with ferry.Node() as sender:

        async def collect() -> List[bytes]:
            got: List[bytes] = []

            async def send() -> None:
                for i in range(10):
                    await asyncio.sleep(0.005)
                    sender.notify(node.addr, b"async-%d" % i)

            task = asyncio.ensure_future(send())
            async for delivery in node.incoming():
                got.append(delivery.body)
                if len(got) == 10:
                    break
            await task
            return got

        got = asyncio.run(asyncio.wait_for(collect(), timeout=20.0))
        assert got == [b"async-%d" % i for i in range(10)]
        # The loop is gone: what arrives next is not taken by it.
        sender.notify(node.addr, b"after the loop")
        later = node.next_notification(timeout=5.0)
        assert later is not None and later.body == b"after the loop"
