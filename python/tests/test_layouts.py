"""Layouts and plans from Python: KV caches declared from numpy arrays,
handed between sides of other tensor-parallel degrees, block sizes and
axis orders, each byte checked against a reference numpy computes on its
own (``kv_layouts``: the logical tensor scattered through each side's block
tables with fancy indexing), never against the planner. Every pool is
compared whole: the bytes that must arrive did, and nothing else changed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest

import ferry
from conftest import EXIT_DEADLINE, START_DEADLINE, TESTS, env_for, read_line
from kv_layouts import Model, Side, expected, heads_of, layout, logical, per_layer, pool_shape, scatter, table

TIMEOUT = 30.0
#: Tokens a request moves: a whole number of neither side's blocks.
TOKENS = 200


@dataclass
class Rank:
    """One rank: its node, pool (or per-layer arrays), regions, layout."""

    node: ferry.Node
    pool: Any
    regions: List[ferry.Region]
    layout: ferry.RankLayout

    def stacked(self) -> Any:
        """The pool as one ``(2, layers, ...)`` array."""
        if isinstance(self.pool, list):
            return np.stack(self.pool, axis=1)
        return self.pool


@dataclass
class Cluster:
    """Both sides' ranks, each on a node of its own, in this process."""

    nodes: List[ferry.Node] = field(default_factory=list)

    def side(self, model: Model, side: Side, fill: Optional[Tuple[Any, Any]] = None) -> List[Rank]:
        """``side.tp`` ranks with zeroed pools, or, with ``fill`` = (logical
        kv, block table), the first ``TOKENS`` tokens written in."""
        ranks = []
        for r in range(side.tp):
            node = ferry.Node()
            self.nodes.append(node)
            pool = np.zeros(pool_shape(model, side, r), dtype=model.dtype)
            if fill is not None:
                scatter(model, side, r, pool, fill[0], fill[1], TOKENS)
            if side.layers == "per_layer":
                arrays = per_layer(model, side, r, pool)
                regions = [node.register(a) for a in arrays]
                ranks.append(Rank(node, arrays, regions, layout(model, side, r, arrays, regions)))
            else:
                region = node.register(pool)
                ranks.append(Rank(node, pool, [region], layout(model, side, r, pool, region)))
        return ranks

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    transport = getattr(request, "param", "memory")
    if transport == "tcp":
        monkeypatch.setenv("FERRY_DISABLE_MEMORY", "1")
    else:
        monkeypatch.delenv("FERRY_DISABLE_MEMORY", raising=False)
    made = Cluster()
    try:
        yield made
    finally:
        made.close()


def wire(ranks: Sequence[Rank]) -> List[ferry.RankLayout]:
    """The ranks' layouts as a peer process gets them: through bytes."""
    return [ferry.RankLayout.from_bytes(r.layout.to_bytes()) for r in ranks]


