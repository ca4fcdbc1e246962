"""ferry's planner driving NIXL: a KV cache handed from prefill TP 2 (blocks
of 16 tokens, NHD) to decode TP 1 (blocks of 32, HND) through NIXL's
prepared lists, made from ``ferry.nixl_plan``'s descriptor and index
arrays, with NIXL's UCX backend and then with FERRY. The prefill ranks are
agents in processes of their own (``nixl_peer.py``), the decode agent is
here; the decode pool is compared whole with a reference numpy computes
from the prefill pools' bytes and both block tables alone.

It needs the ``ferry`` Python package in this environment
(``scripts/nixl-tests.sh`` makes the one ``scripts/python-tests.sh`` built
importable), and is skipped, saying so, without it.
"""

from __future__ import annotations

import time
from typing import Dict, List

import numpy as np
import pytest
from nixl._api import nixl_agent, nixl_agent_config
from nixl_peer import pattern

ferry = pytest.importorskip(
    "ferry", reason="the ferry Python package is not importable here: run scripts/python-tests.sh first"
)

LAYERS, HEADS, DIM, MAX_TOKENS = 2, 8, 16, 1024
PREFILL_TP, PREFILL_BLOCK, PREFILL_BLOCKS = 2, 16, 48
DECODE_BLOCK, DECODE_BLOCKS = 32, 24
#: Tokens the request moves: a multiple of 16 (the rows' sub-block), not of 32.
TOKENS = 208
DTYPE = np.uint16


def prefill_shape() -> tuple:
    """(K/V, layer, block, token, head, dim): NHD, half the heads."""
    return (2, LAYERS, PREFILL_BLOCKS, PREFILL_BLOCK, HEADS // PREFILL_TP, DIM)


def decode_shape() -> tuple:
    """(K/V, layer, block, head, token, dim): HND, every head."""
    return (2, LAYERS, DECODE_BLOCKS, HEADS, DECODE_BLOCK, DIM)


def rank_layout(rank: int, tp: int, pool: np.ndarray, order: str):
    inner = ("token", "head") if order == "NHD" else ("head", "token")
    tensors = [
        ferry.TensorLayout.from_array(
            name, pool[i], pool,
            axes=("layer", "block", *inner, "dim"),
            paged=("token", "block"),
            table="kv",
            global_sizes={"token": MAX_TOKENS},
            parts={"head": (rank, tp)},
        )
        for i, name in enumerate(("k", "v"))
    ]
    return ferry.RankLayout(rank, tensors)


def wait_done(agent: nixl_agent, handle, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
        assert time.monotonic() < deadline, "still in progress"
        time.sleep(0.0005)


def reference(prefill: List[np.ndarray], prefill_table: np.ndarray, decode_table: np.ndarray) -> np.ndarray:
    """The decode pool once tokens 0..TOKENS arrived: gathered from each
    prefill pool through its table, scattered through the decode one."""
    t = np.arange(TOKENS)
    # [K/V, layer, token, head, dim] of all heads, from the prefill ranks.
    logical = np.concatenate(
        [pool[:, :, prefill_table[t // PREFILL_BLOCK], t % PREFILL_BLOCK] for pool in prefill], axis=3
    )
    out = np.zeros(decode_shape(), dtype=DTYPE)
    out.swapaxes(3, 4)[:, :, decode_table[t // DECODE_BLOCK], t % DECODE_BLOCK] = logical
    return out


@pytest.mark.parametrize("backend", ["UCX", "FERRY"])
def test_a_tp2_to_tp1_kv_handoff_through_nixl_with_the_planners_arrays(peers, backend):
    nbytes = int(np.prod(prefill_shape())) * np.dtype(DTYPE).itemsize
    agents = [peers(f"prefill{r}", backends=[backend]) for r in range(PREFILL_TP)]
    memory = [a.alloc(nbytes, seed=r + 1) for r, a in enumerate(agents)]
    # The prefill pools' bytes, as the peers hold them (pattern bytes).
    prefill = [pattern(nbytes, r + 1).view(DTYPE).reshape(prefill_shape()) for r in range(PREFILL_TP)]

    decode = nixl_agent("decode", nixl_agent_config(backends=[]))
    decode.create_backend(backend, {})
    pool = np.zeros(decode_shape(), dtype=DTYPE)
    decode.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    for a in agents:
        decode.add_remote_agent(a.metadata)

    # Each prefill rank declares its layout; here, as its shape and strides
    # are all the decode side needs, over an array of the same shape. The
    # peer's base addresses come with NIXL's metadata.
    declared = [rank_layout(r, PREFILL_TP, np.empty(prefill_shape(), dtype=DTYPE), "NHD") for r in range(PREFILL_TP)]
    received = [ferry.RankLayout.from_bytes(d.to_bytes()) for d in declared]
    plan = ferry.nixl_plan(rank_layout(0, 1, pool, "HND"), received, direction="pull")
    assert plan.remote_ranks == [0, 1] and plan.operation == "READ"

    local_list = decode.prep_xfer_dlist("NIXL_INIT_AGENT", plan.local_descs(), "DRAM")
    remote_lists = {
        r: decode.prep_xfer_dlist(
            f"prefill{r}", plan.remote_descs(r, bases=[memory[r]["addr"]]), "DRAM"
        )
        for r in plan.remote_ranks
    }
    prefill_table = np.random.default_rng(1).permutation(PREFILL_BLOCKS)[: TOKENS // PREFILL_BLOCK]
    decode_table = np.random.default_rng(2).permutation(DECODE_BLOCKS)[: -(-TOKENS // DECODE_BLOCK)]
    indices: Dict[int, tuple] = plan.indices(TOKENS, decode_table, prefill_table)
    handles = []
    for r, (local_idx, remote_idx) in indices.items():
        handle = decode.make_prepped_xfer(
            plan.operation, local_list, local_idx, remote_lists[r], remote_idx, notif_msg=b"kv read"
        )
        assert decode.transfer(handle) in ("PROC", "DONE")
        handles.append(handle)
    for handle in handles:
        assert wait_done(decode, handle) == "DONE"
        decode.release_xfer_handle(handle)

    want = reference(prefill, prefill_table, decode_table)
    if not np.array_equal(pool, want):
        wrong = np.argwhere(pool != want)
        raise AssertionError(f"{backend}: {len(wrong)} elements differ, the first at {tuple(wrong[0])}")
    for a in agents:
        assert a.notifs(1) == {"decode": [b"kv read"]}, backend
    # Pairs per request: a prefill rank's 4 heads of a token are one run of
    # 128 bytes in its NHD block, 4 runs of 32 bytes apart in an HND one:
    # one pair per K or V, layer, token and head.
    pairs = sum(len(li) for li, _ in indices.values())
    assert pairs == 2 * LAYERS * TOKENS * HEADS
    decode.release_dlist_handle(local_list)
    for handle in remote_lists.values():
        decode.release_dlist_handle(handle)
