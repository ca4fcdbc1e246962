"""Every bad input reaches Python as the right exception class, and nothing
changes on the other side: forged handles, out-of-bounds ops (with the
failing op's index), dropped regions, dead and stopped peers, bad indices
in a request, and the argument errors caught before anything moves."""

from __future__ import annotations

import json
import time
from typing import Any, Dict

import numpy as np
import pytest

import ferry
from conftest import PeerFactory, PeerProcess, make_node
from patterns import pattern, sha256

MiB = 1 << 20


def u8(region: Any) -> "np.ndarray[Any, np.dtype[np.uint8]]":
    return np.frombuffer(region, dtype=np.uint8)


def forge(raw: bytes, **changes: Any) -> ferry.RemoteRegion:
    """The handle ``raw`` with top-level fields changed; ``tokens=True``
    flips a digit of every transport's token."""
    doc: Dict[str, Any] = json.loads(raw)
    if changes.pop("tokens", False):
        for transport in doc["transports"].values():
            if isinstance(transport, dict) and "token" in transport:
                token = transport["token"]
                transport["token"] = ("1" if token[0] == "0" else "0") + token[1:]
    doc.update(changes)
    return ferry.RemoteRegion.from_bytes(json.dumps(doc).encode())


def filled_peer(spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int, **kw: Any) -> PeerProcess:
    peer = spawn_peer(transport, **kw)
    for r, size in enumerate(peer.info["sizes"]):
        peer.rpc(node, "fill", {"region": r, "seed": seed + r})
    return peer


def unchanged(peer: PeerProcess, node: ferry.Node, seed: int, region: int = 0) -> bool:
    size = peer.info["sizes"][region] if region < len(peer.info["sizes"]) else None
    request: Dict[str, Any] = {"region": region, "offset": 0, "seed": seed + region}
    if size is not None:
        request["length"] = size
    verdict: bool = peer.rpc(node, "verify", request)["equal"]
    return verdict


# -- forged handles -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["alloc", "register"])
def test_forged_token_is_access_denied(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, mode: str, seed: int
) -> None:
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[64 * 1024], mode=mode)
    forged = forge(peer.handle_bytes[0], tokens=True)
    src = node.alloc(64 * 1024)
    u8(src)[:] = 0x11
    with pytest.raises(ferry.AccessDenied) as caught:
        node.write(src, forged)
    assert isinstance(caught.value, PermissionError)
    assert caught.value.op_index == 0
    with pytest.raises(ferry.AccessDenied):
        node.read(src, forged)
    assert (u8(src) == 0x11).all(), "a refused read changed local bytes"
    assert unchanged(peer, node, seed)
    # The genuine handle still works.
    node.write(src, peer.handles[0])
    assert peer.rpc(node, "sha256", {"region": 0})["sha256"] != ""


@pytest.mark.parametrize(
    "field",
    ["len", "addr", "region", "generation"],
)
def test_forged_fields_are_refused(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, field: str, seed: int
) -> None:
    """A handle with a field edited but its tokens intact: the owner refuses
    it, and none of its memory (this region's, or its neighbour's) changes."""
    size = 64 * 1024
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[size, size], mode="register")
    raw = peer.handle_bytes[0]
    doc = json.loads(raw)
    src = node.alloc(2 * size)
    u8(src)[:] = 0x22
    if field == "len":
        forged = forge(raw, len=2 * size)
        ops = [ferry.Op.write(src, forged, remote_offset=size, length=size)]
    elif field == "addr":
        # Points at the neighbouring region's bytes.
        other = json.loads(peer.handle_bytes[1])
        forged = forge(raw, addr=other["addr"])
        ops = [ferry.Op.write(src, forged, length=size)]
    elif field == "region":
        forged = forge(raw, region=json.loads(peer.handle_bytes[1])["region"])
        ops = [ferry.Op.write(src, forged, length=size)]
    else:
        forged = forge(raw, generation=doc["generation"] + 1)
        ops = [ferry.Op.write(src, forged, length=size)]
    with pytest.raises(ferry.FerryError) as caught:
        node.submit(ops)
    assert isinstance(caught.value, (ferry.AccessDenied, ferry.OutOfBounds, ferry.RegionGone)), repr(
        caught.value
    )
    assert unchanged(peer, node, seed, 0)
    assert unchanged(peer, node, seed, 1)


