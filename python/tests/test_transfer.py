"""Two Python processes: writes and reads of 1 B to 256 MiB, verified byte
for byte on both sides, over the same-host path and over TCP."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ferry
from conftest import PeerFactory, make_node
from patterns import pattern, sha256

MiB = 1 << 20
SMALL_SIZES = [1, 3, 127, 4095, 4096, 4097, 65537, 1 * MiB, 3 * MiB + 5]
LARGE_SIZES = [64 * MiB, 256 * MiB]


def u8(region: Any) -> "np.ndarray[Any, np.dtype[np.uint8]]":
    return np.frombuffer(region, dtype=np.uint8)


def check_both_ways(
    node: ferry.Node, peer: Any, index: int, size: int, seed: int, local_kind: str
) -> None:
    """Writes a fresh pattern into the peer's region ``index`` (checked by
    the owner), then has the owner fill another and reads it back (checked
    here)."""
    handle = peer.handles[index]
    assert handle.nbytes == size
    # WRITE: local -> owner.
    data = pattern(seed, size)
    if local_kind == "register":
        src_array = data.copy()
        src = node.register(src_array)
    else:
        src = node.alloc(size)
        u8(src)[:] = data
    node.write(src, handle, timeout=60.0)
    verdict = peer.rpc(node, "verify", {"region": index, "offset": 0, "length": size, "seed": seed})
    assert verdict == {"equal": True, "first": -1}, f"write of {size} B: owner's bytes differ at {verdict['first']}"
    # READ: owner -> local, after the owner wrote other bytes.
    read_seed = seed ^ 0x5A5A5A5A
    peer.rpc(node, "fill", {"region": index, "seed": read_seed})
    if local_kind == "register":
        dst_array = np.zeros(size, dtype=np.uint8)
        dst = node.register(dst_array)
        got = dst_array
    else:
        dst = node.alloc(size)
        got = u8(dst)
    node.read(dst, handle, timeout=60.0)
    expected = pattern(read_seed, size)
    assert np.array_equal(got, expected), f"read of {size} B differs at {int(np.flatnonzero(got != expected)[0])}"
    src.close()
    dst.close()


@pytest.mark.parametrize("owner_mode", ["alloc", "register"])
def test_small_and_odd_sizes(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, owner_mode: str, seed: int
) -> None:
    peer = spawn_peer(transport, sizes=SMALL_SIZES, mode=owner_mode)
    if transport == "tcp":
        assert "memory" not in peer.transports
        assert "memory" not in node.transports()
    else:
        assert peer.transports[0] == "memory"
    for index, size in enumerate(SMALL_SIZES):
        local_kind = "register" if index % 2 else "alloc"
        check_both_ways(node, peer, index, size, seed + index, local_kind)


@pytest.mark.parametrize("size", LARGE_SIZES, ids=["64MiB", "256MiB"])
def test_large_sizes(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, size: int, seed: int
) -> None:
    # The owner registers a numpy array for the 256 MiB case and allocates
    # for 64 MiB, so both kinds of region cross both transports.
    mode = "register" if size == 256 * MiB else "alloc"
    peer = spawn_peer(transport, sizes=[size], mode=mode)
    check_both_ways(node, peer, 0, size, seed, "alloc" if mode == "register" else "register")


def test_offsets_and_slices(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    """Odd offsets on both sides, a sliced handle, a multi-op submit: only
    the bytes named move."""
    size = 1 * MiB + 13
    peer = spawn_peer(transport, sizes=[size])
    handle = peer.handles[0]
    src = node.alloc(size)
    u8(src)[:] = pattern(seed, size)
    expected = np.zeros(size, dtype=np.uint8)

    node.write(src, handle, local_offset=7, remote_offset=1001, length=4099)
    expected[1001 : 1001 + 4099] = u8(src)[7 : 7 + 4099]

    window = handle.slice(200_003, 300_007)
    assert window.nbytes == 100_004
    node.write(src, window, local_offset=3, remote_offset=1, length=100_003)
    expected[200_004 : 300_007] = u8(src)[3 : 3 + 100_003]

    node.submit(
        [
            ferry.Op.write(src, handle, local_offset=500_000, remote_offset=600_001, length=1),
            ferry.Op.write(src, handle, local_offset=size - 999, remote_offset=size - 999, length=999),
            ferry.Op.write(src, handle, local_offset=11, remote_offset=700_000, length=65_537),
        ],
        timeout=10.0,
    )
    expected[600_001] = u8(src)[500_000]
    expected[size - 999 :] = u8(src)[size - 999 :]
    expected[700_000 : 700_000 + 65_537] = u8(src)[11 : 11 + 65_537]

    assert peer.sha256(node) == sha256(expected)

    # Reads at odd offsets, into the middle of a local region.
    dst = node.alloc(size)
    node.submit(
        [
            ferry.Op.read(dst, handle, local_offset=5, remote_offset=1001, length=4099),
            ferry.Op.read(dst, window, local_offset=10_000, remote_offset=1, length=100_003),
        ],
        timeout=10.0,
    )
    got = u8(dst)
    assert np.array_equal(got[5 : 5 + 4099], expected[1001 : 1001 + 4099])
    assert np.array_equal(got[10_000 : 10_000 + 100_003], expected[200_004:300_007])
    assert not got[:5].any() and not got[5 + 4099 : 10_000].any() and not got[110_003:].any()


def test_read_only_handle_refuses_writes(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    peer = spawn_peer(transport, sizes=[4096])
    peer.rpc(node, "fill", {"region": 0, "seed": seed})
    before = peer.sha256(node)
    src = node.alloc(4096)
    u8(src)[:] = 0xEE
    ro = peer.handles[0].read_only()
    assert ro.access == "r"
    with pytest.raises(ferry.ReadOnly) as caught:
        node.write(src, ro)
    assert isinstance(caught.value, ferry.AccessDenied)
    assert isinstance(caught.value, PermissionError)
    assert peer.sha256(node) == before
    # Reads through it work.
    node.read(src, ro)
    assert np.array_equal(u8(src), pattern(seed, 4096))


def test_async_submit(monkeypatch: pytest.MonkeyPatch, spawn_peer: PeerFactory, seed: int) -> None:
    import asyncio

    peer = spawn_peer("memory", sizes=[8 * MiB])
    node = make_node(monkeypatch, "memory")
    try:
        src = node.alloc(8 * MiB)
        u8(src)[:] = pattern(seed, 8 * MiB)
        dst = node.alloc(8 * MiB)

        async def go() -> None:
            half = 4 * MiB
            await asyncio.gather(
                node.submit_async([ferry.Op.write(src, peer.handles[0], length=half)]),
                node.submit_async(
                    [ferry.Op.write(src, peer.handles[0], local_offset=half, remote_offset=half)]
                ),
            )
            await node.submit_async([ferry.Op.read(dst, peer.handles[0])])

        asyncio.run(go())
        assert np.array_equal(u8(dst), u8(src))
        assert peer.rpc(node, "verify", {"region": 0, "offset": 0, "length": 8 * MiB, "seed": seed})["equal"]
    finally:
        node.close()


def test_threads_share_a_node(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    """8 threads write disjoint slices through one node at once, then read
    them back; every byte lands where it should."""
    from concurrent.futures import ThreadPoolExecutor

    threads, share = 8, 2 * MiB + 3
    size = threads * share
    peer = spawn_peer(transport, sizes=[size])
    src = node.alloc(size)
    u8(src)[:] = pattern(seed, size)
    dst = node.alloc(size)

    def one(i: int) -> None:
        for _ in range(3):
            node.write(src, peer.handles[0], local_offset=i * share, remote_offset=i * share, length=share, timeout=30.0)
        node.read(dst, peer.handles[0], local_offset=i * share, remote_offset=i * share, length=share, timeout=30.0)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, range(threads), timeout=120.0))
    assert np.array_equal(u8(dst), u8(src))
    assert peer.rpc(node, "verify", {"region": 0, "offset": 0, "length": size, "seed": seed})["equal"]


def test_a_node_with_tcp_off_moves_same_host_bytes_and_refuses_tcp_only_nodes(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """``tcp=False``: same-host memory still carries the bytes, and a node
    only TCP reaches is refused with NoSharedTransport both ways, nothing
    moved. (ibverbs off throughout, so that a host with a device answers
    the same.)"""
    monkeypatch.delenv("FERRY_DISABLE_MEMORY", raising=False)
    with ferry.Node(tcp=False, ibverbs=False) as node, ferry.Node(ibverbs=False) as shared, ferry.Node(
        memory=False, ibverbs=False
    ) as tcp_only:
        assert node.transports() == ["memory"], node.transports()
        data = pattern(seed, 4096)
        src = node.alloc(4096)
        u8(src)[:] = data
        theirs = shared.alloc(4096)
        node.write(src, theirs.remote())
        assert np.array_equal(u8(theirs), data)
        target = tcp_only.alloc(4096)
        with pytest.raises(ferry.NoSharedTransport):
            node.write(src, target.remote())
        assert not u8(target).any()
        back = tcp_only.alloc(4096)
        with pytest.raises(ferry.NoSharedTransport):
            tcp_only.read(back, src.remote())
        assert not u8(back).any()
