"""The weight set of the weight publication tests, and its reference.

Two tensors: ``w`` (``ROWS`` x ``COLS``), split by rows over the publisher
ranks, and ``b`` (``COLS``), which every publisher rank holds whole
(replicated). Subscribers split both by columns (or hold them whole), and
keep ``w`` column-major: another sharding and other strides than the
publishers'.

Element ``i`` (a global index: ``w`` row-major, then ``b``) of version
``v`` is ``v << 20 | i``: every element differs within a version, and a
buffer's first element says which version the whole buffer must hold, so
one comparison tells a right buffer from a mix of versions or misplaced
bytes.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import numpy.typing as npt

import ferry

ROWS, COLS = 64, 96
U32 = npt.NDArray[np.uint32]


def values(version: int) -> U32:
    """Every element of ``version``: ``w`` row-major, then ``b``."""
    index = np.arange(ROWS * COLS + COLS, dtype=np.uint32)
    return (np.uint32(version) << np.uint32(20)) | index


def expected_w(version: int) -> U32:
    return values(version)[: ROWS * COLS].reshape(ROWS, COLS)


def expected_b(version: int) -> U32:
    return values(version)[ROWS * COLS :]


class PublisherRank:
    """Rank ``rank`` of ``ranks`` (rows split): its rows of ``w`` and all of
    ``b``, in one registered buffer."""

    def __init__(self, node: ferry.Node, rank: int, ranks: int) -> None:
        self.rank, self.ranks = rank, ranks
        rows = ROWS // ranks
        self.rows = slice(rank * rows, (rank + 1) * rows)
        self.buf: U32 = np.zeros(rows * COLS + COLS, dtype=np.uint32)
        self.w = self.buf[: rows * COLS].reshape(rows, COLS)
        self.b = self.buf[rows * COLS :]
        region = node.register(self.buf)
        self.layout = ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                "w", self.w, region, axes=("row", "col"), parts={"row": (rank, ranks)}
            ),
            ferry.TensorLayout.from_array("b", self.b, region, axes=("col",), replicated=True),
        ])

    def fill(self, version: int) -> None:
        self.w[:] = expected_w(version)[self.rows]
        self.b[:] = expected_b(version)


class SubscriberBuffer:
    """One buffer of subscriber rank ``rank`` of ``parts`` (columns split):
    its columns of ``w``, stored column-major, and of ``b``."""

    def __init__(self, node: ferry.Node, rank: int, parts: int) -> None:
        cols = COLS // parts
        self.cols = slice(rank * cols, (rank + 1) * cols)
        self.w_t: U32 = np.zeros((cols, ROWS), dtype=np.uint32)  # [col, row]
        self.b: U32 = np.zeros(cols, dtype=np.uint32)
        self.layout = ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                "w", self.w_t.T, node.register(self.w_t), axes=("row", "col"),
                parts={"col": (rank, parts)},
            ),
            ferry.TensorLayout.from_array(
                "b", self.b, node.register(self.b), axes=("col",), parts={"col": (rank, parts)}
            ),
        ])

    def holds(self, version: int) -> bool:
        return bool(
            np.array_equal(self.w_t.T, expected_w(version)[:, self.cols])
            and np.array_equal(self.b, expected_b(version)[self.cols])
        )

    def held(self) -> Optional[int]:
        """The version the buffer holds whole; None for anything else (a
        mix, bytes out of place, zeros)."""
        version = int(self.w_t[0, 0]) >> 20
        return version if version and self.holds(version) else None


def subscriber_buffers(node: ferry.Node, rank: int, parts: int, count: int) -> List[SubscriberBuffer]:
    return [SubscriberBuffer(node, rank, parts) for _ in range(count)]


def layouts(buffers: List[SubscriberBuffer]) -> List[Any]:
    return [b.layout for b in buffers]
