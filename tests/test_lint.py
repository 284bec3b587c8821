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

# Run in a fresh interpreter: after some other tests (a RecursionError caught somewhere, a
# changed recursion limit) CPython 3.11's ast.parse can fail with "AST constructor recursion
# depth mismatch" in the test process itself.
PRIVATE_IMPORTS = """
import ast, sys
from pathlib import Path
root, first_party = Path(sys.argv[1]), sys.argv[2].split(",")
for top in first_party:
    for path in sorted((root / top).rglob("*.py")):
        here = path.parent.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in first_party):
                continue
            there = "/".join(node.module.split(".")[:-1])
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and there != here:
                print(f"{path.relative_to(root)}:{node.lineno} {node.module} {private}")
"""


def test_no_private_name_is_imported_from_another_package():
    """``from pkg.mod import _name`` only within one folder: a name another folder needs is
    made public (tests may reach in; they are not part of the layout)."""
    done = subprocess.run([sys.executable, "-c", PRIVATE_IMPORTS, str(ROOT), ",".join(FIRST_PARTY)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout
