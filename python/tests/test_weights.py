"""Weight publication from Python: publisher ranks in processes of their
own (``weights_peer.py``) split a weight set by rows; subscribers here
split it by columns, or hold it whole, in one buffer or two. Every update's
bytes are compared whole with the reference (``weights_set``); the fence is
held by a reader that checks its buffer continuously while versions are
published and pulled; failures are typed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest

import ferry
from conftest import EXIT_DEADLINE, START_DEADLINE, TESTS, env_for, read_line
from weights_set import COLS, ROWS, PublisherRank, SubscriberBuffer, layouts, subscriber_buffers

TIMEOUT = 30.0


class PublisherProcess:
    """``weights_peer.py``: one publisher rank."""

    def __init__(self, tmp_path: Path, set_name: str, rank: int, ranks: int, transport: str) -> None:
        self.log = tmp_path / f"weights-peer-{set_name}-{rank}-{time.monotonic_ns()}.stderr"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "weights_peer.py"), set_name, str(rank), str(ranks)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=env_for(transport), cwd=str(TESTS),
            )
        first = self.read(START_DEADLINE)
        self.addr = ferry.NodeAddr.parse(first["addr"])

    def read(self, deadline: float = TIMEOUT) -> Dict[str, Any]:
        try:
            line = read_line(self.proc, time.monotonic() + deadline, "weights_peer.py")
        except AssertionError as error:
            raise AssertionError(f"{error}\nstderr:\n{self.log.read_text(errors='replace')}") from None
        answer: Dict[str, Any] = json.loads(line)
        return answer

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=EXIT_DEADLINE)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=EXIT_DEADLINE)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=EXIT_DEADLINE)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Trainer:
    """The publisher ranks of one set, each in its own process."""

    def __init__(self, tmp_path: Path, transport: str) -> None:
        self.tmp_path, self.transport = tmp_path, transport
        self.ranks: List[PublisherProcess] = []

    def start(self, set_name: str, ranks: int = 2) -> List[PublisherProcess]:
        started = [PublisherProcess(self.tmp_path, set_name, r, ranks, self.transport) for r in range(ranks)]
        self.ranks.extend(started)
        return started

    def close(self) -> None:
        for p in self.ranks:
            p.close()


@pytest.fixture
def trainer(tmp_path: Path, transport: str) -> Iterator[Trainer]:
    made = Trainer(tmp_path, transport)
    try:
        yield made
    finally:
        made.close()


def publish(ranks: List[PublisherProcess], version: int) -> None:
    for p in ranks:
        p.send(op="publish", version=version)
    for p in ranks:
        assert p.read() == {"overrun": 0}


def addrs(ranks: List[PublisherProcess]) -> List[ferry.NodeAddr]:
    return [p.addr for p in ranks]


# -- versions ----------------------------------------------------------------------


def test_each_version_arrives_resharded_byte_for_byte(node: ferry.Node, trainer: Trainer) -> None:
    """Rows split over two publisher processes; here, two subscribers that
    split the columns (two buffers each) and one that holds it whole (one
    buffer), each on a node of its own: every version, every byte, the
    whole one checking checksums against each rank's."""
    ranks = trainer.start("policy")
    publish(ranks, 1)
    nodes = [node, ferry.Node(), ferry.Node()]
    try:
        subs = []
        for n, (rank, parts, count) in zip(nodes, [(0, 2, 2), (1, 2, 2), (0, 1, 1)]):
            buffers = subscriber_buffers(n, rank, parts, count)
            subs.append((ferry.Subscriber(n, "policy", addrs(ranks), layouts(buffers)), buffers))
        for version in range(1, 5):
            if version > 1:
                publish(ranks, version)
            for k, (sub, buffers) in enumerate(subs):
                update = sub.update(timeout=TIMEOUT, verify=k == 2)
                assert update == ferry.Update(version, True, sub.active)
                assert sub.version == version
                assert buffers[update.buffer].holds(version), (version, update)
                if len(buffers) == 2:  # the other buffer holds the version before
                    other = buffers[1 - update.buffer]
                    assert other.held() == (version - 1 if version > 1 else None)
                # Already the newest: nothing moves.
                assert sub.update(timeout=TIMEOUT) == ferry.Update(version, False, update.buffer)
                with sub.read() as held:
                    assert held == update.buffer
    finally:
        for n in nodes[1:]:
            n.close()


