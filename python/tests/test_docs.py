"""Every ```python block of README.md and docs/*.md runs, and exits 0.

Each block runs as a script of its own, in a fresh interpreter (this one,
with the ``ferry`` package built into it), under a deadline, once per
same-host transport (``memory``, and ``tcp`` with ``FERRY_DISABLE_MEMORY=1``
in the process): a renamed call or a changed behaviour fails here, not in a
reader's hands. Blocks must therefore be whole programs: both ends of a
transfer in one process.

Blocks that import ``nixl`` need NIXL with the FERRY plugin installed:
they run under the interpreter ``FERRY_NIXL_PYTHON`` names (the virtual
environment ``scripts/nixl-tests.sh`` makes), and are skipped without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional

import pytest

from conftest import REPO, env_for

#: How long one block may run.
BLOCK_DEADLINE = 60.0
#: The interpreter for blocks that import nixl.
NIXL_PYTHON_ENV = "FERRY_NIXL_PYTHON"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


class Block(NamedTuple):
    """One fenced block: where it is, its info string, its code."""

    page: str
    line: int
    info: str
    code: str

    @property
    def language(self) -> str:
        return self.info.split(",")[0].split()[0] if self.info.strip() else ""

    @property
    def needs_nixl(self) -> bool:
        return re.search(r"^\s*(from|import)\s+nixl\b", self.code, re.M) is not None


def doc_pages() -> List[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks_of(path: Path) -> Iterator[Block]:
    """Every fenced code block of a Markdown page."""
    page = str(path.relative_to(REPO))
    fence: Optional[str] = None
    start, info = 0, ""
    code: List[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, start, info, code = match.group(1), number, match.group(2).strip(), []
        elif (
            match
            and match.group(1)[0] == fence[0]
            and len(match.group(1)) >= len(fence)
            and not match.group(2).strip()
        ):
            yield Block(page, start, info, "\n".join(code) + "\n")
            fence = None
        else:
            code.append(line)


def all_blocks() -> List[Block]:
    return [block for path in doc_pages() for block in blocks_of(path)]


PYTHON_BLOCKS = [block for block in all_blocks() if block.language == "python"]


def run_block(
    block: Block, python: str, env: Dict[str, str], timeout: float = BLOCK_DEADLINE
) -> "subprocess.CompletedProcess[str]":
    """Runs the block as a script in a scratch directory; killed (and
    reported) past ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="ferry-doc-") as scratch:
        script = Path(scratch) / f"{Path(block.page).stem}_{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        proc = subprocess.Popen(
            [python, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=scratch,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            killed = f"{err}\n[killed after {timeout} s]"
            return subprocess.CompletedProcess(proc.args, -9, out, killed)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def explain(block: Block, result: "subprocess.CompletedProcess[str]") -> str:
    return (
        f"the python block at {block.page}:{block.line} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def test_the_docs_have_python_blocks() -> None:
    # A fence spelled differently (```py) would silently drop out of the
    # blocks run below; the README's example must be among them.
    pages = {block.page for block in PYTHON_BLOCKS}
    assert "README.md" in pages and "docs/python.md" in pages, pages


@pytest.mark.parametrize(
    "block",
    [b for b in all_blocks() if b.language.lower().startswith("py")],
    ids=lambda b: f"{b.page}:{b.line}",
)
def test_python_fences_say_python(block: Block) -> None:
    assert block.language == "python", (
        f"{block.page}:{block.line}: fence ```{block.info}: say ```python, or it is not run"
    )


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize(
    "block", [b for b in PYTHON_BLOCKS if not b.needs_nixl], ids=lambda b: f"{b.page}:{b.line}"
)
def test_python_block_runs(block: Block, transport: str) -> None:
    result = run_block(block, sys.executable, env_for(transport))
    assert result.returncode == 0, explain(block, result)


@pytest.mark.parametrize(
    "block", [b for b in PYTHON_BLOCKS if b.needs_nixl], ids=lambda b: f"{b.page}:{b.line}"
)
def test_nixl_block_runs(block: Block) -> None:
    python = os.environ.get(NIXL_PYTHON_ENV)
    if not python:
        pytest.skip(f"needs NIXL with the FERRY plugin: {NIXL_PYTHON_ENV} names no interpreter")
    env = env_for("memory")
    env["NIXL_LOG_LEVEL"] = "WARN"
    result = run_block(block, python, env)
    assert result.returncode == 0, explain(block, result)


def test_a_broken_block_fails() -> None:
    # The check itself: a block that calls an API that does not exist, or
    # that hangs, is reported as failed, not passed.
    broken = Block("docs/broken.md", 1, "python", "import ferry\nferry.Node().no_such_call()\n")
    result = run_block(broken, sys.executable, env_for("memory"))
    assert result.returncode != 0 and "AttributeError" in result.stderr, explain(broken, result)
    hangs = Block("docs/broken.md", 2, "python", "import time\ntime.sleep(60)\n")
    result = run_block(hangs, sys.executable, env_for("memory"), timeout=1.0)
    assert result.returncode != 0 and "killed after" in result.stderr, explain(hangs, result)
