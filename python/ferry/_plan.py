"""Transfer plans: what a node compiled once from both sides' layouts
(:meth:`Node.plan_transfer`), and the requests made from it, each naming
only tokens and block tables (``docs/layouts.md``)."""

from __future__ import annotations

import array as _array
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _ferry
from ._errors import InvalidArgument, InvalidRange
from ._layout import RankLayout, TableLike
from ._region import Region, RemoteRegion
from ._xfer import Xfer

__all__ = ["TransferPlan"]


def _ids_bytes(ids: Any, what: str) -> bytes:
    """Block ids as little-endian u64 bytes, in one pass over a numpy
    array."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - the tests install numpy
        np = None  # type: ignore[assignment]
    if np is not None and isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise InvalidArgument(f"{what} has shape {ids.shape}, not (N,)")
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"{what} is {ids.dtype}, not integers")
        if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
            raise InvalidRange(f"{what} holds a negative block id")
        return np.ascontiguousarray(ids, dtype="<u8").tobytes()
    try:
        return _array.array("Q", [int(i) for i in ids]).tobytes()
    except OverflowError:
        raise InvalidRange(f"{what} holds a negative block id") from None


def _token_range(tokens: Any, table: str) -> Tuple[int, int]:
    if isinstance(tokens, range):
        if tokens.step != 1:
            raise InvalidArgument(f"table {table!r}: tokens {tokens!r} is not a range of step 1")
        return tokens.start, tokens.stop
    if isinstance(tokens, int):
        return 0, tokens
    if isinstance(tokens, tuple) and len(tokens) == 2:
        return int(tokens[0]), int(tokens[1])
    raise InvalidArgument(
        f"table {table!r}: tokens {tokens!r} is not a count, a range or a (start, end) pair"
    )


def _tables(
    plan_tables: Sequence[str],
    tokens: Any,
    local_blocks: Any,
    remote_blocks: Any,
    table: Optional[str],
    tables: Optional[Mapping[str, TableLike]],
) -> List[_ferry.TableTuple]:
    """A request's tables as the native half takes them."""
    given: Dict[str, TableLike] = {}
    if tables is not None:
        if tokens is not None or table is not None:
            raise InvalidArgument("give tokens and block tables, or tables=, not both")
        given = dict(tables)
    elif tokens is not None:
        if local_blocks is None or remote_blocks is None:
            raise InvalidArgument("a request names its tokens and both sides' block tables")
        if table is None:
            if len(plan_tables) != 1:
                raise InvalidArgument(
                    f"the plan pages through tables {list(plan_tables)}: name one (table=) "
                    "or give them all (tables=)"
                )
            table = plan_tables[0]
        given = {table: (tokens, local_blocks, remote_blocks)}
    out: List[_ferry.TableTuple] = []
    for name, entry in given.items():
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise InvalidArgument(f"table {name!r}: give (tokens, local block ids, remote block ids)")
        start, end = _token_range(entry[0], name)
        if start < 0 or end < 0:
            raise InvalidRange(f"table {name!r}: a negative token index")
        out.append(
            (
                str(name),
                start,
                end,
                _ids_bytes(entry[1], f"table {name!r}'s local block ids"),
                _ids_bytes(entry[2], f"table {name!r}'s remote block ids"),
            )
        )
    return out


def _direction(direction: str) -> bool:
    """Whether ``direction`` pushes."""
    if direction not in ("pull", "push"):
        raise InvalidArgument(f"direction {direction!r} is neither \"pull\" nor \"push\"")
    return direction == "push"


class TransferPlan:
    """A plan a node compiled once (:meth:`Node.plan_transfer`), over the
    peers' memory prepared once: each :meth:`request` names only tokens and
    block tables, and is one transfer request (:class:`Xfer`) over every
    remote rank it needs, with one status, one wait and one notification
    per rank."""

    __slots__ = ("_native", "direction")

    def __init__(self, native: _ferry.NativePlan) -> None:
        self._native = native
        #: ``"pull"`` (READs) or ``"push"`` (WRITEs).
        self.direction = "push" if native.write else "pull"

    @property
    def remote_ranks(self) -> List[int]:
        """The remote ranks the plan moves bytes with, ascending."""
        return self._native.remote_ranks

    @property
    def tables(self) -> List[str]:
        """The block tables a request names (none: every request moves the
        same bytes)."""
        return self._native.tables

    @property
    def segments(self) -> int:
        """Loop nests in the plan: its size, O(pieces), never O(blocks)."""
        return self._native.segments

    def request(
        self,
        tokens: Any = None,
        local_blocks: Any = None,
        remote_blocks: Any = None,
        *,
        table: Optional[str] = None,
        tables: Optional[Mapping[str, TableLike]] = None,
        notification: Optional[bytes] = None,
    ) -> Xfer:
        """The request that moves ``tokens`` (a count from 0, a ``range``
        or a (start, end) pair) of the paged axis, which lie in this side's
        blocks ``local_blocks`` and the other side's ``remote_blocks``
        (numpy integer arrays, or sequences: entry ``i`` holds tokens ``i *
        block`` to ``(i + 1) * block`` on its side); ``table`` names the
        table when the plan has several, or ``tables={name: (tokens, local,
        remote)}`` gives them all. A plan with no paged tensor takes none.

        ``notification`` reaches every remote rank the request moves bytes
        with, once, after its bytes. A block id past a pool or a table too
        short for the tokens raises :class:`BlockTableError` naming the
        table, side and position; nothing moves."""
        native = self._native.request(
            _tables(self.tables, tokens, local_blocks, remote_blocks, table, tables),
            None if notification is None else bytes(notification),
        )
        return Xfer(native)

    def descriptor_count(
        self,
        tokens: Any = None,
        local_blocks: Any = None,
        remote_blocks: Any = None,
        *,
        table: Optional[str] = None,
        tables: Optional[Mapping[str, TableLike]] = None,
    ) -> int:
        """Descriptors a request for these tables moves (after merging
        those that continue on both sides), without making it."""
        return self._native.count(
            _tables(self.tables, tokens, local_blocks, remote_blocks, table, tables)
        )

    def check_current(self, peers: Sequence[RankLayout]) -> None:
        """Raises :class:`LayoutError` if a peer's layout is no longer the
        one the plan was made from (plan again)."""
        self._native.check_current([_peer_tuple(p) for p in peers])

    def __repr__(self) -> str:
        return (
            f"<ferry.TransferPlan {self.direction} with ranks {self.remote_ranks}, "
            f"{self.segments} segments>"
        )


def _peer_tuple(peer: RankLayout) -> Tuple[str, List[_ferry.NativeRemote]]:
    handles = []
    for i, r in enumerate(peer.regions):
        if isinstance(r, Region):
            r = r.remote()
        if not isinstance(r, RemoteRegion):
            raise InvalidArgument(
                f"peer rank {peer.rank}'s region {i} is {r!r}, not a ferry region's handle: "
                "send its layout with RankLayout.to_bytes() over ferry regions"
            )
        handles.append(r._native)
    return (peer.to_json(), handles)


def _local_regions(local: RankLayout) -> List[_ferry.NativeRegion]:
    """The regions of this rank's layout, which a node plans over: ferry
    regions, registered with the node."""
    regions = []
    for i, r in enumerate(local.regions):
        if not isinstance(r, Region):
            raise InvalidArgument(
                f"rank {local.rank}'s region {i} is {type(r).__name__}, not a ferry Region: "
                "register the memory with the node (node.register(array))"
            )
        regions.append(r._native)
    return regions


def _plan_transfer(
    node: _ferry.NativeNode,
    local: RankLayout,
    peers: Sequence[RankLayout],
    direction: str,
    timeout: float,
    every_remote_tensor: bool,
    local_peers: Sequence[RankLayout],
) -> TransferPlan:
    native = node.plan_transfer(
        local.to_json(),
        _local_regions(local),
        [_peer_tuple(p) for p in peers],
        _direction(direction),
        every_remote_tensor,
        [p.to_json() for p in local_peers],
        timeout,
    )
    return TransferPlan(native)