def test_relays_carry_each_version_so_the_publishers_serve_it_once(
    node: ferry.Node, trainer: Trainer
) -> None:
    """A pulls from the publisher processes and serves on; B (the same
    column half, one buffer) and C (a quarter inside that half) pull from A
    only: every version reaches both whole, and a relay that closes fails
    its downstream typed."""
    ranks = trainer.start("relayed")
    publish(ranks, 1)
    nodes = [node, ferry.Node(), ferry.Node()]
    try:
        a_buffers = subscriber_buffers(nodes[0], 0, 2, 2)
        a = ferry.Subscriber(nodes[0], "relayed", addrs(ranks), layouts(a_buffers))
        a.serve_relay()
        downstream = []
        for n, (rank, parts, count) in zip(nodes[1:], [(0, 2, 1), (0, 4, 2)]):
            buffers = subscriber_buffers(n, rank, parts, count)
            sub = ferry.Subscriber.from_relay(n, "relayed", nodes[0].addr, layouts(buffers))
            downstream.append((sub, buffers))
        for version in range(1, 4):
            if version > 1:
                publish(ranks, version)
            assert a.update(timeout=TIMEOUT).version == version
            for sub, buffers in downstream:
                update = sub.update(timeout=TIMEOUT, at_least=version)
                assert update == ferry.Update(version, True, sub.active)
                assert buffers[update.buffer].holds(version), (version, update)
        a.close()
        with pytest.raises(ferry.PublisherLost):
            downstream[0][0].update(timeout=5.0)
        assert downstream[0][0].version == 3
    finally:
        for n in nodes[1:]:
            n.close()


def test_a_subscriber_behind_gets_the_newest_and_a_late_joiner_the_current(
    node: ferry.Node, trainer: Trainer
) -> None:
    ranks = trainer.start("behind")
    publish(ranks, 1)
    buffers = subscriber_buffers(node, 1, 2, 2)
    sub = ferry.Subscriber(node, "behind", addrs(ranks), layouts(buffers))
    assert sub.update(timeout=TIMEOUT).version == 1
    for version in (2, 5, 9):  # versions need only grow
        publish(ranks, version)
    update = sub.update(timeout=TIMEOUT)
    assert update.version == 9 and update.changed
    assert buffers[update.buffer].holds(9)
    # A subscriber that joins now gets version 9, in its own sharding.
    late_node = ferry.Node()
    try:
        late = subscriber_buffers(late_node, 0, 1, 1)
        joined = ferry.Subscriber(late_node, "behind", [str(a.endpoint) for a in addrs(ranks)], late[0].layout)
        assert joined.version is None
        assert joined.update(timeout=TIMEOUT) == ferry.Update(9, True, 0)
        assert late[0].holds(9)
    finally:
        late_node.close()


# -- the fence ---------------------------------------------------------------------


class Reader(threading.Thread):
    """Checks the subscriber's buffer continuously, holding it while it
    checks: it must always hold one version whole, never an older one
    than before."""

    def __init__(self, sub: ferry.Subscriber, buffers: List[SubscriberBuffer]) -> None:
        super().__init__(daemon=True)
        self.sub, self.buffers = sub, buffers
        self.stop = threading.Event()
        #: Set once the first check is done: the test waits for it before
        #: versions move, so that the reader sees version 1.
        self.checked = threading.Event()
        self.checks = 0
        self.seen: List[int] = []
        self.problems: List[str] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                with self.sub.read(timeout=TIMEOUT) as b:
                    version = self.buffers[b].held()
                if version is None:
                    self.problems.append(f"check {self.checks}: buffer {b} holds no one version")
                elif self.seen and version < self.seen[-1]:
                    self.problems.append(f"check {self.checks}: version {version} after {self.seen[-1]}")
                elif not self.seen or version != self.seen[-1]:
                    self.seen.append(version)
                self.checks += 1
                self.checked.set()
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.problems.append(repr(error))