def notifications(node: ferry.Node, count: int) -> List[bytes]:
    got: List[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    while len(got) < count and time.monotonic() < deadline:
        d = node.next_notification(timeout=max(0.0, deadline - time.monotonic()))
        if d is not None:
            got.append(d.body)
    time.sleep(0.05)
    got.extend(d.body for d in node.notifications())
    return got


def handoff(
    cluster: Cluster,
    model: Model,
    prefill_side: Side,
    decode_side: Side,
    direction: str = "pull",
    seed: int = 1,
) -> Dict[str, Any]:
    """Prefill ranks hold ``TOKENS`` tokens of a request; every decode rank
    pulls its share (or every prefill rank pushes its own); then every
    decode pool is compared whole with the reference, and every source rank
    must have been notified once per request that moved its bytes."""
    kv = logical(model, seed)
    prefill_table = table(-(-TOKENS // prefill_side.block), prefill_side.blocks, seed)
    decode_table = table(-(-TOKENS // decode_side.block), decode_side.blocks, seed + 1)
    prefill = cluster.side(model, prefill_side, fill=(kv, prefill_table))
    decode = cluster.side(model, decode_side)
    stats: Dict[str, Any] = {"descriptors": [], "ranks": []}
    notified: Dict[int, int] = {}
    if direction == "pull":
        peers = wire(prefill)
        for d in decode:
            plan = d.node.plan_transfer(d.layout, peers, direction="pull", timeout=TIMEOUT)
            assert plan.tables == ["kv"] and plan.direction == "pull"
            stats["ranks"].append(plan.remote_ranks)
            stats["descriptors"].append(plan.descriptor_count(TOKENS, decode_table, prefill_table))
            xfer = plan.request(TOKENS, decode_table, prefill_table, notification=b"req-1")
            xfer.post(timeout=TIMEOUT)
            assert xfer.wait() is True
            assert xfer.status() is ferry.XferStatus.DONE
            for r in plan.remote_ranks:
                notified[r] = notified.get(r, 0) + 1
        for r, p in enumerate(prefill):
            assert notifications(p.node, notified.get(r, 0)) == [b"req-1"] * notified.get(r, 0)
    else:
        peers = wire(decode)
        for p in prefill:
            plan = p.node.plan_transfer(p.layout, peers, direction="push", timeout=TIMEOUT)
            assert plan.direction == "push"
            stats["ranks"].append(plan.remote_ranks)
            stats["descriptors"].append(plan.descriptor_count(TOKENS, prefill_table, decode_table))
            xfer = plan.request(tables={"kv": (range(TOKENS), prefill_table, decode_table)})
            xfer.post(timeout=TIMEOUT)
            xfer.wait()
            for r in plan.remote_ranks:
                notified[r] = notified.get(r, 0) + 1
    for r, d in enumerate(decode):
        want = expected(model, decode_side, r, kv, decode_table, TOKENS)
        got = d.stacked()
        if not np.array_equal(got, want):
            wrong = np.argwhere(got != want)
            raise AssertionError(
                f"decode rank {r}: {len(wrong)} elements differ, the first at {tuple(wrong[0])}"
            )
    # The prefill pools are untouched (a pull reads; a push reads its own).
    for r, p in enumerate(prefill):
        assert np.array_equal(p.stacked(), expected(model, prefill_side, r, kv, prefill_table, TOKENS))
    return stats


# -- the cases ------------------------------------------------------------------

M = Model()
CASES = {
    "same layout, TP 1": (M, Side(1, 16, 32), Side(1, 16, 32)),
    "TP 1 -> 2, blocks 16 -> 32": (M, Side(1, 16, 32), Side(2, 32, 20)),
    "TP 2 -> 1, blocks 32 -> 16": (M, Side(2, 32, 20), Side(1, 16, 32)),
    "TP 4 -> 2, blocks 16 -> 32": (M, Side(4, 16, 64), Side(2, 32, 40)),
    "TP 4 -> 2, blocks 32 -> 16": (M, Side(4, 32, 40), Side(2, 16, 64)),
    "NHD -> HND, TP 2 -> 2": (M, Side(2, 16, 32, "NHD"), Side(2, 32, 16, "HND")),
    "HND -> NHD, TP 4 -> 2": (M, Side(4, 16, 32, "HND"), Side(2, 16, 40, "NHD")),
    "8 heads, TP 8 -> 2": (M, Side(8, 16, 32), Side(2, 32, 16, "HND")),
    "2 heads, TP 8 -> 2 (replicated)": (Model(heads=2), Side(8, 16, 32), Side(2, 32, 16)),
    "per-layer regions -> one pool, 2-byte elements": (
        Model(dtype="uint16"),
        Side(4, 16, 32, "NHD", "per_layer"),
        Side(2, 32, 16, "HND"),
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_kv_cache_is_pulled_byte_for_byte(cluster: Cluster, case: str) -> None:
    model, prefill_side, decode_side = CASES[case]
    handoff(cluster, model, prefill_side, decode_side)


@pytest.mark.parametrize("cluster", ["tcp"], indirect=True)
def test_tp4_to_tp2_over_tcp(cluster: Cluster) -> None:
    handoff(cluster, *CASES["TP 4 -> 2, blocks 16 -> 32"])


@pytest.mark.parametrize("case", ["TP 4 -> 2, blocks 16 -> 32", "2 heads, TP 8 -> 2 (replicated)"])
def test_a_kv_cache_is_pushed_byte_for_byte(cluster: Cluster, case: str) -> None:
    model, prefill_side, decode_side = CASES[case]
    handoff(cluster, model, prefill_side, decode_side, direction="push")


def test_which_ranks_a_decode_rank_reads(cluster: Cluster) -> None:
    """TP 4 -> 2: decode rank 0 reads heads 0-3 from prefill ranks 0 and 1,
    rank 1 from 2 and 3; with 2 heads over 8 prefill ranks, decode rank r
    reads head r from one replica (r % 4 of its four)."""
    stats = handoff(cluster, *CASES["TP 4 -> 2, blocks 16 -> 32"])
    assert stats["ranks"] == [[0, 1], [2, 3]]
    # HND on neither side, NHD blocks: per layer, K or V, token and source
    # rank one run of its heads; prefill's 16-token blocks merge into
    # decode's 32-token ones only within a block pair.
    assert all(n > 0 for n in stats["descriptors"])


def test_replicas_are_spread_over_readers(cluster: Cluster) -> None:
    stats = handoff(cluster, *CASES["2 heads, TP 8 -> 2 (replicated)"])
    # Decode rank 0 holds head 0 (prefill ranks 0-3), reads replica 0 % 4;
    # decode rank 1 head 1 (ranks 4-7), replica 1 % 4: rank 5.
    assert stats["ranks"] == [[0], [5]]


def test_consecutive_blocks_merge_into_few_descriptors(cluster: Cluster) -> None:
    """The same layout on both sides and consecutive block tables: a whole
    request is one run per layer and K or V."""
    model = Model()
    side = Side(2, 16, 32)
    prefill = cluster.side(model, side)
    decode = cluster.side(model, side)
    plan = decode[0].node.plan_transfer(decode[0].layout, wire(prefill))
    blocks = np.arange(16)
    assert plan.descriptor_count(256, blocks, blocks) == model.layers * 2
    assert plan.descriptor_count(256, blocks, blocks[::-1].copy()) == model.layers * 2 * 16


def test_weights_resharded_from_uneven_row_stages_to_column_splits(cluster: Cluster) -> None:
    """No paged axis: a matrix held by two pipeline stages of uneven rows
    (range parts), each with a replicated bias, pulled by three ranks that
    split its columns (and the bias whole, from one replica): every request
    moves the same bytes, and takes no tables."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32)
    trainer = []
    for rank, rows in enumerate((range(0, 3), range(3, 8))):
        node = ferry.Node()
        cluster.nodes.append(node)
        # The rows, then the bias, in one registered buffer; rows padded.
        buf = np.zeros(len(rows) * 16 + 12, dtype=np.float32)
        piece = buf[: len(rows) * 16].reshape(len(rows), 16)[:, :12]
        piece[:] = w[rows.start : rows.stop]
        buf[-12:] = bias
        region = node.register(buf)
        trainer.append(ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                "w", piece, region, axes=("out", "in"),
                parts={"out": rows}, global_sizes={"out": 8},
            ),
            ferry.TensorLayout.from_array("bias", buf[-12:], region, axes=("in",), replicated=True),
        ]))
    peers = [ferry.RankLayout.from_bytes(t.to_bytes()) for t in trainer]
    for rank in range(3):
        node = ferry.Node()
        cluster.nodes.append(node)
        mine = np.zeros((12, 8), dtype=np.float32)  # column-major: [in, out]
        mine_bias = np.zeros(12, dtype=np.float32)
        layout = ferry.RankLayout(rank, [
            ferry.TensorLayout.from_array(
                "w", mine[4 * rank : 4 * rank + 4].T, node.register(mine),
                axes=("out", "in"), parts={"in": (rank, 3)},
            ),
            ferry.TensorLayout.from_array("bias", mine_bias, node.register(mine_bias), axes=("in",)),
        ])
        plan = node.plan_transfer(layout, peers)
        assert plan.tables == [] and plan.remote_ranks == [0, 1]
        for _ in range(2):  # posted twice, the same bytes
            plan.request().post(timeout=TIMEOUT).wait()
        cols = slice(4 * rank, 4 * rank + 4)
        assert np.array_equal(mine[cols].T, w[:, cols]), rank
        assert not mine[: cols.start].any() and not mine[cols.stop :].any()
        assert np.array_equal(mine_bias, bias)


# -- layouts: declaring, serializing --------------------------------------------


def test_from_array_reads_offset_and_strides(cluster: Cluster) -> None:
    node = ferry.Node()
    cluster.nodes.append(node)
    pool = np.zeros((2, 3, 10, 4, 2, 8), dtype=np.float16)  # kv, layer, block, head, token, dim
    region = node.register(pool)
    v = ferry.TensorLayout.from_array(
        "v", pool[1], region,
        axes=("layer", "block", "head", "token", "dim"),
        paged=("token", "block"),
        global_sizes={"token": 100, "head": 8},
        parts={"head": (1, 2)},
    )
    assert v.elem_size == 2
    assert v.axes == (("dim", 8), ("head", 8), ("layer", 3), ("token", 100))  # sorted
    assert v.parts == (("full",), ("split", 2, 1), ("full",), ("full",))
    assert v.offset == pool[1].ctypes.data - pool.ctypes.data == pool.nbytes // 2
    assert v.strides == (2, 2 * 8 * 2, 10 * 4 * 2 * 8 * 2, 8 * 2)
    assert v.paged == ferry.Paged("token", block=2, block_stride=4 * 2 * 8 * 2, blocks=10, table="token")
    assert v.region is region and not v.replicated
    layout = ferry.RankLayout(1, [v])
    assert layout.regions == [region]
    data = json.loads(layout.to_json())
    assert data["region_lens"] == [pool.nbytes]
    assert data["tensors"][0]["parts"][1] == {"Split": {"parts": 2, "index": 1}}
    assert data["tensors"][0]["paged"]["axis"] == 3


def test_layouts_travel_as_bytes_with_their_handles(cluster: Cluster) -> None:
    model, side = Model(), Side(2, 16, 32, "HND", "per_layer")
    ranks = cluster.side(model, side)
    layout = ranks[1].layout
    blob = layout.to_bytes()
    back = ferry.RankLayout.from_bytes(blob)
    assert back == layout and back.to_json() == layout.to_json()
    assert back.regions == [r.remote() for r in ranks[1].regions]
    assert all(isinstance(r, ferry.RemoteRegion) for r in back.regions)
    assert back.tensor("k") is not None and back.tensor("k").region_map is not None  # type: ignore[union-attr]
    # The JSON is the Rust type's serde form, field for field.
    assert ferry._ferry.rank_layout_json(layout.to_json()) == layout.to_json()
    # A bare layout (a Rust program's RankLayout JSON) takes its handles.
    bare = ferry.RankLayout.from_bytes(layout.to_json().encode(), regions=back.regions)
    assert bare == layout and bare.regions == back.regions


def test_a_torch_like_tensor_is_an_array(cluster: Cluster) -> None:
    """What a torch tensor offers (data_ptr, stride in elements,
    element_size, shape) is enough: torch itself is never imported."""

    class Tensor:  # torch.Tensor's calls, over a numpy array
        def __init__(self, a: Any) -> None:
            self.a, self.shape = a, a.shape

        def data_ptr(self) -> int:
            return int(self.a.ctypes.data)

        def stride(self) -> Tuple[int, ...]:
            return tuple(s // self.a.itemsize for s in self.a.strides)

        def element_size(self) -> int:
            return int(self.a.itemsize)

    pool = np.zeros((2, 8, 16, 4, 8), dtype=np.float16)
    node = ferry.Node()
    cluster.nodes.append(node)
    region = node.register(pool)
    args: Dict[str, Any] = dict(
        axes=("layer", "block", "token", "head", "dim"), paged=("token", "block"),
        global_sizes={"token": 64},
    )
    t = ferry.TensorLayout.from_array("k", Tensor(pool), Tensor(pool), **args)
    n = ferry.TensorLayout.from_array("k", pool, region, **args)
    assert ferry.RankLayout(0, [t]).to_json() == ferry.RankLayout(0, [n]).to_json()


try:
    import torch  # type: ignore[import-not-found]  # noqa: F401
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None, reason="torch is not installed (the layouts never need it)")
def test_a_torch_tensor_is_an_array(cluster: Cluster) -> None:
    pool = torch.zeros((2, 8, 16, 4, 8), dtype=torch.float16)
    args: Dict[str, Any] = dict(
        axes=("layer", "block", "token", "head", "dim"), paged=("token", "block"),
        global_sizes={"token": 64},
    )
    t = ferry.TensorLayout.from_array("k", pool, pool, **args)
    n = ferry.TensorLayout.from_array("k", pool.numpy(), pool.numpy(), **args)
    assert ferry.RankLayout(0, [t]).to_json() == ferry.RankLayout(0, [n]).to_json()


# -- bad input ------------------------------------------------------------------


def test_a_rank_missing_is_refused_naming_the_element(cluster: Cluster) -> None:
    model = Model()
    prefill = cluster.side(model, Side(4, 16, 32))
    decode = cluster.side(model, Side(2, 32, 16))
    peers = wire(prefill)
    del peers[1]  # heads 2-3 are nobody's
    with pytest.raises(ferry.LayoutError, match=r"no remote rank holds element \[\d+, 2, 0, 0\]") as error:
        decode[0].node.plan_transfer(decode[0].layout, peers)
    assert isinstance(error.value, ValueError) and isinstance(error.value, ferry.InvalidArgument)
    # The remote side is checked whole, even by a rank that needs no byte
    # of the missing one: a side with a hole is a bug on that side.
    with pytest.raises(ferry.LayoutError, match="no remote rank holds"):
        decode[1].node.plan_transfer(decode[1].layout, peers)
    assert decode[1].node.plan_transfer(decode[1].layout, wire(prefill)).remote_ranks == [2, 3]


def test_bad_block_tables_are_refused_and_move_nothing(cluster: Cluster) -> None:
    model = Model()
    kv = logical(model, 3)
    prefill_table = table(13, 32, 3)
    prefill = cluster.side(model, Side(2, 16, 32), fill=(kv, prefill_table))
    decode = cluster.side(model, Side(1, 32, 16))
    plan = decode[0].node.plan_transfer(decode[0].layout, wire(prefill))
    mine = table(7, 16, 4)
    out_of_pool = mine.copy()
    out_of_pool[5] = 16
    with pytest.raises(ferry.BlockTableError, match="local block table position 5 names block 16 of a pool of 16"):
        plan.request(TOKENS, out_of_pool, prefill_table)
    bad_remote = prefill_table.copy()
    bad_remote[12] = 1000
    with pytest.raises(ferry.BlockTableError, match="remote block table position 12 names block 1000 of a pool of 32"):
        plan.request(TOKENS, mine, bad_remote)
    with pytest.raises(ferry.BlockTableError, match="remote block table has 12 entries, the range needs 13"):
        plan.request(TOKENS, mine, prefill_table[:12])
    with pytest.raises(ferry.BlockTableError, match="leaves the paged axis of 512"):
        plan.request((500, 520), mine, prefill_table)
    with pytest.raises(ferry.BlockTableError, match='table "kvv" is not used'):
        plan.request(tables={"kv": (TOKENS, mine, prefill_table), "kvv": (1, [0], [0])})
    with pytest.raises(ferry.InvalidRange, match="negative block id"):
        plan.request(TOKENS, mine - 10, prefill_table)
    with pytest.raises(ferry.InvalidArgument, match="not integers"):
        plan.request(TOKENS, mine.astype(np.float32), prefill_table)
    assert not decode[0].stacked().any(), "a refused request moved bytes"
    # And the good one moves them.
    plan.request(TOKENS, mine, prefill_table).post(timeout=TIMEOUT).wait()
    assert np.array_equal(decode[0].stacked(), expected(model, Side(1, 32, 16), 0, kv, mine, TOKENS))


def test_layouts_that_do_not_match_are_refused(cluster: Cluster) -> None:
    prefill = cluster.side(Model(dim=4), Side(2, 16, 32))
    decode = cluster.side(Model(dim=8), Side(1, 16, 32))
    with pytest.raises(ferry.LayoutError, match=r'tensor "[kv]": rank 0 and rank 0 disagree on its axes'):
        decode[0].node.plan_transfer(decode[0].layout, wire(prefill))
    # A token axis of another length is another tensor too.
    other = cluster.side(Model(dim=4, tokens=1024), Side(1, 16, 64))
    with pytest.raises(ferry.LayoutError, match="disagree on its axes"):
        other[0].node.plan_transfer(other[0].layout, wire(prefill))
    # A pushed plan needs the peers' handles, and local memory a node registered.
    with pytest.raises(ferry.InvalidArgument, match="not a ferry Region"):
        pool = np.zeros(pool_shape(Model(), Side(1, 16, 32), 0), dtype=np.uint32)
        unregistered = layout(Model(), Side(1, 16, 32), 0, pool, pool)
        prefill[0].node.plan_transfer(unregistered, wire(decode))
    with pytest.raises(ferry.LayoutError, match="rank 0 is given twice"):
        decode[0].node.plan_transfer(decode[0].layout, wire(prefill[:1]) * 2)


def test_from_array_refuses_what_it_cannot_mean() -> None:
    pool = np.zeros((4, 16, 2, 8), dtype=np.uint16)  # block, token, head, dim
    other = np.zeros(16, dtype=np.uint8)
    kw: Dict[str, Any] = dict(axes=("block", "token", "head", "dim"), paged=("token", "block"))
    with pytest.raises(ferry.LayoutError, match=r"give global_sizes=\{'token': N\}"):
        ferry.TensorLayout.from_array("k", pool, pool, **kw)
    kw["global_sizes"] = {"token": 64}
    with pytest.raises(ferry.LayoutError, match="is not inside its region"):
        ferry.TensorLayout.from_array("k", pool, other, **kw)
    with pytest.raises(ferry.LayoutError, match="3 axis names"):
        ferry.TensorLayout.from_array("k", pool, pool, **{**kw, "axes": ("block", "token", "head")})
    # Two heads here are rank 1's of 2: the global size is 4.
    ferry.TensorLayout.from_array("k", pool, pool, **kw, parts={"head": (1, 2)})
    with pytest.raises(ferry.LayoutError, match="rank 1 of 2 holds 4 of 'head'"):
        ferry.TensorLayout.from_array(
            "k", pool, pool, axes=kw["axes"], paged=kw["paged"],
            global_sizes={"token": 64, "head": 8}, parts={"head": (1, 2)},
        )
    with pytest.raises(ferry.LayoutError, match="axis 'head' of 3 cannot be shared by 2"):
        ferry.TensorLayout.from_array(
            "k", pool, pool, axes=kw["axes"], paged=kw["paged"],
            global_sizes={"token": 64, "head": 3}, parts={"head": (1, 2)},
        )
    with pytest.raises(ferry.LayoutError, match="'layer' is not one of its logical axes"):
        ferry.TensorLayout.from_array("k", pool, pool, **kw, parts={"layer": (0, 2)})
    with pytest.raises(ferry.LayoutError, match="not an order of its logical axes"):
        ferry.TensorLayout.from_array("k", pool, pool, **kw, order=("token", "head"))
    with pytest.raises(ferry.InvalidArgument, match="not an array"):
        ferry.TensorLayout.from_array("k", [[1, 2]], [pool], **kw)  # a list of lists
    with pytest.raises(ferry.MetadataError):
        ferry.RankLayout.from_bytes(b"{not json")
    with pytest.raises(ferry.MetadataError, match="not a rank layout"):
        ferry.RankLayout.from_bytes(b'{"rank": 0, "region_lens": "many"}')


# -- processes --------------------------------------------------------------------


class LayoutPeer:
    """``layout_peer.py``: ranks of one side in another process."""

    def __init__(self, tmp_path: Any, spec: Dict[str, Any], transport: str = "memory") -> None:
        import subprocess
        import sys

        self.log = tmp_path / "layout-peer.stderr"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "layout_peer.py"), json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=env_for(transport), cwd=str(TESTS),
            )
        self.first = self.read()

    def read(self) -> Dict[str, Any]:
        try:
            line = read_line(self.proc, time.monotonic() + START_DEADLINE, "layout_peer.py")
        except AssertionError as error:
            raise AssertionError(f"{error}\nstderr:\n{self.log.read_text(errors='replace')}") from None
        answer: Dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=EXIT_DEADLINE)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(timeout=EXIT_DEADLINE)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_decode_pulls_from_prefill_ranks_in_another_process(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Prefill TP 4 (blocks of 16, NHD) in a peer process, decode TP 2
    (blocks of 32, HND) here: only the layouts' bytes cross."""
    if transport == "tcp":
        monkeypatch.setenv("FERRY_DISABLE_MEMORY", "1")
    else:
        monkeypatch.delenv("FERRY_DISABLE_MEMORY", raising=False)
    model = Model()
    prefill_side, decode_side = Side(4, 16, 64), Side(2, 32, 40, "HND")
    seed = 11
    prefill_table = table(-(-TOKENS // 16), 64, seed)
    peer = LayoutPeer(tmp_path, {
        "model": vars(model), "side": vars(prefill_side), "role": "prefill",
        "seed": seed, "tokens": TOKENS, "table": prefill_table.tolist(),
    }, transport)
    cluster = Cluster()
    try:
        peers = [ferry.RankLayout.from_bytes(bytes.fromhex(h)) for h in peer.first["layouts"]]
        decode = cluster.side(model, decode_side)
        decode_table = table(-(-TOKENS // 32), 40, seed + 1)
        for d in decode:
            plan = d.node.plan_transfer(d.layout, peers, timeout=TIMEOUT)
            plan.request(TOKENS, decode_table, prefill_table, notification=b"done").post(timeout=TIMEOUT).wait()
        kv = logical(model, seed)
        for r, d in enumerate(decode):
            assert np.array_equal(d.stacked(), expected(model, decode_side, r, kv, decode_table, TOKENS)), r
        assert peer.ask(op="notifications", count=4)["got"] == [["done"]] * 4
    finally:
        cluster.close()
        peer.close()


def test_prefill_pushes_into_decode_ranks_in_another_process(tmp_path: Any) -> None:
    """Decode TP 2 (per-layer regions, HND) in a peer process, prefill TP 4
    here pushing: the peer checks its pools against its own reference."""
    model = Model()
    prefill_side, decode_side = Side(4, 32, 20), Side(2, 16, 40, "HND", "per_layer")
    seed = 12
    decode_table = table(-(-TOKENS // 16), 40, seed + 1)
    peer = LayoutPeer(tmp_path, {
        "model": vars(model), "side": vars(decode_side), "role": "decode",
        "seed": seed, "tokens": TOKENS, "table": decode_table.tolist(),
    })
    cluster = Cluster()
    try:
        peers = [ferry.RankLayout.from_bytes(bytes.fromhex(h)) for h in peer.first["layouts"]]
        prefill_table = table(-(-TOKENS // 32), 20, seed)
        prefill = cluster.side(model, prefill_side, fill=(logical(model, seed), prefill_table))
        layouts = [p.layout for p in prefill]
        for p in prefill:
            plan = p.node.plan_transfer(p.layout, peers, direction="push", local_peers=layouts)
            plan.request(TOKENS, prefill_table, decode_table).post(timeout=TIMEOUT).wait()
        assert peer.ask(op="check") == {"equal": [True, True]}
    finally:
        cluster.close()
        peer.close()


# -- NIXL's shape ------------------------------------------------------------------


def nixl_copy(rows_to: Any, rows_from: Any, to_idx: Any, from_idx: Any) -> None:
    """What a NIXL backend does with a prepared request: row ``to_idx[k]``
    of one list gets the bytes of row ``from_idx[k]`` of the other (here,
    one process's memory: memmove)."""
    import ctypes

    assert len(to_idx) == len(from_idx)
    for a, b in zip(to_idx, from_idx):
        dst, src = rows_to[a], rows_from[b]
        assert dst[1] == src[1], "rows of one pair differ in length"
        ctypes.memmove(int(dst[0]), int(src[0]), int(dst[1]))


@pytest.mark.parametrize(
    "case", ["TP 4 -> 2, blocks 16 -> 32", "NHD -> HND, TP 2 -> 2", "2 heads, TP 8 -> 2 (replicated)"]
)
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_nixl_lists_and_indices_move_the_bytes(case: str, direction: str) -> None:
    """nixl_plan's (addr, len, dev) lists and index arrays, applied as a
    NIXL backend applies them (memmove between the rows of each pair),
    leave every decode pool as the reference says. No node: the layouts'
    memory is plain numpy arrays, their addresses carried by to_bytes."""
    model, prefill_side, decode_side = CASES[case]
    kv = logical(model, 21)
    tokens = 208  # a multiple of both sides' blocks' greatest common divisor
    prefill_table = table(-(-tokens // prefill_side.block), prefill_side.blocks, 21)
    decode_table = table(-(-tokens // decode_side.block), decode_side.blocks, 22)

    def side(s: Side, fill: bool, rank_table: Any) -> List[Tuple[Any, ferry.RankLayout]]:
        out = []
        for r in range(s.tp):
            pool = np.zeros(pool_shape(model, s, r), dtype=model.dtype)
            if fill:
                scatter(model, s, r, pool, kv, rank_table, tokens)
            out.append((pool, layout(model, s, r, pool, pool)))
        return out

    prefill = side(prefill_side, True, prefill_table)
    decode = side(decode_side, False, decode_table)
    if direction == "pull":
        for pool, mine in decode:
            peers = [ferry.RankLayout.from_bytes(l.to_bytes()) for _, l in prefill]
            assert all(isinstance(r, ferry.MemorySpan) for p in peers for r in p.regions)
            nx = ferry.nixl_plan(mine, peers)
            assert nx.operation == "READ"
            local = nx.local_descs()
            for rank, (li, ri) in nx.indices(tokens, decode_table, prefill_table).items():
                assert li.dtype == np.int32 and ri.dtype == np.int32
                nixl_copy(local, nx.remote_descs(rank), li, ri)
    else:
        for pool, mine in prefill:
            peers = [ferry.RankLayout.from_bytes(l.to_bytes()) for _, l in decode]
            nx = ferry.nixl_plan(mine, peers, direction="push", local_peers=[l for _, l in prefill])
            assert nx.operation == "WRITE"
            local = nx.local_descs()
            for rank, (li, ri) in nx.indices(tokens, prefill_table, decode_table).items():
                nixl_copy(nx.remote_descs(rank), local, ri, li)
    for r, (pool, _) in enumerate(decode):
        assert np.array_equal(pool, expected(model, decode_side, r, kv, decode_table, tokens)), r


def test_nixl_plan_refusals() -> None:
    model = Model()
    pools = [np.zeros(pool_shape(model, Side(2, 16, 32), r), dtype=model.dtype) for r in range(2)]
    prefill = [layout(model, Side(2, 16, 32), r, pools[r], pools[r]) for r in range(2)]
    pool = np.zeros(pool_shape(model, Side(1, 32, 16), 0), dtype=model.dtype)
    mine = layout(model, Side(1, 32, 16), 0, pool, pool)
    with pytest.raises(ferry.LayoutError, match="no remote rank holds"):
        ferry.nixl_plan(mine, prefill[:1])
    nx = ferry.nixl_plan(mine, prefill)
    # Rows are sub-blocks of 16 tokens: a range must start and end on one.
    with pytest.raises(ferry.BlockTableError, match="not aligned to 16"):
        nx.indices(200, list(range(7)), list(range(13)))
    with pytest.raises(ferry.BlockTableError, match="names block 99 of a pool of 32"):
        nx.indices(32, [0], [1, 99])
    with pytest.raises(ferry.InvalidArgument, match="rank 5 is not among"):
        nx.remote_descs(5)
    # A peer whose layout came without addresses needs them given.
    bare = ferry.RankLayout.from_bytes(prefill[0].to_json().encode())
    with pytest.raises(ferry.InvalidArgument, match="pass bases="):
        ferry.nixl_plan(mine, [bare, prefill[1]]).remote_descs(0)
    rows = ferry.nixl_plan(mine, [bare, prefill[1]]).remote_descs(0, bases=[pools[0].ctypes.data])
    assert np.array_equal(rows, nx.remote_descs(0))
    # The lists cover the whole pool: NHD on both sides, a source rank's 4
    # heads are a run per token (K or V, layer, block, sub-block of 16
    # tokens, token, source rank); per request, pairs follow the tables.
    assert len(nx.local_descs()) == 2 * model.layers * 16 * 2 * 16 * 2
    assert nx.descriptor_count(64, [3, 4], [0, 1, 2, 3]) <= sum(
        len(li) for li, _ in nx.indices(64, [3, 4], [0, 1, 2, 3]).values()
    )
