"""Lifetimes: a registered object stays alive while registered, even once
the caller dropped it, and goes once the region is closed and dropped;
views of a region keep its memory."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest

import ferry
from patterns import pattern


def collect_until_dead(ref: "weakref.ref[Any]", seconds: float = 5.0) -> bool:
    """Collects until ``ref`` dies or ``seconds`` passed (a decref deferred
    to a runtime thread lands a moment later)."""
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        if ref() is not None:
            time.sleep(0.01)
    return ref() is None


def test_registered_array_outlives_the_callers_reference(node: ferry.Node, seed: int) -> None:
    size = 1 << 20
    with ferry.Node() as peer:
        array = pattern(seed, size).copy()
        ref = weakref.ref(array)
        region = node.register(array)
        del array
        gc.collect()
        assert ref() is not None, "the region let go of the registered array"

        # Its bytes are still the region's: a peer reads them.
        dst = peer.alloc(size)
        peer.read(dst, region.remote())
        assert np.array_equal(np.frombuffer(dst, np.uint8), pattern(seed, size))
        # And writes into it land in the array.
        np.frombuffer(dst, np.uint8)[:] = pattern(seed + 1, size)
        peer.write(dst, region.remote())
        alive = ref()
        assert alive is not None and np.array_equal(alive, pattern(seed + 1, size))
        del alive

        assert region.close() is True
        assert region.closed
        with pytest.raises(ferry.RegionGone):
            peer.read(dst, region.remote())
        del region
        assert collect_until_dead(ref), "the array outlived its closed, dropped region"


def test_dropping_an_open_region_keeps_nothing_alive(node: ferry.Node) -> None:
    """A region dropped without close: the node lets it go, and the array
    with it (nothing leaks); a handle to it is refused."""
    array = np.zeros(4096, np.uint8)
    ref = weakref.ref(array)
    region = node.register(array)
    handle = region.remote()
    del array, region
    assert collect_until_dead(ref), "an unclosed, dropped region kept its array"
    with ferry.Node() as peer:
        with pytest.raises(ferry.RegionGone):
            peer.read(peer.alloc(4096), handle)


def test_views_keep_the_memory(node: ferry.Node, seed: int) -> None:
    size = 64 * 1024
    array = pattern(seed, size).copy()
    ref = weakref.ref(array)
    region = node.register(array)
    del array
    view = np.frombuffer(region, dtype=np.uint8)
    region.close()
    del region
    gc.collect()
    assert ref() is not None, "a view of the region outlived the memory behind it"
    assert np.array_equal(view, pattern(seed, size))
    del view
    assert collect_until_dead(ref)

    # Allocated memory: a view keeps it after close and drop.
    allocated = node.alloc(size)
    view = np.frombuffer(allocated, dtype=np.uint64)
    view[:] = 7
    allocated.close()
    del allocated
    gc.collect()
    assert int(view.sum()) == 7 * (size // 8)
    view[:] = 8  # still writable memory, and ours
    assert int(view.sum()) == 8 * (size // 8)


def test_region_basics(node: ferry.Node) -> None:
    region = node.alloc(1000, access="r")
    assert len(region) == region.nbytes == 1000
    assert region.access == "r" and region.remote().access == "r"
    assert memoryview(region).nbytes == 1000
    handle = region.remote()
    assert handle.owner == node.addr
    assert ferry.RemoteRegion.from_bytes(handle.to_bytes()) == handle
    assert hash(ferry.RemoteRegion.from_bytes(handle.to_bytes())) == hash(handle)
    assert handle.slice(10, 20).nbytes == 10
    with region as same:
        assert same is region
    assert region.closed
    assert region.close() is True  # twice: nothing
    # register() on a bytearray and an mmap.
    import mmap

    buffer = bytearray(b"x" * 100)
    assert node.register(buffer).nbytes == 100
    with mmap.mmap(-1, 8192) as m:
        r = node.register(m)
        assert r.nbytes == 8192
        r.close()
        del r
    assert ferry.NodeAddr.parse(str(node.addr)) == node.addr


def test_a_region_view_takes_bytes_and_keeps_the_memory() -> None:
    """``region.view()`` is a flat ``"B"`` memoryview: ``bytes`` can be
    assigned into it, it reads back through numpy, and it outlives the
    region object it came from."""
    with ferry.Node() as node:
        region = node.alloc(4096)
        view = region.view()
        assert (view.format, view.nbytes, view.readonly) == ("B", 4096, False)
        view[:5] = b"hello"
        assert bytes(np.frombuffer(region, dtype=np.uint8)[:5]) == b"hello"
        del region
        gc.collect()
        assert bytes(view[:5]) == b"hello"
