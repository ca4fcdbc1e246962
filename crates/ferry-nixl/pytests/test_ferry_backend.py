"""FERRY as a NIXL backend, driven through NIXL's Python API the way vLLM's
NixlConnector and SGLang's NIXL backend drive it, between two processes:
bytes compared, notifications counted, and every bad input answered with
NIXL's errors while this process lives on."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from nixl._api import nixl_agent, nixl_agent_config
from nixl_peer import pattern

BLOCK = 4096
BLOCKS = 16384
#: Same-host memory (the default), and TCP only.
TRANSPORTS = {"memory": {}, "tcp": {"transports": "tcp"}}


def agent(name: str, backends=("FERRY",), params=None, telemetry=False) -> nixl_agent:
    """An agent in this process with only `backends`."""
    made = nixl_agent(name, nixl_agent_config(backends=[], capture_telemetry=telemetry))
    for backend in backends:
        made.create_backend(backend, (params or {}).get(backend, {}))
    return made


def strided(addr: int, blocks: int) -> np.ndarray:
    """NIXL's Nx5 list: `blocks` blocks of BLOCK bytes from `addr`."""
    return np.array([[addr, BLOCK, 0, BLOCK, blocks]], dtype=np.uint64)


def wait_done(a: nixl_agent, handle, timeout: float = 60.0) -> str:
    """Polls check_xfer_state until it leaves PROC; its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        state = a.check_xfer_state(handle)
        if state != "PROC":
            return state
        assert time.monotonic() < deadline, "still in progress"
        time.sleep(0.0005)


def blocks_of(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1, BLOCK)


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_vllms_call_sequence_moves_16384_blocks_byte_for_byte(peers, transport):
    params = {"FERRY": TRANSPORTS[transport]}
    prefill = peers("prefill", params=params)
    decode = agent("decode", params=params, telemetry=True)
    remote = prefill.alloc(BLOCK * BLOCKS, 1)
    local = pattern(BLOCK * BLOCKS, 2)
    reg = decode.register_memory(
        decode.get_reg_descs([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    )
    assert decode.add_remote_agent(prefill.metadata) == b"prefill"
    prefill.ask("add_remote", metadata=base64.b64encode(decode.get_agent_metadata()).decode())
    assert decode.check_remote_metadata("prefill")
    local_side = decode.prep_xfer_dlist("NIXL_INIT_AGENT", strided(local.ctypes.data, BLOCKS), "DRAM")
    remote_side = decode.prep_xfer_dlist("prefill", strided(remote["addr"], BLOCKS), "DRAM")

    # READ: reversed, with repeats on the remote side.
    local_idx = np.arange(BLOCKS, dtype=np.int32)
    remote_idx = (BLOCKS - 1 - local_idx).astype(np.int32)
    remote_idx[::7] = 5
    read = decode.make_prepped_xfer("READ", local_side, local_idx, remote_side, remote_idx, notif_msg=b"read 1")
    assert decode.transfer(read) in ("PROC", "DONE")
    assert wait_done(decode, read) == "DONE"
    theirs = blocks_of(pattern(BLOCK * BLOCKS, 1))
    assert np.array_equal(blocks_of(local), theirs[remote_idx]), "read bytes differ"
    assert prefill.notifs(1) == {"decode": [b"read 1"]}
    telemetry = decode.get_xfer_telemetry(read)
    assert telemetry.totalBytes == BLOCK * BLOCKS
    decode.release_xfer_handle(read)

    # WRITE: reversed, with repeats on the local side; posted twice, with a
    # new notification the second time.
    local[:] = pattern(local.nbytes, 3)
    remote_idx = np.arange(BLOCKS, dtype=np.int32)
    local_idx = (BLOCKS - 1 - remote_idx).astype(np.int32)
    local_idx[::5] = 9
    write = decode.make_prepped_xfer("WRITE", local_side, local_idx, remote_side, remote_idx, notif_msg=b"write 1")
    assert decode.transfer(write) in ("PROC", "DONE")
    assert wait_done(decode, write) == "DONE"
    expected = blocks_of(local)[local_idx]
    assert prefill.ask("digest")["digest"] == digest(expected), "written bytes differ"
    assert prefill.notifs(1) == {"decode": [b"write 1"]}
    prefill.ask("fill", seed=4)
    assert decode.transfer(write, b"write 2") in ("PROC", "DONE")
    assert wait_done(decode, write) == "DONE"
    assert prefill.ask("digest")["digest"] == digest(expected)
    assert prefill.notifs(1) == {"decode": [b"write 2"]}
    decode.release_xfer_handle(write)

    decode.send_notif("prefill", b"standalone")
    assert prefill.notifs(1) == {"decode": [b"standalone"]}
    prefill.ask("send_notif", agent="decode", msg=base64.b64encode(b"back").decode())
    deadline = time.monotonic() + 10
    got: dict = {}
    while not got and time.monotonic() < deadline:
        got = decode.get_new_notifs()
        time.sleep(0.01)
    assert got == {"prefill": [b"back"]}

    decode.release_dlist_handle(local_side)
    decode.release_dlist_handle(remote_side)
    decode.deregister_memory(reg)
    decode.remove_remote_agent("prefill")


def test_sglangs_call_sequence_with_initialize_xfer(peers):
    prefill = peers("prefill")
    decode = agent("decode")
    remote = prefill.alloc(BLOCK * 64, 5)
    local = pattern(BLOCK * 64, 6)
    reg = decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    decode.add_remote_agent(prefill.metadata)
    # Blocks 0..31 of ours to 32..63 of theirs, as (addr, len, dev) rows.
    src = decode.get_xfer_descs(
        np.array([[local.ctypes.data + i * BLOCK, BLOCK, 0] for i in range(32)], dtype=np.uint64), "DRAM"
    )
    dst = decode.get_xfer_descs(
        np.array([[remote["addr"] + (32 + i) * BLOCK, BLOCK, 0] for i in range(32)], dtype=np.uint64), "DRAM"
    )
    handle = decode.initialize_xfer("WRITE", src, dst, "prefill", b"kv ready")
    assert decode.transfer(handle) in ("PROC", "DONE")
    assert wait_done(decode, handle) == "DONE"
    expected = blocks_of(pattern(BLOCK * 64, 5)).copy()
    expected[32:] = blocks_of(local)[:32]
    assert prefill.ask("digest")["digest"] == digest(expected)
    assert prefill.notifs(1) == {"decode": [b"kv ready"]}
    decode.release_xfer_handle(handle)
    decode.deregister_memory(reg)


def test_one_agent_with_ucx_and_ferry_loaded_uses_either(peers):
    backends = ["UCX", "FERRY"]
    prefill = peers("prefill", backends=backends)
    decode = agent("decode", backends=backends)
    assert set(backends) <= set(decode.get_plugin_list())
    remote = prefill.alloc(BLOCK * 16, 7)
    local = pattern(BLOCK * 16, 8)
    decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    decode.add_remote_agent(prefill.metadata)
    src = decode.get_xfer_descs([(local.ctypes.data, local.nbytes, 0)], "DRAM")
    dst = decode.get_xfer_descs([(remote["addr"], local.nbytes, 0)], "DRAM")
    for backend, seed in (("FERRY", 8), ("UCX", 9)):
        local[:] = pattern(local.nbytes, seed)
        handle = decode.initialize_xfer("WRITE", src, dst, "prefill", b"", backends=[backend])
        assert decode.query_xfer_backend(handle) == backend
        assert decode.transfer(handle) in ("PROC", "DONE")
        assert wait_done(decode, handle) == "DONE"
        assert prefill.ask("digest")["digest"] == digest(local), backend
        decode.release_xfer_handle(handle)


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


def test_metadata_through_nixls_listener_then_a_notified_write(peers):
    """Dynamo's way in: metadata fetched from and sent to a peer's listener
    (NIXL's own thread calls the backend's loads), not passed by hand."""
    port, our_port = free_port(), free_port()
    prefill = peers("prefill", listen_port=port)
    remote = prefill.alloc(BLOCK * 32, 11)
    decode = nixl_agent(
        "decode",
        nixl_agent_config(backends=[], enable_listen_thread=True, listen_port=our_port),
    )
    decode.create_backend("FERRY", {})
    local = pattern(BLOCK * 32, 12)
    reg = decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    decode.fetch_remote_metadata("prefill", "127.0.0.1", port)
    wait_until(lambda: decode.check_remote_metadata("prefill"), "the peer's metadata fetched")
    src = decode.get_xfer_descs([(local.ctypes.data, local.nbytes, 0)], "DRAM")
    dst = decode.get_xfer_descs([(remote["addr"], local.nbytes, 0)], "DRAM")
    handle = decode.initialize_xfer("WRITE", src, dst, "prefill", b"via listener")
    assert decode.transfer(handle) in ("PROC", "DONE")
    assert wait_done(decode, handle) == "DONE"
    assert prefill.ask("digest")["digest"] == digest(local)
    assert prefill.notifs(1) == {"decode": [b"via listener"]}
    decode.release_xfer_handle(handle)
    # Our metadata to the peer's listener, then withdrawn from it.
    decode.send_local_metadata("127.0.0.1", port)
    wait_until(lambda: prefill.ask("has_remote", agent="decode")["has"], "our metadata at the peer")
    decode.invalidate_local_metadata("127.0.0.1", port)
    wait_until(lambda: not prefill.ask("has_remote", agent="decode")["has"], "our metadata withdrawn")
    # Once the peer's metadata is removed here, a request to it is refused.
    decode.remove_remote_agent("prefill")
    expect_error(lambda: decode.initialize_xfer("WRITE", src, dst, "prefill", b""))
    decode.deregister_memory(reg)


def expect_error(call) -> None:
    """`call` raises one of NIXL's errors (or returns "ERR")."""
    try:
        answer = call()
    except Exception as error:  # noqa: BLE001 - NIXL's bindings raise several types
        assert type(error).__name__.startswith("nixl"), repr(error)
        return
    assert answer == "ERR", answer


