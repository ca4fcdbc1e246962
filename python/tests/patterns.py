"""Data patterns shared by the tests and their peer processes.

Every byte of ``pattern(seed, n)`` depends on the seed and on its position:
each 8-byte word is a mix of its index and the seed, so a misplaced chunk, a
stale buffer from an earlier run or a repeated block never compares equal.
The tests draw a fresh seed per run.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def fresh_seed() -> int:
    """A seed no earlier run used (63 random bits)."""
    return secrets.randbits(63)


def _splitmix(seed: int) -> int:
    z = (seed + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)


def pattern(seed: int, nbytes: int) -> "np.ndarray[Any, np.dtype[np.uint8]]":
    """``nbytes`` bytes that depend on ``seed`` and on each byte's position."""
    nwords = (nbytes + 7) // 8
    words = np.arange(nwords, dtype=np.uint64)
    words *= _GOLDEN
    words ^= np.uint64(_splitmix(seed))
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:nbytes]


def sha256(buffer: Any) -> str:
    """Hex SHA-256 of a buffer's bytes."""
    return hashlib.sha256(np.frombuffer(buffer, dtype=np.uint8).data).hexdigest()

