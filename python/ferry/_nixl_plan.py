"""ferry's planner for NIXL: a plan between two sides' layouts in the shape
NIXL's prepared transfers take (``prep_xfer_dlist`` rows per side, and per
request the index arrays for ``make_prepped_xfer``), made without a node,
for a connector that moves its bytes on any NIXL backend
(``docs/nixl.md``, "ferry's planner on any NIXL backend")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _ferry
from ._errors import InvalidArgument, InvalidRange
from ._layout import RankLayout, TableLike, _span
from ._plan import _direction, _tables

if TYPE_CHECKING:  # numpy is needed only by the calls that return arrays.
    import numpy as np
    import numpy.typing as npt

__all__ = ["NixlPlan", "nixl_plan"]


def nixl_plan(
    local: RankLayout,
    peers: Sequence[RankLayout],
    *,
    direction: str = "pull",
    every_remote_tensor: bool = False,
    local_peers: Sequence[RankLayout] = (),
) -> "NixlPlan":
    """ferry's plan between ``local`` and ``peers`` in the shape NIXL's
    prepared transfers take, made without a node: per side a descriptor
    list over the whole pool (:meth:`NixlPlan.local_descs`,
    :meth:`NixlPlan.remote_descs`: ``(addr, len, dev_id)`` rows for
    ``prep_xfer_dlist``), and per request the index arrays into them
    (:meth:`NixlPlan.indices`, for ``make_prepped_xfer``), on any NIXL
    backend. Bad layouts raise :class:`LayoutError`, as
    :meth:`Node.plan_transfer` does."""
    native = _ferry.plan_layouts(
        local.to_json(),
        [p.to_json() for p in peers],
        _direction(direction),
        every_remote_tensor,
        [p.to_json() for p in local_peers],
    )
    return NixlPlan(native, local, list(peers))


def _rows(raw: bytes) -> "npt.NDArray[np.uint64]":
    import numpy as np

    return np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(-1, 3)


class NixlPlan:
    """A plan as NIXL's prepared lists and index arrays (:func:`nixl_plan`).

    Prepared rows cannot merge across blocks (which blocks are adjacent is
    known only per request): each row is a sub-block of ``g`` tokens, ``g``
    the greatest common divisor of both sides' block sizes, of one piece of
    geometry, and a request's token range must start and end on a multiple
    of ``g`` (:class:`BlockTableError` otherwise)."""

    __slots__ = ("_native", "_local", "_peers", "direction")

    def __init__(
        self, native: _ferry.NativeLayoutPlan, local: RankLayout, peers: List[RankLayout]
    ) -> None:
        self._native = native
        self._local = local
        self._peers = {p.rank: p for p in peers}
        #: ``"pull"`` (READ) or ``"push"`` (WRITE): the operation to make.
        self.direction = "push" if native.write else "pull"

    @property
    def operation(self) -> str:
        """NIXL's name for it: ``"READ"`` or ``"WRITE"``."""
        return "WRITE" if self.direction == "push" else "READ"

    @property
    def remote_ranks(self) -> List[int]:
        """The remote ranks the plan moves bytes with: one remote list and
        one pair of index arrays each."""
        return self._native.remote_ranks

    @property
    def tables(self) -> List[str]:
        """The block tables a request names."""
        return self._native.tables

    def local_descs(
        self, bases: Optional[Sequence[int]] = None, dev_id: Union[int, Sequence[int]] = 0
    ) -> "npt.NDArray[np.uint64]":
        """The local list: N×3 ``(addr, len, dev_id)`` rows, for
        ``prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type)``. Addresses
        are each region's base (the local layout's regions', or ``bases``
        by region index) plus the row's offset; ``dev_id`` is one for all,
        or one per region."""
        rows = _rows(self._native.nixl_local())
        bases = self._bases(self._local, bases)
        regions = self._native.local_regions
        return _addressed(rows, [bases[i] for i in regions], _devs(dev_id, regions))

    def remote_descs(
        self,
        rank: int,
        bases: Optional[Sequence[int]] = None,
        dev_id: Union[int, Sequence[int]] = 0,
    ) -> "npt.NDArray[np.uint64]":
        """Remote rank ``rank``'s list, for ``prep_xfer_dlist(its agent,
        rows, mem_type)``: its regions' base addresses are those its layout
        carried (:meth:`RankLayout.to_bytes` over memory that is not ferry's
        sends them), or ``bases`` by region index (from the peer's NIXL
        registration)."""
        peer = self._peers.get(rank)
        if peer is None:
            raise InvalidArgument(f"rank {rank} is not among the plan's peers")
        rows = _rows(self._native.nixl_remote(rank))
        full = self._bases(peer, bases)
        # Remote rows name the plan's remote regions: (rank, region) pairs.
        table = self._native.remote_regions
        regions = [region for _, region in table]
        return _addressed(
            rows,
            [full[region] if r == rank else 0 for r, region in table],
            _devs(dev_id, regions),
        )

    def indices(
        self,
        tokens: Any = None,
        local_blocks: Any = None,
        remote_blocks: Any = None,
        *,
        table: Optional[str] = None,
        tables: Optional[Mapping[str, TableLike]] = None,
    ) -> Dict[int, Tuple["npt.NDArray[np.int32]", "npt.NDArray[np.int32]"]]:
        """One request's index arrays, per remote rank: ``(local,
        remote)`` int32 arrays for ``make_prepped_xfer(operation,
        local_list, local, its list, remote)``. Arguments as
        :meth:`TransferPlan.request`'s."""
        import numpy as np

        out: Dict[int, Tuple["npt.NDArray[np.int32]", "npt.NDArray[np.int32]"]] = {}
        native = self._native.nixl_indices(
            _tables(self.tables, tokens, local_blocks, remote_blocks, table, tables)
        )
        for rank, local, remote in native:
            pair = []
            for raw in (local, remote):
                rows = np.frombuffer(raw, dtype="<u8")
                if rows.size and int(rows.max()) > 2**31 - 1:
                    raise InvalidRange("a NIXL index past 2**31-1: the lists are too long for NIXL")
                pair.append(rows.astype(np.int32))
            out[rank] = (pair[0], pair[1])
        return out

    def descriptor_count(
        self,
        tokens: Any = None,
        local_blocks: Any = None,
        remote_blocks: Any = None,
        *,
        table: Optional[str] = None,
        tables: Optional[Mapping[str, TableLike]] = None,
    ) -> int:
        """Descriptors ferry's own request would move for these tables (after
        merging), for comparison with the index pairs NIXL is given."""
        local, _, _ = self._native.expand(
            _tables(self.tables, tokens, local_blocks, remote_blocks, table, tables), True
        )
        return len(local) // 24

    @staticmethod
    def _bases(layout: RankLayout, bases: Optional[Sequence[int]]) -> List[int]:
        if bases is not None:
            if len(bases) != len(layout.regions):
                raise InvalidArgument(
                    f"rank {layout.rank} has {len(layout.regions)} regions; {len(bases)} bases given"
                )
            return [int(b) for b in bases]
        out = []
        for i, r in enumerate(layout.regions):
            span = _span(r, f"rank {layout.rank}'s region {i}")
            if span is None:
                raise InvalidArgument(
                    f"rank {layout.rank}'s region {i} has no address here: pass bases="
                )
            out.append(span.addr)
        return out

    def __repr__(self) -> str:
        return f"<ferry.NixlPlan {self.operation} with ranks {self.remote_ranks}>"


def _devs(dev_id: Union[int, Sequence[int]], regions: Iterable[int]) -> List[int]:
    if isinstance(dev_id, int):
        return [dev_id for _ in regions]
    ids = list(dev_id)
    return [ids[r] for r in regions]


def _addressed(
    rows: "npt.NDArray[np.uint64]", bases: Sequence[int], devs: Sequence[int]
) -> "npt.NDArray[np.uint64]":
    """(region, offset, len) rows to (addr, len, dev) rows."""
    import numpy as np

    out = np.empty_like(rows)
    if rows.shape[0]:
        region = rows[:, 0].astype(np.int64)
        out[:, 0] = np.asarray(bases, dtype=np.uint64)[region] + rows[:, 1]
        out[:, 1] = rows[:, 2]
        out[:, 2] = np.asarray(devs, dtype=np.uint64)[region]
    return out
