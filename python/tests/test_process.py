"""Process exit without closing anything, fork, and the example and type
checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import PYTHON_DIR, TESTS, env_for, run_script

EXIT_MODES = ["plain", "threads", "asyncio", "sysexit"]


@pytest.mark.parametrize("mode", EXIT_MODES)
def test_exit_without_closing(mode: str) -> None:
    """Nodes, an RPC server, transfers in flight (and, per mode, threads
    blocked in ferry calls or an event loop awaiting them): leaving the
    script exits 0, quickly, without a crash or a warning of one."""
    started = time.monotonic()
    done = run_script([str(TESTS / "exit_child.py"), mode], timeout=30.0)
    took = time.monotonic() - started
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "started" in done.stdout
    for bad in ("panicked", "Fatal Python error", "Traceback", "Exception ignored"):
        assert bad not in done.stderr, done.stderr
    assert took < 15.0, f"exit took {took:.1f} s"


@pytest.fixture(scope="module")
def forked() -> "subprocess.CompletedProcess[str]":
    """exit_child.py fork: a process with two nodes forks; the child calls
    the parent's nodes, reports, and exits through sys.exit (atexit hooks
    run, the parent's nodes still referenced)."""
    return run_script([str(TESTS / "exit_child.py"), "fork"], timeout=40.0)


def fork_lines(done: "subprocess.CompletedProcess[str]") -> dict[str, str]:
    return dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)


def test_forked_child_gets_ferry_error(forked: "subprocess.CompletedProcess[str]") -> None:
    assert forked.returncode == 0, f"{forked.stdout}\n{forked.stderr}"
    results = dict(item.split(":", 1) for item in fork_lines(forked)["child"].split(";"))
    for name in ("alloc", "write", "call", "notifications", "remote", "close", "new node"):
        assert results[name].startswith("FerryError"), (name, results[name])
    assert "parent works" in forked.stdout
    assert "panicked" not in forked.stderr and "Fatal Python error" not in forked.stderr, forked.stderr


def test_forked_child_exits(forked: "subprocess.CompletedProcess[str]") -> None:
    """The child's normal exit (sys.exit, atexit hooks) is quick and clean."""
    assert fork_lines(forked)["child exit"] == "0", forked.stdout


@pytest.mark.parametrize("args", [[], ["--tcp"]], ids=["default", "tcp"])
def test_kv_handoff_example(args: list[str]) -> None:
    """python/examples/kv_handoff.py runs the whole demo (it starts the
    decode side itself) and checks every byte it moved."""
    done = run_script([str(PYTHON_DIR / "examples" / "kv_handoff.py"), *args], timeout=90.0)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "kv_handoff:" in done.stdout and "checked byte for byte" in done.stdout
    transport = "tcp" if args else "memory"
    assert f"over {transport}" in done.stdout, done.stdout


@pytest.mark.parametrize("args", [[], ["--tcp"]], ids=["default", "tcp"])
def test_kv_handoff_layouts_example(args: list[str]) -> None:
    """python/examples/kv_handoff_layouts.py: prefill TP 4 -> decode TP 2
    with other block sizes and axis orders, a process per rank, every byte
    checked by the decode ranks."""
    done = run_script(
        [str(PYTHON_DIR / "examples" / "kv_handoff_layouts.py"), *args], timeout=120.0
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "kv_handoff_layouts:" in done.stdout and "checked byte for byte" in done.stdout
    assert "reading from prefill ranks [0, 1] and [2, 3]" in done.stdout, done.stdout
    transport = "tcp" if args else "memory"
    assert f"over {transport}" in done.stdout, done.stdout


@pytest.mark.parametrize("args", [[], ["--tcp"]], ids=["default", "tcp"])
def test_weights_example(args: list[str]) -> None:
    """python/examples/weights.py: 2 trainer processes (rows split) publish
    10 versions to 4 inference processes (columns split), each of which
    checks every byte of every version."""
    done = run_script([str(PYTHON_DIR / "examples" / "weights.py"), *args], timeout=120.0)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "every byte checked by each of the 4 subscribers" in done.stdout, done.stdout
    assert done.stdout.count(", checked") == 10, done.stdout
    transport = "tcp" if args else "memory"
    assert f"over {transport}" in done.stdout, done.stdout


def mypy_strict(*args: str) -> None:
    """``mypy --strict`` on ``args`` (from python/), which must pass."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir=/dev/null", *args],
        cwd=str(PYTHON_DIR),
        capture_output=True,
        text=True,
        timeout=170,
        env=env_for("memory"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_examples() -> None:
    """The examples type-check with ``mypy --strict`` against the package's
    annotations and stubs."""
    mypy_strict("examples/")


def test_mypy_strict_tests() -> None:
    """Checked as for Python 3.12, where numpy's stubs take any buffer (PEP
    688), since the tests pass Regions to ``numpy.frombuffer``."""
    mypy_strict("--python-version", "3.12", "tests/")


TYPED_USAGE = '''
import numpy as np
import numpy.typing as npt
import ferry

def views(node: ferry.Node) -> npt.NDArray[np.uint8]:
    region = node.alloc(4096)
    assert len(region) == 4096
    raw = memoryview(region)
    assert raw.nbytes == 4096
    return np.frombuffer(raw, dtype=np.uint8)
'''

#: numpy.frombuffer(region) itself: numpy's stubs take any buffer (PEP 688)
#: when mypy checks for Python 3.12 or later, and a list of concrete types
#: before, so this one is checked as for 3.12.
TYPED_USAGE_312 = '''
import numpy as np
import numpy.typing as npt
import ferry

def view(node: ferry.Node) -> npt.NDArray[np.uint8]:
    return np.frombuffer(node.alloc(4096), dtype=np.uint8)
'''


@pytest.mark.parametrize("usage, version", [(TYPED_USAGE, None), (TYPED_USAGE_312, "3.12")])
def test_mypy_strict_region_is_a_buffer(
    tmp_path: "os.PathLike[str]", usage: str, version: "str | None"
) -> None:
    """A Region is a buffer and sized for mypy too, not only at run time:
    ``memoryview(region)`` and ``len(region)`` on this interpreter, and
    ``numpy.frombuffer(region)`` where numpy's stubs accept any buffer."""
    source = os.path.join(str(tmp_path), "typed_usage.py")
    with open(source, "w") as f:
        f.write(usage)
    flags = [] if version is None else ["--python-version", version]
    mypy_strict(*flags, source)


FORK_BEFORE_ANY_NODE = '''
import os, sys
import ferry
pid = os.fork()
if pid == 0:
    with ferry.Node() as a, ferry.Node() as b:
        src, dst = a.alloc(4096), bytearray(4096)
        src.view()[:6] = b"forked"
        held = b.register(dst)
        a.write(src, held.remote())
        os._exit(0 if bytes(dst[:6]) == b"forked" else 3)
_, status = os.waitpid(pid, 0)
with ferry.Node() as node:
    print("parent", node.transports())
sys.exit(os.waitstatus_to_exitcode(status))
'''


def test_a_child_forked_before_any_node_started_runs_its_own() -> None:
    """Importing ferry does not stop a process from forking workers
    (multiprocessing's default on Linux): only a child forked after a node
    started is refused."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_BEFORE_ANY_NODE],
        capture_output=True, text=True, timeout=60, env=env_for("memory"),
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "parent" in done.stdout
