"""No call of the FERRY backend waits on the network.

vLLM and SGLang make NIXL's calls on the thread that schedules their
model: one that waited for a peer's connection would stall a whole decode
instance on one stuck prefill peer. Against a peer this agent never reached
before, stopped (SIGSTOP), behind an address whose packets are dropped, or
on a refused port, every call that reaches the backend returns at once; a
request is in progress (``PROC``) until the connection is up and the bytes
have moved, or fails (``ERR``) by the backend's deadline.

The agent whose calls are timed runs in a process of its own
(``nixl_peer.py``'s ``timed_calls``), so that it can sit in a network
namespace for the dropped case.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import subprocess

import pytest
from nixl_peer import pattern

LEN = 1 << 20
#: The calls' bound. A call that waited on the network would take the
#: deadline (seconds) or a connect attempt's timeout; these calls take
#: microseconds (the note of the change that made them so has figures).
#: The bound is loose so that a busy 2-core CI machine's scheduling does
#: not fail it, and tight enough to tell the two apart.
BOUND = 0.5
CALLS = (
    "loadRemoteMD",
    "prepXfer",
    "postXfer",
    "checkXfer",
    "makeXferReq",
    "releaseReqH",
    "genNotif",
    "getNotifs",
    "connect",
)


def params(deadline_ms: int, listen: str = "127.0.0.1:0") -> dict:
    return {"FERRY": {"transports": "tcp", "deadline_ms": str(deadline_ms), "listen": listen}}


def check_times(answer: dict) -> None:
    times = answer["times"]
    print({call: f"{t * 1e6:.0f} us" for call, t in times.items()})
    assert sorted(times) == sorted(CALLS)
    slow = {call: t for call, t in times.items() if t > BOUND}
    assert not slow, f"calls that waited: {slow} (all: {times})"


def test_a_stopped_peer_holds_no_call_and_gets_the_bytes_once_continued(peers):
    prefill = peers("prefill", params=params(30_000))
    remote = prefill.alloc(LEN, 1)
    decode = peers("decode", params=params(30_000))
    prefill.stop()
    try:
        answer = decode.ask(
            "timed_calls",
            metadata=base64.b64encode(prefill.metadata).decode(),
            addr=remote["addr"],
            len=LEN,
            seed=2,
        )
        check_times(answer)
        # Nothing can have moved: the peer is stopped.
        assert answer["states"] == ["PROC", "PROC"]
    finally:
        prefill.signal(signal.SIGCONT)
    waited = decode.ask("timed_wait", timeout=60)
    assert waited["state"] == "DONE"
    assert waited["releaseReqH"] < BOUND
    assert prefill.ask("digest")["digest"] == hashlib.sha256(pattern(LEN, 2).tobytes()).hexdigest()
    # The request released before it was made moved nothing and said
    # nothing; the other two notifications came once each.
    got = prefill.notifs(2)
    assert sorted(got["decode"]) == [b"alone", b"prepped"] and list(got) == ["decode"]


def test_a_refused_port_holds_no_call_and_fails_the_request(peers):
    prefill = peers("prefill", params=params(20_000))
    remote = prefill.alloc(LEN, 1)
    metadata = prefill.metadata
    prefill.proc.kill()
    prefill.proc.wait()
    decode = peers("decode", params=params(20_000))
    answer = decode.ask(
        "timed_calls",
        metadata=base64.b64encode(metadata).decode(),
        addr=remote["addr"],
        len=LEN,
        seed=2,
    )
    check_times(answer)
    waited = decode.ask("timed_wait", timeout=60)
    # Refused at once: failed at once, not at the deadline (20 s).
    assert waited["state"] == "ERR: nixlRemoteDisconnectError", waited
    assert waited["elapsed"] < 10, waited


@pytest.fixture
def dropped():
    """Two network namespaces joined by a veth pair: ``near`` at
    10.231.0.1, ``far`` at 10.231.0.2 (with a static neighbour entry for it
    in ``near``, so nothing waits for ARP). Removing far's address later
    makes far drop every packet near sends it, with no answer: what a
    peer behind a dead link or a filtering firewall looks like. Skipped
    without root or iproute2."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    near, far = f"ferry-near-{os.getpid()}", f"ferry-far-{os.getpid()}"
    veth = f"fdrop{os.getpid() % 100000}"

    def ip(*args: str) -> str:
        return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout

    ip("netns", "add", near)
    ip("netns", "add", far)
    try:
        ip("link", "add", veth + "a", "netns", near, "type", "veth", "peer", "name", veth + "b", "netns", far)
        for ns, dev, addr in ((near, veth + "a", "10.231.0.1/24"), (far, veth + "b", "10.231.0.2/24")):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        mac = ip("-n", far, "-o", "link", "show", veth + "b").split("link/ether ")[1].split()[0]
        ip("-n", near, "neigh", "replace", "10.231.0.2", "lladdr", mac, "dev", veth + "a", "nud", "permanent")

        def cut() -> None:
            ip("-n", far, "addr", "del", "10.231.0.2/24", "dev", veth + "b")

        yield near, far, cut
    finally:
        subprocess.run(["ip", "netns", "del", near], check=False)
        subprocess.run(["ip", "netns", "del", far], check=False)


def test_an_address_that_drops_packets_holds_no_call_and_fails_by_the_deadline(peers, dropped):
    near, far, cut = dropped
    prefill = peers("prefill", params=params(3_000, "10.231.0.2:0"), prefix=["ip", "netns", "exec", far])
    remote = prefill.alloc(LEN, 1)
    decode = peers("decode", params=params(3_000, "10.231.0.1:0"), prefix=["ip", "netns", "exec", near])
    cut()
    answer = decode.ask(
        "timed_calls",
        metadata=base64.b64encode(prefill.metadata).decode(),
        addr=remote["addr"],
        len=LEN,
        seed=2,
    )
    check_times(answer)
    assert answer["states"] == ["PROC", "PROC"]
    waited = decode.ask("timed_wait", timeout=60)
    assert waited["state"] == "ERR: nixlRemoteDisconnectError", waited
    # Failed by the deadline (3 s from the post), not at once: nothing
    # refused the connection.
    assert 1.0 < waited["elapsed"] < 3 + 5, waited