@pytest.mark.parametrize("count", [1, 2], ids=["one buffer", "two buffers"])
def test_a_reader_never_sees_two_versions_mixed(node: ferry.Node, trainer: Trainer, count: int) -> None:
    """Both publisher ranks publish versions 2..LAST on their own, as fast
    as they can; here updates are pulled in a loop while a reader checks
    the buffer it holds. With one buffer the publishers' writes wait for
    the leases; with two, they overrun them at once (timeout 0), and the
    overrun updates fail typed and are retried: the reader's buffer is
    never written either way."""
    last = 40
    ranks = trainer.start(f"fence{count}")
    publish(ranks, 1)
    buffers = subscriber_buffers(node, 1, 2, count)
    sub = ferry.Subscriber(node, f"fence{count}", addrs(ranks), layouts(buffers))
    assert sub.update(timeout=TIMEOUT).version == 1
    reader = Reader(sub, buffers)
    reader.start()
    assert reader.checked.wait(timeout=TIMEOUT), reader.problems
    write_timeout = 30.0 if count == 1 else 0.0
    for p in ranks:
        p.send(op="run", first=2, last=last, gap=0.002, write_timeout=write_timeout)
    failures: Dict[str, int] = {}
    deadline = time.monotonic() + 60.0
    while sub.version != last:
        assert time.monotonic() < deadline, f"stuck at version {sub.version}; failures {failures}"
        try:
            sub.update(timeout=TIMEOUT)
        except (ferry.NoCompleteVersion, ferry.Overwritten) as error:
            failures[type(error).__name__] = failures.get(type(error).__name__, 0) + 1
            if isinstance(error, ferry.Overwritten):
                assert error.rank in (0, 1) and error.version is not None and error.version < last
            time.sleep(0.001)
    overrun = sum(p.read(60.0)["overrun"] for p in ranks)
    time.sleep(0.05)  # the reader sees the last version too
    reader.stop.set()
    reader.join(timeout=TIMEOUT)
    assert not reader.is_alive()
    assert reader.problems == [], reader.problems[:5]
    assert reader.checks > 10 and reader.seen[0] == 1 and reader.seen[-1] == last, (
        reader.checks, reader.seen
    )
    if count == 1:
        assert overrun == 0 and "Overwritten" not in failures
    assert buffers[sub.active].holds(last)


def test_readers_that_hold_the_only_buffer_fail_the_update_typed() -> None:
    """One buffer, a reader holding it: the update cannot write it, and
    says so at its deadline; the subscriber keeps its version."""
    with ferry.Node() as pub_node, ferry.Node() as sub_node:
        me = PublisherRank(pub_node, 0, 1)
        publisher = ferry.Publisher(pub_node, "held", me.layout)
        with publisher.write() as w:
            me.fill(1)
            w.publish(1)
        buffer = SubscriberBuffer(sub_node, 0, 1)
        sub = ferry.Subscriber(sub_node, "held", [pub_node.addr], [buffer.layout])
        sub.update()
        with publisher.write() as w:
            me.fill(2)
            w.publish(2)
        guard = sub.read()
        started = time.monotonic()
        with pytest.raises(ferry.ReadersHold) as caught:
            sub.update(timeout=0.3)
        assert time.monotonic() - started < 5.0
        assert caught.value.buffer == 0 and isinstance(caught.value, TimeoutError)
        assert sub.version == 1 and buffer.holds(1)
        # A second reader still gets the buffer (readers share it).
        with sub.read(timeout=1.0) as b:
            assert b == 0
        guard.release()
        assert sub.update() == ferry.Update(2, True, 0) and buffer.holds(2)


# -- failures ----------------------------------------------------------------------


def test_a_killed_publisher_is_publisher_lost_and_the_last_version_stays(
    node: ferry.Node, trainer: Trainer
) -> None:
    ranks = trainer.start("lost")
    publish(ranks, 1)
    publish(ranks, 2)
    buffers = subscriber_buffers(node, 0, 2, 2)
    sub = ferry.Subscriber(node, "lost", addrs(ranks), layouts(buffers))
    assert sub.update(timeout=TIMEOUT).version == 2
    ranks[1].kill()
    publish(ranks[:1], 3)  # the live rank goes on
    started = time.monotonic()
    with pytest.raises(ferry.PublisherLost) as caught:
        sub.update(timeout=10.0)
    assert time.monotonic() - started < 9.0, "found by the deadline, not by the lost connection"
    assert caught.value.rank == 1 and isinstance(caught.value, ConnectionError)
    assert sub.version == 2 and buffers[sub.active].holds(2)
    with sub.read() as b:
        assert buffers[b].holds(2)
    # Restarted (a new process, another address): the old subscriber's
    # plan is for the old one; a new subscriber plans again.
    (again,) = [PublisherProcess(trainer.tmp_path, "lost", 1, 2, trainer.transport)]
    trainer.ranks.append(again)
    publish([again], 3)
    with pytest.raises(ferry.PublisherLost):
        sub.update(timeout=10.0)
    fresh = ferry.Subscriber(node, "lost", [ranks[0].addr, again.addr], layouts(buffers))
    update = fresh.update(timeout=TIMEOUT)
    assert update.version == 3 and buffers[update.buffer].holds(3)


def test_versions_only_grow_and_an_abandoned_write_serves_nothing() -> None:
    with ferry.Node() as pub_node, ferry.Node() as sub_node:
        me = PublisherRank(pub_node, 0, 1)
        with ferry.Publisher(pub_node, "grow", me.layout) as publisher:
            assert publisher.version is None and publisher.rank == 0
            buffer = SubscriberBuffer(sub_node, 0, 1)
            sub = ferry.Subscriber(sub_node, "grow", [pub_node.addr], buffer.layout)
            with pytest.raises(ferry.NoCompleteVersion):
                sub.update(timeout=TIMEOUT)
            with publisher.write() as w:
                me.fill(5)
                w.publish(5)
            assert publisher.version == 5 and w.done and w.overrun == 0
            with pytest.raises(ferry.VersionNotNewer) as caught:
                with publisher.write() as w:
                    me.fill(4)
                    w.publish(4)
            assert (caught.value.version, caught.value.last) == (4, 5)
            assert isinstance(caught.value, ValueError)
            # The memory holds no published version now.
            assert publisher.version is None
            with pytest.raises(ferry.NoCompleteVersion):
                sub.update(timeout=TIMEOUT)
            with pytest.raises(RuntimeError):
                with publisher.write():
                    me.fill(6)
                    raise RuntimeError("the step failed halfway")
            assert publisher.version is None
            with pytest.raises(ferry.NoCompleteVersion):
                sub.update(timeout=TIMEOUT)
            with publisher.write() as w:
                me.fill(6)
                w.publish(6)
            assert sub.update(timeout=TIMEOUT).version == 6 and buffer.holds(6)
        # Closed: the set is not served any more.
        assert publisher.closed and publisher.version is None
        with pytest.raises(ferry.PublisherLost):
            sub.update(timeout=TIMEOUT)
        assert sub.version == 6 and buffer.holds(6)


def test_an_overrun_reader_is_counted() -> None:
    """A reader that holds its lease past the write's timeout (here: a
    lease taken by hand, as a stopped subscriber holds it) is overrun, and
    the write says so."""
    with ferry.Node() as pub_node, ferry.Node() as other:
        me = PublisherRank(pub_node, 0, 1)
        with ferry.Publisher(pub_node, "overrun", me.layout) as publisher:
            with publisher.write() as w:
                w.publish(1)
            leased = other.call(pub_node.addr, "ferry.weights:overrun", b'{"Lease":{"version":1}}')
            assert b"Leased" in leased
            started = time.monotonic()
            with publisher.write(timeout=0.2) as w:
                assert w.overrun == 1
                w.publish(2)
            assert 0.15 < time.monotonic() - started < 5.0


def test_publisher_ranks_may_be_named() -> None:
    """Ranks given by their nodes' names, looked up among the peers whose
    metadata the subscriber's node fetched (through etcd on a node that
    uses it)."""
    with ferry.Node(name="rank-a") as a, ferry.Node(name="rank-b") as b, ferry.Node() as sub_node:
        ranks = [PublisherRank(a, 0, 2), PublisherRank(b, 1, 2)]
        publishers = [ferry.Publisher(n, "named", r.layout) for n, r in zip((a, b), ranks)]
        for publisher, rank in zip(publishers, ranks):
            with publisher.write() as w:
                rank.fill(3)
                w.publish(3)
        for n in (a, b):
            sub_node.fetch_metadata(n.addr.endpoint)
        buffer = subscriber_buffers(sub_node, 0, 1, 1)[0]
        sub = ferry.Subscriber(sub_node, "named", ["rank-b", "rank-a"], buffer.layout)
        assert sub.update(timeout=TIMEOUT, verify=True) == ferry.Update(3, True, 0)
        assert buffer.holds(3)
        sub.close()
        for publisher in publishers:
            publisher.close()


