"""ferry's exceptions: one class per typed error of the Rust API.

Every error ferry raises is a :class:`FerryError`. The classes also derive
from the built-in exception a Python programmer would catch for that kind of
failure: a timeout is a :class:`TimeoutError`, a peer that cannot be reached
is a :class:`ConnectionError`, a range outside a region is an
:class:`IndexError`, and so on.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "FerryError",
    "Timeout",
    "PeerUnreachable",
    "ConnectionLost",
    "PeerBusy",
    "AuthFailed",
    "UnknownNode",
    "AccessDenied",
    "ReadOnly",
    "OutOfBounds",
    "InvalidArgument",
    "InvalidRange",
    "LengthMismatch",
    "RegionGone",
    "StaleRegion",
    "NoSharedTransport",
    "ProtocolError",
    "ShutDown",
    "BackendStopped",
    "TooLarge",
    "OutOfMemory",
    "NoSuchHandler",
    "RemoteError",
    "Cancelled",
    "InProgress",
    "NotFound",
    "MetadataError",
    "DiscoveryError",
    "LayoutError",
    "BlockTableError",
    "WeightsError",
    "NoCompleteVersion",
    "Overwritten",
    "ChecksumMismatch",
    "PublisherLost",
    "ReadersHold",
    "VersionNotNewer",
]


class FerryError(Exception):
    """Base class of every error ferry raises.

    ``op_index`` is the position of the failing op (in a ``submit``'s list)
    or of the failing descriptor (in a transfer request's index arrays, or a
    descriptor list) when the error is about one; ``None`` otherwise.
    """

    op_index: Optional[int]

    def __init__(self, message: str, op_index: Optional[int] = None) -> None:
        super().__init__(message)
        self.op_index = op_index


class Timeout(FerryError, TimeoutError):
    """The deadline passed first. Memory the unfinished ops touch stays
    registered until no transport can write to it any more."""


class PeerUnreachable(FerryError, ConnectionError):
    """No connection to the peer could be made."""


class ConnectionLost(FerryError, ConnectionError):
    """The connection to the peer closed before the operation completed."""


class PeerBusy(FerryError, ConnectionError):
    """The peer is at its connection limit."""


class AuthFailed(FerryError, PermissionError):
    """The peer and this node do not hold the same cluster secret (one has
    none, or another): nothing was sent."""


class UnknownNode(FerryError, ConnectionError):
    """The node at the handle's address is not its owner: the owner
    restarted (a new node at that address), or the handle is wrong."""


class AccessDenied(FerryError, PermissionError):
    """The owner refused the handle's credentials (a forged or altered
    handle)."""


class ReadOnly(AccessDenied):
    """A write to a region whose handle allows reads only."""


class OutOfBounds(FerryError, IndexError):
    """A range outside its region, or an index outside its list."""


class InvalidArgument(FerryError, ValueError):
    """An argument ferry cannot use: a zero length, a buffer that is not
    writable or not contiguous, two index arrays of different lengths, a
    malformed address."""


class InvalidRange(InvalidArgument):
    """A malformed range: inverted, negative, or past the address space."""


class LengthMismatch(FerryError, ValueError):
    """The two sides of an op differ in length."""


class RegionGone(FerryError):
    """The remote region does not exist (any more)."""


class StaleRegion(RegionGone):
    """The handle names an earlier region in a slot now reused: the region
    it was made for was deregistered."""


class NoSharedTransport(FerryError):
    """This node and the remote side share no transport."""


class ProtocolError(FerryError):
    """The peer broke the wire protocol."""


class ShutDown(FerryError):
    """The node was closed: it initiates and serves nothing any more."""


class BackendStopped(FerryError):
    """A transport's backend stopped while the operation ran."""


class TooLarge(FerryError, ValueError):
    """A message, notification, RPC argument or region over its limit."""


class OutOfMemory(FerryError, MemoryError):
    """The host could not allocate the memory asked for."""


class NoSuchHandler(FerryError, LookupError):
    """The peer serves no RPC handler by that name."""


class RemoteError(FerryError):
    """The peer's RPC handler failed (raised): the message is its text."""


class Cancelled(FerryError):
    """The transfer request was cancelled (``cancel()``, a drop, or a
    KeyboardInterrupt during ``wait``)."""


class InProgress(FerryError):
    """The request is in progress: post it again once it is done."""


class NotFound(FerryError, LookupError):
    """A peer or region name that is not known."""


class MetadataError(FerryError, ValueError):
    """A metadata blob this node cannot use."""


class DiscoveryError(FerryError):
    """etcd could not be asked (unreachable, or it refused)."""


class LayoutError(InvalidArgument):
    """Layouts that do not describe one transfer, said with the rank, tensor
    and axis concerned: a rank missing (no remote rank holds some element),
    two ranks claiming one piece, tensors that disagree on their axes,
    strides that leave a region, a region shorter than declared, an array
    that is not inside its region. Nothing was planned."""


class BlockTableError(InvalidArgument):
    """A request's block tables do not fit the plan, said with the table,
    the side and the position: a block id past its pool, a table too short
    for the tokens, a table missing, unknown or given twice, tokens past the
    paged axis (or, for NIXL's index arrays, not on a sub-block edge).
    Nothing moved."""


class WeightsError(FerryError):
    """A weight set's publisher or subscriber could not do what was asked
    (``docs/weights.md``). Nothing half-done is left: a subscriber whose
    update failed keeps the version it held. Layouts that do not plan and
    transfers that fail raise their own classes (:class:`LayoutError`,
    :class:`ConnectionLost`, ...)."""

    #: The publisher rank concerned, when the error is about one.
    rank: Optional[int] = None
    #: The version concerned, when the error is about one.
    version: Optional[int] = None


class NoCompleteVersion(WeightsError, LookupError):
    """No version is complete on every publisher rank now: a rank has
    published none yet, or is writing the next one, or the ranks' newest
    versions differ. Update again later."""


class Overwritten(WeightsError):
    """Publisher rank :attr:`rank` overwrote version :attr:`version` while
    this subscriber read it (its write's timeout passed): nothing of the
    update counts. Update again, which takes the next version."""


class ChecksumMismatch(WeightsError):
    """``update(verify=True)`` found that the bytes of tensor
    :attr:`tensor` this subscriber holds from publisher rank :attr:`rank`
    (0 for a relay) are not those the rank held for version
    :attr:`version`: nothing of the update counts, and with one buffer the
    subscriber holds no version until the next update succeeds."""

    #: The tensor whose checksums differ.
    tensor: Optional[str] = None


class PublisherLost(WeightsError, ConnectionError):
    """A publisher rank cannot be reached (its process died, its node
    closed), or its node is not the one the subscriber planned against (it
    restarted). The subscriber keeps its last version; a new
    :class:`Subscriber` plans against the ranks as they are now.
    :attr:`rank` is ``None`` when the rank was never reached."""


class ReadersHold(WeightsError, TimeoutError):
    """Readers held buffer :attr:`buffer`, which the update had to write,
    until its deadline: release read guards sooner, or give the subscriber
    two buffers."""

    #: The buffer the readers held.
    buffer: Optional[int] = None


class VersionNotNewer(WeightsError, ValueError):
    """A publish of :attr:`version`, which is not newer than :attr:`last`,
    the last version this rank published: versions only grow."""

    #: The last version the rank published.
    last: Optional[int] = None