def test_read_only_handle_cannot_be_upgraded(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    size = 4096
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[size])
    doc = json.loads(peer.handles[0].read_only().to_bytes())
    assert doc["access"] == "ReadOnly"
    doc["access"] = "ReadWrite"
    upgraded = ferry.RemoteRegion.from_bytes(json.dumps(doc).encode())
    src = node.alloc(size)
    with pytest.raises(ferry.AccessDenied):
        node.write(src, upgraded)
    assert unchanged(peer, node, seed)


# -- out of bounds --------------------------------------------------------------


def test_out_of_bounds_names_the_op(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    size = 4096
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[size])
    handle = peer.handles[0]
    src = node.alloc(2 * size)
    u8(src)[:] = 0x33
    good = ferry.Op.write(src, handle, length=16)
    cases = [
        (2, ferry.Op.write(src, handle, remote_offset=size - 10, length=11)),  # remote end
        (1, ferry.Op.write(src, handle, remote_offset=size, length=1)),  # remote start
        (3, ferry.Op.write(src, handle, local_offset=2 * size - 1, length=2)),  # local end
        (0, ferry.Op.read(src, handle, remote_offset=1, length=size)),  # a read
    ]
    for index, bad in cases:
        ops = [good] * 4
        ops[index] = bad
        with pytest.raises(ferry.OutOfBounds) as caught:
            node.submit(ops)
        assert caught.value.op_index == index, (index, caught.value)
        assert isinstance(caught.value, IndexError)
        assert unchanged(peer, node, seed), f"case {index}: the good ops moved bytes"
    # Slicing a handle past its end.
    with pytest.raises(ferry.OutOfBounds):
        handle.slice(0, size + 1)
    # The region still takes a good write.
    node.submit([good])
    expected = pattern(seed, size).copy()
    expected[:16] = 0x33
    assert peer.sha256(node) == sha256(expected)


# -- dropped region ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["alloc", "register"])
def test_dropped_region(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, mode: str, seed: int
) -> None:
    size = 64 * 1024
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[size], mode=mode)
    handle = peer.handles[0]
    src = node.alloc(size)
    # Prepared before the drop too: the list's region goes with it.
    prepared = node.prepare_remote(ferry.RemoteDescs([handle], strided=ferry.Strided(0, 0, 4096, 4096, 16)))
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, 4096, 4096, 16))
    node.read(src, handle)
    assert np.array_equal(u8(src), pattern(seed, size))

    assert peer.rpc(node, "close-region", {"region": 0})["closed"] is True
    u8(src)[:] = 0x44
    with pytest.raises(ferry.RegionGone):
        node.write(src, handle)
    with pytest.raises(ferry.RegionGone):
        node.read(src, handle)
    assert (u8(src) == 0x44).all()
    xfer = node.make_xfer("WRITE", local, range(16), prepared, range(16))
    xfer.post(timeout=5.0)
    with pytest.raises(ferry.RegionGone):
        xfer.wait(timeout=10.0)
    assert xfer.status() is ferry.XferStatus.FAILED
    assert isinstance(xfer.error, ferry.RegionGone)
    # The memory the owner still holds (its view outlives the region) kept
    # its bytes.
    assert unchanged(peer, node, seed)

    # A new region, perhaps in the same slot: the old handle does not reach it.
    fresh = peer.rpc(node, "new-region", {"size": size})
    with pytest.raises(ferry.RegionGone):  # StaleRegion is a RegionGone
        node.write(src, handle)
    assert peer.sha256(node, region=fresh["region"]) == sha256(np.zeros(size, np.uint8))
    new_handle = ferry.RemoteRegion.from_bytes(bytes.fromhex(fresh["handle"]))
    node.write(src, new_handle)
    assert peer.sha256(node, region=fresh["region"]) == sha256(u8(src))


# -- dead peer ---------------------------------------------------------------------


