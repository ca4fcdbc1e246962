"""The node: memory, transfers, messages, RPC and names."""

from __future__ import annotations

import asyncio
import atexit
import inspect
import weakref
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Union,
)

from . import _ferry
from ._addr import NodeAddr
from ._errors import FerryError, InvalidArgument
from ._fork import forked, node_started, refuse_in_child
from ._layout import RankLayout
from ._plan import TransferPlan, _plan_transfer
from ._region import Region, RemoteRegion, _from_alloc, _from_buffer
from ._xfer import (
    IndicesLike,
    LocalDescs,
    PreparedRemote,
    RemoteDescs,
    Xfer,
    _indices,
    _settler,
)

__all__ = ["Node", "Op", "Delivery"]

#: Message, notification and RPC bodies: any bytes-like object.
Body = Union[bytes, bytearray, memoryview]
#: An RPC handler: takes the argument, returns the answer (or awaits it).
Handler = Callable[[bytes], Union[Body, Awaitable[Body]]]


class Op(NamedTuple):
    """One op of :meth:`Node.submit`: ``length`` bytes between a local
    region and a remote one. Make it with :meth:`read` or :meth:`write`."""

    is_write: bool
    local: Region
    remote: RemoteRegion
    local_offset: int
    remote_offset: int
    length: int

    @classmethod
    def read(
        cls,
        local: Region,
        remote: RemoteRegion,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: Optional[int] = None,
    ) -> "Op":
        """Copy remote bytes into ``local``. ``length`` defaults to the
        rest of the local region from ``local_offset``."""
        return cls._between(False, local, remote, local_offset, remote_offset, length)

    @classmethod
    def write(
        cls,
        local: Region,
        remote: RemoteRegion,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: Optional[int] = None,
    ) -> "Op":
        """Copy bytes of ``local`` into the remote region. ``length``
        defaults to the rest of the local region from ``local_offset``."""
        return cls._between(True, local, remote, local_offset, remote_offset, length)

    @classmethod
    def _between(
        cls,
        is_write: bool,
        local: Region,
        remote: RemoteRegion,
        local_offset: int,
        remote_offset: int,
        length: Optional[int],
    ) -> "Op":
        if length is None:
            length = local.nbytes - local_offset
        return cls(is_write, local, remote, local_offset, remote_offset, length)


class Delivery(NamedTuple):
    """A message or notification a peer sent this node."""

    sender: NodeAddr
    #: ``"message"`` or ``"notification"`` (the latter announces transfers
    #: into this node's memory that completed).
    kind: str
    body: bytes


class TransportStatus(NamedTuple):
    """One transport of a node (:meth:`Node.transport_status`)."""

    #: ``"memory"``, ``"ibverbs"`` or ``"tcp"``.
    name: str
    #: Whether it runs.
    running: bool
    #: What it runs on (device and port, connections) when it runs; why it
    #: could not start otherwise (``"no RDMA device: libibverbs not found
    #: (...)"``, disabled, ...).
    detail: str


def _ops(ops: Sequence[Op]) -> List[_ferry.OpTuple]:
    for n, op in enumerate(ops):
        if op.length < 0 or op.local_offset < 0 or op.remote_offset < 0:
            from ._errors import InvalidRange

            raise InvalidRange(f"op {n} has a negative offset or length", n)
    return [
        (op.is_write, op.local._native, op.local_offset, op.length, op.remote._native, op.remote_offset)
        for op in ops
    ]


def _delivery(raw: _ferry.DeliveryTuple) -> Delivery:
    (endpoint, node_id), kind, body = raw
    return Delivery(NodeAddr(endpoint, node_id), kind, body)


# Nodes still open, closed at interpreter exit (then no ferry thread calls
# into Python any more), and the fork guard.
_OPEN: "weakref.WeakSet[Node]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    # In a forked child the nodes' threads are gone: closing would wait
    # for them forever.
    if not forked():
        for node in list(_OPEN):
            try:
                node.close()
            except FerryError:
                pass
    _ferry.at_exit()


atexit.register(_close_all_at_exit)


