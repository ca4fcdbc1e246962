"""Prepared transfers of 100,000 descriptors, built from numpy arrays (N×3
rows and the strided form), posted with numpy index arrays (an interleaved
permutation, repeats), verified byte for byte by the owner; on both
transports."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

import numpy as np
import pytest

import ferry
from conftest import PeerFactory
from patterns import pattern, sha256

N = 100_000
U8 = "np.ndarray[Any, np.dtype[np.uint8]]"
I64 = "np.ndarray[Any, np.dtype[np.int64]]"


class Table(NamedTuple):
    """A descriptor list, as numpy columns, and the sizes of its regions."""

    region: Any  # int64[N]
    offset: Any  # int64[N]
    length: Any  # int64[N]
    sizes: List[int]
    strided: Any  # ferry.Strided or None

    def rows(self) -> Any:
        return np.stack([self.region, self.offset, self.length], axis=1).astype(np.uint64)


def rows_table(lengths: Any, order: Any, regions: int, gap: int) -> Table:
    """Descriptor ``d`` has ``lengths[d]`` bytes in region ``d % regions``
    (or as ``order`` says), laid out in the order ``order`` with ``gap``
    bytes between neighbours."""
    n = lengths.size
    region = np.arange(n, dtype=np.int64) % regions
    offset = np.zeros(n, np.int64)
    sizes = []
    for r in range(regions):
        mine = order[region[order] == r]
        spans = lengths[mine] + gap
        starts = np.cumsum(spans) - spans + gap
        offset[mine] = starts
        sizes.append(int(starts[-1] + lengths[mine[-1]] + gap))
    return Table(region, offset, lengths.astype(np.int64), sizes, None)


def strided_table(base: int, stride: int, length: int, count: int) -> Table:
    index = np.arange(count, dtype=np.int64)
    return Table(
        np.zeros(count, np.int64),
        base + index * stride,
        np.full(count, length, np.int64),
        [base + stride * count + 17],
        ferry.Strided(0, base, stride, length, count),
    )


def byte_positions(table: Table, descs: Any, bases: List[int]) -> Any:
    """Flat byte positions (regions laid end to end at ``bases``) of the
    descriptors ``descs``, in order."""
    lengths = table.length[descs]
    firsts = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(firsts, lengths)
    starts = np.asarray(bases, np.int64)[table.region[descs]] + table.offset[descs]
    return np.repeat(starts, lengths) + within


def bases_of(sizes: List[int]) -> List[int]:
    return [int(b) for b in np.cumsum([0] + sizes[:-1])]


def interleaved(n: int) -> Any:
    """0, n-1, 1, n-2, ...: first half forwards interleaved with the second
    half backwards."""
    out = np.empty(n, np.int64)
    half = (n + 1) // 2
    out[0::2] = np.arange(half)
    out[1::2] = np.arange(n - 1, half - 1, -1)
    return out


def build(form: str, kind: str, seed: int) -> Tuple[Table, Table, Any, Any]:
    """(local table, remote table, local_idx, remote_idx) for ``form``.

    The destination's index array is an interleaved permutation (every
    destination descriptor once); the source's repeats descriptors, so that
    the outcome is still determined.

    rows: lengths 1..64 bytes, descriptor d and d±64 alike; destination e
    is paired with source e±64 (most sources used twice), over two regions
    on each side.
    strided: 100,000 blocks of 48 bytes; the source indices are random
    (repeats) after a plain run.
    """
    rng = np.random.default_rng(seed % (2**32))
    dst_idx = interleaved(N)
    if form == "rows":
        d = np.arange(N, dtype=np.int64)
        lengths = 1 + (d * 37) % 64
        remote = rows_table(lengths, interleaved(N), regions=2, gap=3)
        local = rows_table(lengths, d[::-1].copy(), regions=2, gap=1)
        src_idx = np.where(dst_idx >= 64, dst_idx - 64, dst_idx + 64)
    else:
        local = strided_table(base=5, stride=61, length=48, count=N)
        remote = strided_table(base=64, stride=64, length=48, count=N)
        src_idx = rng.integers(0, N, size=N)
        src_idx[: N // 2] = np.arange(N // 2)
    if kind == "WRITE":
        return local, remote, src_idx, dst_idx
    return local, remote, dst_idx, src_idx


@pytest.mark.parametrize("form", ["rows", "strided"])
@pytest.mark.parametrize("kind", ["WRITE", "READ"])
def test_100k_descriptors(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, form: str, kind: str, seed: int
) -> None:
    local_t, remote_t, local_idx, remote_idx = build(form, kind, seed)
    local_idx = local_idx.astype(np.uint32 if form == "rows" else np.int64)
    peer = spawn_peer(transport, sizes=remote_t.sizes)
    # The owner's regions start as a pattern: the gaps between descriptors
    # must keep it.
    remote_seed = seed ^ 0xABCDEF
    remote_flat = np.concatenate([pattern(remote_seed + r, s) for r, s in enumerate(remote_t.sizes)])
    for r in range(len(remote_t.sizes)):
        peer.rpc(node, "fill", {"region": r, "seed": remote_seed + r})

    local_regions = [node.alloc(s) for s in local_t.sizes]
    local_flat = np.concatenate([pattern(seed + 1000 + r, s) for r, s in enumerate(local_t.sizes)])
    for region, base in zip(local_regions, bases_of(local_t.sizes)):
        np.frombuffer(region, np.uint8)[:] = local_flat[base : base + region.nbytes]

    if form == "rows":
        local = ferry.LocalDescs(local_regions, local_t.rows())
        remote = ferry.RemoteDescs(peer.handles, remote_t.rows())
    else:
        local = ferry.LocalDescs(local_regions, strided=local_t.strided)
        remote = ferry.RemoteDescs(peer.handles, strided=remote_t.strided)
    assert len(local) == N and len(remote) == N

    # The list crosses to another process as bytes; the strided form stays
    # small.
    blob = remote.to_bytes()
    if form == "strided":
        assert len(blob) < 4096, len(blob)
    remote = ferry.RemoteDescs.from_bytes(blob)
    assert len(remote) == N

    prepared = node.prepare_remote(remote, timeout=10.0)
    assert len(prepared) == N
    assert prepared.transports()[0] == ("memory" if transport == "memory" else "tcp")

    xfer = node.make_xfer(kind, local, local_idx, prepared, remote_idx)
    assert len(xfer) == N
    assert xfer.nbytes == int(local_t.length[local_idx].sum())
    assert xfer.status() is ferry.XferStatus.READY
    estimate = xfer.estimate()
    assert estimate.duration > 0 and estimate.method in ("measured", "configured")

    assert xfer.post(timeout=60.0) is xfer
    assert xfer.wait(timeout=60.0) is True
    assert xfer.status() is ferry.XferStatus.DONE
    assert xfer.error is None
    assert xfer.completed == N

    src_pos = byte_positions(local_t, local_idx, bases_of(local_t.sizes))
    dst_pos = byte_positions(remote_t, remote_idx, bases_of(remote_t.sizes))
    if kind == "WRITE":
        expected = remote_flat.copy()
        expected[dst_pos] = local_flat[src_pos]
        for r, base in enumerate(bases_of(remote_t.sizes)):
            want = sha256(expected[base : base + remote_t.sizes[r]])
            assert peer.sha256(node, region=r) == want, f"owner region {r} differs"
    else:
        # The owner's bytes are unchanged; ours hold what was read.
        for r in range(len(remote_t.sizes)):
            assert peer.rpc(node, "verify", {"region": r, "offset": 0, "length": remote_t.sizes[r], "seed": remote_seed + r})["equal"]
        expected = local_flat.copy()
        expected[src_pos] = remote_flat[dst_pos]
        got = np.concatenate([np.frombuffer(r, np.uint8) for r in local_regions])
        if not np.array_equal(got, expected):
            first = int(np.flatnonzero(got != expected)[0])
            pytest.fail(f"local bytes differ from byte {first} on")

    # Posted again once done: same bytes again, the estimate now measured.
    xfer.post(timeout=60.0)
    assert xfer.wait(timeout=60.0)
    assert xfer.estimate().method == "measured"


def test_xfer_awaitable_and_repost_guard(
    spawn_peer: PeerFactory, node: ferry.Node, transport: str, seed: int
) -> None:
    """``await xfer``; posting a request that runs raises InProgress."""
    import asyncio

    count, block = 4096, 256
    peer = spawn_peer(transport, sizes=[count * block])
    src = node.alloc(count * block)
    np.frombuffer(src, np.uint8)[:] = pattern(seed, count * block)
    local = ferry.LocalDescs([src], strided=ferry.Strided(0, 0, block, block, count))
    prepared = node.prepare_remote(
        ferry.RemoteDescs(peer.handles, strided=ferry.Strided(0, 0, block, block, count))
    )
    order = np.arange(count)[::-1]
    xfer = node.make_xfer("write", local, order, prepared, order)

    async def go() -> None:
        xfer.post()
        try:
            xfer.post()
        except ferry.InProgress:
            pass  # it was still running: refused, as documented
        await xfer

    asyncio.run(go())
    assert xfer.status() is ferry.XferStatus.DONE
    assert peer.rpc(node, "verify", {"region": 0, "offset": 0, "length": count * block, "seed": seed})["equal"]