@pytest.mark.parametrize("talked", [True, False], ids=["connected", "fresh"])
def test_dead_peer(
    spawn_peer: PeerFactory,
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
    talked: bool,
    seed: int,
) -> None:
    """A killed owner: a ConnectionError subclass, soon (not the deadline),
    for one-shot ops, prepared requests and calls."""
    peer = spawn_peer(transport, sizes=[MiB])
    node = make_node(monkeypatch, transport)
    try:
        handle = peer.handles[0]
        src = node.alloc(MiB)
        u8(src)[:] = pattern(seed, MiB)
        if talked:
            node.write(src, handle)
            prepared = node.prepare_remote(ferry.RemoteDescs([handle], np.array([[0, 0, MiB]])))
        peer.kill()
        dead = (ferry.UnknownNode, ferry.PeerUnreachable, ferry.ConnectionLost)
        for op in ("write", "read"):
            started = time.monotonic()
            with pytest.raises(dead) as caught:
                getattr(node, op)(src, handle, timeout=8.0)
            assert isinstance(caught.value, ConnectionError)
            assert time.monotonic() - started < 6.0, f"{op} took until its deadline"
        if talked:
            local = ferry.LocalDescs([src], np.array([[0, 0, MiB]]))
            xfer = node.make_xfer("WRITE", local, [0], prepared, [0])
            xfer.post(timeout=8.0)
            with pytest.raises(dead):
                xfer.wait(timeout=10.0)
        with pytest.raises(dead):
            node.call(peer.addr, "echo", b"x", timeout=8.0)
        with pytest.raises(dead):
            node.notify(peer.addr, b"x", timeout=8.0)
        assert np.array_equal(u8(src), pattern(seed, MiB))
    finally:
        node.close()


# -- a stopped peer: timeouts --------------------------------------------------------


def test_timeout_on_stopped_peer(
    spawn_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """TCP, 256 MiB: the owner is stopped (SIGSTOP) with the connection up;
    a write and a read with a short deadline raise ferry.Timeout (a
    TimeoutError) at about that deadline; continued (SIGCONT), the owner
    has kept its bytes where only a read touched them, and transfers work
    again."""
    size = 256 * MiB
    peer = spawn_peer("tcp", sizes=[size, 4096])
    node = make_node(monkeypatch, "tcp")
    try:
        peer.rpc(node, "fill", {"region": 1, "seed": seed + 1})
        src = node.alloc(size)
        u8(src)[:] = pattern(seed, size)
        node.write(src, peer.handles[0], timeout=60.0)  # connections up
        small = node.alloc(4096)

        peer.sigstop()
        try:
            for op, handle, local in (
                ("write", peer.handles[0], src),
                ("read", peer.handles[1], small),
            ):
                started = time.monotonic()
                with pytest.raises(ferry.Timeout) as caught:
                    getattr(node, op)(local, handle, timeout=0.5)
                took = time.monotonic() - started
                assert isinstance(caught.value, TimeoutError)
                assert 0.4 < took < 5.0, f"{op} timed out after {took:.2f} s"
            with pytest.raises(ferry.Timeout):
                node.call(peer.addr, "echo", b"x", timeout=0.5)
        finally:
            peer.sigcont()

        assert unchanged(peer, node, seed, region=1), "a timed-out read changed the owner's bytes"
        # The node and the peer work again: a fresh pattern arrives whole.
        u8(src)[:] = pattern(seed + 7, size)
        node.write(src, peer.handles[0], timeout=60.0)
        verdict = peer.rpc(node, "verify", {"region": 0, "offset": 0, "length": size, "seed": seed + 7})
        assert verdict["equal"], verdict
        node.read(small, peer.handles[1])
        assert np.array_equal(u8(small), pattern(seed + 1, 4096))
    finally:
        node.close()


def test_timeout_during_prepared_transfer(
    spawn_peer: PeerFactory, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A 256 MiB prepared request over TCP (65,536 descriptors of 4 KiB);
    the owner is stopped once part of it has completed: ``wait`` raises
    Timeout at the post's deadline."""
    count, block = 65536, 4096
    size = count * block
    peer = spawn_peer("tcp", sizes=[size])
    node = make_node(monkeypatch, "tcp")
    try:
        src = node.alloc(size)
        u8(src)[:] = pattern(seed, size)
        local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, block, block, count))
        prepared = node.prepare_remote(
            ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, block, block, count))
        )
        order = np.arange(count)[::-1]
        xfer = node.make_xfer("WRITE", local, order, prepared, order)
        stopped_midway = False
        for _attempt in range(5):
            xfer.post(timeout=2.0)
            deadline = time.monotonic() + 2.0
            while xfer.completed == 0 and time.monotonic() < deadline:
                pass
            peer.sigstop()
            if xfer.status() is ferry.XferStatus.IN_PROGRESS and xfer.completed < count:
                stopped_midway = True
                break
            peer.sigcont()
            xfer.wait(timeout=10.0)
        assert stopped_midway, "the request always finished before the owner could be stopped"
        try:
            started = time.monotonic()
            with pytest.raises(ferry.Timeout):
                xfer.wait(timeout=10.0)
            assert time.monotonic() - started < 5.0
            assert xfer.status() is ferry.XferStatus.FAILED
            assert isinstance(xfer.error, ferry.Timeout)
        finally:
            peer.sigcont()
        # Posted again with the owner running: it completes, every byte.
        xfer.post(timeout=60.0)
        assert xfer.wait(timeout=60.0)
        verdict = peer.rpc(node, "verify", {"region": 0, "offset": 0, "length": size, "seed": seed})
        assert verdict["equal"], verdict
    finally:
        node.close()


