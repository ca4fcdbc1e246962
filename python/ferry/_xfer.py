"""Descriptor lists, prepared remote lists and transfer requests: how a
KV-cache connector drives transfers.

Lists are made once, from numpy arrays (an N×3 array of region index,
offset, length) or in the strided form, which stays a few numbers however
many descriptors it holds. A request names descriptors of two lists by index
arrays; the node posts it in slices and sends its notification behind the
last one, without the caller polling.
"""

from __future__ import annotations

import array
import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Generator, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _ferry
from ._fork import refuse_in_child
from ._errors import FerryError, InvalidArgument, InvalidRange
from ._region import Region, RemoteRegion

__all__ = [
    "Strided",
    "LocalDescs",
    "RemoteDescs",
    "PreparedRemote",
    "Xfer",
    "XferStatus",
    "Estimate",
]

try:  # numpy is optional: lists of ints work too.
    import numpy as _np
except ImportError:  # pragma: no cover - the tests install numpy
    _np = None  # type: ignore[assignment]

#: Descriptor rows: an N×3 array-like of (region index, offset, length).
Rows = Any
#: Indices into a list: a ``range`` (step 1), or a 1-D array-like of ints.
IndicesLike = Union[range, Sequence[int], Any]

_U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Strided:
    """``count`` descriptors of ``length`` bytes in region ``region``, the
    first at ``base``, each ``stride`` bytes after the one before: one per
    KV block, say. It stays five numbers, in memory and on the wire."""

    region: int
    base: int
    stride: int
    length: int
    count: int

    def _tuple(self) -> Tuple[int, int, int, int, int]:
        return (self.region, self.base, self.stride, self.length, self.count)


def _rows_bytes(rows: Rows) -> bytes:
    """N×3 non-negative integers as little-endian u64 bytes, in one pass
    over a numpy array (no Python object per descriptor)."""
    if _np is not None and isinstance(rows, _np.ndarray):
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise InvalidArgument(f"descriptor rows have shape {rows.shape}, not (N, 3)")
        if rows.dtype.kind not in "iu":
            raise InvalidArgument(f"descriptor rows are {rows.dtype}, not integers")
        if rows.dtype.kind == "i" and rows.size and int(rows.min()) < 0:
            raise InvalidRange("descriptor rows hold a negative number")
        return _np.ascontiguousarray(rows, dtype="<u8").tobytes()
    flat = array.array("Q")
    for n, row in enumerate(rows):
        if len(row) != 3:
            raise InvalidArgument(f"descriptor row {n} has {len(row)} values, not 3")
        try:
            flat.extend(row)
        except OverflowError:
            raise InvalidRange(f"descriptor row {n} holds a negative number") from None
    return flat.tobytes()


def _indices(idx: IndicesLike) -> Union[bytes, Tuple[int, int]]:
    """A range as (start, count); anything else as little-endian u32
    bytes."""
    if isinstance(idx, range):
        if idx.step != 1 or idx.start < 0:
            return _indices(list(idx))
        return (idx.start, len(idx))
    if _np is not None and isinstance(idx, _np.ndarray):
        if idx.ndim != 1:
            raise InvalidArgument(f"an index array has shape {idx.shape}, not (N,)")
        if idx.dtype.kind not in "iu":
            raise InvalidArgument(f"an index array is {idx.dtype}, not integers")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) > _U32_MAX):
            raise InvalidRange("an index array holds an index outside 0..2**32-1")
        return _np.ascontiguousarray(idx, dtype="<u4").tobytes()
    try:
        return array.array("I", idx).tobytes()
    except OverflowError:
        raise InvalidRange("an index array holds an index outside 0..2**32-1") from None


class LocalDescs:
    """Descriptors over this node's regions (NIXL's prepared local list).
    Every descriptor is checked against its region when the list is made;
    an error names its index (``op_index``)."""

    __slots__ = ("_native", "regions")

    def __init__(
        self,
        regions: Sequence[Region],
        rows: Optional[Rows] = None,
        *,
        strided: Optional[Strided] = None,
    ) -> None:
        self.regions = list(regions)
        natives = [r._native for r in self.regions]
        if strided is not None:
            self._native = _ferry.NativeLocalDescs(natives, None, strided._tuple())
        elif rows is not None:
            self._native = _ferry.NativeLocalDescs(natives, _rows_bytes(rows), None)
        else:
            raise InvalidArgument("give descriptor rows or strided=")

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"<ferry.LocalDescs {len(self)} descriptors over {len(self.regions)} regions>"


