"""Tensor layouts and transfer plans: each side declares once how its
tensors lie in memory, the node compiles a plan once, and each request
names only block tables (``docs/layouts.md``).

A layout is built from the arrays a framework already has: a numpy array (a
torch tensor works too, when torch is installed) that views a registered
region, with a name per dimension. Its address within the region and its
strides are the layout's offset and strides; the names say which logical
axis each dimension is, which dimension holds a paged axis's physical
blocks, and which part of each axis this rank holds.

>>> import numpy as np, ferry
>>> node = ferry.Node()
>>> pool = np.zeros((2, 64, 16, 4, 8), dtype=np.float16)  # layer, block, token, head, dim
>>> region = node.register(pool)
>>> k = ferry.TensorLayout.from_array(
...     "k", pool, region,
...     axes=("layer", "block", "token", "head", "dim"),
...     paged=("token", "block"),          # "block" holds the physical blocks of "token"
...     global_sizes={"token": 1024},      # the longest sequence both sides name
...     parts={"head": (0, 2)},            # tensor-parallel rank 0 of 2: heads 0-3 of 8
... )
>>> layout = ferry.RankLayout(0, [k])    # its regions: those its tensors lie in
>>> blob = layout.to_bytes()               # for the other side, handles included
>>> node.close()
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _ferry
from ._errors import InvalidArgument, LayoutError, MetadataError
from ._region import Region, RemoteRegion

if TYPE_CHECKING:  # numpy is needed only by the calls that return arrays.
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "MemorySpan",
    "Paged",
    "TensorLayout",
    "RankLayout",
]


class MemorySpan(NamedTuple):
    """``nbytes`` bytes at address ``addr`` of some process: memory a
    layout may lie in without being a ferry :class:`Region` (memory
    registered with NIXL, say). A layout received from a peer whose
    regions are such spans carries their addresses."""

    addr: int
    nbytes: int


#: What a layout's tensors lie in: a ferry :class:`Region` (or, on the
#: other side, its :class:`RemoteRegion` handle), a :class:`MemorySpan`, or
#: the array (numpy, torch) that was registered.
RegionLike = Any
#: A numpy array, or anything with torch's tensor calls (``data_ptr``,
#: ``stride``, ``element_size``) or a ``__cuda_array_interface__``.
ArrayLike = Any
#: One table of a request: (tokens, local block ids, remote block ids);
#: tokens an ``int`` n (0..n), a ``range`` or a (start, end) pair; the ids a
#: 1-D integer numpy array or a sequence of ints.
TableLike = Tuple[Any, Any, Any]


# -- arrays and memory ----------------------------------------------------------


class _ArrayInfo(NamedTuple):
    addr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int


def _c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    strides = []
    stride = itemsize
    for n in reversed(shape):
        strides.append(stride)
        stride *= n
    return tuple(reversed(strides))


def _typestr_size(typestr: str) -> int:
    digits = "".join(c for c in typestr if c.isdigit())
    if not digits:
        raise InvalidArgument(f"an array of type {typestr!r}: no element size")
    return int(digits)


def _array_info(a: ArrayLike, what: str) -> _ArrayInfo:
    """Address, shape, byte strides and element size of an array, without
    importing its library (and without copying it)."""
    if callable(getattr(a, "data_ptr", None)) and callable(getattr(a, "stride", None)):
        # torch.Tensor (CPU or GPU): strides in elements.
        itemsize = int(a.element_size())
        shape = tuple(int(n) for n in a.shape)
        strides = tuple(int(s) * itemsize for s in a.stride())
        return _ArrayInfo(int(a.data_ptr()), shape, strides, itemsize)
    for attr in ("__array_interface__", "__cuda_array_interface__"):
        face = getattr(a, attr, None)
        if isinstance(face, dict):
            shape = tuple(int(n) for n in face["shape"])
            itemsize = _typestr_size(str(face["typestr"]))
            raw = face.get("strides")
            strides = _c_strides(shape, itemsize) if raw is None else tuple(int(s) for s in raw)
            return _ArrayInfo(int(face["data"][0]), shape, strides, itemsize)
    raise InvalidArgument(
        f"{what} is a {type(a).__name__}, not an array (numpy, or a torch tensor)"
    )


def _span(region: RegionLike, what: str) -> Optional[MemorySpan]:
    """Where a region lies in this process (None for a remote handle)."""
    if isinstance(region, Region):
        return MemorySpan(region.addr, region.nbytes)
    if isinstance(region, MemorySpan):
        return region
    if isinstance(region, (RemoteRegion, _Unbound)):
        return None
    info = _array_info(region, what)
    if info.strides != _c_strides(info.shape, info.itemsize):
        raise InvalidArgument(f"{what} is not contiguous: a region is one span of memory")
    nbytes = info.itemsize
    for n in info.shape:
        nbytes *= n
    return MemorySpan(info.addr, nbytes)


def _region_len(region: RegionLike) -> int:
    if isinstance(region, (Region, RemoteRegion)):
        return region.nbytes
    if isinstance(region, _Unbound):
        return region.nbytes
    span = _span(region, "a region")
    assert span is not None
    return span.nbytes


def _region_key(region: RegionLike) -> Any:
    """Two region objects for the same memory are one region."""
    if isinstance(region, RemoteRegion):
        return ("handle", region.to_bytes())
    if isinstance(region, _Unbound):
        return ("unbound", id(region))
    span = _span(region, "a region")
    assert span is not None
    return ("span", span.addr, span.nbytes)


class _Unbound:
    """Region ``index`` of a layout received without handles or addresses:
    bind it with ``RankLayout.from_bytes(data, regions=...)``."""

    __slots__ = ("index", "nbytes")

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<region {self.index} of {self.nbytes} bytes, no handle>"


# -- layouts --------------------------------------------------------------------


#: One axis's part: ``"full"``, ``("split", parts, index)`` or
#: ``("range", start, len)``.
Part = Tuple[Any, ...]


@dataclass(frozen=True)
class Paged:
    """A paged axis: logical index ``t`` lies in physical block
    ``table[t // block]``, at in-block position ``t % block`` (whose stride
    is the axis's stride)."""

    #: The logical axis paged, e.g. ``"token"``.
    axis: str
    #: Elements of that axis per block.
    block: int
    #: Bytes between the starts of consecutive physical blocks.
    block_stride: int
    #: Physical blocks in the pool: a block id must be below this.
    blocks: int
    #: Which block table of a request applies.
    table: str


@dataclass(frozen=True)
class TensorLayout:
    """One rank's piece of a logical tensor, and where it lies: what
    :meth:`from_array` builds. The fields are those of the Rust
    ``ferry::layout::TensorLayout`` (``docs/layouts.md``), with axes named
    instead of numbered and regions as objects instead of indices.

    The byte of the element with rank-local index ``x`` is ``offset +
    sum(x[d] * strides[d])`` in ``region``, except that a region-mapped
    axis takes its (region, offset) from ``region_map`` and the paged axis
    contributes ``table[x // block] * block_stride + (x % block) *
    strides[axis]``.
    """

    #: The tensor's name, the same on every rank and both sides.
    name: str
    #: Bytes per element.
    elem_size: int
    #: The logical axes, (name, global size), in logical order: both sides
    #: must agree on these.
    axes: Tuple[Tuple[str, int], ...]
    #: Per axis, the part this rank holds.
    parts: Tuple[Part, ...]
    #: Other ranks hold exactly this piece too.
    replicated: bool
    #: The region element ``[0, 0, ...]`` lies in (unused with a region map).
    region: RegionLike
    #: Its byte offset there.
    offset: int
    #: Byte stride per logical axis, for the rank-local index.
    strides: Tuple[int, ...]
    #: (axis, ((region, offset) per rank-local index)): an axis whose
    #: indices lie in regions of their own (a region per layer).
    region_map: Optional[Tuple[str, Tuple[Tuple[RegionLike, int], ...]]] = None
    #: The paged axis, if any.
    paged: Optional[Paged] = None

    @classmethod
    def from_array(
        cls,
        name: str,
        array: Union[ArrayLike, Sequence[ArrayLike]],
        region: Union[RegionLike, Sequence[RegionLike]],
        *,
        axes: Sequence[str],
        paged: Optional[Tuple[str, str]] = None,
        table: Optional[str] = None,
        parts: Optional[Mapping[str, Any]] = None,
        global_sizes: Optional[Mapping[str, int]] = None,
        replicated: bool = False,
        order: Optional[Sequence[str]] = None,
    ) -> "TensorLayout":
        """The layout of tensor ``name`` as ``array`` holds it: a view (any
        strides) into ``region``'s memory, which is a registered
        :class:`Region`, the array that was registered, or a
        :class:`MemorySpan`.

        ``axes`` names each dimension of ``array``. A name is a logical
        axis, which both sides must name alike (``"layer"``, ``"token"``,
        ``"head"``, ``"dim"``), except the dimension ``paged`` names as a
        paged axis's physical blocks:

        - ``paged=("token", "block")``: logical axis ``token`` is stored in
          a pool of physical blocks, the dimension named ``"block"`` indexes
          them and the one named ``"token"`` is the position within a
          block. vLLM's KV pool ``(num_blocks, block_size, num_heads,
          head_dim)`` is ``axes=("block", "token", "head", "dim")``, HND
          ``(num_blocks, num_heads, block_size, head_dim)`` is ``("block",
          "head", "token", "dim")``; K and V as one ``(2, num_blocks, ...)``
          array are ``kv[0]`` and ``kv[1]``, two tensors ``"k"`` and
          ``"v"``. Requests name the table ``table`` (default: the paged
          axis's name) with each side's block ids.
        - ``parts={"head": (rank, tp)}``: this rank holds the ``rank``-th of
          ``tp`` equal parts of ``head`` (tensor parallelism); when ``tp``
          exceeds the axis's global size (8 ranks over 2 KV heads), each
          element is held by ``tp / size`` consecutive ranks, and the piece
          is marked replicated. ``parts={"layer": range(16, 32)}``: an
          uneven part, such as a pipeline stage. Axes not named are held
          whole.
        - ``global_sizes``: an axis's size over all ranks, where it is not
          the array's (times the split): always for the paged axis (the
          longest sequence a request may name, the same on both sides),
          for a ``range`` part, and for a split that replicates.
        - ``replicated=True``: other ranks hold exactly this piece too
          (MLA's latent, held whole on every rank).
        - ``order``: the logical axes' order. Both sides must use the same
          one; by default the names sorted, so that NHD and HND arrays
          describe the same tensor. Give it to match a peer that declared
          another (``("layer", "token", "head", "dim")`` for the Rust
          ``KvCache`` helper).

        A list of arrays is one more axis, named by ``axes[0]``, each of its
        indices in a region of its own (vLLM registers a KV array per
        layer): ``region`` is then a list too, one region per array (or
        one region they all lie in), and the arrays must have the same
        shape and strides.
        """
        return _from_array(
            name, array, region, axes, paged, table, parts, global_sizes, replicated, order
        )

    # -- JSON (the serde form of the Rust type) -------------------------------

    def _regions(self) -> List[RegionLike]:
        if self.region_map is not None:
            return [r for r, _ in self.region_map[1]]
        return [self.region]

    def _json(self, index: Callable[[RegionLike], int]) -> Dict[str, Any]:
        names = [n for n, _ in self.axes]

        def axis_index(name: str) -> int:
            if name in names:
                return names.index(name)
            if name.isdigit():  # as a peer sent it: the planner says what is wrong
                return int(name)
            raise LayoutError(f"tensor {self.name!r}: {name!r} is not one of its axes {names}")

        out: Dict[str, Any] = {
            "tensor": {
                "name": self.name,
                "elem_size": self.elem_size,
                "axes": [{"name": n, "size": s} for n, s in self.axes],
            },
            "parts": [_part_json(p) for p in self.parts],
            "replicated": self.replicated,
            "region": 0,
            "offset": self.offset,
            "strides": list(self.strides),
            "region_map": None,
            "paged": None,
        }
        if self.region_map is not None:
            axis, places = self.region_map
            out["region_map"] = {
                "axis": axis_index(axis),
                "places": [{"region": index(r), "offset": o} for r, o in places],
            }
            out["region"] = index(places[0][0]) if places else 0
        else:
            out["region"] = index(self.region)
        if self.paged is not None:
            p = self.paged
            out["paged"] = {
                "axis": axis_index(p.axis),
                "block": p.block,
                "block_stride": p.block_stride,
                "blocks": p.blocks,
                "table": p.table,
            }
        return out

    @classmethod
    def _from_json(cls, data: Mapping[str, Any], regions: Sequence[RegionLike]) -> "TensorLayout":
        tensor = data["tensor"]
        axes = tuple((str(a["name"]), int(a["size"])) for a in tensor["axes"])
        names = [n for n, _ in axes]

        def region(i: int) -> RegionLike:
            if not 0 <= i < len(regions):
                # The planner names the region count in its own error.
                return _Unbound(i, 0)
            return regions[i]

        region_map = None
        raw_map = data.get("region_map")
        if raw_map is not None:
            axis = int(raw_map["axis"])
            places = tuple((region(int(p["region"])), int(p["offset"])) for p in raw_map["places"])
            region_map = (names[axis] if axis < len(names) else str(axis), places)
        paged = None
        raw_paged = data.get("paged")
        if raw_paged is not None:
            axis = int(raw_paged["axis"])
            paged = Paged(
                axis=names[axis] if axis < len(names) else str(axis),
                block=int(raw_paged["block"]),
                block_stride=int(raw_paged["block_stride"]),
                blocks=int(raw_paged["blocks"]),
                table=str(raw_paged["table"]),
            )
        return cls(
            name=str(tensor["name"]),
            elem_size=int(tensor["elem_size"]),
            axes=axes,
            parts=tuple(_part_from_json(p) for p in data["parts"]),
            replicated=bool(data["replicated"]),
            region=region(int(data["region"])),
            offset=int(data["offset"]),
            strides=tuple(int(s) for s in data["strides"]),
            region_map=region_map,
            paged=paged,
        )


def _part_json(part: Part) -> Any:
    if part[0] == "full":
        return "Full"
    if part[0] == "split":
        return {"Split": {"parts": part[1], "index": part[2]}}
    return {"Range": {"start": part[1], "len": part[2]}}


def _part_from_json(data: Any) -> Part:
    if data == "Full":
        return ("full",)
    if isinstance(data, dict) and "Split" in data:
        return ("split", int(data["Split"]["parts"]), int(data["Split"]["index"]))
    if isinstance(data, dict) and "Range" in data:
        return ("range", int(data["Range"]["start"]), int(data["Range"]["len"]))
    raise MetadataError(f"not an axis part: {data!r}")


def _from_array(
    name: str,
    array: Any,
    region: Any,
    axes: Sequence[str],
    paged: Optional[Tuple[str, str]],
    table: Optional[str],
    parts: Optional[Mapping[str, Any]],
    global_sizes: Optional[Mapping[str, int]],
    replicated: bool,
    order: Optional[Sequence[str]],
) -> TensorLayout:
    where = f"tensor {name!r}"
    axes = [str(a) for a in axes]
    if len(set(axes)) != len(axes):
        raise LayoutError(f"{where}: axes {axes} name a dimension twice")
    parts = dict(parts or {})
    global_sizes = dict(global_sizes or {})

    # A list of arrays: axes[0] is the list's axis, one region per array.
    mapped: Optional[str] = None
    if isinstance(array, (list, tuple)):
        if not array:
            raise LayoutError(f"{where}: an empty list of arrays")
        if not isinstance(region, (list, tuple)):
            region = [region] * len(array)  # one region holds them all
        if len(region) != len(array):
            raise LayoutError(f"{where}: {len(array)} arrays and {len(region)} regions")
        mapped, dims = axes[0], axes[1:]
        infos = [_array_info(a, f"{where}'s array {i}") for i, a in enumerate(array)]
        first = infos[0]
        for i, info in enumerate(infos[1:], 1):
            if (info.shape, info.strides, info.itemsize) != (first.shape, first.strides, first.itemsize):
                raise LayoutError(
                    f"{where}: array {i} has shape {info.shape} and strides {info.strides}, "
                    f"array 0 {first.shape} and {first.strides}"
                )
        regions = list(region)
    else:
        dims = axes
        first = _array_info(array, f"{where}'s array")
        infos = [first]
        regions = [region]
    if len(dims) != len(first.shape):
        raise LayoutError(
            f"{where}: {len(dims)} axis names {list(dims)} for an array of {len(first.shape)} "
            f"dimensions {first.shape}"
        )
    if any(s < 0 for s in first.strides):
        raise LayoutError(f"{where}: negative strides {first.strides}")

    # Where each array lies in its region.
    places: List[Tuple[RegionLike, int]] = []
    for i, (info, reg) in enumerate(zip(infos, regions)):
        span = _span(reg, f"{where}'s region")
        if span is None:
            raise InvalidArgument(
                f"{where}: its region is a handle to another process's memory; "
                "a layout is declared by the process whose memory it is"
            )
        offset = info.addr - span.addr
        if not 0 <= offset <= span.nbytes:
            what = f"array {i}" if mapped is not None else "the array"
            raise LayoutError(
                f"{where}: {what} at {info.addr:#x} is not inside its region "
                f"({span.nbytes} bytes at {span.addr:#x})"
            )
        places.append((reg, offset))

    # Logical axes: every name but the paged axis's block dimension.
    size_of = dict(zip(dims, first.shape))
    stride_of = dict(zip(dims, first.strides))
    paged_axis: Optional[str] = None
    block_dim: Optional[str] = None
    if paged is not None:
        paged_axis, block_dim = paged
        for n in (paged_axis, block_dim):
            if n not in size_of:
                raise LayoutError(f"{where}: paged={paged!r} names {n!r}, not one of the axes {axes}")
        if paged_axis == block_dim:
            raise LayoutError(f"{where}: paged={paged!r} names one dimension twice")
    local: Dict[str, int] = {}
    strides: Dict[str, int] = {}
    if mapped is not None:
        local[mapped] = len(infos)
        strides[mapped] = 0
    for n in dims:
        if n != block_dim:
            local[n] = size_of[n]
            strides[n] = stride_of[n]
    for n in list(parts) + list(global_sizes):
        if n not in local:
            raise LayoutError(f"{where}: {n!r} is not one of its logical axes {sorted(local)}")

    names = sorted(local) if order is None else [str(n) for n in order]
    if sorted(names) != sorted(local):
        raise LayoutError(f"{where}: order {names} is not an order of its logical axes {sorted(local)}")

    replicated_by_split = False
    sizes: List[Tuple[str, int]] = []
    part_list: List[Part] = []
    for n in names:
        held = local[n]
        given = parts.get(n)
        size = global_sizes.get(n)
        if n == paged_axis:
            if size is None:
                raise LayoutError(
                    f"{where}: give global_sizes={{{n!r}: N}}, N the longest sequence a request "
                    "may name (the same on both sides)"
                )
            if given is not None:
                raise LayoutError(f"{where}: a paged axis ({n!r}) is held whole")
            sizes.append((n, int(size)))
            part_list.append(("full",))
            continue
        if given is None:
            size = held if size is None else int(size)
            if size != held:
                raise LayoutError(
                    f"{where}: axis {n!r} has {held} elements here and global size {size}: "
                    "say which part this rank holds (parts=)"
                )
            part: Part = ("full",)
        elif isinstance(given, range):
            if given.step != 1 or len(given) == 0:
                raise LayoutError(f"{where}: part {given!r} of {n!r} is not a non-empty range of step 1")
            if size is None:
                raise LayoutError(f"{where}: a range part of {n!r} needs its size in global_sizes")
            if len(given) != held:
                raise LayoutError(
                    f"{where}: part {given!r} of {n!r} holds {len(given)} elements; the array {held}"
                )
            part = ("range", given.start, len(given))
            size = int(size)
        elif isinstance(given, tuple) and len(given) == 2:
            index, count = int(given[0]), int(given[1])
            if count <= 0 or not 0 <= index < count:
                raise LayoutError(f"{where}: part {given!r} of {n!r} is not (rank, ranks) with rank < ranks")
            size = held * count if size is None else int(size)
            if size % count == 0:
                part = ("split", count, index)
                share = size // count
            elif size > 0 and count % size == 0:
                # More ranks than elements: each held by count / size ranks.
                part = ("split", size, index // (count // size))
                share = 1
                replicated_by_split = True
            else:
                raise LayoutError(f"{where}: axis {n!r} of {size} cannot be shared by {count} ranks")
            if share != held:
                raise LayoutError(
                    f"{where}: rank {index} of {count} holds {share} of {n!r}'s {size}; the array {held}"
                )
        else:
            raise LayoutError(
                f"{where}: part {given!r} of {n!r} is neither (rank, ranks) nor a range"
            )
        sizes.append((n, size))
        part_list.append(part)

    paged_spec = None
    if paged_axis is not None and block_dim is not None:
        paged_spec = Paged(
            axis=paged_axis,
            block=size_of[paged_axis],
            block_stride=stride_of[block_dim],
            blocks=size_of[block_dim],
            table=paged_axis if table is None else str(table),
        )
    elif table is not None:
        raise LayoutError(f"{where}: table={table!r} without a paged axis")
    reg0, off0 = places[0]
    return TensorLayout(
        name=str(name),
        elem_size=first.itemsize,
        axes=tuple(sizes),
        parts=tuple(part_list),
        replicated=bool(replicated) or replicated_by_split,
        region=reg0,
        offset=off0 if mapped is None else 0,
        strides=tuple(strides[n] for n in names),
        region_map=None if mapped is None else (mapped, tuple(places)),
        paged=paged_spec,
    )


class RankLayout:
    """What one rank holds: its tensors (:class:`TensorLayout`) and the
    regions they lie in, in order (by default, the regions of its tensors,
    in the order they first appear). A side of a transfer is a list of
    these.

    :meth:`to_bytes` is what a peer needs: the layout (the JSON of the
    Rust ``RankLayout``), with the handles of its regions when they are
    ferry regions, or their addresses when they are other memory (for
    NIXL). :meth:`from_bytes` reads it back, in another process.
    """

    __slots__ = ("rank", "tensors", "regions")

    def __init__(
        self,
        rank: int,
        tensors: Sequence[TensorLayout],
        regions: Optional[Sequence[RegionLike]] = None,
    ) -> None:
        self.rank = int(rank)
        self.tensors: List[TensorLayout] = list(tensors)
        if regions is None:
            found: Dict[Any, RegionLike] = {}
            for t in self.tensors:
                for r in t._regions():
                    found.setdefault(_region_key(r), r)
            self.regions: List[RegionLike] = list(found.values())
        else:
            self.regions = list(regions)
        self._index()  # every tensor's regions are among them

    def _index(self) -> Dict[Any, int]:
        index: Dict[Any, int] = {}
        for i, r in enumerate(self.regions):
            index.setdefault(_region_key(r), i)
        for t in self.tensors:
            for r in t._regions():
                if _region_key(r) not in index:
                    raise LayoutError(
                        f"rank {self.rank}, tensor {t.name!r}: its region {r!r} is not among "
                        "the rank's regions"
                    )
        return index

    def tensor(self, name: str) -> Optional[TensorLayout]:
        """The piece of tensor ``name``, if this rank holds one."""
        return next((t for t in self.tensors if t.name == name), None)

    def to_json(self) -> str:
        """The layout alone, as the Rust ``RankLayout``'s serde JSON."""
        index = self._index()
        data = {
            "rank": self.rank,
            "region_lens": [_region_len(r) for r in self.regions],
            "tensors": [t._json(lambda r: index[_region_key(r)]) for t in self.tensors],
        }
        return json.dumps(data, separators=(",", ":"))

    def to_bytes(self) -> bytes:
        """The layout for a peer: its JSON, with the handles of its regions
        (ferry regions) or their addresses (other memory)."""
        out: Dict[str, Any] = {"rank_layout": json.loads(self.to_json())}
        if self.regions and all(isinstance(r, (Region, RemoteRegion)) for r in self.regions):
            handles = [r.remote() if isinstance(r, Region) else r for r in self.regions]
            out["handles"] = [h.to_bytes().hex() for h in handles]
        else:
            spans = [None if isinstance(r, (Region, RemoteRegion, _Unbound)) else _span(r, "a region")
                     for r in self.regions]
            if spans and all(s is not None for s in spans):
                out["addrs"] = [s.addr for s in spans if s is not None]
        return json.dumps(out, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(
        cls, data: Union[bytes, str], regions: Optional[Sequence[RegionLike]] = None
    ) -> "RankLayout":
        """A layout from :meth:`to_bytes` (or a Rust ``RankLayout``'s JSON).
        Its regions are the handles (or addresses, as :class:`MemorySpan`)
        it carries, or ``regions`` (in its order) when given."""
        try:
            outer = json.loads(data)
        except ValueError as error:
            raise MetadataError(f"not a rank layout: {error}") from None
        if not isinstance(outer, dict):
            raise MetadataError("not a rank layout: not a JSON object")
        inner = outer.get("rank_layout", outer)
        # Read by Rust and written back: a layout both read the same way.
        layout = json.loads(_ferry.rank_layout_json(json.dumps(inner)))
        lens = [int(n) for n in layout["region_lens"]]
        bound: List[RegionLike]
        if regions is not None:
            bound = list(regions)
        elif "handles" in outer:
            bound = [RemoteRegion.from_bytes(bytes.fromhex(h)) for h in outer["handles"]]
        elif "addrs" in outer:
            bound = [MemorySpan(int(a), n) for a, n in zip(outer["addrs"], lens)]
        else:
            bound = [_Unbound(i, n) for i, n in enumerate(lens)]
        if len(bound) != len(lens):
            raise MetadataError(
                f"rank {layout['rank']}'s layout names {len(lens)} regions; {len(bound)} came with it"
            )
        tensors = [TensorLayout._from_json(t, bound) for t in layout["tensors"]]
        made = cls.__new__(cls)
        made.rank = int(layout["rank"])
        made.tensors = tensors
        made.regions = bound
        return made

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankLayout) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.tensors)
        return f"<ferry.RankLayout rank {self.rank}: {names} over {len(self.regions)} regions>"