# -- bad indices and descriptors in a request ----------------------------------------


def test_make_xfer_index_out_of_range(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    count, block = 1000, 64
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[count * block])
    src = node.alloc(count * block)
    u8(src)[:] = 0x55
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, block, block, count))
    prepared = node.prepare_remote(
        ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, block, block, count))
    )
    good = np.arange(count)
    for side in ("local", "remote"):
        for position in (0, 617, count - 1):
            bad = good.copy()
            bad[position] = count + position  # one past the list, or more
            args = (bad, good) if side == "local" else (good, bad)
            with pytest.raises(ferry.OutOfBounds) as caught:
                node.make_xfer("WRITE", local, args[0], prepared, args[1])
            assert caught.value.op_index == position, (side, position, caught.value)
            assert str(position) in str(caught.value)
    # A range past the end, too.
    with pytest.raises(ferry.OutOfBounds):
        node.make_xfer("WRITE", local, range(1, count + 1), prepared, range(count))
    # Index arrays of different lengths; negative indices; a bad kind.
    with pytest.raises(ferry.InvalidArgument):
        node.make_xfer("WRITE", local, good, prepared, good[:-1])
    with pytest.raises(ferry.InvalidRange):
        node.make_xfer("WRITE", local, -good, prepared, good)
    with pytest.raises(ferry.InvalidArgument):
        node.make_xfer("COPY", local, good, prepared, good)
    with pytest.raises(ferry.InvalidArgument):
        node.make_xfer("WRITE", local, good.reshape(10, 100), prepared, good)
    with pytest.raises(ferry.InvalidArgument):
        node.make_xfer("WRITE", local, good.astype(np.float64), prepared, good)
    assert unchanged(peer, node, seed), "a refused request moved bytes"


def test_length_mismatch_names_the_pair(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    peer = filled_peer(spawn_peer, node, transport, seed, sizes=[4096])
    src = node.alloc(4096)
    local = ferry.LocalDescs([src], np.array([[0, 0, 16], [0, 16, 16], [0, 32, 17]]))
    prepared = node.prepare_remote(ferry.RemoteDescs(peer.handles, np.array([[0, 0, 16], [0, 100, 16], [0, 200, 16]])))
    with pytest.raises(ferry.LengthMismatch) as caught:
        node.make_xfer("WRITE", local, [0, 1, 2], prepared, [0, 1, 2])
    assert caught.value.op_index == 2
    # One-shot ops take one length for both sides: past a handle's end is
    # OutOfBounds.
    with pytest.raises(ferry.OutOfBounds):
        node.submit([ferry.Op.write(src, peer.handles[0].slice(0, 10), length=11)])
    assert unchanged(peer, node, seed)


def test_descriptor_lists_are_checked(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str
) -> None:
    peer = spawn_peer(transport, sizes=[4096])
    src = node.alloc(4096)
    rows = np.array([[0, 0, 16], [0, 4000, 96], [0, 4090, 7]])
    with pytest.raises(ferry.OutOfBounds) as caught:
        ferry.LocalDescs([src], rows)
    assert caught.value.op_index == 2
    with pytest.raises(ferry.OutOfBounds) as caught:
        ferry.LocalDescs([src], np.array([[0, 0, 16], [1, 0, 16]]))  # no region 1
    assert caught.value.op_index == 1
    with pytest.raises(ferry.OutOfBounds):
        ferry.RemoteDescs(peer.handles, rows)
    with pytest.raises(ferry.OutOfBounds):
        ferry.LocalDescs([src], strided=ferry.Strided(0, 0, 100, 100, 41))
    with pytest.raises(ferry.InvalidArgument):
        ferry.LocalDescs([src], np.zeros((4, 2), np.int64))
    with pytest.raises(ferry.InvalidRange):
        ferry.LocalDescs([src], np.array([[0, -1, 16]]))
    with pytest.raises(ferry.InvalidArgument):
        ferry.LocalDescs([src])
    with pytest.raises(ferry.MetadataError):
        ferry.RemoteDescs.from_bytes(b"{not json")
    for not_a_list in (b"[1, 2]", b'"text"', b"{}"):
        with pytest.raises(ferry.MetadataError):
            ferry.RemoteDescs.from_bytes(not_a_list)
    # A list whose `count` was raised in transit is refused as making it
    # is: the same class, the same descriptor named.
    strided = ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, 100, 100, 40))
    doc = json.loads(strided.to_bytes())
    doc["descs"]["Strided"]["count"] = 41
    with pytest.raises(ferry.OutOfBounds) as from_bytes:
        ferry.RemoteDescs.from_bytes(json.dumps(doc).encode())
    with pytest.raises(ferry.OutOfBounds) as made:
        ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, 100, 100, 41))
    assert from_bytes.value.op_index == made.value.op_index == 40


