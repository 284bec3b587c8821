"""The project's lint, run by the test command: ruff, configured in pyproject.toml."""

from __future__ import annotations

import ast
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


def test_no_private_name_is_imported_from_another_package():
    """``from pkg.mod import _name`` only within one folder: a name another folder needs is
    made public (tests may reach in; they are not part of the layout)."""
    found = []
    for top in FIRST_PARTY:
        for path in (ROOT / top).rglob("*.py"):
            here = path.parent.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and node.module.split(".")[0] in FIRST_PARTY):
                    continue
                there = "/".join(node.module.split(".")[:-1])
                private = [a.name for a in node.names
                           if a.name.startswith("_") and not a.name.startswith("__")]
                if private and there != here:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} "
                                 f"{private}")
    assert not found, found
