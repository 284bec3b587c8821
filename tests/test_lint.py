"""The project's lint, run by the test command: ruff, configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "No module named ruff" not in run.stderr, (
        "ruff is not installed: it is in the test extras (pip install -e '.[test]', or "
        "bash scripts/dev.sh setup)")
    assert run.returncode == 0, run.stdout + run.stderr


FIRST_PARTY = ("weightbridge", "controller", "meshes", "kernels", "examples", "benchmarks")
FACES = ("weightbridge", "weightbridge.driver")
"""What controller/ (and its baselines) may import of the library: its two faces."""

# Run in a fresh interpreter: after some other tests (a RecursionError caught somewhere, a
# changed recursion limit) CPython 3.11's ast.parse can fail with "AST constructor recursion
# depth mismatch" in the test process itself.
IMPORTS = """
import ast, sys
from pathlib import Path
root, first_party, faces = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
for top in first_party:
    for path in sorted((root / top).rglob("*.py")):
        here = path.parent.relative_to(root).as_posix()
        where = f"{path.relative_to(root)}"
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for module in names:
                if top == "controller" and module.startswith("weightbridge") and \
                        module not in faces:
                    print(f"{where}:{node.lineno} {module}: controller/ imports only {faces}")
            if not (isinstance(node, ast.ImportFrom) and names
                    and names[0].split(".")[0] in first_party):
                continue
            there = "/".join(node.module.split(".")[:-1])
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and there != here:
                print(f"{where}:{node.lineno} {node.module} {private}: private, another folder")
"""


def test_imports_keep_the_layout():
    """``from pkg.mod import _name`` only within one folder: a name another folder needs is
    made public (tests may reach in; they are not part of the layout). controller/ (and its
    baselines) import the library through its two faces only, ``weightbridge`` and
    ``weightbridge.driver``, as any driver of one would."""
    done = subprocess.run([sys.executable, "-c", IMPORTS, str(ROOT), ",".join(FIRST_PARTY),
                           ",".join(FACES)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout
