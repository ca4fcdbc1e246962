"""Names: regions published under a name and found by peers, through the
peer-to-peer metadata fetch, a metadata blob, and a real etcd."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Iterator

import numpy as np
import pytest

import ferry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def etcd() -> Iterator[str]:
    """A real etcd on loopback ports of its own, with a fresh data dir."""
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    if not shutil.which(binary):
        pytest.skip("etcd is not installed (scripts/install-deps.sh installs etcd-server)")
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="ferry-py-etcd-")
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [binary, "--name", "ferry-py", "--data-dir", data,
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"ferry-py=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "etcd exited at start"
            assert time.monotonic() < deadline, "etcd did not listen within 20 s"
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(data, ignore_errors=True)


def test_lookup_region_through_etcd_waits_for_the_publication(etcd: str) -> None:
    with ferry.Node(name="prefill", etcd=etcd, cluster="py") as owner, \
            ferry.Node(name="decode", etcd=etcd, cluster="py") as reader:
        kv = np.zeros(1 << 16, dtype=np.uint8)
        region = owner.register(kv)
        owner.publish("kv", region)
        handle = reader.lookup_region("prefill", "kv", timeout=10.0)
        assert handle == region.remote()
        src = reader.alloc(1 << 16)
        pattern = np.random.default_rng().integers(0, 256, 1 << 16, dtype=np.uint8)
        np.frombuffer(src, dtype=np.uint8)[:] = pattern
        reader.write(src, handle)
        assert np.array_equal(kv, pattern)
        with pytest.raises(ferry.NotFound):
            reader.lookup_region("prefill", "no-such-region", timeout=0.5)


def test_etcd_unreachable_at_start_is_a_typed_error() -> None:
    with pytest.raises(ferry.FerryError, match="etcd"):
        ferry.Node(name="lonely", etcd=f"http://127.0.0.1:{free_port()}")


def test_metadata_fetched_from_a_peer_names_its_regions() -> None:
    with ferry.Node(name="owner") as owner, ferry.Node() as reader:
        region = owner.alloc(4096)
        owner.publish("blocks", region)
        key = reader.fetch_metadata(owner.addr.endpoint, timeout=5.0)
        assert key == "owner"
        assert reader.remote_region("owner", "blocks") == region.remote()
        with pytest.raises(ferry.NotFound):
            reader.remote_region("owner", "other")
        with pytest.raises(ferry.NotFound):
            reader.remote_region("nobody", "blocks")


def test_a_metadata_blob_loads_on_another_node_and_garbage_is_refused() -> None:
    with ferry.Node(name="blob-owner") as owner, ferry.Node() as reader:
        region = owner.alloc(4096)
        owner.publish("r", region)
        assert reader.load_metadata(owner.metadata()) == "blob-owner"
        assert reader.remote_region("blob-owner", "r") == region.remote()
        with pytest.raises(ferry.MetadataError):
            reader.load_metadata(b"not metadata at all")


def test_a_standalone_notification_arrives_as_a_notification() -> None:
    with ferry.Node() as owner, ferry.Node() as sender:
        sender.notify(owner.addr, b"req-9:freed")
        sender.send_message(owner.addr, b"hello")
        got: list[ferry.Delivery] = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            d = owner.next_notification(timeout=1.0)
            if d is not None:
                got.append(d)
        assert sorted((d.kind, d.body) for d in got) == [
            ("message", b"hello"), ("notification", b"req-9:freed")]
        assert all(d.sender == sender.addr for d in got)
        assert owner.notifications() == []