class Node:
    """A ferry node: registers memory, moves bytes to and from peers'
    regions over the fastest transport both share (same-host shared memory,
    RDMA, TCP), sends messages and notifications, serves and calls RPC.

    Use it as a context manager, or call :meth:`close`. Every blocking call
    releases the GIL and takes a ``timeout`` in seconds; Ctrl-C interrupts
    it. A node does not survive ``fork()``: use it in the process that made
    it (a child forked after a node started gets :class:`FerryError` from
    every call, and cannot start nodes of its own; one forked before any
    node started can).

    With ``etcd`` (a client URL such as ``"http://127.0.0.1:2379"``) a
    named node publishes itself and its published regions under
    ``/ferry/<cluster>/``, and :meth:`lookup_region` finds peers there.

    ``memory`` and ``ibverbs`` turn those transports off (they also follow
    ``FERRY_DISABLE_MEMORY=1`` and ``FERRY_DISABLE_IBVERBS=1``). ``tcp=False``
    keeps region bytes off TCP: this node's handles carry no TCP
    credentials, and a transfer that neither same-host memory nor ibverbs
    carries raises :class:`NoSharedTransport` instead of falling back
    (connections, messages and RPC still use TCP).

    ``cluster_secret`` (bytes or str, at least 16 bytes; else
    ``FERRY_CLUSTER_SECRET`` or the file ``FERRY_CLUSTER_SECRET_FILE``
    names): every connection to and from this node proves it, both ways,
    and peers without it are refused with :class:`AuthFailed`.
    """

    def __init__(
        self,
        name: Optional[str] = None,
        listen: str = "127.0.0.1:0",
        advertise: Optional[str] = None,
        *,
        memory: bool = True,
        ibverbs: bool = True,
        tcp: bool = True,
        tcp_connections: Optional[int] = None,
        etcd: Optional[str] = None,
        cluster: str = "default",
        cluster_secret: Union[bytes, str, None] = None,
    ) -> None:
        if forked():
            raise FerryError("ferry cannot start a node in a process forked from one that ran it")
        secret = cluster_secret.encode() if isinstance(cluster_secret, str) else cluster_secret
        self._native = _ferry.NativeNode(
            name, listen, advertise, memory, ibverbs, tcp_connections, etcd, cluster, secret, tcp
        )
        node_started()
        _OPEN.add(self)

    def _node(self) -> _ferry.NativeNode:
        refuse_in_child("this node")
        return self._native

    # -- the node ----------------------------------------------------------

    @property
    def addr(self) -> NodeAddr:
        """This node's address, for peers."""
        return NodeAddr(*self._native.addr)

    def transports(self) -> List[str]:
        """The transports running, fastest first (``"memory"``,
        ``"ibverbs"``, ``"tcp"``)."""
        return self._node().transports()

    def transport_status(self) -> List[TransportStatus]:
        """Every transport, fastest first, running or not, with what it runs
        on or why it could not start (as ``ferry info`` prints them)."""
        return [TransportStatus(*t) for t in self._node().transport_status()]

    def close(self) -> None:
        """Shuts the node down: transfers in flight fail, peers can no
        longer reach its regions, and every later call raises
        :class:`ShutDown`. Closing twice does nothing; in a forked child it
        does nothing either (the node is the parent's)."""
        _OPEN.discard(self)
        if not forked() and not self._native.closed:
            self._native.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._native.closed

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ferry.Node {self.addr}{' closed' if self.closed else ''}>"

    # -- memory ------------------------------------------------------------

    def alloc(self, nbytes: int, access: str = "rw") -> Region:
        """Allocates ``nbytes`` zeroed bytes and registers them. ``access``
        (``"rw"`` or ``"r"``) is the most a handle to it allows peers. With
        the same-host transport, same-host peers map it directly."""
        return _from_alloc(self._node().alloc(nbytes, access))

    def register(self, obj: Any, access: str = "rw") -> Region:
        """Registers the memory of ``obj``: any writable, C-contiguous
        buffer (a numpy array, a ``bytearray``, an ``mmap``, a torch CPU
        tensor's ``.numpy()``). The region holds the object, so it stays
        alive (and cannot be resized) while registered, even if the caller
        drops it."""
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidArgument(f"{type(obj).__name__} does not expose a buffer") from None
        if view.readonly:
            raise InvalidArgument("the buffer is read-only: ferry writes into registered memory")
        if not view.c_contiguous:
            raise InvalidArgument("the buffer is not C-contiguous")
        if view.nbytes == 0:
            raise InvalidArgument("a region must be at least one byte long")
        flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        region, addr = _from_buffer(flat)
        region._native = self._node().register(addr, flat.nbytes, access, flat)
        return region

    # -- one-shot transfers ---------------------------------------------------

    def submit(
        self, ops: Sequence[Op], timeout: float = 5.0, *, notification: Optional[Body] = None
    ) -> None:
        """Runs ``ops`` (each to the fastest transport its two ends share)
        and returns when all completed. An op's error is raised with its
        index (``op_index``); the deadline raises :class:`Timeout`. With
        ``notification``, each owner of remote memory gets it once its ops
        are done."""
        body = None if notification is None else bytes(notification)
        self._node().submit(_ops(ops), timeout, body)

    async def submit_async(
        self, ops: Sequence[Op], timeout: float = 5.0, *, notification: Optional[Body] = None
    ) -> None:
        """:meth:`submit` on the running event loop. Cancelling the
        awaiting task stops waiting, not the ops: they end by the
        deadline."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        body = None if notification is None else bytes(notification)
        self._node().submit_then(_ops(ops), timeout, _settler(loop, future), body)
        await future

    def read(
        self,
        local: Region,
        remote: RemoteRegion,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: Optional[int] = None,
        timeout: float = 5.0,
    ) -> None:
        """Copies ``length`` bytes (default: the rest of ``local``) of the
        remote region into ``local``."""
        op = Op.read(
            local, remote, local_offset=local_offset, remote_offset=remote_offset, length=length
        )
        self.submit([op], timeout)

    def write(
        self,
        local: Region,
        remote: RemoteRegion,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: Optional[int] = None,
        timeout: float = 5.0,
        notification: Optional[Body] = None,
    ) -> None:
        """Copies ``length`` bytes (default: the rest of ``local``) of
        ``local`` into the remote region."""
        op = Op.write(
            local, remote, local_offset=local_offset, remote_offset=remote_offset, length=length
        )
        self.submit([op], timeout, notification=notification)

    # -- prepared transfers ------------------------------------------------------

    def connect(self, peer: NodeAddr, timeout: float = 5.0) -> None:
        """Sets up every connection to ``peer`` that transfers will take,
        so that the first one pays no set-up (NIXL's ``make_connection``)."""
        self._node().connect(peer._tuple(), timeout)

    def prepare_remote(self, descs: RemoteDescs, timeout: float = 5.0) -> PreparedRemote:
        """Prepares a peer's list once: routes each region, connects to
        its owner and, for same-host peers, maps its memory. A region that
        cannot be used raises with its index (``op_index``)."""
        return PreparedRemote(self._node().prepare_remote(descs._native, timeout))

    def make_xfer(
        self,
        kind: str,
        local: LocalDescs,
        local_idx: IndicesLike,
        remote: PreparedRemote,
        remote_idx: IndicesLike,
        *,
        notification: Optional[Body] = None,
    ) -> Xfer:
        """A request of ``kind`` (``"READ"`` or ``"WRITE"``) between
        ``local[local_idx[k]]`` and ``remote[remote_idx[k]]`` for every
        ``k``. Indices are a ``range`` or an integer array (numpy, repeats
        allowed); every index and pair is checked now, and an error names
        its position. ``notification`` goes to the owner once every byte is
        in place."""
        write = {"READ": False, "WRITE": True}.get(kind.upper())
        if write is None:
            raise InvalidArgument(f"kind {kind!r} is neither 'READ' nor 'WRITE'")
        body = None if notification is None else bytes(notification)
        native = self._node().make_xfer(
            write, local._native, _indices(local_idx), remote._native, _indices(remote_idx), body
        )
        return Xfer(native)

    def plan_transfer(
        self,
        local: RankLayout,
        peers: Sequence[RankLayout],
        *,
        direction: str = "pull",
        timeout: float = 10.0,
        every_remote_tensor: bool = False,
        local_peers: Sequence[RankLayout] = (),
    ) -> TransferPlan:
        """Compiles the plan that moves every tensor ``local`` (this rank's
        layout, over regions of this node) holds between this node and the
        ranks ``peers`` (their layouts, from :meth:`RankLayout.from_bytes`,
        with their handles): READs for ``direction="pull"``, WRITEs for
        ``"push"``. Prepares the peers' memory within ``timeout`` seconds.

        Both sides are checked first; a bad layout raises
        :class:`LayoutError` with what is wrong (a rank missing, tensors
        that disagree, a region too short). Pulling, a byte several peers
        hold (``replicated``) is read from one of them, ``local.rank % n``;
        pushing, every replica is written, unless ``local_peers`` (the other
        ranks of this side) lets this side's replicas share the writes.
        ``every_remote_tensor``: refuse remote tensors this rank does not
        hold, instead of leaving them."""
        return _plan_transfer(
            self._node(), local, peers, direction, timeout, every_remote_tensor, local_peers
        )

    # -- messages and notifications ------------------------------------------

    def send_message(self, peer: NodeAddr, body: Body, timeout: float = 5.0) -> None:
        """Sends ``body`` to ``peer``'s inbox; returns once it is there."""
        self._node().send_message(peer._tuple(), bytes(body), timeout)

    def notify(self, peer: NodeAddr, body: Body, timeout: float = 5.0) -> None:
        """Sends ``body`` to ``peer`` as a notification on its own (NIXL's
        ``send_notif``)."""
        self._node().notify(peer._tuple(), bytes(body), timeout)

    def notifications(self, max: int = 1 << 20) -> List[Delivery]:
        """What peers sent that has arrived (notifications and messages, in
        order), taken from the inbox; never waits (NIXL's
        ``get_new_notifs``)."""
        return [_delivery(d) for d in self._node().drain_deliveries(max)]

    def next_notification(self, timeout: float = 5.0) -> Optional[Delivery]:
        """The next delivery, waiting up to ``timeout`` seconds; None if
        none came."""
        raw = self._node().next_delivery(timeout)
        return None if raw is None else _delivery(raw)

    async def incoming(self) -> AsyncIterator[Delivery]:
        """Every delivery, as it arrives, on the running event loop; ends
        when the node closes. Each is taken from the inbox only when the
        loop asks for it: leaving the loop early loses nothing."""
        loop = asyncio.get_running_loop()
        while True:
            taken = self._node().drain_deliveries(1)
            if taken:
                yield _delivery(taken[0])
                continue
            future = loop.create_future()
            self._node().when_delivery_waits(_settler(loop, future))
            if not await future:
                return

    # -- RPC ---------------------------------------------------------------

    def serve_rpc(self, name: str, handler: Handler) -> None:
        """Answers peers' calls of ``name`` with ``handler(argument) ->
        answer`` (bytes-like). A coroutine function runs on the event loop
        running when ``serve_rpc`` was called (or one of its own per call).
        A handler that raises fails that call with its text; the node lives
        on."""
        try:
            loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

        def run(sender: _ferry.AddrTuple, body: bytes, seconds_left: float) -> bytes:
            answer = handler(body)
            if inspect.isawaitable(answer):
                if loop is not None and loop.is_running():
                    coro = _as_coroutine(answer)
                    answer = asyncio.run_coroutine_threadsafe(coro, loop).result(seconds_left)
                else:
                    answer = asyncio.run(_as_coroutine(answer))
            return bytes(answer)

        self._node().serve_rpc(name, run)

    def unserve_rpc(self, name: str) -> bool:
        """Stops serving ``name``; returns whether it was served."""
        return self._node().unserve_rpc(name)

    def call(self, peer: NodeAddr, name: str, body: Body = b"", timeout: float = 5.0) -> bytes:
        """Calls ``peer``'s handler ``name``; its answer. A handler that
        raised raises :class:`RemoteError` here."""
        return self._node().call(peer._tuple(), name, bytes(body), timeout)

    async def call_async(
        self, peer: NodeAddr, name: str, body: Body = b"", timeout: float = 5.0
    ) -> bytes:
        """:meth:`call` on the running event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._node().call_then(peer._tuple(), name, bytes(body), timeout, _settler(loop, future))
        answer: bytes = await future
        return answer

    # -- names -------------------------------------------------------------

    def publish(self, name: str, region: Region) -> None:
        """Publishes ``region`` under ``name`` in this node's metadata
        (withdrawn when the region closes)."""
        self._node().publish(name, region._native)
        region._publications.append((self, name))

    def unpublish(self, name: str) -> bool:
        """Withdraws ``name``; returns whether it was published."""
        return self._node().unpublish(name)

    def metadata(self) -> bytes:
        """This node's metadata (address, published regions), for
        :meth:`load_metadata` on a peer."""
        return self._node().export_metadata()

    def load_metadata(self, blob: bytes) -> str:
        """Loads a peer's metadata; returns the name it is known by."""
        return self._node().load_metadata(bytes(blob))

    def fetch_metadata(self, endpoint: str, timeout: float = 5.0) -> str:
        """Fetches the metadata of the node at ``endpoint`` (``ip:port``);
        returns the name it is known by."""
        return self._node().fetch_metadata(endpoint, timeout)

    def remote_region(self, peer: str, name: str) -> RemoteRegion:
        """The handle of the region ``peer`` published as ``name``, from
        metadata loaded or fetched before."""
        return RemoteRegion(self._node().remote_region(peer, name))


    def lookup_region(self, peer: str, name: str, timeout: float = 5.0) -> RemoteRegion:
        """The handle of the region ``peer`` published as ``name``: from
        metadata loaded before, or looked up in etcd, waiting up to
        ``timeout`` seconds for it to be published."""
        return RemoteRegion(self._node().lookup_region(peer, name, timeout))


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