def test_an_agent_of_another_host_or_namespace_on_loopback_is_refused_at_add_remote_agent(peers):
    """The FERRY default listens on loopback: an agent of another host (or
    of another network namespace of this one) that kept it cannot be
    reached, and adding it says so (a log line naming the `listen` option)
    instead of a transfer failing later."""
    prefill = peers("prefill")
    remote = prefill.alloc(BLOCK, 3)
    decode = agent("decode")
    # The peer's metadata as if it came from another host: every boot id
    # in it changed (same length), its endpoint still 127.0.0.1.
    flip = bytes.maketrans(b"0123456789abcdef", b"123456789abcdef0")
    elsewhere = re.sub(
        rb'"boot_id":"([0-9a-f]{32})"',
        lambda m: b'"boot_id":"' + m.group(1).translate(flip) + b'"',
        prefill.metadata,
    )
    assert elsewhere != prefill.metadata and len(elsewhere) == len(prefill.metadata)
    expect_error(lambda: decode.add_remote_agent(elsewhere))
    # As if from another container of this host: the same boot, another
    # network namespace (its last digit changed).
    other_netns = re.sub(
        rb'"netns":(\d+)',
        lambda m: b'"netns":' + m.group(1)[:-1] + str((int(m.group(1)[-1:]) + 1) % 10).encode(),
        prefill.metadata,
    )
    assert other_netns != prefill.metadata and len(other_netns) == len(prefill.metadata)
    expect_error(lambda: decode.add_remote_agent(other_netns))
    # The metadata as it came from this host loads, and a write moves.
    assert decode.add_remote_agent(prefill.metadata) == b"prefill"
    local = pattern(BLOCK, 4)
    decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    src = decode.get_xfer_descs([(local.ctypes.data, BLOCK, 0)], "DRAM")
    dst = decode.get_xfer_descs([(remote["addr"], BLOCK, 0)], "DRAM")
    handle = decode.initialize_xfer("WRITE", src, dst, "prefill", b"")
    assert decode.transfer(handle) in ("PROC", "DONE")
    assert wait_done(decode, handle) == "DONE"
    assert prefill.ask("digest")["digest"] == digest(local)
    decode.release_xfer_handle(handle)


