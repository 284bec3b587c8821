"""Every ```python block of the guides (`DOCS`: quickstart, concepts, integration,
delta-elastic, your-model) runs as written.

A block may be preceded by a marker line, an HTML comment (invisible when rendered):

    (none)                          in this process, in a fresh namespace
    <!-- test: file NAME.py -->     not run itself: written to a temporary directory as module
                                    NAME, which every other block can import (the mesh blocks'
                                    procs too: the directory is on their PYTHONPATH)
    <!-- test: mesh -->             spawns Monarch meshes: run as a script in a subprocess of
                                    its own, with a timeout; the block stops its meshes in a
                                    ``finally`` (or a ``with``) of its own

Tracebacks name the line of the doc (``docs/integration.md:LINE``). The blocks check their own
results (bit-exactness with ``torch.equal`` on uint8 views); a test fails on any exception.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "docs" / name for name in (
    "quickstart.md", "concepts.md", "integration.md", "delta-elastic.md", "your-model.md")]
"""The pages whose ```python blocks run; a "file" block of any of them is importable from all."""
MARKER = re.compile(r"<!--\s*test:\s*(.*?)\s*-->")
MESH_TIMEOUT_S = 240
"""Per mesh block: spawning procs and importing torch in them dominates (about 10-15 s here)."""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    """1-based line of the doc where the code starts (after the fence)."""
    kind: str
    """"local", "mesh" or "file"."""
    name: str | None
    """The module file name of a "file" block."""
    code: str

    @property
    def label(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    def source(self) -> str:
        """The code, shifted down so that line numbers in tracebacks are the doc's."""
        return "\n" * (self.line - 1) + self.code


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.search(before)
        kind, name = "local", None
        if marker:
            words = marker.group(1).split()
            if words == ["mesh"]:
                kind = "mesh"
            elif len(words) == 2 and words[0] == "file" and re.fullmatch(r"\w+\.py", words[1]):
                kind, name = "file", words[1]
            else:
                raise ValueError(f"{path}:{i}: unknown test marker {marker.group(0)!r}")
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end]) + "\n"
        blocks.append(Block(doc=path, line=i + 2, kind=kind, name=name, code=code))
        i = end + 1
    return blocks


BLOCKS = [b for doc in DOCS for b in python_blocks(doc)]
RUN = [b for b in BLOCKS if b.kind != "file"]
FILES = [b for b in BLOCKS if b.kind == "file"]


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> Path:
    """The docs' "file" blocks as modules in a directory of their own."""
    root = tmp_path_factory.mktemp("doc_modules")
    for b in FILES:
        (root / b.name).write_text(b.source())
    return root


def _run_here(block: Block, modules: Path) -> None:
    names = [b.name.removesuffix(".py") for b in FILES]
    sys.path.insert(0, str(modules))
    try:
        exec(compile(block.source(), block.label, "exec"), {"__name__": "doc_snippet"})
    finally:
        sys.path.remove(str(modules))
        for name in names:  # the next block imports them afresh
            sys.modules.pop(name, None)


def _run_subprocess(block: Block, modules: Path, tmp_path: Path) -> None:
    script = tmp_path / f"{block.doc.stem.replace('-', '_')}_md_{block.line}.py"
    script.write_text(block.source())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(modules), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=MESH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group: it and its procs
        out, err = proc.communicate()
        pytest.fail(f"{block.label} did not finish within {MESH_TIMEOUT_S}s\n{out[-3000:]}\n"
                    f"{err[-3000:]}")
    assert proc.returncode == 0, (f"{block.label} exited with {proc.returncode}\n"
                                  f"{out[-3000:]}\n{err[-5000:]}")


def test_the_docs_have_each_kind_of_block():
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("local") >= 3 and kinds.count("mesh") >= 2 and kinds.count("file") >= 1, \
        [(b.label, b.kind) for b in BLOCKS]
    assert {b.doc for b in BLOCKS} == set(DOCS), "a page listed in DOCS has no python block"
    names = [b.name for b in FILES]
    assert len(names) == len(set(names)), f"two file blocks share a module name: {names}"


@pytest.mark.parametrize("block", [b for b in RUN if b.kind == "local"], ids=lambda b: b.label)
def test_in_process_block_runs(block, modules):
    _run_here(block, modules)


@pytest.mark.mesh
@pytest.mark.parametrize("block", [b for b in RUN if b.kind == "mesh"], ids=lambda b: b.label)
def test_mesh_block_runs(block, modules, tmp_path):
    _run_subprocess(block, modules, tmp_path)