def test_bad_input_is_refused_typed() -> None:
    with ferry.Node() as pub_node, ferry.Node() as sub_node:
        me = PublisherRank(pub_node, 0, 1)
        publisher = ferry.Publisher(pub_node, "bad", me.layout)
        with pytest.raises(ferry.InvalidArgument, match="cannot be published"):
            ferry.Publisher(pub_node, "bad", me.layout)  # one rank per set and node
        with publisher.write() as w:
            with pytest.raises(ferry.InvalidArgument, match="being written"):
                publisher.write()
            with pytest.raises(ferry.InvalidArgument, match="not an integer"):
                w.publish(-1)
        with pytest.raises(ferry.InvalidArgument, match="not a duration"):
            publisher.write(timeout=-1.0)
        with publisher.write() as w:
            w.publish(1)
        with pytest.raises(ferry.InvalidArgument, match="published or abandoned already"):
            w.publish(2)
        # Memory that is not a registered region.
        loose = np.zeros(COLS, dtype=np.uint32)
        unregistered = ferry.RankLayout(0, [ferry.TensorLayout.from_array("b", loose, loose, axes=("col",))])
        with pytest.raises(ferry.InvalidArgument, match="not a ferry Region"):
            ferry.Publisher(pub_node, "loose", unregistered)
        buffers = subscriber_buffers(sub_node, 0, 1, 3)
        addr = [pub_node.addr]
        for wrong in ([], layouts(buffers)):
            with pytest.raises(ferry.InvalidArgument, match="one buffer or two"):
                ferry.Subscriber(sub_node, "bad", addr, wrong)
        # Not an address: a node name, which nobody here has.
        with pytest.raises(ferry.PublisherLost, match="nowhere"):
            ferry.Subscriber(sub_node, "bad", ["nowhere"], buffers[0].layout)
        with pytest.raises(ferry.InvalidArgument, match="not a mix"):
            ferry.Subscriber(sub_node, "bad", ["nowhere", pub_node.addr], buffers[0].layout)
        with pytest.raises(ferry.InvalidArgument, match="a list of addresses"):
            ferry.Subscriber(sub_node, "bad", pub_node.addr.endpoint, buffers[0].layout)
        with pytest.raises(ferry.NotFound):
            ferry.Subscriber(sub_node, "no-such-set", addr, buffers[0].layout)
        # Only part of the set's ranks: rows 32.. are nobody's.
        half = PublisherRank(pub_node, 0, 2)
        # Kept: a publisher dropped withdraws its layout.
        half_publisher = ferry.Publisher(pub_node, "half", half.layout)
        with pytest.raises(ferry.LayoutError, match="no remote rank holds"):
            ferry.Subscriber(sub_node, "half", addr, buffers[0].layout)
        half_publisher.close()
        # Other tensors on this side.
        other = np.zeros((ROWS, COLS + 1), dtype=np.uint32)
        wider = ferry.RankLayout(0, [
            ferry.TensorLayout.from_array("w", other, sub_node.register(other), axes=("row", "col"))
        ])
        with pytest.raises(ferry.LayoutError):
            ferry.Subscriber(sub_node, "bad", addr, wider)
        # Nothing listens there (a port of this host that no node holds).
        with pytest.raises(ferry.PublisherLost) as lost:
            ferry.Subscriber(sub_node, "bad", ["127.0.0.1:9"], buffers[0].layout, timeout=5.0)
        assert lost.value.rank is None
        sub = ferry.Subscriber(sub_node, "bad", addr, buffers[0].layout)
        sub.close()
        assert sub.closed
        with pytest.raises(ferry.ShutDown):
            sub.update()
        publisher.close()
        publisher.close()
        with pytest.raises(ferry.ShutDown):
            publisher.write()


try:
    import torch  # type: ignore[import-not-found]
except ImportError:
    torch = None


@pytest.mark.skipif(torch is None, reason="torch is not installed (weight sets never need it)")
def test_torch_cpu_tensors_publish_and_subscribe() -> None:
    with ferry.Node() as pub_node, ferry.Node() as sub_node:
        weights = torch.arange(ROWS * COLS, dtype=torch.int32).reshape(ROWS, COLS)
        region = pub_node.register(weights.numpy())
        layout = ferry.RankLayout(0, [ferry.TensorLayout.from_array("w", weights, region, axes=("row", "col"))])
        mine = torch.zeros((ROWS, COLS // 2), dtype=torch.int32)
        sub_layout = ferry.RankLayout(1, [ferry.TensorLayout.from_array(
            "w", mine, sub_node.register(mine.numpy()), axes=("row", "col"), parts={"col": (1, 2)},
        )])
        with ferry.Publisher(pub_node, "torch", layout) as publisher:
            with publisher.write() as w:
                w.publish(1)
            sub = ferry.Subscriber(sub_node, "torch", [pub_node.addr], sub_layout)
            assert sub.update().version == 1
            assert torch.equal(mine, weights[:, COLS // 2 :])