@pytest.fixture
def netns():
    """A network namespace of this host, with its loopback up, removed at
    the end: what a container of its own gets. Skipped without root or
    `ip`."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2's ip")
    name = f"ferry-nixl-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_an_agent_in_another_network_namespace_on_loopback_is_refused(peers, netns):
    """Not forged: a peer agent in a namespace of its own, on its own
    loopback, as in a container of this host. Adding it is refused (its
    boot id is ours, its namespace is not); one in ours is not."""
    apart = peers("prefill", prefix=["ip", "netns", "exec", netns])
    apart.alloc(BLOCK, 3)
    decode = agent("decode")
    expect_error(lambda: decode.add_remote_agent(apart.metadata))
    beside = peers("beside")
    beside.alloc(BLOCK, 4)
    assert decode.add_remote_agent(beside.metadata) == b"beside"


def test_a_transport_left_out_of_transports_is_never_used(peers, monkeypatch):
    """`transports` says what FERRY may use: an agent allowed same-host
    memory only does not fall back to TCP for a peer only TCP reaches (its
    request fails, nothing moves), and a backend none of whose transports
    runs here is refused at creation."""
    prefill = peers("prefill", params={"FERRY": {"transports": "tcp"}})
    remote = prefill.alloc(BLOCK, 5)
    untouched = prefill.ask("digest")["digest"]
    decode = agent("decode", params={"FERRY": {"transports": "memory"}})
    assert decode.add_remote_agent(prefill.metadata) == b"prefill"
    local = pattern(BLOCK, 6)
    reg = decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    src = decode.get_xfer_descs([(local.ctypes.data, BLOCK, 0)], "DRAM")
    dst = decode.get_xfer_descs([(remote["addr"], BLOCK, 0)], "DRAM")
    # Made at once (no call waits on the network); it fails when checked.
    handle = decode.initialize_xfer("WRITE", src, dst, "prefill", b"")
    expect_error(lambda: (decode.transfer(handle), wait_done(decode, handle, timeout=30))[1])
    assert prefill.ask("digest")["digest"] == untouched
    decode.release_xfer_handle(handle)
    decode.deregister_memory(reg)

    # ibverbs alone, on a host where it cannot run (kept off here, so that
    # a host with an RDMA device gives the same answer).
    monkeypatch.setenv("FERRY_DISABLE_IBVERBS", "1")
    with pytest.raises(Exception) as refused:
        agent("rdma-only", params={"FERRY": {"transports": "ibverbs"}})
    assert type(refused.value).__name__.startswith("nixl"), repr(refused.value)


@pytest.mark.parametrize("backend", ["FERRY", "UCX"])
def test_partial_metadata_needs_the_connection_info_first_as_with_ucx(backend):
    """Partial metadata without connection info loads only for an agent
    whose connection info is loaded: refused (NOT_FOUND) on first contact
    and after the agent was removed, as UCX refuses it."""
    owner, other = agent("owner", backends=[backend]), agent("other", backends=[backend])
    buf = pattern(BLOCK, 7)
    descs = owner.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    owner.register_memory(descs)
    partial = owner.get_partial_agent_metadata(descs, False, [backend])
    expect_error(lambda: other.add_remote_agent(partial))
    assert other.add_remote_agent(owner.get_agent_metadata()) == b"owner"
    assert other.add_remote_agent(partial) == b"owner"
    other.remove_remote_agent("owner")
    expect_error(lambda: other.add_remote_agent(partial))


def test_bad_input_gets_nixls_errors_and_moves_nothing(peers):
    params = {"FERRY": {"transports": "tcp", "deadline_ms": "2000"}}
    prefill = peers("prefill", params=params)
    decode = agent("decode", params=params)
    remote = prefill.alloc(BLOCK * 16, 10)
    untouched = prefill.ask("digest")["digest"]
    local = pattern(BLOCK * 16, 11)
    reg = decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")

    # Garbage and truncated metadata.
    expect_error(lambda: decode.add_remote_agent(b"garbage"))
    expect_error(lambda: decode.add_remote_agent(prefill.metadata[: len(prefill.metadata) // 2]))
    decode.add_remote_agent(prefill.metadata)

    whole = decode.get_xfer_descs([(local.ctypes.data, local.nbytes, 0)], "DRAM")
    theirs = decode.get_xfer_descs([(remote["addr"], local.nbytes, 0)], "DRAM")
    # Descriptors outside the peer's registered memory.
    past = decode.get_xfer_descs([(remote["addr"] + BLOCK, local.nbytes, 0)], "DRAM")
    expect_error(lambda: decode.transfer(decode.initialize_xfer("WRITE", whole, past, "prefill")))

    # Memory deregistered under a prepared request.
    stale = decode.initialize_xfer("WRITE", whole, theirs, "prefill")
    decode.deregister_memory(reg)
    expect_error(lambda: decode.transfer(stale))
    assert prefill.ask("digest")["digest"] == untouched
    decode.release_xfer_handle(stale)
    reg = decode.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")

    # A request to an agent removed since it was made.
    orphan = decode.initialize_xfer("WRITE", whole, theirs, "prefill")
    decode.remove_remote_agent("prefill")
    expect_error(lambda: decode.transfer(orphan))
    assert prefill.ask("digest")["digest"] == untouched
    decode.release_xfer_handle(orphan)

    # A stopped peer: ERR past the deadline (2 s), not PROC forever.
    decode.add_remote_agent(prefill.metadata)
    handle = decode.initialize_xfer("WRITE", whole, theirs, "prefill")
    assert decode.transfer(handle) in ("PROC", "DONE")
    assert wait_done(decode, handle) == "DONE"
    prefill.stop()
    try:
        started = time.monotonic()
        expect_error(lambda: (decode.transfer(handle), wait_done(decode, handle, timeout=30))[1])
        assert time.monotonic() - started < 30
    finally:
        prefill.signal(signal.SIGCONT)
    decode.release_xfer_handle(handle)

    # A killed peer: ERR, and this process goes on.
    prefill.proc.kill()
    prefill.proc.wait()

    def to_the_dead():
        handle = decode.initialize_xfer("WRITE", whole, theirs, "prefill")
        decode.transfer(handle)
        return wait_done(decode, handle, timeout=30)

    expect_error(to_the_dead)
    decode.deregister_memory(reg)


def test_the_plugins_engine_vtable_matches_the_wheels():
    """ferry's declaration of nixlBackendEngine has as many virtual slots as
    the one NIXL's own UCX plugin was built with (232 bytes: offset, type
    info and 27 slots)."""
    import nixl_cu12

    plugins = Path(nixl_cu12.__file__).parent.parent / ".nixl_cu12.mesonpy.libs" / "plugins"

    def vtable_size(lib: Path, symbol: str) -> int:
        out = subprocess.run(["nm", "-C", "-S", str(lib)], capture_output=True, text=True, check=True)
        sizes = {
            int(parts[1], 16)
            for line in out.stdout.splitlines()
            if line.endswith(symbol) and len(parts := line.split()) >= 4
        }
        assert len(sizes) == 1, (lib, symbol, sizes)
        return sizes.pop()

    theirs = vtable_size(plugins / "libplugin_UCX.so", "vtable for nixlBackendEngine")
    ours = vtable_size(plugins / "libplugin_FERRY.so", "vtable for nixlBackendEngine")
    assert theirs == ours == 232
