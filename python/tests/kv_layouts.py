"""Paged KV caches for the layout tests, and their reference: what every
pool must hold, computed with numpy alone (fancy indexing through the block
tables), never with ferry's planner.

A cache is vLLM's: per rank a pool ``(2, layers, blocks, block, heads,
dim)`` (NHD) or ``(2, layers, blocks, heads, block, dim)`` (HND), K and V
first, its heads the rank's tensor-parallel share. The logical tensor is
``[2, layers, tokens, heads, dim]`` of values that differ per element and
per seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

import ferry

Pool = npt.NDArray[Any]
#: A block table: the physical block of each logical one (``table()``'s
#: int64 arrays, or plain ints).
BlockTable = Union[npt.NDArray[np.int64], Sequence[int]]


@dataclass(frozen=True)
class Model:
    """What both sides agree on."""

    layers: int = 2
    heads: int = 8
    dim: int = 4
    #: The token axis's logical size: the longest sequence a request names.
    tokens: int = 512
    dtype: str = "uint32"


@dataclass(frozen=True)
class Side:
    """One side's engine configuration."""

    tp: int
    block: int
    blocks: int
    order: str = "NHD"  # or "HND"
    #: "pool": one array for all layers; "per_layer": an array (and a
    #: region) per layer, as vLLM registers them.
    layers: str = "pool"


def heads_of(model: Model, side: Side, rank: int) -> range:
    """The global heads ``rank`` holds (replicated when tp > heads)."""
    if model.heads % side.tp == 0:
        share = model.heads // side.tp
        return range(rank * share, (rank + 1) * share)
    per_head = side.tp // model.heads
    head = rank // per_head
    return range(head, head + 1)


def logical(model: Model, seed: int) -> Pool:
    """The logical K and V: ``[2, layers, tokens, heads, dim]``, every
    element its own value."""
    shape = (2, model.layers, model.tokens, model.heads, model.dim)
    count = int(np.prod(shape))
    values = np.arange(count, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 7919 + 1)
    values ^= values >> np.uint64(29)
    out = values.astype(model.dtype).reshape(shape)
    if model.dtype == "uint32":  # distinct for sure: the index in the low bits
        out = (np.arange(count, dtype=np.uint32) + np.uint32(seed << 24)).reshape(shape)
    return out


def pool_shape(model: Model, side: Side, rank: int) -> Tuple[int, ...]:
    h = len(heads_of(model, side, rank))
    if side.order == "NHD":
        return (2, model.layers, side.blocks, side.block, h, model.dim)
    return (2, model.layers, side.blocks, h, side.block, model.dim)


def nhd(side: Side, pool: Pool) -> Pool:
    """The pool viewed as ``(2, layers, blocks, block, heads, dim)``."""
    return pool if side.order == "NHD" else pool.swapaxes(3, 4)


def axes(side: Side) -> Tuple[str, ...]:
    """The names of a K (or V) array's dimensions."""
    inner = ("token", "head") if side.order == "NHD" else ("head", "token")
    return ("layer", "block", *inner, "dim")


def scatter(model: Model, side: Side, rank: int, pool: Pool, kv: Pool, table: BlockTable, tokens: int) -> None:
    """Writes tokens ``0..tokens`` of the logical ``kv`` (this rank's heads)
    into ``pool`` through ``table``, with numpy fancy indexing."""
    t = np.arange(tokens)
    blocks = np.asarray(table, dtype=np.int64)[t // side.block]
    heads = heads_of(model, side, rank)
    nhd(side, pool)[:, :, blocks, t % side.block] = kv[:, :, :tokens, heads.start : heads.stop]


def expected(model: Model, side: Side, rank: int, kv: Pool, table: BlockTable, tokens: int) -> Pool:
    """What ``rank``'s pool must hold once tokens ``0..tokens`` arrived
    through ``table`` into a zeroed pool: those, and zeros elsewhere."""
    pool = np.zeros(pool_shape(model, side, rank), dtype=model.dtype)
    scatter(model, side, rank, pool, kv, table, tokens)
    return pool


def layout(
    model: Model,
    side: Side,
    rank: int,
    pool: Union[Pool, Sequence[Pool]],
    regions: Any,
    order: Optional[Sequence[str]] = None,
) -> ferry.RankLayout:
    """``rank``'s layout over ``pool``: ``regions`` is its region (one
    pool) or the list of per-layer regions (``pool`` then being the list of
    per-layer arrays ``(2, blocks, ...)``)."""
    common = dict(
        axes=axes(side),
        paged=("token", "block"),
        table="kv",
        global_sizes={"token": model.tokens, "head": model.heads},
        parts={"head": (rank, side.tp)},
        order=order,
    )
    tensors = []
    for which, name in enumerate(("k", "v")):
        if side.layers == "per_layer":
            arrays: Any = [layer[which] for layer in pool]
        else:
            arrays = pool[which]
        tensors.append(ferry.TensorLayout.from_array(name, arrays, regions, **common))  # type: ignore[arg-type]
    return ferry.RankLayout(rank, tensors)


def per_layer(model: Model, side: Side, rank: int, pool: Pool) -> List[Pool]:
    """vLLM's per-layer arrays ``(2, blocks, ...)``, copies of ``pool``'s
    layers (each to be registered on its own)."""
    return [np.ascontiguousarray(pool[:, layer]) for layer in range(model.layers)]


def table(count: int, pool: int, seed: int) -> npt.NDArray[np.int64]:
    """``count`` distinct physical blocks of a pool of ``pool``, shuffled."""
    rng = np.random.default_rng(seed)
    return rng.permutation(pool)[:count].astype(np.int64)