class RemoteDescs:
    """Descriptors over regions of other nodes, from their handles.
    Serializes with :meth:`to_bytes` (a strided list stays small)."""

    __slots__ = ("_native",)

    def __init__(
        self,
        regions: Sequence[RemoteRegion],
        rows: Optional[Rows] = None,
        *,
        strided: Optional[Strided] = None,
    ) -> None:
        natives = [r._native for r in regions]
        if strided is not None:
            self._native = _ferry.NativeRemoteDescs(natives, None, strided._tuple())
        elif rows is not None:
            self._native = _ferry.NativeRemoteDescs(natives, _rows_bytes(rows), None)
        else:
            raise InvalidArgument("give descriptor rows or strided=")

    @classmethod
    def from_bytes(cls, data: bytes) -> "RemoteDescs":
        """A list from :meth:`to_bytes`'s bytes, checked as when made."""
        descs = cls.__new__(cls)
        descs._native = _ferry.NativeRemoteDescs.from_bytes(bytes(data))
        return descs

    def to_bytes(self) -> bytes:
        """The list as bytes, for another process."""
        return self._native.to_bytes()

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"<ferry.RemoteDescs {len(self)} descriptors>"


class PreparedRemote:
    """A remote list prepared by :meth:`Node.prepare_remote`: routed,
    connected and (for same-host peers) mapped once, for every request."""

    __slots__ = ("_native",)

    def __init__(self, native: _ferry.NativePrepared) -> None:
        self._native = native

    def transports(self) -> List[str]:
        """The transport each of the list's regions takes."""
        return self._native.transports()

    def __len__(self) -> int:
        return len(self._native)


class XferStatus(str, enum.Enum):
    """Where a request stands. A post moves it to ``IN_PROGRESS``; the
    node moves it on to ``DONE`` or ``FAILED``, never back."""

    READY = "ready"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class Estimate(NamedTuple):
    """What a request is expected to take (:meth:`Xfer.estimate`)."""

    #: Expected duration, seconds.
    duration: float
    #: How far off it may be, seconds.
    margin: float
    #: ``"measured"`` (from requests to this peer over this transport) or
    #: ``"configured"`` (defaults, before any measurement).
    method: str
    #: Requests measured.
    samples: int
    #: The transport it takes.
    transport: str


class Xfer:
    """A transfer request (:meth:`Node.make_xfer`): post it, poll
    :meth:`status` once per step, :meth:`wait` for it or ``await`` it, post
    it again once done. :meth:`cancel` (or dropping it) stops it: what is in
    flight (one window at most) finishes, nothing else moves, and it ends
    ``FAILED`` with :class:`Cancelled`. Against an owner that stopped
    answering, that window ends only at the post's deadline; the error then
    counts the ops whose outcome is unknown (their destination bytes may be
    old, new, or partly written)."""

    __slots__ = ("_native", "_error")

    def __init__(self, native: _ferry.NativeXfer) -> None:
        self._native = native
        self._error: Optional[FerryError] = None

    def post(self, timeout: float = 30.0) -> "Xfer":
        """Starts the request with a deadline of ``timeout`` seconds and
        returns at once (raises :class:`InProgress` if it runs). Refused
        in a forked child (the node is the parent's)."""
        refuse_in_child("this request")
        self._native.post(timeout)
        return self

    def status(self) -> XferStatus:
        """Where it stands; never waits. Once ``FAILED``, :attr:`error` is
        the reason."""
        state, error = self._native.status()
        self._error = error
        return XferStatus(state)

    @property
    def error(self) -> Optional[FerryError]:
        """Why it failed, as of the last :meth:`status`."""
        return self._error

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits (the GIL released) up to ``timeout`` seconds, or the
        post's own deadline: True once done, False if still in progress;
        raises its error if it failed. Ctrl-C cancels the request (and
        raises ``KeyboardInterrupt`` at once; the request goes on to
        ``FAILED`` with :class:`Cancelled` once its window settles)."""
        refuse_in_child("this request")
        return self._native.wait(timeout)

    def cancel(self) -> None:
        """Stops posting; what is in flight finishes (or reaches the
        post's deadline), then it ends :class:`Cancelled`."""
        self._native.cancel()

    async def wait_async(self) -> None:
        """Waits on the running event loop; raises its error if it failed.
        Cancelling the awaiting task cancels the request."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._native.wait_then(_settler(loop, future))
        try:
            await future
        except asyncio.CancelledError:
            self._native.cancel()
            raise

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait_async().__await__()

    @property
    def completed(self) -> int:
        """Ops of the current post that completed."""
        return self._native.completed

    @property
    def nbytes(self) -> int:
        """Bytes the request moves."""
        return self._native.nbytes

    def __len__(self) -> int:
        return len(self._native)

    def estimate(self) -> Estimate:
        """What the request is expected to take."""
        return Estimate(*self._native.estimate())

    def __repr__(self) -> str:
        return f"<ferry.Xfer {len(self)} ops, {self.nbytes} bytes, {self.status().value}>"


def _settler(loop: asyncio.AbstractEventLoop, future: "asyncio.Future[Any]") -> Any:
    """A callback for a runtime thread that settles ``future`` on its
    loop: a result, or an exception."""

    def settle(outcome: Any) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def callback(outcome: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:
            pass  # The loop closed: nobody awaits the outcome any more.

    return callback