# -- argument errors -------------------------------------------------------------------


def test_argument_errors(node: ferry.Node) -> None:
    other = ferry.Node()
    try:
        with pytest.raises(ferry.InvalidArgument):
            node.alloc(0)
        with pytest.raises(ferry.InvalidArgument):
            node.alloc(16, access="w")
        with pytest.raises(ferry.InvalidArgument):
            node.register(b"read-only bytes")
        with pytest.raises(ferry.InvalidArgument):
            node.register(np.zeros((4, 4), np.uint8)[:, 1])
        with pytest.raises(ferry.InvalidArgument):
            node.register(bytearray())
        with pytest.raises(ferry.InvalidArgument):
            node.register(42)
        with pytest.raises(ferry.MetadataError):
            ferry.RemoteRegion.from_bytes(b"not a handle")
        with pytest.raises(ferry.InvalidArgument):
            ferry.NodeAddr.parse("no-id-here")
        region = other.alloc(64)
        src = node.alloc(64)
        with pytest.raises(ferry.InvalidRange):
            node.write(src, region.remote(), local_offset=-1)
        with pytest.raises(ferry.InvalidArgument):
            node.write(src, region.remote(), timeout=-1.0)
        with pytest.raises(ferry.NoSuchHandler):
            node.call(other.addr, "nobody-serves-this", b"")
        with pytest.raises(ferry.TooLarge):
            node.call(other.addr, "echo", bytes(1 << 20))
        with pytest.raises(ferry.InvalidArgument):
            ferry.Node(listen="not an address")
        # Closed: ShutDown from every call, both ends.
        other.close()
        assert other.closed
        with pytest.raises(ferry.ShutDown):
            other.alloc(16)
        with pytest.raises(ferry.ShutDown):
            other.write(region, src.remote())
        with pytest.raises(ferry.FerryError):
            node.write(src, region.remote(), timeout=3.0)
        other.close()  # twice: nothing
    finally:
        other.close()


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_a_node_without_the_cluster_secret_is_refused_with_auth_failed(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Nodes holding one cluster secret move bytes; one without it, or with
    another, gets :class:`AuthFailed` and the owner's bytes stay."""
    if transport == "tcp":
        monkeypatch.setenv("FERRY_DISABLE_MEMORY", "1")
    secret = b"the python suite's secret, 32 B"
    with ferry.Node(cluster_secret=secret) as owner, ferry.Node(cluster_secret=secret.decode()) as peer:
        target = owner.alloc(4096)
        u8(target)[:] = 7
        src = peer.alloc(4096)
        u8(src)[:] = 9
        peer.write(src, target.remote())
        assert (u8(target) == 9).all()
        u8(target)[:] = 7
        for other in (None, b"another cluster's secret, 32 B!"):
            with ferry.Node(cluster_secret=other) as stranger:
                src = stranger.alloc(4096)
                with pytest.raises(ferry.AuthFailed):
                    stranger.write(src, target.remote())
                with pytest.raises(ferry.AuthFailed):
                    stranger.send_message(owner.addr, b"forged")
        assert (u8(target) == 7).all()
    with pytest.raises(ferry.InvalidArgument):
        ferry.Node(cluster_secret=b"short")
