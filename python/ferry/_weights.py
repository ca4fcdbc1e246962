"""Weight publication: every new version of a model's weights from a
trainer's ranks to inference processes of another sharding, planned once
per subscriber and replayed every version, behind a fence
(``docs/weights.md``).

Each trainer rank declares how its shards lie in its memory (a
:class:`RankLayout` over registered arrays, as for
:meth:`Node.plan_transfer`) and publishes them under the set's name
(:class:`Publisher`). After each step it takes its memory
(:meth:`Publisher.write`), writes the new weights and says which version
they are (:meth:`WriteGuard.publish`); version ``v`` of the set is ready
once every rank has published it. An inference process declares its own
layout of the same tensors, in one buffer or two (:class:`Subscriber`), and
:meth:`Subscriber.update` pulls the newest complete version through the
plan it made once: nothing is planned, registered or exchanged per version
beyond a lease per rank.

The fence: readers hold the buffer they read (:meth:`Subscriber.read`), and
an update never writes a buffer a reader holds; a trainer's write waits,
up to its timeout, for the subscribers reading its memory, and past it
their updates fail with :class:`Overwritten` and take the next version.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Union

from . import _ferry
from ._addr import NodeAddr
from ._errors import InvalidArgument, ShutDown
from ._fork import refuse_in_child
from ._layout import RankLayout
from ._plan import _local_regions

if TYPE_CHECKING:
    from ._node import Node

__all__ = ["Publisher", "WriteGuard", "Subscriber", "ReadGuard", "Update"]

#: A publisher rank's node: its :class:`NodeAddr`, that address as
#: ``str()`` prints it, or its ``"ip:port"``.
PublisherAddr = Union[NodeAddr, str]

_U64_MAX = 2**64 - 1


def _version(version: int) -> int:
    # pyo3 would raise OverflowError, which is no ferry error.
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= _U64_MAX:
        raise InvalidArgument(f"version {version!r} is not an integer from 0 to 2**64 - 1")
    return version


class Update(NamedTuple):
    """What :meth:`Subscriber.update` did."""

    #: The version the subscriber holds now.
    version: int
    #: Whether the update moved a new version in (``False``: it held the
    #: newest complete one already, and nothing moved).
    changed: bool
    #: The buffer that holds it, which readers get from now on.
    buffer: int


class WriteGuard:
    """A publisher rank's memory, taken for writing the next version
    (:meth:`Publisher.write`): no subscriber leases it until
    :meth:`publish`. As a context manager, leaving the block without
    publishing (an exception, say) abandons the write, and the rank holds
    no version until the next one is published: half-written weights are
    never served."""

    __slots__ = ("_native", "_publisher")

    def __init__(self, native: _ferry.NativeWriteGuard, publisher: "Publisher") -> None:
        self._native = native
        self._publisher = publisher

    @property
    def overrun(self) -> int:
        """Subscribers that still read the previous version when the
        write's timeout passed: their updates fail with
        :class:`Overwritten`, and take the next version."""
        return self._native.overrun

    @property
    def done(self) -> bool:
        """Whether :meth:`publish` or :meth:`abort` ran."""
        return self._native.done

    def publish(self, version: int) -> None:
        """The memory holds ``version`` now: subscribers may read it. It
        must be newer than every version this rank published before, or
        :class:`VersionNotNewer` is raised, and the rank then holds no
        version (what the memory holds is not the last one any more):
        write again."""
        try:
            self._native.publish(_version(version))
        finally:
            self._publisher._ended(self)

    def abort(self) -> None:
        """Abandons the write: the rank holds no version until the next
        :meth:`publish`. Does nothing once published."""
        self._native.abort()
        self._publisher._ended(self)

    def __enter__(self) -> "WriteGuard":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done:
            self.abort()

    def __repr__(self) -> str:
        state = "done" if self.done else "open"
        return f"<ferry.WriteGuard rank {self._publisher.rank}, {state}, {self.overrun} overrun>"


class Publisher:
    """One rank of the weight set ``set_name``, over ``layout``'s memory
    (this rank's shards, in arrays registered with ``node``): its layout
    and regions are published in the node's metadata under the set's name,
    and the node answers subscribers from now on. The memory holds no
    version until the first :meth:`WriteGuard.publish`.

    Subscribers find the rank by its node's address (``node.addr``). Use it
    as a context manager, or call :meth:`close`, to stop serving the set.
    """

    __slots__ = ("_native", "_lock", "_open", "_taking", "set_name", "layout")

    def __init__(self, node: "Node", set_name: str, layout: RankLayout) -> None:
        regions = _local_regions(layout)
        self._native = node._node().start_publisher(str(set_name), layout.to_json(), regions)
        self._lock = threading.Lock()
        self._open: Optional[WriteGuard] = None
        self._taking = False
        #: The set's name.
        self.set_name = str(set_name)
        #: This rank's layout, over its regions.
        self.layout = layout

    @property
    def rank(self) -> int:
        """This rank."""
        return self._native.rank

    @property
    def version(self) -> Optional[int]:
        """The version this rank's memory holds: ``None`` before the first
        publish, while being written, and once closed."""
        return self._native.version

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._native.closed

    def write(self, timeout: float = 30.0) -> WriteGuard:
        """Takes this rank's memory for writing the next version. New
        leases are refused from now on, and this waits up to ``timeout``
        seconds for the subscribers that still read the current version.
        Past it, it takes the memory anyway (:attr:`WriteGuard.overrun`
        says from how many): a long timeout never starves inference of an
        update, a short one never holds training up.

        One write at a time: a second one while a guard is open raises
        :class:`InvalidArgument`."""
        refuse_in_child("this publisher")
        with self._lock:
            if self._taking or (self._open is not None and not self._open.done):
                raise InvalidArgument(
                    f"rank {self.rank} of {self.set_name!r} is being written: publish or abort "
                    "that write first"
                )
            # Not held while waiting for readers: close() must not wait.
            self._taking = True
        try:
            guard = WriteGuard(self._native.write(timeout), self)
        finally:
            with self._lock:
                self._taking = False
        with self._lock:
            self._open = guard
        if self.closed:  # closed while the write waited: serve nothing more
            guard.abort()
            raise ShutDown(f"rank {self.rank} of {self.set_name!r} was closed during the write")
        return guard

    def _ended(self, guard: WriteGuard) -> None:
        with self._lock:
            if self._open is guard:
                self._open = None

    def close(self) -> None:
        """Stops serving the set (a write still open is abandoned) and
        withdraws its layout: subscribers' next updates fail with
        :class:`PublisherLost`, and the node may publish the set again.
        Closing twice does nothing."""
        with self._lock:
            guard, self._open = self._open, None
        if guard is not None and not guard.done:
            guard._native.abort()
        self._native.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version {self.version}"
        return f"<ferry.Publisher {self.set_name!r} rank {self.rank}, {state}>"


class ReadGuard:
    """A buffer held for reading (:meth:`Subscriber.read`): it holds one
    complete version, which no update writes, until :meth:`release` (or
    the end of the ``with`` block, which gives the buffer's index)."""

    __slots__ = ("_native",)

    def __init__(self, native: _ferry.NativeReadGuard) -> None:
        self._native = native

    @property
    def buffer(self) -> int:
        """The buffer held: its index in :attr:`Subscriber.buffers`."""
        return self._native.buffer

    @property
    def version(self) -> int:
        """The version the buffer holds."""
        return self._native.version

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran."""
        return self._native.released

    def release(self) -> None:
        """Lets the buffer go: an update may write it again. Releasing
        twice does nothing."""
        self._native.release()

    def __enter__(self) -> int:
        return self.buffer

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<ferry.ReadGuard buffer {self.buffer}, {state}>"


class Subscriber:
    """A subscriber of the weight set ``set_name``, published by the nodes
    at ``publishers`` (one per rank, in any order: a :class:`NodeAddr`, its
    ``str()``, or its ``"ip:port"``: the subscriber asks whatever node
    listens there for the set's layout; or else every rank's node name,
    looked up through ``node``'s names: in etcd, or among the peers whose
    metadata it fetched), into ``buffers``: this process's
    layout of the same tensors (another sharding is fine; the same element
    sizes), over arrays registered with ``node``.

    - One buffer: an update writes it in place, once no reader holds it,
      and readers wait for the update meanwhile.
    - Two (two layouts over two sets of arrays): an update fills the one
      readers do not use and then makes it the :attr:`active` one; readers
      never wait for an update, and an update waits only for readers of the
      older version.

    Fetches each rank's published layout and plans once per buffer, within
    ``timeout`` seconds. A rank that cannot be reached raises
    :class:`PublisherLost`; a node that publishes no set of that name,
    :class:`NotFound`; layouts that do not plan, :class:`LayoutError`.
    """

    __slots__ = ("_native", "set_name", "buffers")

    def __init__(
        self,
        node: "Node",
        set_name: str,
        publishers: Sequence[PublisherAddr],
        buffers: Union[RankLayout, Sequence[RankLayout]],
        *,
        timeout: float = 30.0,
    ) -> None:
        if isinstance(publishers, (str, NodeAddr)):
            raise InvalidArgument("publishers is a list of addresses, one per publisher rank")
        endpoints = [_endpoint(p, "publisher") for p in publishers]
        if not endpoints:
            raise InvalidArgument("a subscriber needs the address of every publisher rank")
        self._start(node, set_name, endpoints, None, buffers, timeout)

    @classmethod
    def from_relay(
        cls,
        node: "Node",
        set_name: str,
        relay: PublisherAddr,
        buffers: Union[RankLayout, Sequence[RankLayout]],
        *,
        timeout: float = 30.0,
    ) -> "Subscriber":
        """A subscriber that takes its versions from another subscriber, the
        one whose node is at ``relay`` (it called :meth:`serve_relay`),
        instead of from the publishers, so that the publishers' links carry
        each version once however many subscribers there are. Its buffers
        hold the relay's shard of the tensors, or part of it; a relay may
        itself relay (a tree). A relay holds a version only once it has it
        whole: after the publishers' step, call
        ``update(at_least=version)``. Raises as the constructor does
        (:class:`NotFound` when ``relay`` serves no relay of the set)."""
        subscriber = cls.__new__(cls)
        endpoint = _endpoint(relay, "relay")
        subscriber._start(node, set_name, [], endpoint, buffers, timeout)
        return subscriber

    def _start(
        self,
        node: "Node",
        set_name: str,
        endpoints: List[str],
        relay: Optional[str],
        buffers: Union[RankLayout, Sequence[RankLayout]],
        timeout: float,
    ) -> None:
        layouts = [buffers] if isinstance(buffers, RankLayout) else list(buffers)
        if not 1 <= len(layouts) <= 2:
            raise InvalidArgument(f"a subscriber takes one buffer or two, not {len(layouts)}")
        native = [(b.to_json(), _local_regions(b)) for b in layouts]
        self._native = node._node().subscribe(str(set_name), endpoints, native, timeout, relay)
        #: The set's name.
        self.set_name = str(set_name)
        #: The buffers' layouts, in the order given: ``buffers[i]`` is
        #: buffer ``i`` of :attr:`active`, :class:`Update` and
        #: :class:`ReadGuard`.
        self.buffers: List[RankLayout] = layouts

    def serve_relay(self) -> None:
        """Serves this subscriber's buffers on to subscribers made with
        :meth:`from_relay` naming this node: each version it holds whole,
        it lends them as a publisher rank does, and its updates wait (up to
        half their time, then overrun, failing those readers with
        :class:`Overwritten`) for their reads of the buffer they write.
        Serving stops when the subscriber closes."""
        refuse_in_child("this subscriber")
        self._native.serve_relay()

    @property
    def version(self) -> Optional[int]:
        """The version the subscriber holds (``None`` before the first
        update, or, with one buffer, after an update that failed midway)."""
        return self._native.version

    @property
    def active(self) -> int:
        """The buffer readers get: the one the last update filled."""
        return self._native.active

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._native.closed

    def update(
        self, timeout: float = 30.0, *, at_least: Optional[int] = None, verify: bool = False
    ) -> Update:
        """Moves the newest version complete on every publisher rank into
        this subscriber's memory, within ``timeout`` seconds, unless it
        holds it already: a subscriber several versions behind gets the
        newest, never each one between. With ``at_least``, updates again
        until it holds that version or a newer one (what a subscriber
        behind a relay waits for, or one waiting for the publishers' next
        step: each source is asked once to answer when it has the
        version, not polled), raising :class:`NoCompleteVersion` past
        the deadline. With ``verify``, each source (a publisher rank, or
        the relay) hashes the elements it shares with this subscriber
        (XXH3-64, in the tensors' logical order) and the update checks this
        subscriber's bytes against the sums: a second read of the version
        on both sides.

        Raises, leaving the subscriber on the version it held (with two
        buffers, its readers saw nothing of the attempt):
        :class:`NoCompleteVersion` when no version is complete on every
        rank now (one is being written, or has published none);
        :class:`Overwritten` when a rank overran the read (update again);
        :class:`PublisherLost` when a rank is gone or was restarted (make a
        new subscriber, which plans again); :class:`ReadersHold` when
        readers held the buffer to write until the deadline;
        :class:`ChecksumMismatch` when ``verify`` found bytes that differ
        from a source's."""
        refuse_in_child("this subscriber")
        return Update(*self._native.update(timeout, at_least, verify))

    def read(self, timeout: float = 30.0) -> ReadGuard:
        """Holds the buffer that holds the newest complete version, for as
        long as the guard lives: ``with subscriber.read() as buffer:`` then
        read ``subscriber.buffers[buffer]``'s arrays. Any thread may read
        while another updates.

        Waits, up to ``timeout`` seconds (:class:`Timeout` past it), for an
        update writing the only buffer, and for a complete version where
        no buffer holds one: before the first update, and, with one
        buffer, after an update that failed once it began writing
        (:class:`Overwritten`, a transfer error), until the next update
        succeeds. A reader never gets a buffer that holds a mix."""
        refuse_in_child("this subscriber")
        return ReadGuard(self._native.read(timeout))

    def close(self, timeout: float = 5.0) -> None:
        """Drops the plans (an update under way ends first, within
        ``timeout`` seconds): later calls raise :class:`ShutDown`. The
        buffers stay the caller's; closing twice does nothing."""
        self._native.close(timeout)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<ferry.Subscriber {self.set_name!r}, version {self.version}, "
            f"{len(self.buffers)} buffer(s), active {self.active}>"
        )


def _endpoint(address: PublisherAddr, what: str) -> str:
    """A :class:`NodeAddr`, its ``str()`` or an ``"ip:port"``, as ``"ip:port"``;
    any other string is a node's name, passed on as it is."""
    if isinstance(address, NodeAddr):
        return address.endpoint
    if isinstance(address, str):
        return NodeAddr.parse(address).endpoint if "/" in address else address
    raise InvalidArgument(f"{what} {address!r} is neither a NodeAddr nor an ip:port")
