"""Regions (registered memory) and remote handles to them."""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Type

from . import _ferry
from ._addr import NodeAddr
from ._fork import refuse_in_child

__all__ = ["Region", "RemoteRegion"]


class Region:
    """Memory registered with a node: peers reach it through its handle,
    :meth:`remote`.

    A region exposes the buffer protocol, so ``numpy.frombuffer(region,
    dtype=...)``, ``memoryview(region)`` and :meth:`view` are zero-copy
    views of its bytes; each view keeps the region's memory alive.
    ``len(region)`` is its length in bytes.

    It stays registered while this object lives: a handle alone does not
    keep it, and dropping the last reference deregisters it. :meth:`close`
    deregisters it at once: peers can no longer reach it, and a region made
    by :meth:`Node.register` lets go of the object it registered once no
    transfer can touch it and the region (with its views) is gone.
    """

    # Set on every instance by `_from_alloc` or `_from_buffer`.
    _native: _ferry.NativeRegion
    _held: Any
    #: (node, name) pairs it is published under, withdrawn by `close`.
    _publications: List[Tuple[Any, str]]

    if TYPE_CHECKING:
        # At run time the ctypes base class provides both (see below).
        def __buffer__(self, flags: int) -> memoryview: ...

        def __len__(self) -> int: ...

    def view(self) -> memoryview:
        """A flat, writable ``memoryview`` of the bytes (format ``"B"``).
        ``memoryview(region)`` works too, but its format is ctypes'
        ``"<B"``, which slice assignment from ``bytes`` refuses."""
        return memoryview(self).cast("B")

    def remote(self) -> RemoteRegion:
        """A handle to the whole region: serializable (``to_bytes``),
        sliceable, to give to peers. Refused in a forked child (the
        region is the parent's)."""
        refuse_in_child("this region")
        return RemoteRegion(self._native.remote())

    @property
    def nbytes(self) -> int:
        """Length in bytes."""
        return self._native.len

    @property
    def addr(self) -> int:
        """Address of the first byte in this process."""
        return self._native.addr

    @property
    def access(self) -> str:
        """``"rw"`` or ``"r"``: the most a handle to it allows peers."""
        return self._native.access

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._native.closed

    def close(self, timeout: float = 5.0) -> bool:
        """Deregisters the region, then waits up to ``timeout`` seconds
        until no transfer can touch its memory. Returns whether that
        moment came (if not, it comes by itself). Closing twice does
        nothing.

        Names it is published under are withdrawn first. Descriptor
        lists (:class:`LocalDescs`) and requests over it hold it too: it
        stays registered until they are gone, and ``close`` waits for
        that."""
        refuse_in_child("this region")
        for node, name in self._publications:
            node.unpublish(name)
        self._publications.clear()
        return self._native.close(timeout)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.access
        return f"<ferry.Region {self.nbytes} bytes at {self.addr:#x}, {state}>"


# The buffer protocol for a class defined in Python needs Python 3.12
# (PEP 688), and the stable ABI (one wheel for 3.9+) only lets native code
# export buffers from 3.11 on. So each region is also a ctypes array of its
# bytes, which exports them on every version: one class per length.
_CLASSES: Dict[int, Type[Any]] = {}
_CLASSES_LOCK = threading.Lock()


def _class_for(nbytes: int) -> Type[Any]:
    with _CLASSES_LOCK:
        cls = _CLASSES.get(nbytes)
        if cls is None:
            cls = type("Region", (Region, ctypes.c_ubyte * nbytes), {"__module__": "ferry"})
            _CLASSES[nbytes] = cls
        return cls


def _from_alloc(native: _ferry.NativeRegion) -> Region:
    """A region over memory ferry allocated (kept by ``native``)."""
    region: Region = _class_for(native.len).from_address(native.addr)
    region._native = native
    region._held = None
    region._publications = []
    return region


def _from_buffer(flat: memoryview) -> Tuple[Region, int]:
    """A region over a writable byte view of the caller's object, and its
    address. The region holds an export of the view, so the object's
    memory cannot move or be freed while the region lives."""
    region: Region = _class_for(flat.nbytes).from_buffer(flat)
    region._held = flat
    region._publications = []
    return region, ctypes.addressof(region)  # type: ignore[arg-type]


class RemoteRegion:
    """A handle to a region of some node (this one included): what a peer
    needs to read or write it. Serializes with :meth:`to_bytes`; a handle
    whose credentials or bounds were altered on the wire is refused by the
    owner."""

    __slots__ = ("_native",)

    def __init__(self, native: _ferry.NativeRemote) -> None:
        self._native = native

    @classmethod
    def from_bytes(cls, data: bytes) -> "RemoteRegion":
        """A handle from :meth:`to_bytes`'s bytes."""
        return cls(_ferry.NativeRemote.from_bytes(bytes(data)))

    def to_bytes(self) -> bytes:
        """The handle as bytes, for another process."""
        return self._native.to_bytes()

    @property
    def nbytes(self) -> int:
        """Length in bytes."""
        return self._native.len

    @property
    def access(self) -> str:
        """``"rw"`` or ``"r"``."""
        return self._native.access

    @property
    def owner(self) -> NodeAddr:
        """The node that owns the region."""
        return NodeAddr(*self._native.owner)

    def slice(self, start: int, stop: int) -> "RemoteRegion":
        """A handle to bytes ``start:stop`` of the region."""
        return RemoteRegion(self._native.slice(start, stop))

    def read_only(self) -> "RemoteRegion":
        """The same bytes, for reads only. Over TCP and the same host it
        carries read-only tokens, derived one way from the region's, which
        the owner accepts for reads only: editing the handle's access back
        does not let it write. Over RDMA it still carries the region's
        rkey, which the NIC accepts for writes too; to give a peer read
        access there, register the memory with ``access="r"``."""
        return RemoteRegion(self._native.read_only())

    def __len__(self) -> int:
        return self.nbytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteRegion) and self._native == other._native

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    def __repr__(self) -> str:
        return repr(self._native)
